// bf16 weights times a few f32 columns with AVX512-BF16 dot products (vdpbf16ps), for weights in
// our CPU_DKV buffer (mm-narrow.h), where they are the faster instruction (AMD's Zen 4 / Zen 5 run
// them at twice the FMA's multiply-adds: buffer.cpp, bf16_products_on_fma). From pyggml_dkv's
// patches to ggml 0.10.1: 0019 (the kernel) and 0026 (the L2 prefetch, asked in every column tile:
// this product is bound by its weights' stream).
//
// ggml's arithmetic, in another shape: ggml rounds the columns to bf16 (its vec_dot_type) and
// multiplies with vdpbf16ps one weight row by one column at a time; here the columns are rounded
// once per product (nearest even, as ggml's conversion), by all threads into the work buffer, and
// the product runs over register tiles of 4 weight rows x up to 6 columns (each weight vector
// loaded once per 6 columns and used as stored, the next 4-row block prefetched), every output one
// thread's (the thread count changes no bit). Exact bf16 products summed in f32.
//
// Figure: against ggml 0.25.3's own bf16 path (the same weights in ggml's CPU buffer; the same
// arithmetic, one row by one column), alternated in one process, median of 40 (benchmarks/
// ab_narrow_products.py; AMD EPYC family 25 model 17, Zen 4, 2 vCPUs shared with another job, 2
// threads). Microseconds a product, ours / ggml's: 3072 x 1024 x 16 columns 610 / 1235 (0.49),
// 1024 x 3072 x 16 674 / 908 (0.74), 1024 x 1024 x 16 216 / 424 (0.51), 3072 x 1024 x 34 1241 /
// 1871 (0.66), 8192 x 1024 x 9 1188 / 2742 (0.43); 64-86 G multiply-adds/s.
//
// Pyggml-Dkv-Capability: mm-bf16-dpbf16

#include "mm-narrow.h"

namespace ggml::cpu::dkv {

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)

template <int RM, int RN>
struct bf16_dp_tile {
    // x: the columns rounded to bf16 (passed as float * by the table's signature; ldx in bf16 values)
    static inline __attribute__((always_inline)) void run(int64_t K, const uint16_t * w, int64_t ldw, const float * xf, int64_t ldx,
                    float * y, int64_t ldy, const uint16_t * next_w, const uint16_t * far_w) {
        const uint16_t * x = (const uint16_t *) xf;
        __m512 acc[4][6];
        for (int i = 0; i < RM; i++) {
            for (int j = 0; j < RN; j++) {
                acc[i][j] = _mm512_setzero_ps();
            }
        }
        for (int64_t k = 0; k < K; k += 32) {
            if (next_w != nullptr) {
                // the next weight rows stream from DRAM: ask for them a block ahead
                for (int i = 0; i < RM; i++) {
                    _mm_prefetch((const char *) (next_w + i*ldw + k), _MM_HINT_T0);
                }
                if (far_w != nullptr) {
                    for (int i = 0; i < RM; i++) {
                        _mm_prefetch((const char *) (far_w + i*ldw + k), _MM_HINT_T1);
                    }
                }
            }
            __m512bh wv[4];
            for (int i = 0; i < RM; i++) {
                wv[i] = (__m512bh) _mm512_loadu_si512((const void *) (w + i*ldw + k));
            }
            for (int j = 0; j < RN; j++) {
                __m512i xi = _mm512_loadu_si512((const void *) (x + j*ldx + k));
                // keep the column in a register: GCC otherwise folds the load into each of the RM products
                __asm__("" : "+v"(xi));
                for (int i = 0; i < RM; i++) {
                    acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[i], (__m512bh) xi);
                }
            }
        }
        store_tile_sums<RM, RN>(acc, y, ldy);
    }
};


static bool bf16_dp_takes(const struct ggml_tensor * op) {
    return narrow_shape_ok(op, GGML_TYPE_BF16, 32);
}

static size_t bf16_dp_work_size(int, const struct ggml_tensor * op) {
    // one shared copy of the columns in bf16 (what ggml plans for its own conversion)
    return (size_t) (op->src[1]->ne[1] * op->src[0]->ne[0]) * sizeof(ggml_bf16_t);
}

static void bf16_dp_compute(const struct ggml_compute_params * params, struct ggml_tensor * op) {
    const struct ggml_tensor * src0 = op->src[0];
    const struct ggml_tensor * src1 = op->src[1];
    const int64_t K = src0->ne[0];
    const int64_t M = src0->ne[1];  // weight rows = output features
    const int64_t N = src1->ne[1];  // columns = tokens
    const int64_t ldw = src0->nb[1] / 2;
    const int64_t ldy = op->nb[1] / sizeof(float);
    const int ith = params->ith, nth = params->nth;

    // 1. the columns rounded to bf16 (nearest even, as ggml's conversion; f32 denormals to zero),
    //    split over the threads by columns
    GGML_ASSERT(params->wsize >= bf16_dp_work_size(nth, op));
    uint16_t * xb = (uint16_t *) params->wdata;
    for (int64_t j = ith*N/nth; j < (ith + 1)*N/nth; j++) {
        const float * xr = (const float *) ((const char *) src1->data + j*src1->nb[1]);
        for (int64_t k = 0; k < K; k += 32) {
            const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + k + 16), _mm512_loadu_ps(xr + k));
            _mm512_storeu_si512((void *) (xb + j*K + k), (__m512i) h);
        }
    }
    ggml_barrier(params->threadpool);

    // 2. each thread owns a range of whole 4-row blocks, every column tile over one block (the
    //    f16 kernel's groups of blocks were no faster here: 6-column bf16 panels fit L1)
    int64_t r0, r1;
    narrow_rows_of_thread(ith, nth, M, 4, r0, r1);
    for (int64_t r = r0; r < r1; r += 4) {
        const int rm = (int) std::min<int64_t>(4, r1 - r);
        const uint16_t * w = (const uint16_t *) src0->data + r*ldw;
        for (int64_t t = 0; t < N; t += 6) {
            const int rn = (int) std::min<int64_t>(6, N - t);
            // every column tile asks again (0026): the bf16 product is bound by its weights' stream
            const uint16_t * next_w = r + 4 < r1 ? w + 4*ldw : nullptr;
            const uint16_t * far_w  = next_w != nullptr && r + NARROW_FAR_ROWS < r1 ? w + NARROW_FAR_ROWS*ldw : nullptr;
            narrow_tile<bf16_dp_tile>(rm, rn, K, w, ldw, (const float *) (xb + t*K), K,
                                      (float *) op->data + t*ldy + r, ldy, next_w, far_w);
        }
    }
}

static const op_kernel bf16_dp_kernel = {"bf16 narrow (vdpbf16ps)", bf16_dp_takes, bf16_dp_work_size, bf16_dp_compute};

const op_kernel * mm_bf16_dpbf16_kernel() {
    return &bf16_dp_kernel;
}

#else

const op_kernel * mm_bf16_dpbf16_kernel() {
    return nullptr;
}

#endif

}  // namespace ggml::cpu::dkv
