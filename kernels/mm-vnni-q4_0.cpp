// q4_0 weights times f32 rows on AVX512-VNNI (vpdpbusd), for weights in our CPU_DKV_REPACK buffer
// (repack.cpp; the driver in mm-vnni.h, shared with q8_0). From pyggml_dkv's patches to ggml
// 0.10.1: 0022 (layout, tile), 0023 (pair tiles), 0032 (16-row tiles). ggml 0.25.3's CPU_REPACK
// has an AVX2 8x8 layout for q4_0 (8 rows interleaved, llama.cpp's); this one takes matrices of
// whole 16-row groups where the CPU has AVX512-VNNI (pyggml_dkv puts the others in CPU_REPACK).
//
// Per 16 rows x 32 inputs: the 4-bit codes (0..15, as q4_0 stores them) two per byte (4 vectors:
// byte (r, t) of vector v has input 8v + t in its low nibble, 8v + 4 + t in its high one), then the
// rows' f16 d: 288 bytes, exactly the 16 q4_0 blocks it replaces. w = d * (code - 8), q4_0's
// values; the int32 sum starts from -8 * the activation block's sum, so the result is ggml's q4_0 x
// q8_0 arithmetic: f16(dw) * f16(dx) * sum((code - 8) * qx).
//
// Figure: against ggml 0.25.3's own q4_0 path (CPU buffer) and its CPU_REPACK (AVX2 8x8), as for
// q8_0 (mm-vnni-q8_0.cpp: same machine, load and benchmark), 2 threads. Microseconds a product, ours
// / ggml's plain / ggml's CPU_REPACK:
//   3072 x 1024 x 16 columns  254 /  962 /  535    1024 x 3072 x 16  217 /  872 / 464
//   1024 x 1024 x 16          125 /  320 /  207    3072 x 1024 x 34  447 / 1474 / 953
//   8192 x 1024 x  9          472 / 2135 / 1254   (0.38-0.60 of CPU_REPACK's time; 134-240 G/s)
//
// Pyggml-Dkv-Capability: vnni-q4_0

#include "mm-vnni.h"

namespace ggml::cpu::dkv {

#ifdef PYGGML_DKV_VNNI

struct q40v {
    using block = block_q4_0;
    static constexpr size_t  BLOCK_BYTES = VNNI_ROWS * sizeof(block_q4_0);  // 288, = 256 + 16 f16
    static constexpr int     PF_BLOCKS   = 16;
    static constexpr int32_t OFFSET      = 8;
    // a 16-row noise block in one pass over each weight group (old patch 0032): in tiles of 8 rows
    // each group pair was read twice and its codes unpacked 4 times (per 6-row run) instead of 3;
    // the products of a step took 0.88-0.92 of their time on Emerald Rapids, bit-identical
    static constexpr int     MT_MAX      = 16;
    static constexpr bool    PAIRS       = true;
    static constexpr int     PAIR_RUN    = 6;
    static constexpr bool    WIDE_ON_AMX = false;  // no tile kernel of ours for q4_0

    static bool fits(const struct ggml_tensor * t) {
        return t->type == GGML_TYPE_Q4_0 && t->ne[0] % QK4_0 == 0 && t->ne[1] % VNNI_ROWS == 0 && t->ne[2] == 1 &&
               t->ne[3] == 1 && t->nb[0] == sizeof(block_q4_0) && t->nb[1] == (size_t) (t->ne[0] / QK4_0) * sizeof(block_q4_0);
    }

    template <int MT>
    static __attribute__((noinline)) void tile(const uint8_t * GGML_RESTRICT wg, const q8v_rows & x, int64_t r0, float * const * y) {
        const int64_t nb = x.nb;
        const __m512i low4 = _mm512_set1_epi8(0x0F);
        __m512 acc[MT];
        for (int m = 0; m < MT; m++) {
            acc[m] = _mm512_setzero_ps();
        }
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t * blk = wg + b * BLOCK_BYTES;
            for (int l = 0; l < (int) BLOCK_BYTES; l += 64) {
                _mm_prefetch((const char *) blk + PF_BLOCKS * BLOCK_BYTES + l, _MM_HINT_T0);
            }
            // w[u]: inputs 4u .. 4u + 3 of the 16 rows
            __m512i w[8];
            for (int t = 0; t < 4; t++) {
                const __m512i v = _mm512_loadu_si512((const void *) (blk + 64 * t));
                w[2 * t]     = _mm512_and_si512(v, low4);
                w[2 * t + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            }
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (blk + 256)));
#pragma GCC unroll 8
            for (int m = 0; m < MT; m++) {
                const int64_t   i  = b * x.step + x.first(r0) + m;
                const int32_t * xq = (const int32_t *) (x.q + i * QK8_0);
                // two chains of four (vpdpbusd's latency)
                __m512i s0 = _mm512_set1_epi32(x.c[i]), s1 = _mm512_setzero_si512();
                for (int u = 0; u < 8; u += 2) {
                    s0 = _mm512_dpbusd_epi32(s0, w[u], _mm512_set1_epi32(xq[u]));
                    s1 = _mm512_dpbusd_epi32(s1, w[u + 1], _mm512_set1_epi32(xq[u + 1]));
                }
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)),
                                         _mm512_mul_ps(dw, _mm512_set1_ps(x.d[i])), acc[m]);
            }
        }
        for (int m = 0; m < MT; m++) {
            _mm512_storeu_ps(y[m], acc[m]);
        }
    }

    // as q8v::pair_rows, the codes unpacked per 64 bytes
    template <int N, bool FIRST>
    static inline __attribute__((always_inline)) void pair_rows(const uint8_t * GGML_RESTRICT blk0, const uint8_t * GGML_RESTRICT blk1,
                                                                const q8v_rows & x, int64_t b, int64_t i0, __m512 * acc0, __m512 * acc1) {
        if constexpr (FIRST) {
            vnni_pair_prefetch(blk0, blk1, b, x.nb, PF_BLOCKS, BLOCK_BYTES, 0, BLOCK_BYTES);
        }
        const __m512i low4 = _mm512_set1_epi8(0x0F);
        __m512i s0[N], s1[N];
        for (int m = 0; m < N; m++) {
            s0[m] = s1[m] = _mm512_set1_epi32(x.c[i0 + m]);
        }
        for (int t = 0; t < 4; t++) {
            const __m512i v0 = _mm512_loadu_si512((const void *) (blk0 + 64 * t));
            const __m512i v1 = _mm512_loadu_si512((const void *) (blk1 + 64 * t));
            const __m512i lo0 = _mm512_and_si512(v0, low4), hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low4);
            const __m512i lo1 = _mm512_and_si512(v1, low4), hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low4);
            for (int m = 0; m < N; m++) {
                const int32_t * xq = (const int32_t *) (x.q + (i0 + m) * QK8_0);
                const __m512i alo = _mm512_set1_epi32(xq[2 * t]), ahi = _mm512_set1_epi32(xq[2 * t + 1]);
                s0[m] = _mm512_dpbusd_epi32(s0[m], lo0, alo);
                s1[m] = _mm512_dpbusd_epi32(s1[m], lo1, alo);
                s0[m] = _mm512_dpbusd_epi32(s0[m], hi0, ahi);
                s1[m] = _mm512_dpbusd_epi32(s1[m], hi1, ahi);
            }
        }
        b32_pair_scale<N>(s0, s1, blk0 + 256, blk1 + 256, x, i0, acc0, acc1);
    }

    static void repack_block(uint8_t * blk, const block_q4_0 * src, int64_t nb) {
        memset(blk, 0, 256);
        ggml_fp16_t * d = (ggml_fp16_t *) (blk + 256);
        for (int r = 0; r < VNNI_ROWS; r++) {
            const block_q4_0 & s = src[r * nb];
            d[r] = s.d;
            // q4_0's code of value k: the low nibble of qs[k] for k < 16, the high one of qs[k - 16]
            for (int k = 0; k < QK4_0; k++) {
                const int code = k < 16 ? s.qs[k] & 0xF : s.qs[k - 16] >> 4;
                const int t = k % 8;
                blk[(k / 8) * 64 + r * 4 + t % 4] |= (uint8_t) (t < 4 ? code : code << 4);
            }
        }
    }
};

static const repack_layout q4_0_vnni = b32_vnni<q40v>::layout("q4_0 VNNI");

const repack_layout * vnni_q4_0_layout() {
    return &q4_0_vnni;
}

#else

const repack_layout * vnni_q4_0_layout() {
    return nullptr;
}

#endif

}  // namespace ggml::cpu::dkv
