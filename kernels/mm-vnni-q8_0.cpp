// q8_0 weights times f32 rows on AVX512-VNNI (vpdpbusd), for weights in our CPU_DKV_REPACK buffer
// (repack.cpp; the driver and the reasons in mm-vnni.h). The default weight type on CPUs with
// AVX512-VNNI (AMD Zen 4 / Zen 5, Intel Ice Lake and later without AMX). From pyggml_dkv's patches
// to ggml 0.10.1: 0010 (layout, tile), 0023 (pair tiles), 0025, 0044 (the driver's parts).
// ggml 0.25.3 has no x86 layout for q8_0: its CPU_REPACK takes no q8_0 there, and its own path
// multiplies one weight row by one activation row (ggml_vec_dot_q8_0_q8_0).
//
// Repacked block (16 rows x 32 inputs) = exactly the bytes of the 16 q8_0 blocks it replaces (544):
//   uint8 q[8][16][4]: q[j][r][t] = weight(row r, input 4j + t) + 128  (vpdpbusd takes u8 x s8)
//   f16   d[16]:       the rows' q8_0 scales
// Blocks are stored 16-row group by group, K blocks in order within a group. The activations stay
// signed; the +128 of the weights adds 128 * sum(x) per block, which the int32 sum starts from as
// -128 * sum(x).
//
// Figure: against ggml 0.25.3's own q8_0 path (the same weights in ggml's CPU buffer), the graphs
// computed in turn in one process, median of 40 (benchmarks/ab_vnni_products.py; ~25 MB of distinct
// weights per graph, streamed from memory). AMD EPYC, cpuinfo family 25 model 17 (Zen 4), 2 vCPUs
// (load average ~1 from another job), GCC 12, 2 threads. Microseconds a product, ours / ggml's:
//   3072 x 1024 x 16 columns  306 /  982 (0.31)    1024 x 3072 x 16  280 /  832 (0.34)
//   1024 x 1024 x 16          122 /  295 (0.41)    3072 x 1024 x 34  492 / 1599 (0.31)
//   8192 x 1024 x  9          669 / 2234 (0.30)    113-217 G multiply-adds/s
// One thread: 0.26-0.32 of ggml's time; under a load average of 2, 0.29-0.35.
// Within f32 rounding of the exact q8_0 x q8_0 arithmetic (tests/ggml/test_vnni.py: < 1e-6 of it in
// float64; bit-equal to ggml's on data whose sums are exact; the same bits for any thread count).
//
// Pyggml-Dkv-Capability: vnni-q8_0

#include "mm-vnni.h"

namespace ggml::cpu::dkv {

#ifdef PYGGML_DKV_VNNI

// q8_0 (0010): the layout above, 544 bytes per 16 rows x 32 inputs
struct q8v {
    using block = block_q8_0;
    static constexpr size_t  BLOCK_BYTES = VNNI_ROWS * sizeof(block_q8_0);  // 544, = 512 + 16 f16
    // prefetch distance in blocks (8.7 KB): measured on Zen 5, one thread, 3072x1024 at 16 rows from
    // DRAM: none 0.63 ms, 4 blocks 0.24, 8-32 blocks 0.19 ms (the hardware prefetcher alone falls behind)
    static constexpr int     PF_BLOCKS   = 16;
    static constexpr int32_t OFFSET      = 128;
    static constexpr int     MT_MAX      = 16;
    static constexpr bool    PAIRS       = true;  // tiles over two groups (0023)
    static constexpr int     PAIR_RUN    = 6;     // rows per run: 4 x 6 int32 / f32 sums in registers
    static constexpr bool    WIDE_ON_AMX = true;  // wide products on AMX tiles (mm-amx-q8_0.cpp)

    static bool fits(const struct ggml_tensor * t) {
        return t->type == GGML_TYPE_Q8_0 && t->ne[0] % QK8_0 == 0 && t->ne[1] % VNNI_ROWS == 0 && t->ne[2] == 1 &&
               t->ne[3] == 1 && t->nb[0] == sizeof(block_q8_0) && t->nb[1] == (size_t) (t->ne[0] / QK8_0) * sizeof(block_q8_0);
    }

    // MT activation rows (whole tile in registers) x one 16-row weight group, over every K block.
    template <int MT>
    static __attribute__((noinline)) void tile(const uint8_t * GGML_RESTRICT wg, const q8v_rows & x, int64_t r0, float * const * y) {
        const int64_t nb = x.nb;
        __m512 acc[MT];
        for (int m = 0; m < MT; m++) {
            acc[m] = _mm512_setzero_ps();
        }
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t * blk = wg + b * BLOCK_BYTES;
            // the weights stream from DRAM: ask for the block PF_BLOCKS ahead
            for (int l = 0; l < (int) BLOCK_BYTES; l += 64) {
                _mm_prefetch((const char *) blk + PF_BLOCKS * BLOCK_BYTES + l, _MM_HINT_T0);
            }
            __m512i w[8];
            for (int j = 0; j < 8; j++) {
                w[j] = _mm512_loadu_si512((const void *) (blk + 64 * j));
            }
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (blk + 512)));
            for (int m = 0; m < MT; m++) {
                const int64_t   i  = b * x.step + x.first(r0) + m;
                const int32_t * xq = (const int32_t *) (x.q + i * QK8_0);
                __m512i s = _mm512_set1_epi32(x.c[i]);
                for (int j = 0; j < 8; j++) {
                    s = _mm512_dpbusd_epi32(s, w[j], _mm512_set1_epi32(xq[j]));
                }
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_set1_ps(x.d[i])), acc[m]);
            }
        }
        for (int m = 0; m < MT; m++) {
            _mm512_storeu_ps(y[m], acc[m]);
        }
    }

    // rows i0 .. i0 + N - 1 (N <= 6: 4 N sums in registers) of one block of two consecutive 16-row
    // weight groups (old patch 0023): each broadcast activation word feeds one vpdpbusd per group.
    // The same int32 sums (exact, in any order) and f32 operations as tile: bit-identical.
    template <int N, bool FIRST>
    static inline __attribute__((always_inline)) void pair_rows(const uint8_t * GGML_RESTRICT blk0, const uint8_t * GGML_RESTRICT blk1,
                                                                const q8v_rows & x, int64_t b, int64_t i0, __m512 * acc0, __m512 * acc1) {
        if constexpr (FIRST) {
            vnni_pair_prefetch(blk0, blk1, b, x.nb, PF_BLOCKS, BLOCK_BYTES, 0, BLOCK_BYTES);
        }
        __m512i s0[N], s1[N];
        for (int m = 0; m < N; m++) {
            s0[m] = s1[m] = _mm512_set1_epi32(x.c[i0 + m]);
        }
        for (int j = 0; j < 8; j++) {
            const __m512i w0 = _mm512_loadu_si512((const void *) (blk0 + 64 * j));
            const __m512i w1 = _mm512_loadu_si512((const void *) (blk1 + 64 * j));
            for (int m = 0; m < N; m++) {
                const __m512i a = _mm512_set1_epi32(((const int32_t *) (x.q + (i0 + m) * QK8_0))[j]);
                s0[m] = _mm512_dpbusd_epi32(s0[m], w0, a);
                s1[m] = _mm512_dpbusd_epi32(s1[m], w1, a);
            }
        }
        b32_pair_scale<N>(s0, s1, blk0 + 512, blk1 + 512, x, i0, acc0, acc1);
    }

    // one 16-row x 32-value block from the rows' q8_0 blocks src[r * nb]
    static void repack_block(uint8_t * blk, const block_q8_0 * src, int64_t nb) {
        ggml_fp16_t * d = (ggml_fp16_t *) (blk + 512);
        for (int r = 0; r < VNNI_ROWS; r++) {
            const block_q8_0 & s = src[r * nb];
            d[r] = s.d;
            for (int k = 0; k < QK8_0; k++) {
                blk[(k / 4) * 64 + r * 4 + k % 4] = (uint8_t) ((int) s.qs[k] + 128);
            }
        }
    }
};

static const repack_layout q8_0_vnni = b32_vnni<q8v>::layout("q8_0 VNNI");

const repack_layout * vnni_q8_0_layout() {
    return &q8_0_vnni;
}

#else

const repack_layout * vnni_q8_0_layout() {
    return nullptr;
}

#endif

}  // namespace ggml::cpu::dkv
