// pyggml_dkv's kernels inside ggml-cpu (docs/ggml-port-plan.md, "Kernel files"). build_ggml.sh
// copies vendor/kernels/ into src/ggml-cpu/dkv/ of the pinned ggml, and the series' hook patch
// (GGML_CPU_DKV) compiles that folder and lists ggml_backend_cpu_dkv_buffer_type() first among
// ggml-cpu's extra buffer types.
#pragma once

#include "ggml-backend.h"

#ifdef __cplusplus
extern "C" {
#endif

// "CPU_DKV": the extra buffer type our kernels hang off (never NULL once built)
ggml_backend_buffer_type_t ggml_backend_cpu_dkv_buffer_type(void);

#ifdef __cplusplus
}
#endif
