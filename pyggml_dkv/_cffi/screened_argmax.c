/* Screened argmax: a ggml custom op (ggml_custom_4d), compiled into pyggml_dkv._ggml_cffi.
 *
 * For each column x of `hidden` it finds argmax_t (exact_t . x), the product with the rows of an
 * exact (f32 / f16 / bf16) matrix, without computing every product exactly. A q8_0 copy of the
 * matrix ("the screen") has already scored every row, s_t = screen_t . x, in the graph; here a
 * per-row bound B_t >= |s_t - exact_t . x| (derivation in docs/design.md, "Exact draft ids from a
 * screened head") rules rows out, and only the rows it cannot rule out are multiplied exactly, in
 * double precision:
 *
 *   L = max_t (s_t - B_t)                 (the exact maximum is at least this)
 *   candidates = { t : s_t + B_t >= L }   (contains every row that can reach the maximum)
 *   id = the candidate with the largest exact product (the lowest index on a tie)
 *
 * B_t = Ew_t * |x| + Wq_t * ex + acc * Wq_t * (|x| + ex), where Ew_t = |exact_t - screen_t| and
 * Wq_t = |screen_t| are the matrix's per-row norms (the op's `bounds` input, rounded up), ex bounds
 * |x - q8_0(x)| (the activations the q8_0 product quantizes, per 32-value block: scale amax/127
 * rounded to f16, values rounded to nearest) and acc bounds the product's f32 rounding (one
 * rounding per 32-value block: int32 block sums are exact).
 *
 * The exact products cost ~12x the q8_0 ones per row, so a column whose candidates are most of
 * the rows (products all within the bound of the best: e.g. a head of identical rows) takes
 * ~10x a plain product of the whole matrix; it is still exact.
 *
 * Inputs (ggml order): src[0] screen scores f32 [V, Q]; src[1] hidden f32 [H, Q]; src[2] exact
 * matrix [H, V] in host memory; src[3] bounds f32 [2, V + 1]: (Ew_t, Wq_t) per row, then their
 * maxima. Output: i32 [Q], -1 for a column that is not finite, -2 where the op could not
 * allocate the scratch it needs past its stack buffers (thousands of candidates, or a hidden
 * size over 4096). The Python side
 * (pyggml_dkv/ggml/ops_screen.py) checks every shape and type before building the op.
 */

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SCREEN_X86 1
#else
#define SCREEN_X86 0
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "custom_ops.h"

#define SCREEN_BLOCK 32

/* ---------------------------------------------------------------- the scans over V scores */

static float scores_max_scalar(const float * s, int64_t n) {
    float m = -INFINITY;
    for (int64_t i = 0; i < n; i++) {
        m = s[i] > m ? s[i] : m;
    }
    return m;
}

/* The rows with s >= t, ascending, into out[0 .. cap); returns how many there are (more than cap:
 * only the first cap were written) */
static int64_t scores_at_least_scalar(const float * s, int64_t n, float t, int32_t * out, int64_t cap) {
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) {
        if (s[i] >= t) {
            if (k < cap) {
                out[k] = (int32_t) i;
            }
            k++;
        }
    }
    return k;
}

#if SCREEN_X86
__attribute__((target("avx2")))
static float scores_max_avx2(const float * s, int64_t n) {
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        m0 = _mm256_max_ps(m0, _mm256_loadu_ps(s + i));
        m1 = _mm256_max_ps(m1, _mm256_loadu_ps(s + i + 8));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_max_ps(m0, m1));
    float m = scores_max_scalar(lanes, 8);
    for (; i < n; i++) {
        m = s[i] > m ? s[i] : m;
    }
    return m;
}

__attribute__((target("avx2")))
static int64_t scores_at_least_avx2(const float * s, int64_t n, float t, int32_t * out, int64_t cap) {
    const __m256 tv = _mm256_set1_ps(t);
    int64_t k = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        unsigned mask = (unsigned) _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(s + i), tv, _CMP_GE_OQ));
        while (mask) {
            if (k < cap) {
                out[k] = (int32_t) (i + __builtin_ctz(mask));
            }
            k++;
            mask &= mask - 1;
        }
    }
    return k + scores_at_least_scalar(s + i, n - i, t, out + (k < cap ? k : cap), k < cap ? cap - k : 0);
}
#else
#define scores_max_avx2 scores_max_scalar
#define scores_at_least_avx2 scores_at_least_scalar
#endif

/* ---------------------------------------------------------------- exact products, in double */

/* sum_i w[i] x[i] over rows of element type T, each read as float by TO_F32 (four chains) */
#define SCREEN_DOT(name, T, TO_F32)                                              \
    static double name(const T * w, const double * x, int64_t n) {              \
        double a0 = 0, a1 = 0, a2 = 0, a3 = 0;                                 \
        int64_t i = 0;                                                           \
        for (; i + 4 <= n; i += 4) {                                             \
            a0 += (double) TO_F32(w[i]) * x[i];                                  \
            a1 += (double) TO_F32(w[i + 1]) * x[i + 1];                          \
            a2 += (double) TO_F32(w[i + 2]) * x[i + 2];                          \
            a3 += (double) TO_F32(w[i + 3]) * x[i + 3];                          \
        }                                                                        \
        for (; i < n; i++) {                                                     \
            a0 += (double) TO_F32(w[i]) * x[i];                                  \
        }                                                                        \
        return (a0 + a1) + (a2 + a3);                                            \
    }

#define SCREEN_F32(v) (v)
SCREEN_DOT(dot_f32, float, SCREEN_F32)
SCREEN_DOT(dot_bf16, ggml_bf16_t, ggml_bf16_to_fp32)
SCREEN_DOT(dot_f16_scalar, ggml_fp16_t, ggml_fp16_to_fp32)

#if SCREEN_X86
__attribute__((target("avx2,fma,f16c")))
static double dot_f16_avx2(const ggml_fp16_t * w, const double * x, int64_t n) {
    __m256d a0 = _mm256_setzero_pd(), a1 = a0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 wf = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (w + i)));
        a0 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(wf)), _mm256_loadu_pd(x + i), a0);
        a1 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(wf, 1)), _mm256_loadu_pd(x + i + 4), a1);
    }
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(a0, a1));
    double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    for (; i < n; i++) {
        sum += (double) ggml_fp16_to_fp32(w[i]) * x[i];
    }
    return sum;
}
#else
#define dot_f16_avx2 dot_f16_scalar
#endif

/* the CPU features the scans and products may use (compiled for any x86-64; chosen at run time) */
struct cpu_caps {
    int avx2;      /* the scans */
    int avx2_f16;  /* f16 rows: AVX2 + FMA + F16C */
};

static double exact_dot(const struct ggml_tensor * m, int64_t row, const double * x, int64_t n, struct cpu_caps caps) {
    const char * p = (const char *) m->data + row * m->nb[1];
    switch (m->type) {
        case GGML_TYPE_F32:  return dot_f32((const float *) p, x, n);
        case GGML_TYPE_BF16: return dot_bf16((const ggml_bf16_t *) p, x, n);
        default:             return caps.avx2_f16 ? dot_f16_avx2((const ggml_fp16_t *) p, x, n)
                                             : dot_f16_scalar((const ggml_fp16_t *) p, x, n);
    }
}

/* ---------------------------------------------------------------- the bound on the activations */

/* A bound on |x - q8_0(x)|_2 for one column, or a negative value when q8_0 cannot represent it
 * (a block scale past f16's range: the product's scores are then inf / NaN). Per element of a
 * block with d = amax / 127: |x - q * f16(d)| <= |x - q d| + |q| |d - f16(d)|, with |x - q d| <=
 * d (1/2 + 2e-5) (x * (1/d) is rounded twice in f32) and |d - f16(d)| <= max(2^-11 d, 2^-25)
 * (f16 rounds to 11 significant bits; 2^-25 is half its subnormal spacing). */
static double activation_error(const float * x, int64_t n) {
    double e2 = 0.0;
    for (int64_t b = 0; b < n; b += SCREEN_BLOCK) {
        float amax = 0.0f;
        for (int j = 0; j < SCREEN_BLOCK; j++) {
            amax = fmaxf(amax, fabsf(x[b + j]));
        }
        const double d = (double) amax / 127.0;
        if (d > 65504.0) {
            return -1.0;
        }
        const double e = d * (0.5 + 2e-5) + 127.0 * fmax(d * 0x1p-11, 0x1p-25);
        e2 += SCREEN_BLOCK * e * e;
    }
    return sqrt(e2) * (1.0 + 1e-12);
}

/* ---------------------------------------------------------------- the op */

/* Where a thread keeps a column's candidate rows: a buffer on its stack, which holds them in
 * practice (tens per column), and one of V rows on the heap, allocated only when they do not fit
 * (the all-candidates cases); no allocation on a normal step. */
#define SCREEN_STACK_CANDIDATES 2048
#define SCREEN_STACK_HIDDEN     4096

struct candidates {
    int32_t * stack;  /* SCREEN_STACK_CANDIDATES entries */
    int32_t * heap;   /* V entries, or NULL until needed */
    int64_t   V;
};

/* a buffer of at least n (<= V) entries, NULL when the heap one cannot be allocated */
static int32_t * candidates_room(struct candidates * c, int64_t n) {
    if (n <= SCREEN_STACK_CANDIDATES) {
        return c->stack;
    }
    if (c->heap == NULL) {
        c->heap = (int32_t *) malloc((size_t) c->V * sizeof(int32_t));
    }
    return c->heap;
}

static int32_t * all_rows(struct candidates * c, int64_t * n_cand) {
    int32_t * cand = candidates_room(c, c->V);
    if (cand != NULL) {
        for (int64_t t = 0; t < c->V; t++) {
            cand[t] = (int32_t) t;
        }
    }
    *n_cand = c->V;
    return cand;
}

static int32_t screened_argmax_column(const struct ggml_tensor * dst, int64_t col, struct candidates * room,
                                      double * xd, struct cpu_caps caps) {
    const struct ggml_tensor * screen = dst->src[0];
    const struct ggml_tensor * hidden = dst->src[1];
    const struct ggml_tensor * exact = dst->src[2];
    const float * bounds = (const float *) dst->src[3]->data;
    const int64_t V = screen->ne[0], H = hidden->ne[0];
    const float * s = (const float *) ((const char *) screen->data + col * screen->nb[1]);
    const float * x = (const float *) ((const char *) hidden->data + col * hidden->nb[1]);

    double xn2 = 0.0;
    for (int64_t i = 0; i < H; i++) {
        if (!isfinite(x[i])) {
            return -1;
        }
        xd[i] = x[i];
        xn2 += xd[i] * xd[i];
    }
    if (xn2 == 0.0) {  /* every product is exactly 0: a tie of all rows, which the first wins */
        return 0;
    }
    const double xn = sqrt(xn2) * (1.0 + 1e-12);
    const double ex = activation_error(x, H);
    /* B_t = a Ew_t + b Wq_t */
    const double acc = 2.0 * (double) (H / SCREEN_BLOCK + 2) * 0x1p-24;
    const double a = xn, b = ex + acc * (xn + ex);
    const double s_max = ex < 0.0 ? NAN : caps.avx2 ? scores_max_avx2(s, V) : scores_max_scalar(s, V);

    int32_t * cand;
    int64_t n_cand;
    if (!isfinite(s_max)) {  /* no screen (a block scale past f16, or scores inf): every row is a candidate */
        cand = all_rows(room, &n_cand);
    } else {
        /* loose pass with the largest bound: the row attaining L has s_t >= max(s) - 2 b_max; the f32
           threshold rounded down, so no row at or above the double one is missed */
        const double b_max = a * bounds[2 * V] + b * bounds[2 * V + 1];
        float t0 = (float) (s_max - 2.0 * b_max);
        if ((double) t0 > s_max - 2.0 * b_max) {
            t0 = nextafterf(t0, -INFINITY);
        }
        cand = room->stack;
        n_cand = caps.avx2 ? scores_at_least_avx2(s, V, t0, cand, SCREEN_STACK_CANDIDATES)
                           : scores_at_least_scalar(s, V, t0, cand, SCREEN_STACK_CANDIDATES);
        if (n_cand > SCREEN_STACK_CANDIDATES) {  /* did not fit: again, into the heap buffer */
            cand = candidates_room(room, n_cand);
            if (cand != NULL) {
                scores_at_least_scalar(s, V, t0, cand, n_cand);
            }
        }
        if (cand != NULL) {  /* tight pass with each row's own bound */
            double lower = -INFINITY;
            for (int64_t k = 0; k < n_cand; k++) {
                const int32_t t = cand[k];
                const double lo = (double) s[t] - (a * bounds[2 * t] + b * bounds[2 * t + 1]);
                lower = lo > lower ? lo : lower;
            }
            int64_t kept = 0;
            for (int64_t k = 0; k < n_cand; k++) {
                const int32_t t = cand[k];
                if ((double) s[t] + (a * bounds[2 * t] + b * bounds[2 * t + 1]) >= lower) {
                    cand[kept++] = t;
                }
            }
            n_cand = kept;
        }
    }
    if (cand == NULL) {
        return -2;
    }

    int32_t best = -1;
    double best_val = -INFINITY;
    for (int64_t k = 0; k < n_cand; k++) {  /* ascending rows: strict > keeps the lowest on a tie */
        const double v = exact_dot(exact, cand[k], xd, H, caps);
        if (best < 0 || v > best_val) {
            best = cand[k];
            best_val = v;
        }
    }
    return best;
}

void pyggml_dkv_screened_argmax(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    struct cpu_caps caps = {0, 0};
#if SCREEN_X86
    __builtin_cpu_init();
    caps.avx2 = __builtin_cpu_supports("avx2");
    caps.avx2_f16 = caps.avx2 && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
    if (getenv("PYGGML_DKV_SCREEN_SCALAR")) {  /* tests run the portable code too */
        caps.avx2 = caps.avx2_f16 = 0;
    }
    const int64_t V = dst->src[0]->ne[0], H = dst->src[1]->ne[0], Q = dst->ne[0];
    if (ith >= Q) {
        return;
    }
    int32_t cand_stack[SCREEN_STACK_CANDIDATES];
    double xd_stack[SCREEN_STACK_HIDDEN];
    struct candidates room = { cand_stack, NULL, V };
    double * xd = H <= SCREEN_STACK_HIDDEN ? xd_stack : (double *) malloc((size_t) H * sizeof(double));
    int32_t * out = (int32_t *) dst->data;
    for (int64_t col = ith; col < Q; col += nth) {
        out[col] = xd != NULL ? screened_argmax_column(dst, col, &room, xd, caps) : -2;
    }
    free(room.heap);
    if (xd != xd_stack) {
        free(xd);
    }
}
