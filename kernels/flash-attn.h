// Our flash attention kernels, for K/V caches in our CPU_DKV buffer: buffer.cpp claims
// FLASH_ATTN_EXT whose K (src[1]) lives there and that a kernel here takes.
//
//   flash-attn-tiled.cpp  fa-tiled        f32 products in 64 x 64 tiles, transposed scores (AVX-512)
//   flash-attn-bf16.cpp   fa-bf16-avx512  its two products with bf16 inputs, vdpbf16ps (GGML_PREC_BF16)
//   flash-attn-bf16-amx.cpp fa-bf16-amx   the same on AMX-BF16 tiles
//
// A kernel compiled for instructions the build lacks answers nullptr.
#pragma once

// GCC 12's false "used uninitialized" on the AVX-512 intrinsics (see mm-narrow.h)
#if defined(__GNUC__) && !defined(__clang__)
#    pragma GCC diagnostic ignored "-Wuninitialized"
#    pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "kernel.h"

#include <cstddef>
#include <cstdint>

#if defined(__AVX512F__)
#    include <immintrin.h>
#endif

namespace ggml::cpu::dkv {

const op_kernel * fa_tiled_kernel();

// The tiled kernel's two products with bf16 inputs and f32 sums. Operand layouts (QN query columns,
// a multiple of 16; n_keys32: the tile's keys rounded up to 32):
//   QT2[j][q] = (Q[q][2j], Q[q][2j+1])  bf16 pairs, DK/2 x QN words (zeros past tile_rows)
//   Kb[k][d]                            bf16, kv_tile x DK (rows of keys no row sees: not written)
//   weights                             the softmax weights as bf16, in the layout of the products
//                                       (vdpbf16ps: key pairs, n_keys32/2 x QN words; AMX: query-major,
//                                       QN x 64 values), at most 16 KB
//   V2[j][c]  = (V[2j][c], V[2j+1][c])  n_keys32/2 x DV words (keys no row sees: zeros)
struct fa_bf16_products {
    // around one call's products on this thread (nullptr: nothing to do): AMX loads its tile
    // configuration, then ggml's matmul configuration back (amx-tiles.h)
    void (*begin)();
    void (*end)();
    void (*pack_queries)(uint32_t * QT2, int QN, const float * const * q_rows, int tile_rows, int64_t DK);
    void (*pack_keys)(uint16_t * Kb, const char * k_tile, size_t k_stride, uint64_t key_visible, int kv_tile, int64_t DK,
                      bool f16);
    // ST[k][q] = Kb[k] . Q[q] for k < n_keys
    void (*scores)(float * ST, int QN, const uint16_t * Kb, int DK, const uint32_t * QT2, int n_keys);
    void (*pack_weights)(void * weights, const float * ST, int QN, int kv_tile, int n_keys32);
    void (*pack_values)(uint32_t * V2, const char * v_tile, size_t v_stride, uint64_t key_visible, int kv_tile,
                        int n_keys32, int64_t DV, bool f16);
    // O[q] += sum_k P[q][k] * V[k] for q < n_q (a multiple of 4)
    void (*values)(float * O, int DV, const void * weights, int QN, const uint32_t * V2, int n_q, int n_keys32);
};

// nullptr where the build lacks AVX512-BF16 (flash-attn-bf16.cpp)
const fa_bf16_products * fa_bf16_avx512_products();
// nullptr where the build lacks AMX-BF16, Linux refuses the tile state or PYGGML_DKV_NO_AMX is set
// (flash-attn-bf16-amx.cpp)
const fa_bf16_products * fa_bf16_amx_products();

}  // namespace ggml::cpu::dkv
