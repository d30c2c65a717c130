// Our flash attention kernels, for K/V caches in our CPU_DKV buffer: buffer.cpp claims
// FLASH_ATTN_EXT whose K (src[1]) lives there and that a kernel here takes.
//
//   flash-attn-tiled.cpp  fa-tiled  f32 products in 64 x 64 tiles, transposed scores (AVX-512)
//
// A kernel compiled for instructions the build lacks answers nullptr.
#pragma once

// GCC 12's false "used uninitialized" on the AVX-512 intrinsics (see mm-narrow.h)
#if defined(__GNUC__) && !defined(__clang__)
#    pragma GCC diagnostic ignored "-Wuninitialized"
#    pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "kernel.h"

#if defined(__AVX512F__)
#    include <immintrin.h>
#endif

namespace ggml::cpu::dkv {

const op_kernel * fa_tiled_kernel();

}  // namespace ggml::cpu::dkv
