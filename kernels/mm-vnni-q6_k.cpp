// q6_K weights times f32 rows on AVX512-VNNI (vpdpbusd), for weights in our CPU_DKV_REPACK buffer
// (repack.cpp; the drivers in mm-vnni.h and mm-vnni-kquant.h). From pyggml_dkv's patches to ggml
// 0.10.1: 0020 (layout, tile), 0023 (pair tiles), 0033 (runs of 8 rows). ggml 0.25.3 has no x86
// repacked layout for q6_K (its CPU_REPACK takes none here): its own path multiplies one weight row
// by one activation row quantized to q8_K (or its tiled/ kernel from 8 rows).
//
// Figure: against ggml 0.25.3's own q6_K path (CPU buffer: its tiled/ kernel from 8 rows; no x86
// layout for q6_K in its CPU_REPACK), as for q8_0 (mm-vnni-q8_0.cpp: same machine, load and
// benchmark), 2 threads. Microseconds a product, ours / ggml's:
//   3072 x 1024 x 16 columns  383 /  972 (0.39)    1024 x 3072 x 16  337 /  978 (0.34)
//   1024 x 1024 x 16          146 /  371 (0.39)    3072 x 1024 x 34  576 / 1476 (0.39)
//   8192 x 1024 x  9          617 / 2228 (0.28)    115-186 G multiply-adds/s
//
// Pyggml-Dkv-Capability: vnni-q6_k

#include "mm-vnni-kquant.h"

namespace ggml::cpu::dkv {

#ifdef PYGGML_DKV_VNNI

// q6_K (0020): per 16 rows and block the 6-bit codes (0..63) one per byte, 64 vectors of 64 bytes,
// then the 16 sub-blocks' int8 scales of the 16 rows, then the rows' f32 d: w = d * scale * (code - 32),
// exactly the q6_K values. Every 16-value sub-block's int32 sum (vpdpbusd, started at -32 * the
// sub-block's activation sum) is scaled by d * scale in f32, the block's sum by the activation scale.
struct q6v {
    using block = block_q6_K;
    static constexpr size_t CODE_BYTES  = VNNI_ROWS * QK_K;                                               // 4096
    static constexpr size_t BLOCK_BYTES = CODE_BYTES + VNNI_ROWS * (QK_K / 16) + VNNI_ROWS * sizeof(float);  // 4416
    static constexpr int    PF_BLOCKS   = 2;
    static constexpr int    N_SUMS      = 16;  // -32 * the sum of each 16-value sub-block
    static constexpr bool   PAIRS       = true;  // tiles over two groups (0023)
    // a tile's 8 rows in one run (old patch 0033; runs of 4 before kept every sum in registers
    // but loaded each 64-byte vector of codes twice per tile): a step's products 0.91-0.92 of their
    // time on Emerald Rapids, bit-identical
    static constexpr int    PAIR_RUN    = 8;
    static constexpr int    MT_MAX      = 8;     // (16: 0.96-1.02 of the time, 0032)

    static bool fits(const struct ggml_tensor * t) {
        return t->type == GGML_TYPE_Q6_K && t->ne[0] % QK_K == 0 && t->ne[1] % VNNI_ROWS == 0 && t->ne[2] == 1 && t->ne[3] == 1;
    }

    static void block_sums(const int8_t * q, int32_t * c) {
        for (int j = 0; j < QK_K / 16; j++) {
            c[j] = -32 * kv_sum_bytes(q + 16 * j, 16);
        }
    }

    // MT activation rows x one 16-row weight group, over every 256-value block.
    template <int MT>
    static __attribute__((noinline)) void tile(const uint8_t * GGML_RESTRICT wg, const kv_rows & x, int64_t r0, float * const * y) {
        const int64_t nb = x.nb;
        __m512 acc[MT];
        for (int m = 0; m < MT; m++) {
            acc[m] = _mm512_setzero_ps();
        }
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t * blk = wg + b * BLOCK_BYTES;
            const __m512 dw = _mm512_loadu_ps((const float *) (blk + CODE_BYTES + VNNI_ROWS * (QK_K / 16)));
            __m512 accb[MT];
            for (int m = 0; m < MT; m++) {
                accb[m] = _mm512_setzero_ps();
            }
            for (int j = 0; j < QK_K / 16; j++) {
                // the weights stream from DRAM: 4-5 lines of the block PF_BLOCKS ahead per sub-block
                for (int l = j * 320; l < (j + 1) * 320 && l < (int) BLOCK_BYTES; l += 64) {
                    _mm_prefetch((const char *) blk + PF_BLOCKS * BLOCK_BYTES + l, _MM_HINT_T0);
                }
                __m512i w[4];
                for (int t = 0; t < 4; t++) {
                    w[t] = _mm512_loadu_si512((const void *) (blk + 64 * (4 * j + t)));
                }
                const __m128i sc = _mm_loadu_si128((const __m128i *) (blk + CODE_BYTES + 16 * j));
                const __m512 coef = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)), dw);
                for (int m = 0; m < MT; m++) {
                    const int32_t * xq = (const int32_t *) (x.q + (b * x.m + r0 + m) * QK_K + 16 * j);
                    __m512i s = _mm512_set1_epi32(x.sums[(b * x.m + r0 + m) * N_SUMS + j]);
                    for (int t = 0; t < 4; t++) {
                        s = _mm512_dpbusd_epi32(s, w[t], _mm512_set1_epi32(xq[t]));
                    }
                    accb[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), coef, accb[m]);
                }
            }
            for (int m = 0; m < MT; m++) {
                acc[m] = _mm512_fmadd_ps(accb[m], _mm512_set1_ps(x.d[b * x.m + r0 + m]), acc[m]);
            }
        }
        for (int m = 0; m < MT; m++) {
            _mm512_storeu_ps(y[m], acc[m]);
        }
    }

    // as q8v::pair_rows (old patch 0023), per 16-value sub-block as tile; FIRST: this run
    // prefetches, a sub-block's share at a time
    template <int N, bool FIRST>
    static inline __attribute__((always_inline)) void pair_rows(const uint8_t * GGML_RESTRICT blk0, const uint8_t * GGML_RESTRICT blk1,
                                                                const kv_rows & x, int64_t b, int64_t rb0, __m512 * acc0, __m512 * acc1) {
        const __m512 dw0 = _mm512_loadu_ps((const float *) (blk0 + CODE_BYTES + VNNI_ROWS * (QK_K / 16)));
        const __m512 dw1 = _mm512_loadu_ps((const float *) (blk1 + CODE_BYTES + VNNI_ROWS * (QK_K / 16)));
        __m512 accb0[N], accb1[N];
        for (int m = 0; m < N; m++) {
            accb0[m] = accb1[m] = _mm512_setzero_ps();
        }
        for (int j = 0; j < QK_K / 16; j++) {
            if constexpr (FIRST) {
                vnni_pair_prefetch(blk0, blk1, b, x.nb, PF_BLOCKS, BLOCK_BYTES, j * 320, std::min<size_t>((j + 1) * 320, BLOCK_BYTES));
            }
            __m512i s0[N], s1[N];
            for (int m = 0; m < N; m++) {
                s0[m] = s1[m] = _mm512_set1_epi32(x.sums[(rb0 + m) * N_SUMS + j]);
            }
            for (int t = 0; t < 4; t++) {
                const __m512i w0 = _mm512_loadu_si512((const void *) (blk0 + 64 * (4 * j + t)));
                const __m512i w1 = _mm512_loadu_si512((const void *) (blk1 + 64 * (4 * j + t)));
                for (int m = 0; m < N; m++) {
                    const __m512i a = _mm512_set1_epi32(((const int32_t *) (x.q + (rb0 + m) * QK_K + 16 * j))[t]);
                    s0[m] = _mm512_dpbusd_epi32(s0[m], w0, a);
                    s1[m] = _mm512_dpbusd_epi32(s1[m], w1, a);
                }
            }
            const __m512 coef0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) (blk0 + CODE_BYTES + 16 * j)))), dw0);
            const __m512 coef1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) (blk1 + CODE_BYTES + 16 * j)))), dw1);
            for (int m = 0; m < N; m++) {
                accb0[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0[m]), coef0, accb0[m]);
                accb1[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1[m]), coef1, accb1[m]);
            }
        }
        for (int m = 0; m < N; m++) {
            const __m512 dx = _mm512_set1_ps(x.d[rb0 + m]);
            acc0[m] = _mm512_fmadd_ps(accb0[m], dx, acc0[m]);
            acc1[m] = _mm512_fmadd_ps(accb1[m], dx, acc1[m]);
        }
    }


    // one 16-row x 256-value block from the rows' q6_K blocks src[r * nb]
    static void repack_block(uint8_t * blk, const block_q6_K * src, int64_t nb) {
        int8_t * scales = (int8_t *) (blk + CODE_BYTES);
        float * d = (float *) (blk + CODE_BYTES + VNNI_ROWS * (QK_K / 16));
        for (int r = 0; r < VNNI_ROWS; r++) {
            const block_q6_K & s = src[r * nb];
            d[r] = GGML_CPU_FP16_TO_FP32(s.d);
            for (int j = 0; j < QK_K / 16; j++) {
                scales[j * VNNI_ROWS + r] = s.scales[j];
            }
            // q6_K's code of value i: 4 low bits from ql, 2 high bits from qh, in 128-value halves
            // (ggml's dequantize_row_q6_K: values l, l+32, l+64, l+96 of a half share ql / qh bytes)
            for (int i = 0; i < QK_K; i++) {
                const int half = i / 128, l = i % 32, quarter = (i % 128) / 32;
                const uint8_t ql = s.ql[half * 64 + l + (quarter & 1) * 32];
                const uint8_t qh = s.qh[half * 32 + l];
                const int code = ((quarter < 2 ? ql & 0xF : ql >> 4) | (((qh >> (2 * quarter)) & 3) << 4));
                blk[(i / 4) * 64 + r * 4 + i % 4] = (uint8_t) code;
            }
        }
    }
};

static const repack_layout layout = k_vnni<q6v>::layout("q6_K VNNI");

const repack_layout * vnni_q6_k_layout() {
    return &layout;
}

#else

const repack_layout * vnni_q6_k_layout() {
    return nullptr;
}

#endif

}  // namespace ggml::cpu::dkv
