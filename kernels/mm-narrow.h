// The narrow products: f16 / bf16 weights times a draft block's few f32 columns (1..64), on the
// weights in our CPU_DKV buffer (buffer.cpp claims MUL_MAT for them and asks kernel_for).
// ggml rounds the columns to f16 / bf16 (its vec_dot_type) and runs llamafile's GEMM or its dot
// products, converting both operands on every use; these kernels keep the columns f32 where the
// arithmetic allows, convert each block of weight rows once per column tile, and give every output
// to one thread (the thread count changes no bit). One file per kernel, each naming its capability:
//
//   mm-f16-narrow.cpp   mm-f16-narrow   f16 on AVX-512 FMAs            (old patches 0004, 0013, 0016, 0026, 0034)
//   mm-bf16-fma.cpp     mm-bf16-fma     bf16 on AVX-512 FMAs           (0041)
//   mm-bf16-dpbf16.cpp  mm-bf16-dpbf16  bf16 with vdpbf16ps            (0019, 0026)
//   mm-half-avx2.cpp    mm-half-avx2    f16 / bf16 on AVX2 FMAs        (0042)
//   mm-bf16-amx.cpp     mm-bf16-amx     bf16 on AMX-BF16 tiles         (0029, 0043)
//
// A kernel compiled for an ISA the build lacks answers nullptr; the capability names what the
// build carries, capabilities.py combines it with the CPU's features as before.
#pragma once

// GCC 12 reports the AVX-512 intrinsics' own "undefined" operands (_mm512_shuffle_f32x4 and the
// reductions, inlined) as used uninitialized: a false positive, silenced before any include brings
// the intrinsics headers in (the kernel files include this header first)
#if defined(__GNUC__) && !defined(__clang__)
#    pragma GCC diagnostic ignored "-Wuninitialized"
#    pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "kernel.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>

#if defined(__AVX2__) || defined(__AVX512F__)
#    include <immintrin.h>
#endif

namespace ggml::cpu::dkv {

// the most columns any narrow kernel takes (a draft block of 16 rows, a fold-in of 34, up to 64)
constexpr int64_t NARROW_MAX_N = 64;

// each kernel file: its kernel, or nullptr where the build lacks the kernel's instructions
const op_kernel * mm_f16_narrow_kernel();
const op_kernel * mm_bf16_fma_kernel();
const op_kernel * mm_bf16_dpbf16_kernel();
const op_kernel * mm_half_avx2_kernel();
const op_kernel * mm_bf16_amx_kernel();

// bf16 on FMAs rather than with vdpbf16ps (buffer.cpp: the rule by CPU vendor)
bool bf16_products_on_fma();

// the shape rule every narrow kernel shares: 2-D f16 / bf16 weights (rows contiguous, whole
// k_multiple-value rows), f32 columns (at most NARROW_MAX_N, rows contiguous), an f32 dst
static inline bool narrow_shape_ok(const struct ggml_tensor * op, enum ggml_type wtype, int64_t k_multiple) {
    const struct ggml_tensor * src0 = op->src[0];
    const struct ggml_tensor * src1 = op->src[1];
    return op->op == GGML_OP_MUL_MAT && src0->type == wtype && src1->type == GGML_TYPE_F32 && op->type == GGML_TYPE_F32 &&
           src1->ne[1] <= NARROW_MAX_N && src0->ne[0] % k_multiple == 0 &&
           src0->ne[2] == 1 && src0->ne[3] == 1 && src1->ne[2] == 1 && src1->ne[3] == 1 &&
           src0->nb[0] == 2 && src1->nb[0] == sizeof(float) && op->nb[0] == sizeof(float) &&
           src0->nb[1] % 2 == 0 && src1->nb[1] % sizeof(float) == 0 && op->nb[1] % sizeof(float) == 0;
}

// the rows [r0, r1) of thread ith: whole blocks of `block` rows, in order
static inline void narrow_rows_of_thread(int ith, int nth, int64_t M, int64_t block, int64_t & r0, int64_t & r1) {
    const int64_t blocks = (M + block - 1) / block;
    const int64_t per    = (blocks + nth - 1) / nth;
    r0 = std::min(M, ith * per * block);
    r1 = std::min(M, (ith + 1) * per * block);
}

// old patch 0026: while a block of weight rows runs, the rows this far on are asked for into L2
// (the next block's L1 prefetch alone came too late from DRAM: on a Zen 4 the f16 product ran ~20%
// below its speed from L3). 16 rows on (32 KiB at K = 1024) was as good as 24 or 32, better than 64.
constexpr int64_t NARROW_FAR_ROWS = 16;

#if defined(__AVX512F__)
// the sums of four accumulators, added in the order _mm512_reduce_add_ps adds one (256-bit halves,
// 128-bit halves, elements 0+2 and 1+3, then those two), so the results are bit for bit those of
// four reductions in 14 instructions and one store instead of ~32 and four (old patch 0016)
static inline __attribute__((always_inline)) __m128 mm512_reduce_add_ps_x4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 h01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
    const __m512 h23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
    const __m512 q   = _mm512_add_ps(_mm512_shuffle_f32x4(h01, h23, 0x88), _mm512_shuffle_f32x4(h01, h23, 0xDD));
    const __m512 p   = _mm512_add_ps(q, _mm512_permute_ps(q, 0x4E));
    const __m512 s   = _mm512_add_ps(p, _mm512_permute_ps(p, 0xB1));
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), s));
}

// a register tile's sums into dst: a column's RM rows are adjacent there
template <int RM, int RN>
static inline __attribute__((always_inline)) void store_tile_sums(const __m512 (&acc)[4][6], float * y, int64_t ldy) {
    if constexpr (RM == 4) {
        for (int j = 0; j < RN; j++) {
            _mm_storeu_ps(y + j*ldy, mm512_reduce_add_ps_x4(acc[0][j], acc[1][j], acc[2][j], acc[3][j]));
        }
    } else {
        for (int i = 0; i < RM; i++) {
            for (int j = 0; j < RN; j++) {
                y[j*ldy + i] = _mm512_reduce_add_ps(acc[i][j]);
            }
        }
    }
}

// a tile of up to 4 weight rows x up to 6 columns (24 sums in registers): w rows of 16-bit values
// (ldw apart), x columns of f32 (ldx apart), y columns of f32 outputs (ldy apart); next_w / far_w
// the rows to prefetch into L1 / L2 (nullptr: none). Tile<RM, RN>::run is one instance; this picks
// it by the tile's size at run time. A switch, each instance inlined here (their run is
// always_inline), not a table of function pointers: called through a pointer, GCC 12 stored all 24
// sums to the stack and reloaded them at every tile's end (bf16 products 6-12% slower on a Zen 4).
#define PYGGML_DKV_NARROW_CASE(RM_, RN_) \
    case (RM_) * 8 + (RN_): Tile<RM_, RN_>::run(K, w, ldw, x, ldx, y, ldy, next_w, far_w); return;
#define PYGGML_DKV_NARROW_ROW(RM_)                                                         \
    PYGGML_DKV_NARROW_CASE(RM_, 1) PYGGML_DKV_NARROW_CASE(RM_, 2) PYGGML_DKV_NARROW_CASE(RM_, 3) \
    PYGGML_DKV_NARROW_CASE(RM_, 4) PYGGML_DKV_NARROW_CASE(RM_, 5) PYGGML_DKV_NARROW_CASE(RM_, 6)

template <template <int, int> class Tile>
static inline __attribute__((always_inline)) void narrow_tile(int rm, int rn, int64_t K, const uint16_t * w,
                                                              int64_t ldw, const float * x, int64_t ldx, float * y,
                                                              int64_t ldy, const uint16_t * next_w,
                                                              const uint16_t * far_w) {
    switch (rm * 8 + rn) {
        PYGGML_DKV_NARROW_ROW(1) PYGGML_DKV_NARROW_ROW(2) PYGGML_DKV_NARROW_ROW(3) PYGGML_DKV_NARROW_ROW(4)
    }
    GGML_ABORT("narrow product: bad tile %d x %d", rm, rn);
}

#undef PYGGML_DKV_NARROW_ROW
#undef PYGGML_DKV_NARROW_CASE

// old patch 0034: 4-row blocks per group, and the largest 6-column panel of x (bytes) for which
// the blocks are grouped
constexpr int64_t NARROW_FMA_GROUP     = 8;
constexpr int64_t NARROW_FMA_PANEL_MAX = 24576;

// The row blocks of a narrow product on f32 FMAs (f16: old 0004 / 0034; bf16: 0041): each thread
// owns whole 4-row blocks; the blocks in groups, each column tile of 6 run over a whole group. A
// block's three tiles of 16 columns read three 6-column panels of x (64 KiB at K = 1024), more
// than L1 holds, so every tile read its panel from L2; over a group of NARROW_FMA_GROUP blocks (64
// KiB of weights at K = 1024, in L2 after the first tile) a panel comes from L2 once and from L1
// for the other blocks. Only where a panel fits L1 with room to spare (K <= 1024); beyond, the
// groups only re-read weights from L2. Each output is the same tile's arithmetic: bit-identical.
template <template <int, int> class Tile>
static inline void narrow_fma_rows(const struct ggml_compute_params * params, const uint16_t * w0, int64_t ldw, const float * x0, int64_t ldx,
                                   float * y0, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    int64_t r0, r1;
    narrow_rows_of_thread(params->ith, params->nth, M, 4, r0, r1);
    const int64_t group = 6*K*(int64_t) sizeof(float) <= NARROW_FMA_PANEL_MAX ? NARROW_FMA_GROUP : 1;
    for (int64_t g0 = r0; g0 < r1; g0 += 4*group) {
        const int64_t g1 = std::min(r1, g0 + 4*group);
        for (int64_t t = 0; t < N; t += 6) {
            const int rn = (int) std::min<int64_t>(6, N - t);
            const float * x = x0 + t*ldx;
            for (int64_t r = g0; r < g1; r += 4) {
                const int rm = (int) std::min<int64_t>(4, r1 - r);
                const uint16_t * w = w0 + r*ldw;
                // the first column tile asks for the next block (L1) and the rows 16 on (L2)
                const uint16_t * next_w = t == 0 && r + 4 < r1 ? w + 4*ldw : nullptr;
                const uint16_t * far_w  = next_w != nullptr && r + NARROW_FAR_ROWS < r1 ? w + NARROW_FAR_ROWS*ldw : nullptr;
                narrow_tile<Tile>(rm, rn, K, w, ldw, x, ldx, y0 + t*ldy + r, ldy, next_w, far_w);
            }
        }
    }
}
#endif  // __AVX512F__

}  // namespace ggml::cpu::dkv
