// The AVX512-VNNI products of repacked K-quant weights (q6_K, q4_K, q5_K) in our CPU_DKV_REPACK
// buffer: what their layouts share, on mm-vnni.h's drivers. From pyggml_dkv's patches to ggml
// 0.10.1 (there in repack.cpp): 0020 (q6_K), 0021 (q4_K / q5_K), 0023, 0033 (pair tiles), 0037
// (q5_K's fifth bits as a plane), 0038 (q4_K's sub-block scales by vpdpwssd).
//
// q6_K, q4_K and q5_K weights for the same AVX512-VNNI scheme (old patches 0020, 0021): the published
// Q4_K_M drafters keep most matrices in q4_K and their output head and some attn_v / ffn_down
// matrices in q6_K, which ggml multiplied one weight row by one column (q6_K, ~80 G multiply-adds/s
// on the 2-core Zen 5) or with its AVX2 8x8 kernel (q4_K, 125-216 G; q8_0 on 0010 ~530 G). The
// layouts group 16 weight rows and one 256-value block (a K-quant super-block), 4 consecutive inputs
// of the 16 rows per 64-byte vector as 0010, so one vpdpbusd with 4 broadcast activation bytes adds
// 64 products into the 16 rows' int32 sums. The activations are quantized per 256 values (scale
// max|x| / 127, nearest even, like q8_K) and stay signed.
//
// The driver they share: every thread quantizes its share of the activation rows into the work
// buffer (values, one scale per 256, and the per-sub-block sums the layout needs), then the tiles
// of up to the layout's MT_MAX rows (8, 16 for q5_K) run over the 16-row weight groups (vnni_for_each_tile).
#pragma once

#include "mm-vnni.h"
#include "simd-mappings.h"

namespace ggml::cpu::dkv {

#ifdef PYGGML_DKV_VNNI

// Activations of one K-quant product: m rows of nb 256-value blocks, stored block by block so that a
// tile's rows of one block lie at fixed offsets from one pointer (per-row pointers ran out of
// general registers in the tiles and were reloaded from the stack)
struct kv_rows {
    int8_t  * q;     // [nb][m][256]
    float   * d;     // [nb][m]          scale of each block
    int32_t * sums;  // [nb][m][N_SUMS]  the layout's per-sub-block sums
    int64_t   nb;
    int64_t   m;
    int64_t   step;  // = m: block b of row r at b * step + first(r), as in q8v_rows (never tiled here)

    int64_t first(int64_t r) const {
        return r;
    }
};

// quantizes one 256-value block to q, returns its scale
static inline float kv_quantize_block(const float * GGML_RESTRICT xb, int8_t * GGML_RESTRICT q) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    __m512 amax = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int k = 0; k < QK_K; k += 16) {
        const __m512 v = _mm512_loadu_ps(xb + k);
        amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, v));
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    const float m = _mm512_reduce_max_ps(amax);
    // a NaN or inf in the block makes its scale NaN, so the row's outputs are NaN as in f32 arithmetic
    const bool finite = nan == 0 && std::isfinite(m);
    const float db = finite ? m / 127.0f : NAN;
    const float id = finite && db != 0.0f ? 1.0f / db : 0.0f;
    for (int j = 0; j < QK_K / 16; j++) {
        // MXCSR's default rounding (nearest even); the values are within +-127
        const __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 16 * j), _mm512_set1_ps(id)));
        _mm_storeu_si128((__m128i *) (q + 16 * j), _mm512_cvtsepi32_epi8(i));
    }
    return db;
}

// the sum of n stored (saturated) activation bytes
static inline int32_t kv_sum_bytes(const int8_t * q, int n) {
    __m512i s = _mm512_setzero_si512();
    for (int k = 0; k < n; k += 16) {
        s = _mm512_add_epi32(s, _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) (q + k))));
    }
    return _mm512_reduce_add_epi32(s);
}


// The driver of the 256-value layouts (q6_K, q4_K, q5_K): every thread quantizes its share of the
// activation rows per 256 values (kv_quantize_block) with the layout's per-sub-block sums, a barrier,
// then the tiles run over the 16-row weight groups (vnni_for_each_tile). L: the layout (BLOCK_BYTES,
// N_SUMS, MT_MAX, PAIRS, PAIR_RUN, fits, block_sums, tile, pair_rows, repack_block, block).
template <class L>
struct k_vnni {
    static bool fits(const struct ggml_tensor * t) {
        return L::fits(t) && t->nb[1] == ggml_row_size(t->type, t->ne[0]) && ggml_cpu_has_avx512_vnni();
    }

    // more than the type's own blocks (the codes one per byte for q6_K, the scales and mins widened)
    static size_t alloc_size(const struct ggml_tensor * t) {
        return (size_t) (t->ne[1] / VNNI_ROWS) * (size_t) (t->ne[0] / QK_K) * L::BLOCK_BYTES;
    }

    static bool takes(const struct ggml_tensor * op) {
        return vnni_handles(op) && L::fits(op->src[0]);
    }

    static size_t work_size(int n_threads, const struct ggml_tensor * op) {
        const int64_t m = ggml_nrows(op->src[1]), nb = op->src[0]->ne[0] / QK_K;
        // q + d + sums, then one f32 row per thread to gather rows whose values are not contiguous
        return (size_t) m * nb * (QK_K + sizeof(float) + L::N_SUMS * sizeof(int32_t)) + 3 * 64 +
               (size_t) n_threads * nb * QK_K * sizeof(float);
    }

    static void compute(const struct ggml_compute_params * params, struct ggml_tensor * op) {
        const struct ggml_tensor * src0 = op->src[0];
        const struct ggml_tensor * src1 = op->src[1];
        const int64_t K = src0->ne[0], nb = K / QK_K;
        const int64_t M = ggml_nrows(src1);

        char * w = (char *) GGML_PAD((uintptr_t) params->wdata, 64);
        kv_rows x;
        x.nb   = nb;
        x.m    = M;
        x.step = M;
        x.q    = (int8_t *) w;
        x.d    = (float *) GGML_PAD((uintptr_t) (x.q + M * K), 64);
        x.sums = (int32_t *) GGML_PAD((uintptr_t) (x.d + M * nb), 64);
        float * gather = (float *) (x.sums + M * nb * L::N_SUMS);
        GGML_ASSERT((char *) (gather + (size_t) params->nth * K) <= (char *) params->wdata + params->wsize);

        vnni_quantize_own_share(params, src1, gather + (size_t) params->ith * K, nb,
                                [&](const float * xr, int64_t r, int64_t b0, int64_t b1) {
            for (int64_t b = b0; b < b1; b++) {
                int8_t * q = x.q + (b * M + r) * QK_K;
                x.d[b * M + r] = kv_quantize_block(xr + b * QK_K, q);
                L::block_sums(q, x.sums + (b * M + r) * L::N_SUMS);
            }
        });
        ggml_barrier(params->threadpool);
        vnni_for_each_tile<L::MT_MAX, L::PAIRS>(params, op, nb * L::BLOCK_BYTES,
                                                [&](auto mt, auto groups, const uint8_t * wg, int64_t r, float * const * y) {
            if constexpr (decltype(groups)::value == 2) {
                vnni_tile2<L, decltype(mt)::value>(wg, x, r, y);
            } else {
                L::template tile<decltype(mt)::value>(wg, x, r, y);
            }
        });
    }

    static void repack(struct ggml_tensor * t, const void * data) {
        GGML_ASSERT(L::fits(t));
        const int64_t nb = t->ne[0] / QK_K, G = t->ne[1] / VNNI_ROWS;
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

// q4_K and q5_K (0021): per 16 rows and block
//   codes                uint8 q[32][16][4], vector v holds inputs 8v .. 8v+7 of the 16 rows: byte (r, t)
//                        has the low 4 bits of the code of input 8v + t in its low nibble, of input
//                        8v + 4 + t in its high nibble (a 32-value sub-block: 4 vectors)
//   uint64 hb[64]        q5_K only (old patch 0037): the codes' fifth bits, one 64-bit mask per
//                        4 inputs: bit 4r + t of hb[g] is bit 4 of the code of input 4g + t of row r,
//                        the byte lane that input takes in the unpacked vector
//   uint8 sc[8][16]      the 8 sub-blocks' 6-bit scales of the 16 rows
//   int16 mn[4][16][2]   the sub-blocks' 6-bit mins, sub-blocks 2i and 2i + 1 paired per row (vpdpwssd)
//   f32   d[16], dmin[16]
// = 2560 bytes where q4_K stores 16 x 144 = 2304 (q5_K: 3072 for 2816; one code per byte, 0021's
// first layout, took 4608, and q5_K's steps streamed those bytes). w = d * sc * code - dmin * mn,
// exactly the K-quant's values. As ggml's q4_K / q5_K x q8_K dot products, per block
// isum = sum_j sc_j * sum(code * qx) and imin = sum_j mn_j * sum(qx) are exact int32
// (|isum| <= 8 * 63 * 32 * 31 * 127 < 2^26), and y = sum over blocks of dx * (d * f32(isum) -
// dmin * f32(imin)) in f32: the codes need no offset, vpdpbusd takes them as the unsigned operand.
template <int BITS>
struct kmv {
    static_assert(BITS == 4 || BITS == 5, "q4_K or q5_K");
    using block = std::conditional_t<BITS == 4, block_q4_K, block_q5_K>;
    static constexpr ggml_type TYPE     = BITS == 4 ? GGML_TYPE_Q4_K : GGML_TYPE_Q5_K;
    static constexpr size_t CODE_BYTES  = VNNI_ROWS * QK_K / 2;                    // 2048
    static constexpr size_t HB_OFF      = CODE_BYTES;
    static constexpr size_t HB_BYTES    = BITS == 5 ? VNNI_ROWS * QK_K / 8 : 0;    // q5_K: 512
    static constexpr size_t SC_OFF      = HB_OFF + HB_BYTES;
    static constexpr size_t MN_OFF      = SC_OFF + VNNI_ROWS * 8;
    static constexpr size_t D_OFF       = MN_OFF + VNNI_ROWS * 8 * sizeof(int16_t);
    static constexpr size_t BLOCK_BYTES = D_OFF + 2 * VNNI_ROWS * sizeof(float);  // 2560 / 3072
    static constexpr int    PF_BLOCKS   = 3;
    static constexpr int    N_SUMS      = 4;  // sums of sub-blocks 2i (low 16 bits) and 2i + 1 (high)
    // tiles over two groups (0023) for q4_K; q5_K's steps ran 5-10% slower with them (measured with
    // its 4608-byte blocks of one code per byte, before 0037: they streamed at the memory's pace, and
    // two of them per run crowded L1)
    static constexpr bool   PAIRS       = BITS == 4;
    // q4_K: a tile's 8 rows in one run (old patch 0033), its codes unpacked once per tile
    // instead of twice: 0.93-0.96 of a step's products' time on Emerald Rapids (q8_0 / q4_0 keep
    // runs of 6: with 8, 1.2-1.35 / 1.00)
    static constexpr int    PAIR_RUN    = BITS == 4 ? 8 : 4;
    // q5_K in tiles of 16 rows (old patch 0032): one pass of a noise block over each group,
    // 0.83-0.95 of the products' time on Emerald Rapids (with pairs as well: no better); q4_K's
    // pair tiles 0.98-1.01 with 16, so they keep 8
    static constexpr int    MT_MAX      = BITS == 5 ? 16 : 8;

    static bool fits(const struct ggml_tensor * t) {
        return t->type == TYPE && t->ne[0] % QK_K == 0 && t->ne[1] % VNNI_ROWS == 0 && t->ne[2] == 1 && t->ne[3] == 1;
    }

    // w[u], u = 0..7: the codes of inputs 32j + 4u .. 32j + 4u + 3 of the 16 rows (sub-block j of a
    // block), one per byte: the nibbles split, and for q5_K each byte whose fifth bit is set raised
    // by 16 (a masked byte add: the mask straight from hb)
    static inline __attribute__((always_inline)) void sub_block_codes(const uint8_t * GGML_RESTRICT blk, int j, __m512i * w) {
        const __m512i low4 = _mm512_set1_epi8(0x0F);
        for (int t = 0; t < 4; t++) {
            const __m512i v = _mm512_loadu_si512((const void *) (blk + 64 * (4 * j + t)));
            w[2 * t]     = _mm512_and_si512(v, low4);
            w[2 * t + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        }
        if constexpr (BITS == 5) {
            const __m512i sixteen = _mm512_set1_epi8(16);
            for (int u = 0; u < 8; u++) {
                uint64_t bits;
                memcpy(&bits, blk + HB_OFF + 8 * (8 * j + u), sizeof(bits));
                w[u] = _mm512_mask_add_epi8(w[u], _cvtu64_mask64(bits), w[u], sixteen);
            }
        }
    }

    // isum + s * sc for s within int16 (q4_K: 16 codes <= 15 times 16 activations within +-127 are
    // within +-30480) and sc within 0..63: the int32 lanes of s and sc as int16 pairs (s, its sign)
    // and (sc, 0), one vpdpwssd (exact) instead of vpmulld (two uops, ten cycles' latency) + vpaddd
    static inline __attribute__((always_inline)) __m512i scale_add(__m512i isum, __m512i s, __m512i sc) {
        return _mm512_dpwssd_epi32(isum, s, sc);
    }

    static void block_sums(const int8_t * q, int32_t * s) {
        for (int i = 0; i < 4; i++) {  // each sum is within 32 * 127: int16
            const int32_t lo = kv_sum_bytes(q + 64 * i, 32), hi = kv_sum_bytes(q + 64 * i + 32, 32);
            s[i] = (int32_t) ((uint32_t) (uint16_t) (int16_t) lo | ((uint32_t) (uint16_t) (int16_t) hi << 16));
        }
    }

    template <int MT>
    static __attribute__((noinline)) void tile(const uint8_t * GGML_RESTRICT wg, const kv_rows & x, int64_t r0, float * const * y) {
        const int64_t nb = x.nb;
        __m512 acc[MT];
        for (int m = 0; m < MT; m++) {
            acc[m] = _mm512_setzero_ps();
        }
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t * blk = wg + b * BLOCK_BYTES;
            __m512i isum[MT];
            for (int m = 0; m < MT; m++) {
                isum[m] = _mm512_setzero_si512();
            }
            for (int j = 0; j < 8; j++) {
                // the weights stream from DRAM: the sub-block's share of the block PF_BLOCKS ahead
                for (int l = j * (int) (BLOCK_BYTES / 8); l < (j + 1) * (int) (BLOCK_BYTES / 8); l += 64) {
                    _mm_prefetch((const char *) blk + PF_BLOCKS * BLOCK_BYTES + l, _MM_HINT_T0);
                }
                // w[u]: inputs 32j + 4u .. 32j + 4u + 3 of the 16 rows
                __m512i w[8];
                sub_block_codes(blk, j, w);
                const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *) (blk + SC_OFF + 16 * j)));
                // unrolled, so that the rows' sums stay in registers (GCC otherwise keeps them on the stack)
#pragma GCC unroll 8
                for (int m = 0; m < MT; m++) {
                    const int32_t * xq = (const int32_t *) (x.q + (b * x.m + r0 + m) * QK_K + 32 * j);
                    // two chains of four: vpdpbusd's latency, not its throughput, bounded one chain of eight
                    __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
                    for (int u = 0; u < 8; u += 2) {
                        s0 = _mm512_dpbusd_epi32(s0, w[u], _mm512_set1_epi32(xq[u]));
                        s1 = _mm512_dpbusd_epi32(s1, w[u + 1], _mm512_set1_epi32(xq[u + 1]));
                    }
                    if constexpr (BITS == 4) {
                        isum[m] = scale_add(scale_add(isum[m], s0, sc), s1, sc);
                    } else {
                        isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(_mm512_add_epi32(s0, s1), sc));
                    }
                }
            }
            __m512i mn[4];
            for (int i = 0; i < 4; i++) {
                mn[i] = _mm512_loadu_si512((const void *) (blk + MN_OFF + 64 * i));
            }
            const __m512 dw   = _mm512_loadu_ps((const float *) (blk + D_OFF));
            const __m512 dmin = _mm512_loadu_ps((const float *) (blk + D_OFF) + VNNI_ROWS);
            for (int m = 0; m < MT; m++) {
                const int64_t   rb = b * x.m + r0 + m;
                const int32_t * xs = x.sums + rb * N_SUMS;
                __m512i imin = _mm512_setzero_si512();
                for (int i = 0; i < 4; i++) {
                    imin = _mm512_dpwssd_epi32(imin, mn[i], _mm512_set1_epi32(xs[i]));
                }
                const __m512 blk_sum = _mm512_fmsub_ps(dw, _mm512_cvtepi32_ps(isum[m]),
                                                       _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(imin)));
                acc[m] = _mm512_fmadd_ps(blk_sum, _mm512_set1_ps(x.d[rb]), acc[m]);
            }
        }
        for (int m = 0; m < MT; m++) {
            _mm512_storeu_ps(y[m], acc[m]);
        }
    }

    // rows rb0 .. rb0 + N - 1 of block b of two consecutive 16-row groups (old patch 0023): each
    // broadcast activation word feeds one vpdpbusd per group; the same exact int32 sums and the same f32
    // operations as tile (bit-identical). FIRST: this run prefetches, a sub-block's share at a time.
    template <int N, bool FIRST>
    static inline __attribute__((always_inline)) void pair_rows(const uint8_t * GGML_RESTRICT blk0, const uint8_t * GGML_RESTRICT blk1,
                                                                const kv_rows & x, int64_t b, int64_t rb0, __m512 * acc0, __m512 * acc1) {
        const __m512i low4 = _mm512_set1_epi8(0x0F);
        __m512i isum0[N], isum1[N];
        for (int m = 0; m < N; m++) {
            isum0[m] = isum1[m] = _mm512_setzero_si512();
        }
        for (int j = 0; j < 8; j++) {
            if constexpr (FIRST) {
                vnni_pair_prefetch(blk0, blk1, b, x.nb, PF_BLOCKS, BLOCK_BYTES, j * (BLOCK_BYTES / 8), (j + 1) * (BLOCK_BYTES / 8));
            }
            __m512i s0[N], s1[N];
            for (int m = 0; m < N; m++) {
                s0[m] = s1[m] = _mm512_setzero_si512();
            }
            auto step = [&](__m512i w0, __m512i w1, int u) {
                for (int m = 0; m < N; m++) {
                    const __m512i a = _mm512_set1_epi32(((const int32_t *) (x.q + (rb0 + m) * QK_K + 32 * j))[u]);
                    s0[m] = _mm512_dpbusd_epi32(s0[m], w0, a);
                    s1[m] = _mm512_dpbusd_epi32(s1[m], w1, a);
                }
            };
            const __m512i sc0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *) (blk0 + SC_OFF + 16 * j)));
            const __m512i sc1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *) (blk1 + SC_OFF + 16 * j)));
            if constexpr (BITS == 4) {
                for (int t = 0; t < 4; t++) {
                    const __m512i v0 = _mm512_loadu_si512((const void *) (blk0 + 64 * (4 * j + t)));
                    const __m512i v1 = _mm512_loadu_si512((const void *) (blk1 + 64 * (4 * j + t)));
                    step(_mm512_and_si512(v0, low4), _mm512_and_si512(v1, low4), 2 * t);
                    step(_mm512_and_si512(_mm512_srli_epi16(v0, 4), low4), _mm512_and_si512(_mm512_srli_epi16(v1, 4), low4), 2 * t + 1);
                    if (t & 1) {  // 16 inputs summed: within int16, scaled and added by one vpdpwssd
                        for (int m = 0; m < N; m++) {
                            isum0[m] = scale_add(isum0[m], s0[m], sc0);
                            isum1[m] = scale_add(isum1[m], s1[m], sc1);
                            s0[m] = s1[m] = _mm512_setzero_si512();
                        }
                    }
                }
            } else {
                __m512i w0[8], w1[8];
                sub_block_codes(blk0, j, w0);
                sub_block_codes(blk1, j, w1);
                for (int u = 0; u < 8; u++) {
                    step(w0[u], w1[u], u);
                }
                for (int m = 0; m < N; m++) {
                    isum0[m] = _mm512_add_epi32(isum0[m], _mm512_mullo_epi32(s0[m], sc0));
                    isum1[m] = _mm512_add_epi32(isum1[m], _mm512_mullo_epi32(s1[m], sc1));
                }
            }
        }
        const __m512 dw0 = _mm512_loadu_ps((const float *) (blk0 + D_OFF)), dmin0 = _mm512_loadu_ps((const float *) (blk0 + D_OFF) + VNNI_ROWS);
        const __m512 dw1 = _mm512_loadu_ps((const float *) (blk1 + D_OFF)), dmin1 = _mm512_loadu_ps((const float *) (blk1 + D_OFF) + VNNI_ROWS);
        for (int m = 0; m < N; m++) {
            const int32_t * xs = x.sums + (rb0 + m) * N_SUMS;
            __m512i imin0 = _mm512_setzero_si512(), imin1 = _mm512_setzero_si512();
            for (int i = 0; i < 4; i++) {
                const __m512i a = _mm512_set1_epi32(xs[i]);
                imin0 = _mm512_dpwssd_epi32(imin0, _mm512_loadu_si512((const void *) (blk0 + MN_OFF + 64 * i)), a);
                imin1 = _mm512_dpwssd_epi32(imin1, _mm512_loadu_si512((const void *) (blk1 + MN_OFF + 64 * i)), a);
            }
            const __m512 dx = _mm512_set1_ps(x.d[rb0 + m]);
            acc0[m] = _mm512_fmadd_ps(_mm512_fmsub_ps(dw0, _mm512_cvtepi32_ps(isum0[m]), _mm512_mul_ps(dmin0, _mm512_cvtepi32_ps(imin0))), dx, acc0[m]);
            acc1[m] = _mm512_fmadd_ps(_mm512_fmsub_ps(dw1, _mm512_cvtepi32_ps(isum1[m]), _mm512_mul_ps(dmin1, _mm512_cvtepi32_ps(imin1))), dx, acc1[m]);
        }
    }


    // the 6-bit scale and min of sub-block j (ggml's get_scale_min_k4)
    static void scale_min(int j, const uint8_t * q, int & sc, int & mn) {
        if (j < 4) {
            sc = q[j] & 63;
            mn = q[j + 4] & 63;
        } else {
            sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
            mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        }
    }

    // the code of value i: sub-block j = i / 32 is the low (j even) or high (j odd) nibble of byte
    // qs[32 * (j / 2) + i % 32], q5_K's fifth bit bit j of qh[i % 32] (ggml's dequantize_row_q4_K / q5_K)
    static int code(const block & s, int i) {
        const int j = i / 32;
        const uint8_t byte = s.qs[32 * (j / 2) + i % 32];
        const int low = j % 2 == 0 ? byte & 0xF : byte >> 4;
        if constexpr (BITS == 5) {
            return low | (((s.qh[i % 32] >> j) & 1) << 4);
        }
        return low;
    }

    static void repack_block(uint8_t * blk, const block * src, int64_t nb) {
        memset(blk, 0, CODE_BYTES + HB_BYTES);
        int16_t * mins = (int16_t *) (blk + MN_OFF);
        float * d = (float *) (blk + D_OFF);
        for (int r = 0; r < VNNI_ROWS; r++) {
            const block & s = src[r * nb];
            d[r]           = GGML_CPU_FP16_TO_FP32(s.GGML_COMMON_AGGR_U.GGML_COMMON_AGGR_S.d);
            d[VNNI_ROWS + r] = GGML_CPU_FP16_TO_FP32(s.GGML_COMMON_AGGR_U.GGML_COMMON_AGGR_S.dmin);
            for (int j = 0; j < 8; j++) {
                int sc, mn;
                scale_min(j, s.scales, sc, mn);
                blk[SC_OFF + j * VNNI_ROWS + r] = (uint8_t) sc;
                mins[((j / 2) * VNNI_ROWS + r) * 2 + j % 2] = (int16_t) mn;
            }
            for (int i = 0; i < QK_K; i++) {
                const int t = i % 8, low = code(s, i) & 0xF;
                blk[(i / 8) * 64 + r * 4 + t % 4] |= (uint8_t) (t < 4 ? low : low << 4);
                if constexpr (BITS == 5) {
                    uint64_t bits;
                    uint8_t * hb = blk + HB_OFF + 8 * (i / 4);
                    memcpy(&bits, hb, sizeof(bits));
                    bits |= (uint64_t) ((code(s, i) >> 4) & 1) << (4 * r + i % 4);
                    memcpy(hb, &bits, sizeof(bits));
                }
            }
        }
    }
};

#endif  // PYGGML_DKV_VNNI

}  // namespace ggml::cpu::dkv
