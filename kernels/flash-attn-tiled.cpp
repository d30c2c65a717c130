// Flash attention with f32 products in 64 x 64 tiles and transposed scores (AVX-512), for K/V caches
// in our CPU_DKV buffer: buffer.cpp claims FLASH_ATTN_EXT whose K lives there and that this kernel
// takes (flash_attn_kernel_for). From pyggml_dkv's patches to ggml 0.10.1: 0001 (chunks rounded up
// to whole query tiles), 0003 (the tiled kernel from 8 query rows, its NaN rule), 0006 (transposed
// scores), 0013 (operands pinned in registers), 0015 (mask scan by vpternlogd, next-tile prefetch),
// 0017 (mask scans shared across heads, in the op's first phase), 0030 (the softmax pass templated
// on the query vectors), 0035 (K/V prefetched into L2 4 tiles ahead), 0036 (products in 6-row
// blocks). With GGML_PREC_BF16 (attention="bf16") and head sizes multiples of 32, its two products
// take bf16 inputs: on AMX-BF16 tiles (flash-attn-bf16-amx.cpp) where the build, Linux and
// PYGGML_DKV_NO_AMX allow, else with vdpbf16ps (flash-attn-bf16.cpp, AVX512-BF16); elsewhere that
// precision computes in f32, as ggml's own kernels do with patch 0007.
//
// Why: ggml 0.25.3 tiles only from 64 query rows per head. Below, its per-row kernel rereads every
// key for every row and accumulates V in f16 (a draft block's 16-64 rows: off by 6e-4 to 4e-3 from
// float64 with f16 K/V; tests/ggml/test_ops.py::test_flash_attn_ext_tiled_kernel[32|9-*-f16] and
// ..._bias_and_softcap[128-20|80-12-*]). This kernel takes 8+ rows, computes only a tile's valid
// rows, accumulates in f32 (2e-6 of float64), and keeps keys no row may see out of the output (a
// NaN in an unused cache row stays out: masked scores exactly -inf, their V rows not read).
//
// Figure: against ggml 0.25.3's own kernels (the same Q, f16 K/V and mask, K/V in ggml's CPU
// buffer), alternated in one process, median of 40 (benchmarks/ab_flash_attn.py: the small
// drafter's 5 layers, head size 64, 4 K/V heads, a 4128-row cache of which the window and the 16
// noise rows are visible; AMD EPYC, cpuinfo family 25 model 17 (Zen 4), 2 vCPUs shared with
// another job, 2 threads, GCC 12). Microseconds an op, ours / ggml's: 64 folded rows per K/V head
// at window 64 151 / 743 (0.20), 1024 537 / 2307 (0.23), 4096 1920 / 8476 (0.23) (ggml's own tiled
// kernel there: scalar mask conversion, K transposition and row max); 16 rows x 16 heads unfolded
// at 1024 749 / 3976 (0.19; ggml's per-row kernel, 1.9e-3 off ours by its f16 V sums).
//
// Pyggml-Dkv-Capability: fa-tiled

#include "flash-attn.h"

#include "common.h"
#include "ggml-cpu.h"
#include "ops.h"
#include "simd-mappings.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace ggml::cpu::dkv {

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BW__)

static constexpr int Q_TILE_SZ  = ggml_fa_tile_config::Q;
static constexpr int KV_TILE_SZ = ggml_fa_tile_config::KV;
static_assert(Q_TILE_SZ % 16 == 0 && Q_TILE_SZ <= 64, "query columns in whole vectors");
static_assert(KV_TILE_SZ <= 64, "one bit per key of a KV tile");

// the query rows from which the tiled kernel beats the per-row one (0003)
static constexpr int64_t FA_MIN_ROWS = 8;
// K/V tiles between the L2 prefetch and their use (0035)
static constexpr int64_t FA_L2_AHEAD = 4;
// the most (mask plane, query tile, KV tile) cells whose scans the op shares (0017)
static constexpr int64_t FA_MASK_SCAN_MAX_CELLS = 65536;

struct fa_tile_mask_scan {
    uint64_t visible;  // bit tk: key ic + tk is seen by some row
    uint64_t zero;     // 1: the mask adds only +-0 in this tile
};

// a thread's scratch (floats): QT: DK x QN (Q transposed), ST: KV x QN (scores, then weights),
// mask32: Q x KV (mask rows), O: Q x DV (output accumulator), V32: KV x DV, K32: KV x DK
static int64_t fa_thread_floats(int64_t DK, int64_t DV) {
    return Q_TILE_SZ*DK + 2*Q_TILE_SZ*KV_TILE_SZ + Q_TILE_SZ*DV + KV_TILE_SZ*DV + KV_TILE_SZ*DK + (int64_t) CACHE_LINE_SIZE_F32;
}

static int64_t fa_mask_scan_cells(const struct ggml_tensor * dst) {
    const struct ggml_tensor * q = dst->src[0], * k = dst->src[1], * mask = dst->src[3];
    if (mask == nullptr) {
        return 0;
    }
    const int64_t cells = mask->ne[2]*mask->ne[3] * ((q->ne[1] + Q_TILE_SZ - 1)/Q_TILE_SZ) * ((k->ne[1] + KV_TILE_SZ - 1)/KV_TILE_SZ);
    return cells <= FA_MASK_SCAN_MAX_CELLS ? cells : 0;
}

// dst[i] = slope * src[i] for n <= 64 mask values
static inline void fa_tile_load_mask_row(float * dst, const ggml_fp16_t * src, int n, float slope) {
    int i = 0;
    const __m512 vslope = _mm512_set1_ps(slope);
    for (; i + 16 <= n; i += 16) {
        _mm512_storeu_ps(dst + i, _mm512_mul_ps(vslope, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (src + i)))));
    }
    for (; i < n; ++i) {
        dst[i] = slope * GGML_CPU_FP16_TO_FP32(src[i]);
    }
}

// C[M x 16*RN] (=|+=) A[M x K] * B[K x 16*RN]; A(i, kk) = A[i*a_row + kk*a_k]
template <int RM, int RN>
static inline void fa_t_gemm_ukernel(float * C, int ldc, const float * A, int a_row, int a_k,
                                     const float * B, int ldb, int K, bool accumulate) {
    __m512 acc[RM][RN];
    for (int i = 0; i < RM; i++) {
        for (int r = 0; r < RN; r++) {
            acc[i][r] = accumulate ? _mm512_loadu_ps(C + i*ldc + 16*r) : _mm512_setzero_ps();
        }
    }
    static_assert(RN >= 1 && RN <= 4, "up to 4 vectors of B per row");
    for (int kk = 0; kk < K; kk++) {
        // B's vectors in named registers, each pinned by an empty asm: GCC otherwise folds the
        // load into each of the RM FMAs that use it (0013), and an array of them would live on the stack
        const float * brow = B + kk*ldb;
        __m512 b0 = _mm512_loadu_ps(brow), b1 = b0, b2 = b0, b3 = b0;
        __asm__("" : "+v"(b0));
        if constexpr (RN > 1) { b1 = _mm512_loadu_ps(brow + 16); __asm__("" : "+v"(b1)); }
        if constexpr (RN > 2) { b2 = _mm512_loadu_ps(brow + 32); __asm__("" : "+v"(b2)); }
        if constexpr (RN > 3) { b3 = _mm512_loadu_ps(brow + 48); __asm__("" : "+v"(b3)); }
        for (int i = 0; i < RM; i++) {
            const __m512 a = _mm512_set1_ps(A[i*a_row + kk*a_k]);
            acc[i][0] = _mm512_fmadd_ps(a, b0, acc[i][0]);
            if constexpr (RN > 1) { acc[i][1] = _mm512_fmadd_ps(a, b1, acc[i][1]); }
            if constexpr (RN > 2) { acc[i][2] = _mm512_fmadd_ps(a, b2, acc[i][2]); }
            if constexpr (RN > 3) { acc[i][3] = _mm512_fmadd_ps(a, b3, acc[i][3]); }
        }
    }
    for (int i = 0; i < RM; i++) {
        for (int r = 0; r < RN; r++) {
            _mm512_storeu_ps(C + i*ldc + 16*r, acc[i][r]);
        }
    }
}

template <int RM>
static inline void fa_t_gemm_rows(float * C, int ldc, const float * A, int a_row, int a_k,
                                  const float * B, int ldb, int K, int N, bool accumulate) {
    int j = 0;
    for (; j + 64 <= N; j += 64) {
        fa_t_gemm_ukernel<RM, 4>(C + j, ldc, A, a_row, a_k, B + j, ldb, K, accumulate);
    }
    switch ((N - j) / 16) {
        case 3: fa_t_gemm_ukernel<RM, 3>(C + j, ldc, A, a_row, a_k, B + j, ldb, K, accumulate); break;
        case 2: fa_t_gemm_ukernel<RM, 2>(C + j, ldc, A, a_row, a_k, B + j, ldb, K, accumulate); break;
        case 1: fa_t_gemm_ukernel<RM, 1>(C + j, ldc, A, a_row, a_k, B + j, ldb, K, accumulate); break;
        default: break;
    }
}

// C[M x N] (=|+=) A[M x K] * B[K x N], N a multiple of 16. Rows in blocks of 6 (24 accumulators, B's
// 4 vectors and A's broadcast: 29 of the 32 registers), then 4, then 1 (0036): each B row loaded
// once per 6 rows of A. Each element sums over K in order: the same bits as any blocking.
static void fa_t_gemm(float * C, int ldc, const float * A, int a_row, int a_k,
                      const float * B, int ldb, int M, int K, int N, bool accumulate) {
    int i = 0;
    for (; i + 6 <= M; i += 6) {
        fa_t_gemm_rows<6>(C + i*ldc, ldc, A + i*a_row, a_row, a_k, B, ldb, K, N, accumulate);
    }
    for (; i + 4 <= M; i += 4) {
        fa_t_gemm_rows<4>(C + i*ldc, ldc, A + i*a_row, a_row, a_k, B, ldb, K, N, accumulate);
    }
    for (; i < M; i++) {
        fa_t_gemm_rows<1>(C + i*ldc, ldc, A + i*a_row, a_row, a_k, B, ldb, K, N, accumulate);
    }
}

// one K or V row to f32, inline (a call per 64-value row was ~8% of the kernel)
static inline void fa_t_row_to_f32(float * dst, const char * src, int64_t n, bool f16) {
    if (!f16) {
        memcpy(dst, src, n*sizeof(float));
        return;
    }
    const ggml_fp16_t * h = (const ggml_fp16_t *) src;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (h + i))));
    }
    for (; i < n; i++) {
        dst[i] = GGML_CPU_FP16_TO_FP32(h[i]);
    }
}

// Which keys of the KV tile at ic (kv_tile keys) some of the rows [iq1, iq1 + tile_rows) of a mask
// plane may see, and whether the mask adds anything there but zeros (0015). Per 32 keys, OR over the
// rows of (m ^ -inf), zero only where every row masks the key, and of (m & 0x7fff), zero only where
// every row adds +-0: one vpternlogd each per row.
static inline fa_tile_mask_scan fa_scan_mask_tile(const char * mask_plane, size_t nb1, int64_t iq1, int tile_rows,
                                                  int64_t ic, int kv_tile) {
    const __m512i f16_ninf = _mm512_set1_epi16((short) 0xFC00);
    const __m512i f16_abs  = _mm512_set1_epi16(0x7FFF);
    const __mmask32 in0 = kv_tile >= 32 ? (__mmask32) ~0u : (__mmask32) ((1u << kv_tile) - 1);
    const __mmask32 in1 = kv_tile >= 64 ? (__mmask32) ~0u : kv_tile > 32 ? (__mmask32) ((1u << (kv_tile - 32)) - 1) : 0;
    __m512i seen0 = _mm512_setzero_si512(), seen1 = _mm512_setzero_si512(), nonzero = _mm512_setzero_si512();
    for (int tq = 0; tq < tile_rows; tq++) {
        const ggml_fp16_t * mp = (const ggml_fp16_t *) (mask_plane + (iq1 + tq)*nb1) + ic;
        // keys past the tile load as 0 (no -inf): the visible bits exclude them below
        const __m512i m0 = _mm512_maskz_loadu_epi16(in0, mp);
        const __m512i m1 = _mm512_maskz_loadu_epi16(in1, mp + 32);
        seen0   = _mm512_ternarylogic_epi32(seen0, m0, f16_ninf, 0xF6);  // seen0 | (m0 ^ -inf)
        seen1   = _mm512_ternarylogic_epi32(seen1, m1, f16_ninf, 0xF6);
        nonzero = _mm512_ternarylogic_epi32(nonzero, m0, f16_abs, 0xF8);  // nonzero | (m0 & 0x7fff)
        nonzero = _mm512_ternarylogic_epi32(nonzero, m1, f16_abs, 0xF8);
    }
    const uint64_t in_tile = kv_tile == 64 ? ~(uint64_t) 0 : (((uint64_t) 1 << kv_tile) - 1);
    const uint64_t seen = (uint64_t) _mm512_test_epi16_mask(seen0, seen0) |
                          (uint64_t) _mm512_test_epi16_mask(seen1, seen1) << 32;
    return { seen & in_tile, (uint64_t) (_mm512_test_epi16_mask(nonzero, nonzero) == 0) };
}

// A K/V tile's pass over its scores ST[key][query] (QN = 16*QV query columns): scale, mask, per-query
// max, the online softmax's rescale factors MS, the weights exp(score - max) in place, and the sums
// (0030: QV a template argument, so the per-query vectors stay in registers).
template <int QV>
static inline void fa_t_softmax_tile(float * ST, const float * mask32, bool mask_zero, uint64_t key_visible,
                                     int kv_tile, float pass_scale, float * M, float * S, float * MS) {
    constexpr int QN = 16*QV;
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    // scale, mask (masked scores exactly -inf: a NaN score of a key a row may not see must not
    // become a NaN weight), per-query max
    const __m512 vscale = _mm512_set1_ps(pass_scale);
    __m512 colmax[QV];
    for (int r = 0; r < QV; r++) {
        colmax[r] = ninf;
    }
    const __m512i mask_offs = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                 _mm512_set1_epi32(KV_TILE_SZ));
    for (int tk = 0; tk < kv_tile; tk++) {
        float * row = ST + tk*QN;
        if (!((key_visible >> tk) & 1)) {
            for (int r = 0; r < QV; r++) {
                _mm512_storeu_ps(row + 16*r, ninf);
            }
            continue;
        }
        for (int r = 0; r < QV; r++) {
            __m512 x = _mm512_mul_ps(_mm512_loadu_ps(row + 16*r), vscale);
            if (!mask_zero) {
                const __m512 m = _mm512_i32gather_ps(mask_offs, mask32 + (16*r)*KV_TILE_SZ + tk, 4);
                x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m, ninf, _CMP_EQ_OQ), _mm512_add_ps(x, m), ninf);
            }
            _mm512_storeu_ps(row + 16*r, x);
            colmax[r] = _mm512_max_ps(colmax[r], x);
        }
    }

    // online softmax, one query per lane
    __m512 msafe[QV];
    for (int r = 0; r < QV; r++) {
        const __m512 mold = _mm512_load_ps(M + 16*r);
        const __m512 mnew = _mm512_max_ps(mold, colmax[r]);
        // a query that saw no key yet keeps max -inf; its weights use 0 so they are 0, not NaN
        msafe[r] = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mnew, ninf, _CMP_EQ_OQ), mnew, _mm512_setzero_ps());
        const __m512 ms = ggml_v_expf(_mm512_sub_ps(mold, msafe[r]));
        _mm512_store_ps(MS + 16*r, ms);
        _mm512_store_ps(M + 16*r, mnew);
        _mm512_store_ps(S + 16*r, _mm512_mul_ps(_mm512_load_ps(S + 16*r), ms));
    }
    __m512 colsum[QV];
    for (int r = 0; r < QV; r++) {
        colsum[r] = _mm512_setzero_ps();
    }
    for (int tk = 0; tk < kv_tile; tk++) {
        float * row = ST + tk*QN;
        if (!((key_visible >> tk) & 1)) {
            for (int r = 0; r < QV; r++) {
                _mm512_storeu_ps(row + 16*r, _mm512_setzero_ps());
            }
            continue;
        }
        for (int r = 0; r < QV; r++) {
            const __m512 p = ggml_v_expf(_mm512_sub_ps(_mm512_loadu_ps(row + 16*r), msafe[r]));
            _mm512_storeu_ps(row + 16*r, p);
            colsum[r] = _mm512_add_ps(colsum[r], p);
        }
    }
    for (int r = 0; r < QV; r++) {
        _mm512_store_ps(S + 16*r, _mm512_add_ps(_mm512_load_ps(S + 16*r), colsum[r]));
    }
}

// asks for the K and V rows of keys [first, first + n) of one head into the cache level HINT names
template <int HINT>
static inline void fa_prefetch_kv_rows(const char * k_head, const char * v_head, size_t k_stride, size_t v_stride,
                                       int64_t first, int64_t n, int64_t k_row_bytes, int64_t v_row_bytes) {
    for (int64_t tk = first; tk < first + n; tk++) {
        for (int64_t off = 0; off < k_row_bytes; off += 64) {
            _mm_prefetch(k_head + tk*k_stride + off, (_mm_hint) HINT);
        }
        for (int64_t off = 0; off < v_row_bytes; off += 64) {
            _mm_prefetch(v_head + tk*v_stride + off, (_mm_hint) HINT);
        }
    }
}

// the rows [ir0, ir1) (query row fastest, then head, then sequence) of one thread's chunk
static void fa_tiled_rows(const struct ggml_compute_params * params, struct ggml_tensor * dst,
                          int64_t ir0, int64_t ir1, const fa_tile_mask_scan * scans) {
    const struct ggml_tensor * q     = dst->src[0];
    const struct ggml_tensor * k     = dst->src[1];
    const struct ggml_tensor * v     = dst->src[2];
    const struct ggml_tensor * mask  = dst->src[3];
    const struct ggml_tensor * sinks = dst->src[4];

    GGML_TENSOR_LOCALS(int64_t, neq, q,   ne)
    GGML_TENSOR_LOCALS(size_t,  nbq, q,   nb)
    GGML_TENSOR_LOCALS(int64_t, nek, k,   ne)
    GGML_TENSOR_LOCALS(size_t,  nbk, k,   nb)
    GGML_TENSOR_LOCALS(int64_t, nev, v,   ne)
    GGML_TENSOR_LOCALS(size_t,  nbv, v,   nb)
    GGML_TENSOR_LOCALS(int64_t, ne,  dst, ne)
    GGML_TENSOR_LOCALS(size_t,  nb,  dst, nb)
    GGML_UNUSED(nbq0); GGML_UNUSED(nbk0); GGML_UNUSED(nbv0); GGML_UNUSED(nb0); GGML_UNUSED(nb2); GGML_UNUSED(nb3);
    GGML_UNUSED(neq0); GGML_UNUSED(nev1); GGML_UNUSED(ne0); GGML_UNUSED(ne3);

    const int64_t DK = nek0;
    const int64_t DV = nev0;
    const bool kv_f16 = k->type == GGML_TYPE_F16;
    // bf16 products, on AMX-BF16 tiles where usable, else vdpbf16ps: the operands are packed in the
    // same scratch (each fits the f32 operand's space)
    const fa_bf16_products * bf16 = nullptr;
    if (ggml_get_op_params_i32(dst, 3) == GGML_PREC_BF16 && DK % 32 == 0) {
        bf16 = fa_bf16_amx_products();
        if (bf16 == nullptr) {
            bf16 = fa_bf16_avx512_products();
        }
    }
    if (bf16 != nullptr && bf16->begin != nullptr) {
        bf16->begin();
    }

    const int64_t rk2 = neq2/nek2, rk3 = neq3/nek3;
    const int64_t rv2 = neq2/nev2, rv3 = neq3/nev3;
    const int64_t k_row_bytes = DK*(int64_t) ggml_type_size(k->type), v_row_bytes = DV*(int64_t) ggml_type_size(v->type);

    float scale = 1.0f, max_bias = 0.0f, logit_softcap = 0.0f;
    memcpy(&scale,         (float *) dst->op_params + 0, sizeof(float));
    memcpy(&max_bias,      (float *) dst->op_params + 1, sizeof(float));
    memcpy(&logit_softcap, (float *) dst->op_params + 2, sizeof(float));
    if (logit_softcap != 0) {
        scale /= logit_softcap;
    }

    const uint32_t n_head      = neq2;
    const uint32_t n_head_log2 = 1u << (uint32_t) floor(log2(n_head));
    const float m0 = powf(2.0f, -(max_bias       ) / n_head_log2);
    const float m1 = powf(2.0f, -(max_bias / 2.0f) / n_head_log2);

    float * base   = (float *) params->wdata + params->ith*fa_thread_floats(DK, DV);
    float * QT     = base;
    float * ST     = QT + Q_TILE_SZ*DK;
    float * mask32 = ST + Q_TILE_SZ*KV_TILE_SZ;
    float * O      = mask32 + Q_TILE_SZ*KV_TILE_SZ;
    float * V32    = O + Q_TILE_SZ*DV;
    float * K32    = V32 + KV_TILE_SZ*DV;

    int64_t ir = ir0;
    while (ir < ir1) {
        const int64_t iq3 = ir/(neq2*neq1);
        const int64_t iq2 = (ir - iq3*neq2*neq1)/neq1;
        const int64_t iq1 = (ir - iq3*neq2*neq1 - iq2*neq1);

        const int tile_rows = (int) std::min<int64_t>(Q_TILE_SZ, std::min(ir1 - ir, neq1 - iq1));
        GGML_ASSERT(tile_rows > 0);
        const int QN = (tile_rows + 15) / 16 * 16;  // query columns, padded (pads: zero queries, never written out)
        const int QV = QN / 16;

        const uint32_t h = (uint32_t) iq2;
        const float slope = (max_bias > 0.0f) ? h < n_head_log2 ? powf(m0, h + 1) : powf(m1, 2*(h - n_head_log2) + 1) : 1.0f;

        alignas(64) float M[Q_TILE_SZ];   // running max per query
        alignas(64) float S[Q_TILE_SZ];   // running sum per query
        alignas(64) float MS[Q_TILE_SZ];  // this tile's rescale factor per query
        for (int i = 0; i < Q_TILE_SZ; ++i) {
            M[i] = -INFINITY;
            S[i] = 0.0f;
        }
        memset(O, 0, (size_t) (bf16 ? QN : tile_rows)*DV*sizeof(float));  // bf16: the pad rows are computed too

        const int64_t ik3 = iq3 / rk3, ik2 = iq2 / rk2;
        const int64_t iv3 = iq3 / rv3, iv2 = iq2 / rv2;

        const float * q_rows[Q_TILE_SZ];
        for (int tq = 0; tq < tile_rows; tq++) {
            q_rows[tq] = (const float *) ((const char *) q->data + ((iq1 + tq)*nbq1 + iq2*nbq2 + iq3*nbq3));
        }
        if (bf16) {
            bf16->pack_queries((uint32_t *) QT, QN, q_rows, tile_rows, DK);
        } else {
            for (int tq = 0; tq < QN; tq++) {
                for (int64_t d = 0; d < DK; d++) {
                    QT[d*QN + tq] = tq < tile_rows ? q_rows[tq][d] : 0.0f;
                }
            }
        }

        // the tile's mask rows: the head / sequence offset once per query tile
        const char * mask_base = mask ? (const char *) mask->data + (iq2%mask->ne[2])*mask->nb[2] + (iq3%mask->ne[3])*mask->nb[3] : nullptr;
        // this tile's shared scans: for a whole tile at a tile boundary (a chunk may end mid-tile)
        const fa_tile_mask_scan * scans_row = nullptr;
        if (mask && scans != nullptr && iq1 % Q_TILE_SZ == 0 && tile_rows == std::min<int64_t>(Q_TILE_SZ, neq1 - iq1)) {
            const int64_t plane = (iq3%mask->ne[3])*mask->ne[2] + iq2%mask->ne[2];
            scans_row = scans + (plane*((neq1 + Q_TILE_SZ - 1)/Q_TILE_SZ) + iq1/Q_TILE_SZ)*((nek1 + KV_TILE_SZ - 1)/KV_TILE_SZ);
        }

        for (int64_t ic = 0; ic < nek1; ic += KV_TILE_SZ) {
            const int kv_tile = (int) std::min((int64_t) KV_TILE_SZ, nek1 - ic);

            // which keys some row may see, and whether the mask adds anything but zeros
            uint64_t key_visible = kv_tile == 64 ? ~(uint64_t) 0 : (((uint64_t) 1 << kv_tile) - 1);
            bool mask_zero = true;
            if (mask) {
                const fa_tile_mask_scan scan = scans_row != nullptr ? scans_row[ic / KV_TILE_SZ]
                                                                    : fa_scan_mask_tile(mask_base, mask->nb[1], iq1, tile_rows, ic, kv_tile);
                key_visible = scan.visible;
                mask_zero   = scan.zero != 0;
                if (key_visible == 0) {
                    continue;
                }
                if (!mask_zero) {
                    // mask32[tq][tk] = slope*mask; pad rows stay 0
                    memset(mask32 + tile_rows*KV_TILE_SZ, 0, (size_t) (QN - tile_rows)*KV_TILE_SZ*sizeof(float));
                    for (int tq = 0; tq < tile_rows; tq++) {
                        const ggml_fp16_t * mp = (const ggml_fp16_t *) (mask_base + (iq1 + tq)*mask->nb[1]) + ic;
                        fa_tile_load_mask_row(mask32 + tq*KV_TILE_SZ, mp, kv_tile, slope);
                    }
                }
            }

            // the K and V rows FA_L2_AHEAD tiles on into L2, the next tile's into L1 (0015, 0035)
            {
                const char * k_head = (const char *) k->data + ik2*nbk2 + ik3*nbk3;
                const char * v_head = (const char *) v->data + iv2*nbv2 + iv3*nbv3;
                const int64_t next = ic + KV_TILE_SZ, far = ic + FA_L2_AHEAD*KV_TILE_SZ;
                if (far < nek1) {
                    fa_prefetch_kv_rows<_MM_HINT_T1>(k_head, v_head, nbk1, nbv1, far, std::min((int64_t) KV_TILE_SZ, nek1 - far),
                                                     k_row_bytes, v_row_bytes);
                }
                if (next < nek1) {
                    fa_prefetch_kv_rows<_MM_HINT_T0>(k_head, v_head, nbk1, nbv1, next, std::min((int64_t) KV_TILE_SZ, nek1 - next),
                                                     k_row_bytes, v_row_bytes);
                }
            }

            // ST[tk][tq] = K[tk] . Q[tq]; K rows as f32 or bf16 (a key no row sees is not read: its
            // scores are overwritten below)
            const char * k_tile = (const char *) k->data + ic*nbk1 + ik2*nbk2 + ik3*nbk3;
            if (bf16) {
                bf16->pack_keys((uint16_t *) K32, k_tile, nbk1, key_visible, kv_tile, DK, kv_f16);
                bf16->scores(ST, QN, (const uint16_t *) K32, (int) DK, (const uint32_t *) QT, kv_tile);
            } else {
                for (int tk = 0; tk < kv_tile; tk++) {
                    if ((key_visible >> tk) & 1) {
                        fa_t_row_to_f32(K32 + tk*DK, k_tile + tk*nbk1, DK, kv_f16);
                    }
                }
                fa_t_gemm(ST, QN, K32, (int) DK, 1, QT, QN, kv_tile, (int) DK, QN, false);
            }

            float pass_scale = scale;
            if (logit_softcap != 0.0f) {
                for (int tk = 0; tk < kv_tile; tk++) {
                    ggml_vec_scale_f32(QN, ST + tk*QN, scale);
                    ggml_vec_tanh_f32(QN, ST + tk*QN, ST + tk*QN);
                    ggml_vec_scale_f32(QN, ST + tk*QN, logit_softcap);
                }
                pass_scale = 1.0f;
            }

            switch (QV) {  // the scores' pass, its per-query vectors in registers
                case 1:  fa_t_softmax_tile<1>(ST, mask32, mask_zero, key_visible, kv_tile, pass_scale, M, S, MS); break;
                case 2:  fa_t_softmax_tile<2>(ST, mask32, mask_zero, key_visible, kv_tile, pass_scale, M, S, MS); break;
                case 3:  fa_t_softmax_tile<3>(ST, mask32, mask_zero, key_visible, kv_tile, pass_scale, M, S, MS); break;
                default: fa_t_softmax_tile<4>(ST, mask32, mask_zero, key_visible, kv_tile, pass_scale, M, S, MS); break;
            }
            for (int tq = 0; tq < tile_rows; tq++) {
                if (MS[tq] != 1.0f) {
                    ggml_vec_scale_f32((int) DV, O + tq*DV, MS[tq]);
                }
            }

            const char * v_tile = (const char *) v->data + ic*nbv1 + iv2*nbv2 + iv3*nbv3;
            if (bf16) {
                // keys in whole 32-key steps: weights and V rows past the tile's keys are zeros; the
                // weights' pairs go where the mask rows were (read by the softmax pass, free now)
                const int n_keys32 = (kv_tile + 31) / 32 * 32;
                bf16->pack_weights(mask32, ST, QN, kv_tile, n_keys32);
                bf16->pack_values((uint32_t *) V32, v_tile, nbv1, key_visible, kv_tile, n_keys32, DV, kv_f16);
                bf16->values(O, (int) DV, mask32, QN, (const uint32_t *) V32, QN, n_keys32);
                continue;
            }

            // V rows as f32; a key no row sees gets zeros (0 * NaN would still poison the sum)
            for (int tk = 0; tk < kv_tile; tk++) {
                if (!((key_visible >> tk) & 1)) {
                    memset(V32 + tk*DV, 0, DV*sizeof(float));
                    continue;
                }
                fa_t_row_to_f32(V32 + tk*DV, v_tile + tk*nbv1, DV, kv_f16);
            }

            // O[tq] += sum_tk P[tk][tq] * V[tk]   (P read transposed from ST)
            fa_t_gemm(O, (int) DV, ST, 1, QN, V32, (int) DV, tile_rows, kv_tile, (int) DV, true);
        }

        if (sinks) {
            const float s = ((const float *) sinks->data)[h];
            for (int tq = 0; tq < tile_rows; tq++) {
                float ms = 1.0f;
                float vs = 1.0f;
                if (s > M[tq]) {
                    ms = expf(M[tq] - s);
                    ggml_vec_scale_f32((int) DV, O + tq*DV, ms);
                } else {
                    vs = expf(s - M[tq]);
                }
                S[tq] = S[tq]*ms + vs;
            }
        }

        for (int tq = 0; tq < tile_rows; tq++) {
            const float S_inv = S[tq] == 0.0f ? 0.0f : 1.0f/S[tq];
            ggml_vec_scale_f32((int) DV, O + tq*DV, S_inv);
            const int64_t i1 = iq1 + tq;
            memcpy((char *) dst->data + (iq3*ne2*ne1 + iq2 + i1*ne1)*nb1, O + tq*DV, nb1);
        }

        ir += tile_rows;
    }
    if (bf16 != nullptr && bf16->end != nullptr) {
        bf16->end();
    }
}

static bool fa_tiled_takes(const struct ggml_tensor * op) {
    const struct ggml_tensor * q = op->src[0], * k = op->src[1], * v = op->src[2], * mask = op->src[3];
    const int32_t prec = ggml_get_op_params_i32(op, 3);
    return op->op == GGML_OP_FLASH_ATTN_EXT && (prec == GGML_PREC_DEFAULT || prec == GGML_PREC_F32 || prec == GGML_PREC_BF16) &&
           q->type == GGML_TYPE_F32 && op->type == GGML_TYPE_F32 &&
           k->type == v->type && (k->type == GGML_TYPE_F16 || k->type == GGML_TYPE_F32) &&
           (mask == nullptr || mask->type == GGML_TYPE_F16) &&
           q->ne[1] >= FA_MIN_ROWS && v->ne[0] % 16 == 0 && q->ne[0] == k->ne[0] &&
           q->nb[0] == sizeof(float) && k->nb[0] == ggml_type_size(k->type) && v->nb[0] == ggml_type_size(v->type) &&
           op->nb[0] == sizeof(float) && op->nb[0] <= op->nb[1] && op->nb[1] <= op->nb[2] && op->nb[2] <= op->nb[3];
}

static size_t fa_scans_offset(int n_threads, const struct ggml_tensor * op) {
    return (size_t) n_threads * (size_t) fa_thread_floats(op->src[1]->ne[0], op->src[2]->ne[0]) * sizeof(float);
}

static size_t fa_tiled_work_size(int n_threads, const struct ggml_tensor * op) {
    const int64_t cells = fa_mask_scan_cells(op);
    return fa_scans_offset(n_threads, op) + (cells > 0 ? 64 + (size_t) cells*sizeof(fa_tile_mask_scan) : 0);
}

static void fa_tiled_compute(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * q = dst->src[0], * k = dst->src[1], * mask = dst->src[3];
    const int64_t neq1 = q->ne[1], nek1 = k->ne[1];
    const int ith = params->ith, nth = params->nth;
    GGML_ASSERT(params->wsize >= fa_scans_offset(nth, dst));

    // total rows in q; 4 chunks per thread, rounded up to whole query tiles while every thread still
    // gets a chunk (0001: a partial Q tile costs as much as a full one)
    const int64_t nr = q->ne[1]*q->ne[2]*q->ne[3];
    int64_t chunk_size = (nr + nth*4 - 1) / (nth*4);
    const int64_t whole = (chunk_size + Q_TILE_SZ - 1) / Q_TILE_SZ * Q_TILE_SZ;
    if ((nr + whole - 1) / whole >= nth) {
        chunk_size = whole;
    }
    int64_t nchunk = (nr + chunk_size - 1) / chunk_size;
    if (nth == 1 || nchunk < nth || ggml_is_numa()) {
        nchunk = nth;
    }

    // the mask scans every chunk shares (0017), each cell by one thread, ordered before their use
    // by the barrier below; past the threads' scratch
    const fa_tile_mask_scan * scans = nullptr;
    const int64_t n_cells = fa_mask_scan_cells(dst);
    if (n_cells > 0) {
        fa_tile_mask_scan * cells = (fa_tile_mask_scan *) GGML_PAD((uintptr_t) ((char *) params->wdata + fa_scans_offset(nth, dst)), 64);
        if ((char *) (cells + n_cells) <= (char *) params->wdata + params->wsize) {
            const int64_t n_q_tiles = (neq1 + Q_TILE_SZ - 1)/Q_TILE_SZ, n_kv_tiles = (nek1 + KV_TILE_SZ - 1)/KV_TILE_SZ;
            for (int64_t c = ith; c < n_cells; c += nth) {
                const int64_t kt = c % n_kv_tiles, qt = (c / n_kv_tiles) % n_q_tiles, plane = c / (n_kv_tiles*n_q_tiles);
                const char * mask_plane = (const char *) mask->data + (plane % mask->ne[2])*mask->nb[2] + (plane / mask->ne[2])*mask->nb[3];
                cells[c] = fa_scan_mask_tile(mask_plane, mask->nb[1], qt*Q_TILE_SZ, (int) std::min<int64_t>(Q_TILE_SZ, neq1 - qt*Q_TILE_SZ),
                                             kt*KV_TILE_SZ, (int) std::min<int64_t>(KV_TILE_SZ, nek1 - kt*KV_TILE_SZ));
            }
            scans = cells;
        }
    }

    if (ith == 0) {
        ggml_threadpool_chunk_set(params->threadpool, nth);
    }
    ggml_barrier(params->threadpool);

    const int64_t dr = (nr + nchunk - 1) / nchunk;
    int current_chunk = ith;
    while (current_chunk < nchunk) {
        const int64_t ir0 = dr * current_chunk;
        const int64_t ir1 = std::min(ir0 + dr, nr);
        fa_tiled_rows(params, dst, ir0, ir1, scans);
        current_chunk = ggml_threadpool_chunk_add(params->threadpool, 1);
    }
}

static const op_kernel fa_tiled = {"flash attention, f32 tiles (AVX-512)", fa_tiled_takes, fa_tiled_work_size, fa_tiled_compute};

const op_kernel * fa_tiled_kernel() {
    return &fa_tiled;
}

#else

const op_kernel * fa_tiled_kernel() {
    return nullptr;
}

#endif

}  // namespace ggml::cpu::dkv
