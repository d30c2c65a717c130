/* Custom ggml ops compiled into pyggml_dkv._ggml_cffi (one .c file each, OP_SOURCES in build.py);
   included by the generated module source and by each op's file, so both see one prototype. */
#ifndef PYGGML_DKV_CUSTOM_OPS_H
#define PYGGML_DKV_CUSTOM_OPS_H

#include "ggml.h"

/* screened_argmax.c: a ggml_custom_op_t for ggml_custom_4d (pyggml_dkv/ggml/ops_screen.py) */
void pyggml_dkv_screened_argmax(struct ggml_tensor * dst, int ith, int nth, void * userdata);

/* dynamic_conv.c: DFlash-2's grouped dynamic causal convolution, for ggml_custom_4d
   (pyggml_dkv/ggml/ops_conv.py) */
void pyggml_dkv_dynamic_conv(struct ggml_tensor * dst, int ith, int nth, void * userdata);

/* amx_tiles.c: ggml's AMX matmul tile configuration on the calling thread; 1 if loaded, 0 where the
   CPU or kernel offers no AMX tiles */
int pyggml_dkv_load_ggml_matmul_tiles(void);

#endif
