// The two products of our tiled flash attention (flash-attn-tiled.cpp) with bf16 inputs and f32
// sums, on AVX512-BF16 dot products (vdpbf16ps: 16 f32 sums += two bf16 products each), for
// GGML_PREC_BF16 (pyggml_dkv's attention="bf16"). From pyggml_dkv's patches to ggml 0.10.1: 0009
// (the operand layouts, shared with the AMX tiles there), 0011 (the vdpbf16ps products), 0027 (the
// weights as key pairs, no gathers). Scale, mask, max, exp and the running sums stay f32 in the
// tiled kernel; only Q, K, V and the softmax weights are rounded to bf16 (round to nearest even).
//
// Why: where vdpbf16ps issues on as many ports as the f32 FMA (AMD Zen 4 / Zen 5) it does twice the
// multiply-adds per instruction. On Intel's cores it issues on one port (no gain there).
//
// Figure (benchmarks/ab_flash_attn.py: the small drafter's attention, 64 folded query rows x 4 K/V
// heads, f16 K/V in a 4128-row cache; AMD EPYC, cpuinfo family 25 model 17 (Zen 4), 2 threads,
// GCC 12, median of 40 alternated): at window 64 / 1024 / 4096 an op takes 45.6 / 311.6 / 1025.5 us
// against 57.7 / 463.4 / 1647.9 us with f32 products (0.79 / 0.67 / 0.62); whole q8_0 steps of the
// small drafter at window 1024 / 4096 6.87 / 11.15 ms against 7.69 / 13.93 (benchmarks/README.md,
// "ggml 0.25.3 against the 0.10.1 build"). The results are bit-identical to the 0.10.1 build's.
//
// Pyggml-Dkv-Capability: fa-bf16-avx512

#include "flash-attn.h"

#include "ggml-impl.h"

#include <algorithm>

namespace ggml::cpu::dkv {

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)

// 16 words (bf16(x0[c]) | bf16(x1[c]) << 16): x0, x1 from two consecutive keys (or dimensions)
static inline __m512i pack_pairs(__m512 x0, __m512 x1) {
    alignas(64) static const uint16_t interleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                        8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    return _mm512_permutexvar_epi16(_mm512_load_si512(interleave), (__m512i) _mm512_cvtne2ps_pbh(x1, x0));
}

// 16 values of an f16 or f32 row as f32
static inline __m512 load16(const char * row, int64_t c, bool f16) {
    return f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) ((const ggml_fp16_t *) row + c)))
               : _mm512_loadu_ps((const float *) row + c);
}

static void pack_queries(uint32_t * QT2, int QN, const float * const * q_rows, int tile_rows, int64_t DK) {
    for (int tq = 0; tq < QN; tq++) {
        const float * pq = tq < tile_rows ? q_rows[tq] : nullptr;
        for (int64_t j = 0; j < DK/2; j++) {
            QT2[j*QN + tq] = pq ? (uint32_t) GGML_FP32_TO_BF16(pq[2*j]).bits | (uint32_t) GGML_FP32_TO_BF16(pq[2*j + 1]).bits << 16 : 0u;
        }
    }
}

static void pack_keys(uint16_t * Kb, const char * k_tile, size_t k_stride, uint64_t key_visible, int kv_tile, int64_t DK, bool f16) {
    for (int tk = 0; tk < kv_tile; tk++) {
        if (!((key_visible >> tk) & 1)) {
            continue;  // not read: its scores are overwritten by the softmax pass
        }
        const char * row = k_tile + tk*k_stride;
        uint16_t * kb = Kb + tk*DK;
        for (int64_t d = 0; d < DK; d += 32) {
            _mm512_storeu_si512(kb + d, (__m512i) _mm512_cvtne2ps_pbh(load16(row, d + 16, f16), load16(row, d, f16)));
        }
    }
}

// ST[k][q] = sum_d Kb[k][d] * Q[q][d] for k < n_keys, q < 16*QV: 4 keys x QV query vectors of sums
// in registers; a key pair (Kb[k][2j], Kb[k][2j+1]) is broadcast against QT2[j][q]. Past the last
// key the last key is recomputed (never stored), so every pass is a whole 4 x QV tile.
template <int QV>
static void scores_t(float * ST, int QN, const uint16_t * Kb, int DK, const uint32_t * QT2, int n_keys) {
    for (int k0 = 0; k0 < n_keys; k0 += 4) {
        const uint32_t * kr[4];
        for (int i = 0; i < 4; i++) {
            kr[i] = (const uint32_t *) (Kb + (size_t) std::min(k0 + i, n_keys - 1)*DK);
        }
        __m512 acc[4][QV];
        for (int i = 0; i < 4; i++) {
            for (int v = 0; v < QV; v++) {
                acc[i][v] = _mm512_setzero_ps();
            }
        }
        for (int j = 0; j < DK/2; j++) {
            __m512bh b[QV];
            for (int v = 0; v < QV; v++) {
                b[v] = (__m512bh) _mm512_loadu_si512(QT2 + (size_t) j*QN + 16*v);
            }
            for (int i = 0; i < 4; i++) {
                const __m512bh a = (__m512bh) _mm512_set1_epi32((int) kr[i][j]);
                for (int v = 0; v < QV; v++) {
                    acc[i][v] = _mm512_dpbf16_ps(acc[i][v], a, b[v]);
                }
            }
        }
        for (int i = 0; i < 4 && k0 + i < n_keys; i++) {
            for (int v = 0; v < QV; v++) {
                _mm512_storeu_ps(ST + (size_t) (k0 + i)*QN + 16*v, acc[i][v]);
            }
        }
    }
}

static void scores(float * ST, int QN, const uint16_t * Kb, int DK, const uint32_t * QT2, int n_keys) {
    switch (QN / 16) {
        case 1:  scores_t<1>(ST, QN, Kb, DK, QT2, n_keys); break;
        case 2:  scores_t<2>(ST, QN, Kb, DK, QT2, n_keys); break;
        case 3:  scores_t<3>(ST, QN, Kb, DK, QT2, n_keys); break;
        default: scores_t<4>(ST, QN, Kb, DK, QT2, n_keys); break;  // QN <= 64
    }
}

// P2[j][q] = (P[2j][q], P[2j+1][q]): vdpbf16ps needs each query's weight pair as one word, so two
// of ST's rows interleave with no transposition (the gathers of a query-major copy took ~15% of the
// kernel on Zen 4: old patch 0027); zeros past the tile's keys
static void pack_weights(void * weights, const float * ST, int QN, int kv_tile, int n_keys32) {
    uint32_t * P2 = (uint32_t *) weights;
    for (int j = 0; j < n_keys32/2; j++) {
        const float * r0 = 2*j     < kv_tile ? ST + (size_t) (2*j)*QN     : nullptr;
        const float * r1 = 2*j + 1 < kv_tile ? ST + (size_t) (2*j + 1)*QN : nullptr;
        for (int c = 0; c < QN; c += 16) {
            const __m512 p0 = r0 ? _mm512_loadu_ps(r0 + c) : _mm512_setzero_ps();
            const __m512 p1 = r1 ? _mm512_loadu_ps(r1 + c) : _mm512_setzero_ps();
            _mm512_storeu_si512(P2 + (size_t) j*QN + c, pack_pairs(p0, p1));
        }
    }
}

// V2[j][c] = (V[2j][c], V[2j+1][c]); a key past the tile or no row sees is zeros (0 * NaN would
// still poison the sum)
static void pack_values(uint32_t * V2, const char * v_tile, size_t v_stride, uint64_t key_visible, int kv_tile,
                        int n_keys32, int64_t DV, bool f16) {
    for (int j = 0; j < n_keys32/2; j++) {
        const char * v_row[2];
        for (int e = 0; e < 2; e++) {
            const int tk = 2*j + e;
            v_row[e] = tk < kv_tile && ((key_visible >> tk) & 1) ? v_tile + tk*v_stride : nullptr;
        }
        for (int64_t c = 0; c < DV; c += 16) {
            const __m512 x0 = v_row[0] ? load16(v_row[0], c, f16) : _mm512_setzero_ps();
            const __m512 x1 = v_row[1] ? load16(v_row[1], c, f16) : _mm512_setzero_ps();
            _mm512_storeu_si512(V2 + (size_t) j*DV + c, pack_pairs(x0, x1));
        }
    }
}

// O[q][c] += sum_k P[q][k] * V[k][c] for q < n_q (a multiple of 4), k < n_keys32: 4 queries x VV
// column vectors in registers; the weight pair of query q and keys 2j, 2j+1 (P2[j][q]) is
// broadcast against V2[j][c]
template <int VV>
static void values_t(float * O, int DV, int c0, const uint32_t * P2, int QN, const uint32_t * V2, int n_q, int n_keys32) {
    for (int q0 = 0; q0 < n_q; q0 += 4) {
        __m512 acc[4][VV];
        for (int i = 0; i < 4; i++) {
            for (int v = 0; v < VV; v++) {
                acc[i][v] = _mm512_loadu_ps(O + (size_t) (q0 + i)*DV + c0 + 16*v);
            }
        }
        for (int j = 0; j < n_keys32/2; j++) {
            __m512bh b[VV];
            for (int v = 0; v < VV; v++) {
                b[v] = (__m512bh) _mm512_loadu_si512(V2 + (size_t) j*DV + c0 + 16*v);
            }
            for (int i = 0; i < 4; i++) {
                const __m512bh a = (__m512bh) _mm512_set1_epi32((int) P2[(size_t) j*QN + q0 + i]);
                for (int v = 0; v < VV; v++) {
                    acc[i][v] = _mm512_dpbf16_ps(acc[i][v], a, b[v]);
                }
            }
        }
        for (int i = 0; i < 4; i++) {
            for (int v = 0; v < VV; v++) {
                _mm512_storeu_ps(O + (size_t) (q0 + i)*DV + c0 + 16*v, acc[i][v]);
            }
        }
    }
}

static void values(float * O, int DV, const void * weights, int QN, const uint32_t * V2, int n_q, int n_keys32) {
    const uint32_t * P2 = (const uint32_t *) weights;
    for (int c0 = 0; c0 < DV; c0 += 64) {
        switch (std::min(DV - c0, 64) / 16) {
            case 1:  values_t<1>(O, DV, c0, P2, QN, V2, n_q, n_keys32); break;
            case 2:  values_t<2>(O, DV, c0, P2, QN, V2, n_q, n_keys32); break;
            case 3:  values_t<3>(O, DV, c0, P2, QN, V2, n_q, n_keys32); break;
            default: values_t<4>(O, DV, c0, P2, QN, V2, n_q, n_keys32); break;
        }
    }
}

static const fa_bf16_products avx512_bf16 = {nullptr, nullptr, pack_queries, pack_keys, scores, pack_weights, pack_values, values};

const fa_bf16_products * fa_bf16_avx512_products() {
    return &avx512_bf16;
}

#else

const fa_bf16_products * fa_bf16_avx512_products() {
    return nullptr;
}

#endif

}  // namespace ggml::cpu::dkv
