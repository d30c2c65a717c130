// pyggml_dkv's kernels inside ggml-cpu (docs/ggml-port-plan.md, "Kernel files"). build_ggml.sh
// copies kernels/ into src/ggml-cpu/dkv/ of the pinned ggml, and the series' hook patch
// (GGML_CPU_DKV) compiles that folder and lists ggml_backend_cpu_dkv_buffer_types() first among
// ggml-cpu's extra buffer types.
#pragma once

#include "ggml-backend.h"

#ifdef __cplusplus
extern "C" {
#endif

// our extra buffer types, in the order ggml-cpu lists them, NULL-terminated: CPU_DKV, then
// CPU_DKV_REPACK
const ggml_backend_buffer_type_t * ggml_backend_cpu_dkv_buffer_types(void);

// "CPU_DKV": host memory in ggml's layout; our kernels take the ops that read weights or K/V there
// (buffer.cpp; never NULL once built)
ggml_backend_buffer_type_t ggml_backend_cpu_dkv_buffer_type(void);

// "CPU_DKV_REPACK": weights repacked for our int8 kernels as they are uploaded (repack.cpp)
ggml_backend_buffer_type_t ggml_backend_cpu_dkv_repack_buffer_type(void);

// the CPU device with CPU_DKV as its buffer type: a backend it makes is ggml's CPU backend, and
// every buffer allocated for it is ours. For a server that places tensors without knowing what
// they are (ggml's RPC server), so that its products run our kernels as a local CPU_DKV weight's do
ggml_backend_dev_t ggml_backend_cpu_dkv_device(void);

#ifdef __cplusplus
}
#endif
