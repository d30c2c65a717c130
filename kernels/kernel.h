// What each of our kernels answers, for buffer.cpp's tensor traits (mm-narrow.h, flash-attn.h).
#pragma once

#include "ggml.h"
#include "ggml-cpu-impl.h"

#include <cstddef>

namespace ggml::cpu::dkv {

struct op_kernel {
    const char * name;
    // does it take this op (types, shapes, strides, parameters)? decided from the op alone, so that
    // ggml_graph_plan (work_size) and every thread's compute_forward agree
    bool (*takes)(const struct ggml_tensor * op);
    // bytes of ggml's work buffer it needs for the op on n_threads
    size_t (*work_size)(int n_threads, const struct ggml_tensor * op);
    // one thread's part (params->ith of params->nth); every thread calls it
    void (*compute)(const struct ggml_compute_params * params, struct ggml_tensor * op);
};

// the kernel an op whose weights (src[0]) or K/V (src[1]) live in our buffer runs on, nullptr:
// ggml's own (buffer.cpp)
const op_kernel * kernel_for(const struct ggml_tensor * op);

}  // namespace ggml::cpu::dkv
