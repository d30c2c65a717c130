// The AVX512-VNNI products of repacked quantized weights (CPU_DKV_REPACK, repack.h): what the
// layouts share. From pyggml_dkv's patches to ggml 0.10.1 (there in repack.cpp, behind ggml's
// CPU_REPACK buffer): 0010 (the q8_0 layout and driver), 0022 (q4_0, the shared drivers), 0023
// (tiles over two weight groups), 0025 (activations quantized by blocks, F16C scale rounding), 0044
// (output rows without divisions).
//
// Why layouts of our own: ggml's q8_0 dot product (and llamafile's tinyBLAS) multiply one weight
// row by one activation row, 32 int8 values at a time, and must reduce every 32-value block
// horizontally before applying its two scales: per 64 multiply-adds that is one vpdpbusd and ~4
// instructions of reduction and scaling, no better than f32 FMAs. Here each 64-byte vector holds 4
// consecutive input values of 16 weight rows, so one vpdpbusd with 4 broadcast activation bytes
// adds 64 products into 16 per-row int32 sums with no reduction at all; a 32-value block takes 8 of
// them, then one convert and one FMA apply the scales for all 16 rows at once.
//
// The driver: every thread quantizes its share of the activation rows into ggml's work buffer (per
// 32 values, as q8_0: scale amax / 127 rounded to f16, values rounded to nearest even, stored block
// by block), a barrier, then each thread multiplies its own contiguous range of 16-row weight groups
// by all rows (every output is computed by one thread in one order: the thread count changes no
// bit). The result is the exact q8_0 x q8_0 (q4_0 x q8_0) arithmetic of ggml's own kernels: y[m][n]
// = sum over blocks of f16(dw) * f16(dx) * sum(qw * qx), the blocks summed in order in f32.
#pragma once

// GCC 12's false "used uninitialized" on the AVX-512 intrinsics (see mm-narrow.h)
#if defined(__GNUC__) && !defined(__clang__)
#    pragma GCC diagnostic ignored "-Wuninitialized"
#    pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#define GGML_COMMON_DECL_CPP
#include "ggml-common.h"

#include "repack.h"

#include "ggml-cpu.h"
#include "ggml-impl.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#    define PYGGML_DKV_VNNI 1
#    include <immintrin.h>
#endif

namespace ggml::cpu::dkv {

#ifdef PYGGML_DKV_VNNI

constexpr int64_t VNNI_ROWS = 16;  // weight rows per group

// the products the drivers take: 2-D weights, f32 activation rows (any batch), an f32 dst
static inline bool vnni_handles(const struct ggml_tensor * op) {
    const struct ggml_tensor * src0 = op->src[0];
    const struct ggml_tensor * src1 = op->src[1];
    return op->op == GGML_OP_MUL_MAT && src0->ne[2] == 1 && src0->ne[3] == 1 && src1->type == GGML_TYPE_F32 &&
           op->type == GGML_TYPE_F32 && op->nb[0] == sizeof(float) && src1->ne[0] == src0->ne[0] &&
           op->ne[0] == src0->ne[1] && ggml_nrows(op) == ggml_nrows(src1);
}

// row r of the flattened src1 / dst (src1 rows in ggml order i11, i12, i13)
static inline float * vnni_dst_row(struct ggml_tensor * dst, int64_t r) {
    // rows evenly spaced (every product's dst): no divisions. The tiles ask for every row's pointer
    // once per weight group, and three 64-bit divisions a row took 3-4% of a product's time at 9-16
    // rows (old patch 0044)
    if (dst->nb[2] == dst->ne[1] * dst->nb[1] && dst->nb[3] == dst->ne[2] * dst->nb[2]) {
        return (float *) ((char *) dst->data + r * dst->nb[1]);
    }
    const int64_t i1 = r % dst->ne[1], i2 = (r / dst->ne[1]) % dst->ne[2], i3 = r / (dst->ne[1] * dst->ne[2]);
    return (float *) ((char *) dst->data + i1 * dst->nb[1] + i2 * dst->nb[2] + i3 * dst->nb[3]);
}

// quantize(row's values, r, b0, b1): blocks b0 .. b1 - 1 of row r, for this thread's share of src1.
// The quantized activations are stored block by block ([nb][m]: one block of every row side by
// side), so threads that split the rows wrote the same cache lines of every block's scales and
// sums, each write taking the line from the other core: they split the blocks instead (old patch
// 0025) where there are as many blocks as threads. Rows whose values are strided are gathered into
// `gather` (ne[0] floats of this thread's own) and split by rows. `tile_rows` (16 for activations
// stored by 16-row tiles, q8v_rows::tiled): those share no cache line across tiles, so the threads
// split the rows in whole tiles, each reading whole rows (splitting the blocks made every thread
// read half of each row, and the reads, not the arithmetic, took half of the pass).
template <class Quantize>
static inline void vnni_quantize_own_share(const struct ggml_compute_params * params, const struct ggml_tensor * src1,
                                           float * gather, int64_t nb, Quantize && quantize, int64_t tile_rows = 0) {
    const int64_t M = ggml_nrows(src1), K = src1->ne[0];
    const bool by_blocks = tile_rows == 0 && src1->nb[0] == sizeof(float) && nb >= params->nth;
    const int64_t tiles = tile_rows > 0 ? (M + tile_rows - 1) / tile_rows : 0;
    const int64_t r0 = by_blocks    ? 0
                       : tiles > 0 ? params->ith * tiles / params->nth * tile_rows
                                   : params->ith * M / params->nth;
    const int64_t r1 = by_blocks    ? M
                       : tiles > 0 ? std::min(M, (params->ith + 1) * tiles / params->nth * tile_rows)
                                   : (params->ith + 1) * M / params->nth;
    const int64_t b0 = by_blocks ? params->ith * nb / params->nth : 0;
    const int64_t b1 = by_blocks ? (params->ith + 1) * nb / params->nth : nb;
    for (int64_t r = r0; r < r1 && b0 < b1; r++) {
        const int64_t i1 = r % src1->ne[1], i2 = (r / src1->ne[1]) % src1->ne[2], i3 = r / (src1->ne[1] * src1->ne[2]);
        const char * row = (const char *) src1->data + i1 * src1->nb[1] + i2 * src1->nb[2] + i3 * src1->nb[3];
        const float * xr = (const float *) row;
        if (src1->nb[0] != sizeof(float)) {
            for (int64_t k = 0; k < K; k++) {
                gather[k] = *(const float *) (row + k * src1->nb[0]);
            }
            xr = gather;
        }
        quantize(xr, r, b0, b1);
    }
}

// Each thread owns a contiguous range of VNNI_ROWS-row weight groups (every output is computed by
// one thread in one order, so results do not depend on the thread count), the activation rows in
// tiles of MT_MAX / 8 / 4 / 2 / 1: tile(std::integral_constant<int, MT>, std::integral_constant<int,
// 1>, the group's weights, first row, y).
// With PAIRS (old patch 0023) the groups go two at a time while a thread has two left:
// tile(MT, std::integral_constant<int, 2>, the first group's weights, first row, y), y[m] + 16 being
// the second group's outputs. One broadcast activation word then feeds a vpdpbusd of each group:
// with one broadcast per vpdpbusd, a tile issued ~78% of the instruction's peak on Zen 5 even
// without any scaling (a standalone loop, one thread, weights in L1 / L2), with one per two ~97%.
// The layouts' tiles are kept out of line (noinline): inlined into the callers' lambdas, q6_K's ran
// at 2/3 of its speed.
// Only rows [r_begin, r_end) when given (r_end < 0: to the last).
template <int MT_MAX, bool PAIRS, class Tile>
static inline void vnni_for_each_tile(const struct ggml_compute_params * params, struct ggml_tensor * op, size_t group_bytes,
                                      Tile && tile, int64_t r_begin = 0, int64_t r_end = -1) {
    const int64_t G = op->src[0]->ne[1] / VNNI_ROWS, M = r_end < 0 ? ggml_nrows(op->src[1]) : r_end;
    const uint8_t * w0 = (const uint8_t *) op->src[0]->data;
    const int64_t g_end = (params->ith + 1) * G / params->nth;
    for (int64_t g = params->ith * G / params->nth; g < g_end;) {
        const bool pair = PAIRS && g_end - g >= 2;
        const uint8_t * wg = w0 + g * group_bytes;
        float * y[16];
        for (int64_t r = r_begin; r < M;) {
            const int64_t left = M - r;
            const int mt = left >= 16 && MT_MAX >= 16 ? 16 : left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
            for (int m = 0; m < mt; m++) {
                y[m] = vnni_dst_row(op, r + m) + g * VNNI_ROWS;
            }
            auto run = [&](auto groups) {
                switch (mt) {
                    case 16: if constexpr (MT_MAX >= 16) { tile(std::integral_constant<int, 16>{}, groups, wg, r, y); } break;
                    case 8:  tile(std::integral_constant<int, 8>{}, groups, wg, r, y); break;
                    case 4:  tile(std::integral_constant<int, 4>{}, groups, wg, r, y); break;
                    case 2:  tile(std::integral_constant<int, 2>{}, groups, wg, r, y); break;
                    default: tile(std::integral_constant<int, 1>{}, groups, wg, r, y); break;
                }
            };
            if constexpr (PAIRS) {
                if (pair) {
                    run(std::integral_constant<int, 2>{});
                    r += mt;
                    continue;
                }
            }
            run(std::integral_constant<int, 1>{});
            r += mt;
        }
        g += pair ? 2 : 1;
    }
}

// Activations of one product, quantized into the work buffer: m rows of nb 32-value blocks, stored
// block by block so that a tile's rows of one block lie at fixed offsets from one pointer. Block b
// of row r has index b * step + first(r) in q (32 bytes each), d and c: [nb][m] (step m), or, for
// products on AMX tiles, by 16-row tiles [m / 16][nb][16] (step 16: `tiled`), so that the blocks a
// tile reads one after another are neighbours in memory (at step m, 1024 rows put them 32 KB apart
// and the tiles waited on L3). Rows r .. r + n - 1 of one 16-row tile are consecutive either way,
// which is all the tiles assume (they start at multiples of 16 but for the last rows).
struct q8v_rows {
    int8_t  * q;      // the codes
    float   * d;      // f16-rounded scales
    int32_t * c;      // -offset * sum of the block's values (the layout's code offset: 128 / 8)
    int64_t   nb;
    int64_t   m;
    int64_t   step;   // index distance of a row's consecutive blocks
    bool      tiled;

    int64_t first(int64_t r) const {
        return tiled ? (r / 16) * 16 * nb + r % 16 : r;
    }
};

// 16 activation rows x one 16-row weight group of the q8_0 layout, over every K block; y[m]: the
// group's 16 outputs of row r0 + m
using q8v_wide_tile = void (*)(const uint8_t * wg, const q8v_rows & x, int64_t r0, float * const * y);

// mm-amx-q8_0.cpp: the q8_0 tile on AMX-INT8 tiles, with their configuration loaded on the calling
// thread; nullptr where the build or the process has no AMX (PYGGML_DKV_NO_AMX=1). The same bits
// as the VNNI tiles.
q8v_wide_tile amx_q8_0_tile_on_this_thread();

// activation rows from which a q8_0 product runs its 16-row tiles on AMX: below, a step's draft block
// and fold-in (9-34 rows), where the VNNI tiles were the faster (docs/design.md); at 64 rows of a
// 1024 x 5120 matrix the tiles took 0.66-0.83 ms and VNNI 0.87 (model-167 Xeon, 2 threads)
constexpr int64_t AMX_Q8_0_MIN_ROWS = 64;
// bytes of quantized activations a wide product's row chunk holds: the chunk stays in L2 while the
// thread's weight groups pass over it (1024 x 5120 at 1024 rows 12.1 -> 11.5 ms against none)
constexpr int64_t AMX_Q8_0_CHUNK_BYTES = 1 << 20;

// Tiles over two consecutive weight groups (old patch 0023). The block loop: for every block,
// rows(n, first, m0, block of group 0, block of group 1, b, acc0 + m0, acc1 + m0) for the tile's rows
// in runs of n <= RUN, whose sums fit in registers (first: the run that prefetches). The f32 sums of
// a larger MT stay in L1, so that each weight block is read from memory once for all of the tile's
// rows (tiles of 6 rows that read the blocks again per tile left the memory idle meanwhile: slower).
template <int M0, int MT, int RUN, class Rows>
static inline __attribute__((always_inline)) void vnni_pair_runs(Rows & rows, const uint8_t * blk0, const uint8_t * blk1,
                                                                 int64_t b, __m512 * acc0, __m512 * acc1) {
    if constexpr (M0 < MT) {
        rows(std::integral_constant<int, std::min(RUN, MT - M0)>{}, std::bool_constant<M0 == 0>{}, M0, blk0, blk1, b,
             acc0 + M0, acc1 + M0);
        vnni_pair_runs<M0 + RUN, MT, RUN>(rows, blk0, blk1, b, acc0, acc1);
    }
}

template <int MT, int RUN, class Rows>
static inline __attribute__((always_inline)) void vnni_pair_tile(const uint8_t * GGML_RESTRICT wg, size_t group_bytes,
                                                                 int64_t nb, size_t block_bytes, float * const * y,
                                                                 Rows && rows) {
    const uint8_t * wg1 = wg + group_bytes;
    __m512 acc0[MT], acc1[MT];
    for (int m = 0; m < MT; m++) {
        acc0[m] = _mm512_setzero_ps();
        acc1[m] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        vnni_pair_runs<0, MT, RUN>(rows, wg + b * block_bytes, wg1 + b * block_bytes, b, acc0, acc1);
    }
    for (int m = 0; m < MT; m++) {
        _mm512_storeu_ps(y[m], acc0[m]);
        _mm512_storeu_ps(y[m] + VNNI_ROWS, acc1[m]);
    }
}

// bytes [from, to) of the two groups' blocks `ahead` blocks on in a pair tile's order (block b of
// group g is followed by block b + 1 of g, after the last the next pair's first): the first group's
// next blocks in memory are the second group's, which its own stream is reading now
static inline __attribute__((always_inline)) void vnni_pair_prefetch(const uint8_t * blk0, const uint8_t * blk1, int64_t b,
                                                                     int64_t nb, int64_t ahead, size_t block_bytes,
                                                                     size_t from, size_t to) {
    const int64_t next = b + ahead;
    const size_t  off  = (size_t) ((next / nb) * 2 * nb + next % nb - b) * block_bytes;
    for (size_t l = from; l < to; l += 64) {
        _mm_prefetch((const char *) blk0 + off + l, _MM_HINT_T0);
        _mm_prefetch((const char *) blk1 + off + l, _MM_HINT_T0);
    }
}

// The pair tile of layout L: MT rows x two groups, L::pair_rows<n, first>(block of group 0, block of
// group 1, x, b, first row's index in x, acc0, acc1) per run of rows (L::PAIR_RUN at most)
template <class L, int MT, class Rows>
static __attribute__((noinline)) void vnni_tile2(const uint8_t * GGML_RESTRICT wg, const Rows & x, int64_t r0, float * const * y) {
    vnni_pair_tile<MT, L::PAIR_RUN>(wg, x.nb * L::BLOCK_BYTES, x.nb, L::BLOCK_BYTES, y,
        [&](auto n, auto first, int m0, const uint8_t * blk0, const uint8_t * blk1, int64_t b, __m512 * acc0, __m512 * acc1) {
            L::template pair_rows<decltype(n)::value, decltype(first)::value>(blk0, blk1, x, b, b * x.step + x.first(r0) + m0, acc0, acc1);
        });
}

// one row: its block b goes to q[b * m * 32], d[b * m], c[b * m]. Blocks go 16 at a time: their
// scales' two divisions (scalar, one block after another, they bounded the whole pass: 0.3 ms for
// 1024 x 1024 values on 2 threads, a third of a bulk append's k_proj product on AMX) are then two
// vector divisions, the same IEEE results.
static inline void q8v_quantize_row(const float * GGML_RESTRICT x, int8_t * GGML_RESTRICT q, float * GGML_RESTRICT d,
                                    int32_t * GGML_RESTRICT c, int64_t nb, int64_t m, int32_t offset) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        const int n = (int) std::min<int64_t>(16, nb - b0);
        alignas(64) float amax[16];
        __mmask16 bad = 0;  // blocks with a NaN or inf
        for (int j = 0; j < n; j++) {
            const __m512 v0 = _mm512_loadu_ps(x + (b0 + j) * QK8_0);
            const __m512 v1 = _mm512_loadu_ps(x + (b0 + j) * QK8_0 + 16);
            amax[j] = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
            // a NaN or inf in the block makes its scale NaN, so the row's outputs are NaN as in f32
            // arithmetic (max_ps would silently drop a NaN; the values are then quantized as zeros)
            const bool finite = !(_mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q)) &&
                                std::isfinite(amax[j]);
            bad |= (__mmask16) (!finite) << j;
        }
        const __mmask16 live = (__mmask16) ((1u << n) - 1);
        // db = amax / 127 (NaN for a bad block), id = 1 / db (0 where db is 0 or the block bad)
        __m512 db = _mm512_div_ps(_mm512_maskz_load_ps(live, amax), _mm512_set1_ps(127.0f));
        db = _mm512_mask_mov_ps(db, bad, _mm512_set1_ps(NAN));
        const __mmask16 invertible = live & (__mmask16) ~bad & _mm512_cmp_ps_mask(db, _mm512_setzero_ps(), _CMP_NEQ_OQ);
        alignas(64) float ids[16], ds[16];
        _mm512_store_ps(ids, _mm512_maskz_div_ps(invertible, _mm512_set1_ps(1.0f), db));
        // f16 and back with F16C (ggml's scalar FP32 -> FP16 conversion is a bit-by-bit software one
        // on x86: under `perf` a fifth of this function; the same nearest-even result, old patch 0025)
        _mm512_store_ps(ds, _mm512_cvtph_ps(_mm512_cvtps_ph(db, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
        for (int j = 0; j < n; j++) {
            const int64_t b  = b0 + j;
            const __m512  v0 = _mm512_loadu_ps(x + b * QK8_0);
            const __m512  v1 = _mm512_loadu_ps(x + b * QK8_0 + 16);
            // MXCSR's default rounding (nearest even), like ggml's vectorised q8_0 quantization
            const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(ids[j])));
            const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(ids[j])));
            // saturating narrow: the values are within +-127 already
            const __m128i n0 = _mm512_cvtsepi32_epi8(i0), n1 = _mm512_cvtsepi32_epi8(i1);
            _mm_storeu_si128((__m128i *) (q + b * m * QK8_0), n0);
            _mm_storeu_si128((__m128i *) (q + b * m * QK8_0 + 16), n1);
            // the sum of the stored (saturated) bytes, re-widened, so the correction matches them exactly
            c[b * m] = -offset * _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_cvtepi8_epi32(n0), _mm512_cvtepi8_epi32(n1)));
            d[b * m] = ds[j];
        }
    }
}

// the end of a block of a 32-value pair tile (0023): each row's two int32 sums times f16(dw) (the
// groups' 16 scales at dw0 / dw1) and f16(dx), added to its f32 sums, as the single-group tiles do
template <int N>
static inline __attribute__((always_inline)) void b32_pair_scale(const __m512i * s0, const __m512i * s1, const uint8_t * dw0,
                                                                 const uint8_t * dw1, const q8v_rows & x, int64_t i0,
                                                                 __m512 * acc0, __m512 * acc1) {
    const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) dw0));
    const __m512 d1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) dw1));
    for (int m = 0; m < N; m++) {
        const __m512 dx = _mm512_set1_ps(x.d[i0 + m]);
        acc0[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0[m]), _mm512_mul_ps(d0, dx), acc0[m]);
        acc1[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1[m]), _mm512_mul_ps(d1, dx), acc1[m]);
    }
}

// The driver of the 32-value layouts (q8_0, q4_0; 0010's): every thread quantizes its share of the
// activation rows per 32 values (as q8_0), a barrier, then the tiles run over the 16-row weight
// groups (vnni_for_each_tile). L: the layout (BLOCK_BYTES, OFFSET, MT_MAX, PAIRS, PAIR_RUN,
// WIDE_ON_AMX, fits, tile, pair_rows, repack_block, block). With WIDE_ON_AMX, a product of
// AMX_Q8_0_MIN_ROWS rows or more runs its 16-row tiles on AMX tiles where the process has them.
template <class L>
struct b32_vnni {
    static bool fits(const struct ggml_tensor * t) {
        return L::fits(t) && ggml_cpu_has_avx512_vnni();
    }

    static size_t alloc_size(const struct ggml_tensor * t) {
        return (size_t) (t->ne[1] / VNNI_ROWS) * (size_t) (t->ne[0] / QK8_0) * L::BLOCK_BYTES;
    }

    static bool takes(const struct ggml_tensor * op) {
        return vnni_handles(op) && L::fits(op->src[0]);
    }

    static size_t work_size(int n_threads, const struct ggml_tensor * op) {
        const int64_t m = GGML_PAD(ggml_nrows(op->src[1]), 16), nb = op->src[0]->ne[0] / QK8_0;
        // q + d + c (rows padded to whole 16-row tiles: `tiled`), then one f32 row per thread to
        // gather rows whose values are not contiguous
        return (size_t) m * nb * (QK8_0 + 2 * sizeof(float)) + 3 * 64 + (size_t) n_threads * nb * QK8_0 * sizeof(float);
    }

    static void compute(const struct ggml_compute_params * params, struct ggml_tensor * op) {
        const struct ggml_tensor * src0 = op->src[0];
        const struct ggml_tensor * src1 = op->src[1];
        const int64_t K = src0->ne[0], nb = K / QK8_0;
        const int64_t M = ggml_nrows(src1);

        // every thread gets the same answer (the process may use AMX or not), so all quantize alike
        q8v_wide_tile wide = nullptr;
        if constexpr (L::WIDE_ON_AMX) {
            wide = M >= AMX_Q8_0_MIN_ROWS ? amx_q8_0_tile_on_this_thread() : nullptr;
        }
        const int64_t Mp = GGML_PAD(M, 16);
        char * w = (char *) GGML_PAD((uintptr_t) params->wdata, 64);
        q8v_rows x;
        x.nb    = nb;
        x.m     = M;
        x.tiled = wide != nullptr;
        x.step  = x.tiled ? 16 : M;
        x.q     = (int8_t *) w;
        x.d     = (float *) GGML_PAD((uintptr_t) (x.q + Mp * K), 64);
        x.c     = (int32_t *) GGML_PAD((uintptr_t) (x.d + Mp * nb), 64);
        float * gather = (float *) (x.c + Mp * nb);
        GGML_ASSERT((char *) (gather + (size_t) params->nth * K) <= (char *) params->wdata + params->wsize);

        vnni_quantize_own_share(params, src1, gather + (size_t) params->ith * K, nb,
                                [&](const float * xr, int64_t r, int64_t b0, int64_t b1) {
            const int64_t i = b0 * x.step + x.first(r);
            q8v_quantize_row(xr + b0 * QK8_0, x.q + i * QK8_0, x.d + i, x.c + i, b1 - b0, x.step, L::OFFSET);
        }, x.tiled ? 16 : 0);
        ggml_barrier(params->threadpool);
        auto tile = [&](auto mt, auto groups, const uint8_t * wg, int64_t r, float * const * y) {
            if constexpr (L::WIDE_ON_AMX && decltype(mt)::value == 16) {
                if (wide != nullptr) {  // a pair of groups: one after the other
                    wide(wg, x, r, y);
                    if constexpr (decltype(groups)::value == 2) {
                        float * y1[16];
                        for (int m = 0; m < 16; m++) {
                            y1[m] = y[m] + VNNI_ROWS;
                        }
                        wide(wg + nb * L::BLOCK_BYTES, x, r, y1);
                    }
                    return;
                }
            }
            if constexpr (decltype(groups)::value == 2) {
                vnni_tile2<L, decltype(mt)::value>(wg, x, r, y);
            } else {
                L::template tile<decltype(mt)::value>(wg, x, r, y);
            }
        };
        // on AMX, rows in chunks whose quantized activations stay in L2 while every weight group of
        // the thread passes over them (AMX_Q8_0_CHUNK_BYTES)
        const int64_t chunk = wide != nullptr ? std::max<int64_t>(16, (AMX_Q8_0_CHUNK_BYTES / K) / 16 * 16) : M;
        for (int64_t r0 = 0; r0 < M; r0 += chunk) {
            vnni_for_each_tile<L::MT_MAX, L::PAIRS>(params, op, nb * L::BLOCK_BYTES, tile, r0, std::min(M, r0 + chunk));
        }
    }

    static void repack(struct ggml_tensor * t, const void * data) {
        GGML_ASSERT(L::fits(t));
        const int64_t nb = t->ne[0] / QK8_0, G = t->ne[1] / VNNI_ROWS;
        const typename L::block * src = (const typename L::block *) data;
        uint8_t * out = (uint8_t *) t->data;
        for (int64_t g = 0; g < G; g++) {
            for (int64_t b = 0; b < nb; b++) {
                L::repack_block(out + (g * nb + b) * L::BLOCK_BYTES, src + g * VNNI_ROWS * nb + b, nb);
            }
        }
    }

    static constexpr repack_layout layout(const char * name) {
        return {name, fits, alloc_size, repack, {name, takes, work_size, compute}};
    }
};

#endif  // PYGGML_DKV_VNNI

}  // namespace ggml::cpu::dkv
