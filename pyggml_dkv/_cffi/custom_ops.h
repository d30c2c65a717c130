/* Custom ggml ops compiled into pyggml_dkv._ggml_cffi (one .c file each, OP_SOURCES in build.py);
   included by the generated module source and by each op's file, so both see one prototype. */
#ifndef PYGGML_DKV_CUSTOM_OPS_H
#define PYGGML_DKV_CUSTOM_OPS_H

#include "ggml.h"
#include "ggml-backend.h"

/* screened_argmax.c: a ggml_custom_op_t for ggml_custom_4d (pyggml_dkv/ggml/ops_screen.py) */
void pyggml_dkv_screened_argmax(struct ggml_tensor * dst, int ith, int nth, void * userdata);

/* dynamic_conv.c: DFlash-2's grouped dynamic causal convolution, for ggml_custom_4d
   (pyggml_dkv/ggml/ops_conv.py) */
void pyggml_dkv_dynamic_conv(struct ggml_tensor * dst, int ith, int nth, void * userdata);

/* amx_tiles.c: ggml's AMX matmul tile configuration on the calling thread; 1 if loaded, 0 where the
   CPU or kernel offers no AMX tiles */
int pyggml_dkv_load_ggml_matmul_tiles(void);
/* amx_tiles.c: 1 when the calling thread has used AMX tile data (a tile instruction ran on it and
   the tiles were not released since), 0 otherwise or without AMX: for tests of which kernel ran */
int pyggml_dkv_amx_tile_data_in_use(void);

/* kernels.c: what of ours this build carries (comma list of names, "" for none), the raw list
   build_ggml.sh recorded (for a test that kernels.c knows every name), and the build stamp */
const char * pyggml_dkv_kernels(void);
const char * pyggml_dkv_build_capabilities(void);
const char * pyggml_dkv_built_ggml_version(void);
const char * pyggml_dkv_built_variant(void);
const char * pyggml_dkv_built_ggml_build_id(void);

/* kernels.c: the CPU device with our CPU_DKV buffer type as its own (kernels/dkv.h), for an
   RPC server whose products should run our kernels as local weights in CPU_DKV do; NULL where the
   build has no CPU_DKV buffer type */
ggml_backend_dev_t pyggml_dkv_cpu_dkv_device(void);

#endif
