// Layouts of our repacking buffer type, CPU_DKV_REPACK (repack.cpp): weight matrices rewritten
// as they are uploaded into the layout of one of our int8 kernels. Like ggml's CPU_REPACK, a
// tensor there is written whole and only ever read by that kernel (it is not host memory in
// ggml's layout: is_host false, no get_tensor); CPU_DKV (buffer.cpp) keeps ggml's layout instead.
//
//   mm-vnni-q8_0.cpp  vnni-q8_0  q8_0 in 16-row groups for vpdpbusd (AVX512-VNNI)
//   mm-vnni-q4_0.cpp  vnni-q4_0  q4_0 in 16-row groups for vpdpbusd (AVX512-VNNI)
//   mm-vnni-q6_k.cpp  vnni-q6_k  q6_K, the codes one per byte                (AVX512-VNNI)
//   mm-vnni-q4_k.cpp  vnni-q4_k  q4_K, codes as nibbles, scales by vpdpwssd   (AVX512-VNNI)
//   mm-vnni-q5_k.cpp  vnni-q5_k  q5_K, nibbles and a fifth-bit plane         (AVX512-VNNI)
//
// A layout compiled for instructions the build lacks answers nullptr.
#pragma once

#include "kernel.h"

namespace ggml::cpu::dkv {

struct repack_layout {
    const char * name;
    // is this the layout for this tensor (type, shape; the CPU has the kernel's instructions)?
    bool (*fits)(const struct ggml_tensor * t);
    // bytes the tensor takes in this layout
    size_t (*alloc_size)(const struct ggml_tensor * t);
    // the whole tensor's blocks, as ggml stores them (ggml_nbytes bytes at data), into t->data
    void (*repack)(struct ggml_tensor * t, const void * data);
    // the MUL_MAT whose src0 is a tensor of this layout (takes() false: no kernel takes the op)
    op_kernel kernel;
};

// each layout file: its layout, or nullptr where the build lacks its instructions
const repack_layout * vnni_q8_0_layout();
const repack_layout * vnni_q4_0_layout();
const repack_layout * vnni_q6_k_layout();
const repack_layout * vnni_q4_k_layout();
const repack_layout * vnni_q5_k_layout();

}  // namespace ggml::cpu::dkv
