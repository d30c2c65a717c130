// bf16 weights times a few f32 columns on AVX-512 f32 FMAs, for weights in our CPU_DKV buffer
// (mm-narrow.h), where vdpbf16ps is the slower instruction or missing (buffer.cpp,
// bf16_products_on_fma). From pyggml_dkv's patch 0041 to ggml 0.10.1.
//
// vdpbf16ps multiplies twice the values of an FMA per instruction, but Intel's cores run it at
// half the FMA's rate (the model-167 Xeon: 106-122 against 211-244 G multiply-adds/s on two
// threads; Emerald Rapids 60-68 against 114-121), and AVX-512 CPUs before Cooper Lake lack it. A
// bf16 value is the high half of an f32: a 32-bit lane of 32 loaded weights holds inputs 2i (low
// half) and 2i + 1 (high half), so one shift makes the 16 even ones f32 and one mask the 16 odd
// ones, one instruction per 16 weights where f16's vcvtph2ps costs two. Each thread lays the
// columns out to match (per 32 inputs, the 16 even then the 16 odd values, f32) in its own slice
// of the work buffer: no barrier, and the copy it reads is in its own cache. The row blocks,
// groups and prefetches are the f16 kernel's (narrow_fma_rows). Arithmetic: the exact bf16
// weights times the f32 columns (not rounded to bf16), f32 sums, every output one thread's.
//
// Figure: on AMD, where the rule picks vdpbf16ps instead, forced (PYGGML_DKV_BF16_PRODUCTS=fma)
// against ggml 0.25.3's own bf16 path (vdpbf16ps, one row by one column), alternated, median of 30
// (benchmarks/ab_narrow_products.py; AMD EPYC family 25 model 17, Zen 4, 2 vCPUs shared, 2
// threads): 0.76-1.18 of ggml's time, 39-49 G multiply-adds/s (the f16 kernel's rate). Not
// measured on Intel here (0041's figures: the model-167 Xeon, 107 -> 152 G on the 49152-row head).
// With 0041's memory clobber before the odd halves GCC 12 kept all 24 sums on the stack in this
// C++ form (21-23 G); an opaque pointer copy reloads the weights without it.
//
// Pyggml-Dkv-Capability: mm-bf16-fma

#include "mm-narrow.h"

namespace ggml::cpu::dkv {

#if defined(__AVX512F__) && defined(__F16C__)

template <int RM, int RN>
struct bf16_fma_tile {
    static inline __attribute__((always_inline)) void run(int64_t K, const uint16_t * w, int64_t ldw, const float * x, int64_t ldx,
                    float * y, int64_t ldy, const uint16_t * next_w, const uint16_t * far_w) {
        const __m512i high_halves = _mm512_set1_epi32((int) 0xFFFF0000u);
        __m512 acc[4][6];
        for (int i = 0; i < RM; i++) {
            for (int j = 0; j < RN; j++) {
                acc[i][j] = _mm512_setzero_ps();
            }
        }
        for (int64_t k = 0; k < K; k += 32) {
            if (next_w != nullptr) {
                // the next weight rows stream from DRAM: ask for them a block ahead (one line a row)
                for (int i = 0; i < RM; i++) {
                    _mm_prefetch((const char *) (next_w + i*ldw + k), _MM_HINT_T0);
                }
                if (far_w != nullptr) {
                    for (int i = 0; i < RM; i++) {
                        _mm_prefetch((const char *) (far_w + i*ldw + k), _MM_HINT_T1);
                    }
                }
            }
            __m512 wv[4];
            for (int i = 0; i < RM; i++) {  // inputs k, k + 2, ..., k + 30
                wv[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512((const void *) (w + i*ldw + k)), 16));
            }
            for (int j = 0; j < RN; j++) {
                __m512 xv = _mm512_loadu_ps(x + j*ldx + k);
                __asm__("" : "+v"(xv));  // one load per column, not one per product
                for (int i = 0; i < RM; i++) {
                    acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
                }
            }
            // the weights again from L1 rather than kept: 24 sums, 4 weight vectors, a column and the
            // mask fill the 32 registers (the two halves as two passes over the block were slower).
            // An opaque copy of the pointer keeps GCC from reusing the loads above; old patch 0041's
            // memory clobber did the same but, here, also sent the 24 sums through the stack
            const uint16_t * w_again = w;
            __asm__("" : "+r"(w_again));
            for (int i = 0; i < RM; i++) {  // inputs k + 1, k + 3, ..., k + 31
                wv[i] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512((const void *) (w_again + i*ldw + k)), high_halves));
            }
            for (int j = 0; j < RN; j++) {
                __m512 xv = _mm512_loadu_ps(x + j*ldx + k + 16);
                __asm__("" : "+v"(xv));
                for (int i = 0; i < RM; i++) {
                    acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
                }
            }
        }
        store_tile_sums<RM, RN>(acc, y, ldy);
    }
};


static bool bf16_fma_takes(const struct ggml_tensor * op) {
    return narrow_shape_ok(op, GGML_TYPE_BF16, 32);
}

static size_t bf16_fma_work_size(int n_threads, const struct ggml_tensor * op) {
    // each thread's own copy of the columns, laid out for the tile
    return (size_t) n_threads * (size_t) (op->src[1]->ne[1] * op->src[0]->ne[0]) * sizeof(float);
}

static void bf16_fma_compute(const struct ggml_compute_params * params, struct ggml_tensor * op) {
    const struct ggml_tensor * src0 = op->src[0];
    const struct ggml_tensor * src1 = op->src[1];
    const int64_t K = src0->ne[0];
    const int64_t N = src1->ne[1];

    // 1. the columns as the tile reads them, per 32 inputs the even ones then the odd ones, into this
    //    thread's slice of the work buffer
    GGML_ASSERT(params->wsize >= bf16_fma_work_size(params->nth, op));
    float * xd = (float *) params->wdata + (size_t) params->ith * (size_t) (N*K);
    const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odds  = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    for (int64_t j = 0; j < N; j++) {
        const float * xr = (const float *) ((const char *) src1->data + j*src1->nb[1]);
        for (int64_t k = 0; k < K; k += 32) {
            const __m512 lo = _mm512_loadu_ps(xr + k), hi = _mm512_loadu_ps(xr + k + 16);
            _mm512_storeu_ps(xd + j*K + k,      _mm512_permutex2var_ps(lo, evens, hi));
            _mm512_storeu_ps(xd + j*K + k + 16, _mm512_permutex2var_ps(lo, odds,  hi));
        }
    }

    // 2. the row blocks, as the f16 product runs them
    narrow_fma_rows<bf16_fma_tile>(params, (const uint16_t *) src0->data, src0->nb[1] / 2,
                    xd, K, (float *) op->data, op->nb[1] / sizeof(float), src0->ne[1], N, K);
}

static const op_kernel bf16_fma_kernel = {"bf16 narrow (AVX-512 FMA)", bf16_fma_takes, bf16_fma_work_size, bf16_fma_compute};

const op_kernel * mm_bf16_fma_kernel() {
    return &bf16_fma_kernel;
}

#else

const op_kernel * mm_bf16_fma_kernel() {
    return nullptr;
}

#endif

}  // namespace ggml::cpu::dkv
