// f16 and bf16 weights times a few f32 columns on CPUs with AVX2 / FMA / F16C but no AVX-512 (AMD
// Zen 2 / Zen 3, Intel's client cores), for weights in our CPU_DKV buffer (mm-narrow.h), where the
// AVX-512 kernels compile out and ggml's own path rounds the columns to f16 / bf16 and converts both
// operands on every use. From pyggml_dkv's patch 0042 to ggml 0.10.1.
//
// The AVX-512 FMA kernels' arithmetic in 8-wide registers: only the weights are converted (f16 by
// vcvtph2ps, bf16 by a shift / mask, the columns laid out per 16 inputs as 8 even and 8 odd values
// in each thread's slice of the work buffer), the columns stay f32, every output is one f32 dot
// product of one thread. Tiles of 2 weight rows x up to 6 columns (12 sums, 2 weight vectors and a
// column in the 16 registers; bf16 adds the mask), each thread owning whole 2-row blocks whose
// weights stay in L1 over the column tiles, the next block's rows asked for during the first.
//
// Pyggml-Dkv-Capability: mm-half-avx2

#include "mm-narrow.h"

namespace ggml::cpu::dkv {

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)

static inline __attribute__((always_inline)) float mm256_reduce_add_ps(const __m256 v) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

template <bool BF16, int RM, int RN>
static void avx2_tile(int64_t K, const uint16_t * w, int64_t ldw, const float * x, int64_t ldx,
                      float * y, int64_t ldy, const uint16_t * next_w) {
    const __m256i high_halves = _mm256_set1_epi32((int) 0xFFFF0000u);
    __m256 acc[2][6];
    for (int i = 0; i < RM; i++) {
        for (int j = 0; j < RN; j++) {
            acc[i][j] = _mm256_setzero_ps();
        }
    }
    // bf16: 16 inputs a step, the even ones then the odd ones; f16: 8 inputs a step
    constexpr int64_t step = BF16 ? 16 : 8;
    for (int64_t k = 0; k < K; k += step) {
        if (next_w != nullptr && (k & 31) == 0) {  // one line of each of the next block's rows
            for (int i = 0; i < RM; i++) {
                _mm_prefetch((const char *) (next_w + i*ldw + k), _MM_HINT_T0);
            }
        }
        for (int half = 0; half < (BF16 ? 2 : 1); half++) {
            __m256 wv[2];
            for (int i = 0; i < RM; i++) {
                if constexpr (!BF16) {
                    wv[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (w + i*ldw + k)));
                } else {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *) (w + i*ldw + k));
                    wv[i] = _mm256_castsi256_ps(half == 0 ? _mm256_slli_epi32(raw, 16) : _mm256_and_si256(raw, high_halves));
                }
            }
            for (int j = 0; j < RN; j++) {
                __m256 xv = _mm256_loadu_ps(x + j*ldx + k + 8*half);
                __asm__("" : "+x"(xv));  // one load per column, not one per product
                for (int i = 0; i < RM; i++) {
                    acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
                }
            }
        }
    }
    for (int i = 0; i < RM; i++) {
        for (int j = 0; j < RN; j++) {
            y[j*ldy + i] = mm256_reduce_add_ps(acc[i][j]);
        }
    }
}

using avx2_tile_fn = void (*)(int64_t, const uint16_t *, int64_t, const float *, int64_t, float *, int64_t, const uint16_t *);

template <bool BF16>
struct avx2_tiles {
    template <int RM, int... RN>
    static constexpr void fill(avx2_tile_fn (&row)[6], std::integer_sequence<int, RN...>) {
        ((row[RN] = &avx2_tile<BF16, RM, RN + 1>), ...);
    }
    avx2_tile_fn fn[2][6] = {};
    constexpr avx2_tiles() {
        fill<1>(fn[0], std::make_integer_sequence<int, 6>{});
        fill<2>(fn[1], std::make_integer_sequence<int, 6>{});
    }
};

static constexpr avx2_tiles<false> f16_tiles{};
static constexpr avx2_tiles<true>  bf16_tiles{};

static bool avx2_takes(const struct ggml_tensor * op) {
    return narrow_shape_ok(op, GGML_TYPE_F16, 8) || narrow_shape_ok(op, GGML_TYPE_BF16, 16);
}

static size_t avx2_work_size(int n_threads, const struct ggml_tensor * op) {
    // bf16: each thread's own copy of the columns, laid out for the tile; f16 reads them as they are
    return op->src[0]->type != GGML_TYPE_BF16 ? 0 :
           (size_t) n_threads * (size_t) (op->src[1]->ne[1] * op->src[0]->ne[0]) * sizeof(float);
}

static void avx2_compute(const struct ggml_compute_params * params, struct ggml_tensor * op) {
    const struct ggml_tensor * src0 = op->src[0];
    const struct ggml_tensor * src1 = op->src[1];
    const bool bf16 = src0->type == GGML_TYPE_BF16;
    const int64_t K = src0->ne[0];
    const int64_t M = src0->ne[1];  // weight rows = output features
    const int64_t N = src1->ne[1];  // columns = tokens
    const int64_t ldw = src0->nb[1] / 2;
    const int64_t ldy = op->nb[1] / sizeof(float);

    const float * x0 = (const float *) src1->data;
    int64_t ldx = src1->nb[1] / sizeof(float);
    if (bf16) {
        // this thread's copy of the columns, per 16 inputs the 8 even then the 8 odd values
        GGML_ASSERT(params->wsize >= avx2_work_size(params->nth, op));
        float * xd = (float *) params->wdata + (size_t) params->ith * (size_t) (N*K);
        for (int64_t j = 0; j < N; j++) {
            const float * xr = (const float *) ((const char *) src1->data + j*src1->nb[1]);
            for (int64_t k = 0; k < K; k += 16) {
                for (int e = 0; e < 8; e++) {
                    xd[j*K + k + e]     = xr[k + 2*e];
                    xd[j*K + k + 8 + e] = xr[k + 2*e + 1];
                }
            }
        }
        x0 = xd;
        ldx = K;
    }

    // each thread owns a range of whole 2-row blocks; a block's weights stay in L1 over its column tiles
    int64_t r0, r1;
    narrow_rows_of_thread(params->ith, params->nth, M, 2, r0, r1);
    const avx2_tile_fn (&table)[2][6] = bf16 ? bf16_tiles.fn : f16_tiles.fn;
    for (int64_t r = r0; r < r1; r += 2) {
        const int rm = (int) std::min<int64_t>(2, r1 - r);
        const uint16_t * w = (const uint16_t *) src0->data + r*ldw;
        for (int64_t t = 0; t < N; t += 6) {
            const int rn = (int) std::min<int64_t>(6, N - t);
            const uint16_t * next_w = t == 0 && r + 2 < r1 ? w + 2*ldw : nullptr;
            table[rm - 1][rn - 1](K, w, ldw, x0 + t*ldx, ldx, (float *) op->data + t*ldy + r, ldy, next_w);
        }
    }
}

static const op_kernel avx2_kernel = {"f16 / bf16 narrow (AVX2 FMA)", avx2_takes, avx2_work_size, avx2_compute};

const op_kernel * mm_half_avx2_kernel() {
    return &avx2_kernel;
}

#else

const op_kernel * mm_half_avx2_kernel() {
    return nullptr;
}

#endif

}  // namespace ggml::cpu::dkv
