// f16 weights times a few f32 columns (a draft block: 16-64 tokens) on AVX-512 FMAs, for weights in
// our CPU_DKV buffer (mm-narrow.h). ggml rounds the columns to f16 and runs llamafile's f16 x f16
// GEMM, which converts both operands on every use; here the columns stay f32 (more accurate: only
// f32 rounding against the stored weights), each 4-row block of weights is converted once per
// 6-column tile, and every output is one f32 dot product of one thread (the thread count changes
// no bit). From pyggml_dkv's patches to ggml 0.10.1: 0004 (the kernel), 0013 (the column kept in a
// register), 0016 (four rows reduced together, bit-identical), 0026 (the L2 prefetch 16 rows on),
// 0034 (column tiles over groups of 8 blocks for K <= 1024).
//
// Figure: against ggml 0.25.3's own f16 path (the same weights in ggml's CPU buffer), in one
// process, the two placements' graphs computed alternately, median of 40 (benchmarks/
// ab_narrow_products.py; each graph ~48 MB of distinct weights, so they stream from memory). AMD
// EPYC, cpuinfo family 25 model 17 (Zen 4), 2 vCPUs shared with another job (2 threads ran as fast
// as 1), GCC 12. Microseconds a product, ours / ggml's:
//   3072 x 1024 x 16 columns  1037 / 1621 (0.64)    1024 x 3072 x 16  1000 / 1305 (0.77)
//   1024 x 1024 x 16           375 /  585 (0.64)    3072 x 1024 x 34  2184 / 2929 (0.75)
//   8192 x 1024 x  9          1572 / 2976 (0.53)    ~48 G multiply-adds/s: one 512-bit FMA a cycle
// and more accurate: the columns stay f32 (tests/ggml/test_ops.py::
// test_mul_mat_half_weights_few_columns: within 2e-6 of float64 on the stored weights; ggml's
// path, which rounds the columns to f16, is ~1e-4 away).
//
// Pyggml-Dkv-Capability: mm-f16-narrow

#include "mm-narrow.h"

namespace ggml::cpu::dkv {

#if defined(__AVX512F__) && defined(__F16C__)

template <int RM, int RN>
struct f16_tile {
    static inline __attribute__((always_inline)) void run(int64_t K, const uint16_t * w, int64_t ldw, const float * x, int64_t ldx,
                    float * y, int64_t ldy, const uint16_t * next_w, const uint16_t * far_w) {
        __m512 acc[4][6];
        for (int i = 0; i < RM; i++) {
            for (int j = 0; j < RN; j++) {
                acc[i][j] = _mm512_setzero_ps();
            }
        }
        for (int64_t k = 0; k < K; k += 16) {
            if (next_w != nullptr && (k & 31) == 0) {
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
            for (int i = 0; i < RM; i++) {
                wv[i] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (w + i*ldw + k)));
            }
            for (int j = 0; j < RN; j++) {
                __m512 xv = _mm512_loadu_ps(x + j*ldx + k);
                // keep the column in a register: GCC otherwise folds the load into each of the RM FMAs
                __asm__("" : "+v"(xv));
                for (int i = 0; i < RM; i++) {
                    acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
                }
            }
        }
        store_tile_sums<RM, RN>(acc, y, ldy);
    }
};


static bool f16_takes(const struct ggml_tensor * op) {
    return narrow_shape_ok(op, GGML_TYPE_F16, 16);
}

static size_t f16_work_size(int, const struct ggml_tensor *) {
    return 0;  // the columns are read as they are
}

static void f16_compute(const struct ggml_compute_params * params, struct ggml_tensor * op) {
    const struct ggml_tensor * src0 = op->src[0];
    const struct ggml_tensor * src1 = op->src[1];
    narrow_fma_rows<f16_tile>(params, (const uint16_t *) src0->data, src0->nb[1] / 2,
                    (const float *) src1->data, src1->nb[1] / sizeof(float),
                    (float *) op->data, op->nb[1] / sizeof(float), src0->ne[1], src1->ne[1], src0->ne[0]);
}

static const op_kernel f16_kernel = {"f16 narrow (AVX-512 FMA)", f16_takes, f16_work_size, f16_compute};

const op_kernel * mm_f16_narrow_kernel() {
    return &f16_kernel;
}

#else

const op_kernel * mm_f16_narrow_kernel() {
    return nullptr;
}

#endif

}  // namespace ggml::cpu::dkv
