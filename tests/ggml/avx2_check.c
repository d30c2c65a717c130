// The patched ggml built without AVX-512 (AVX2 / FMA / F16C only), driven through the ops a drafter
// step uses; tests/ggml/test_avx2_build.py builds it, feeds it inputs and checks its outputs.
//
//   avx2_check IN OUT    IN: the float32 inputs below, back to back; OUT: the outputs, back to back
//
// Inputs (numpy order, float32): x [16][256], w_norm [256], wf [96][256] (stored as f16), wq [64][256]
// (stored as q8_0), wb [96][256] (stored as bf16), q [4][70][64] (heads, rows, dim), k [2][267][64], v [2][267][64] (stored as f16),
// mask [2][70][267] (stored as f16; head h reads plane h % 2).
// Outputs (float32): norm_fused [16][256], norm_unfused [16][256], yf [16][96], yq [16][64],
// yb [16][96], yf_tail [9][37], yb_tail [9][37] (the first 37 rows of wf / wb times the first 9
// columns of x: a last block of one row and a last tile of three columns), attn [70][4][64].
// The graph runs on 1, 2 and 3 threads; every output must be the same bits each time (exit 3).
// The f16 / bf16 weights wf and wb live in our CPU_DKV buffer where the build has it (as
// BackendWeights places them), so that their products reach our narrow kernels (kernels/).
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { T = 16, D = 256, MF = 96, MQ = 64, HD = 64, NQ = 70, NH = 4, NKV_H = 2, NKV = 267 };

static float * take(float ** cursor, size_t n) {
    float * p = *cursor;
    *cursor += n;
    return p;
}

static void fill(struct ggml_tensor * t, const float * src) {
    const int64_t n = ggml_nelements(t);
    if (t->type == GGML_TYPE_F32) {
        memcpy(t->data, src, n * sizeof(float));
    } else if (t->type == GGML_TYPE_F16) {
        ggml_fp32_to_fp16_row(src, (ggml_fp16_t *) t->data, n);
    } else if (t->type == GGML_TYPE_BF16) {
        ggml_fp32_to_bf16_row(src, (ggml_bf16_t *) t->data, n);
    } else {
        ggml_quantize_chunk(t->type, src, t->data, 0, ggml_nrows(t), t->ne[0], NULL);
    }
}

// our CPU_DKV buffer type among the CPU backend's extra ones, else ggml's CPU buffer type
static ggml_backend_buffer_type_t weights_buffer_type(void) {
    ggml_backend_reg_t reg = ggml_backend_cpu_reg();
    ggml_backend_dev_get_extra_bufts_t get_extra =
        (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    if (get_extra != NULL) {
        for (ggml_backend_buffer_type_t * b = get_extra(ggml_backend_reg_dev_get(reg, 0)); b != NULL && *b != NULL; b++) {
            if (strcmp(ggml_backend_buft_name(*b), "CPU_DKV") == 0) {
                return *b;
            }
        }
    }
    return ggml_backend_cpu_buffer_type();
}

int main(int argc, char ** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s IN OUT\n", argv[0]);
        return 2;
    }
    const size_t n_in = T*D + D + MF*D + MQ*D + MF*D + NH*NQ*HD + 2*NKV_H*NKV*HD + NKV_H*NQ*NKV;
    float * in = malloc(n_in * sizeof(float));
    FILE * f = fopen(argv[1], "rb");
    if (!in || !f || fread(in, sizeof(float), n_in, f) != n_in) {
        fprintf(stderr, "cannot read %zu floats from %s\n", n_in, argv[1]);
        return 2;
    }
    fclose(f);
    float * cur = in;

    struct ggml_init_params ip = { 64u << 20, NULL, false };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * x  = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, D, T);
    struct ggml_tensor * wn = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, D);
    struct ggml_init_params wp = { 4 * ggml_tensor_overhead(), NULL, true };
    struct ggml_context * wctx = ggml_init(wp);
    struct ggml_tensor * wf = ggml_new_tensor_2d(wctx, GGML_TYPE_F16, D, MF);
    struct ggml_tensor * wq = ggml_new_tensor_2d(ctx, GGML_TYPE_Q8_0, D, MQ);
    struct ggml_tensor * wb = ggml_new_tensor_2d(wctx, GGML_TYPE_BF16, D, MF);
    ggml_backend_buffer_t wbuf = ggml_backend_alloc_ctx_tensors_from_buft(wctx, weights_buffer_type());
    if (wbuf == NULL || !ggml_backend_buffer_is_host(wbuf)) {
        fprintf(stderr, "cannot place the f16 / bf16 weights in host memory\n");
        return 2;
    }
    struct ggml_tensor * q  = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, HD, NQ, NH);
    struct ggml_tensor * k  = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, HD, NKV, NKV_H);
    struct ggml_tensor * v  = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, HD, NKV, NKV_H);
    struct ggml_tensor * m  = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, NKV, NQ, NKV_H);
    fill(x, take(&cur, T*D));
    fill(wn, take(&cur, D));
    fill(wf, take(&cur, MF*D));
    fill(wq, take(&cur, MQ*D));
    fill(wb, take(&cur, MF*D));
    fill(q, take(&cur, NH*NQ*HD));
    fill(k, take(&cur, NKV_H*NKV*HD));
    fill(v, take(&cur, NKV_H*NKV*HD));
    fill(m, take(&cur, NKV_H*NQ*NKV));

    // RMSNorm times its weights twice: once fusable (old patch 0018), once with the norm an
    // output of its own (never fused)
    struct ggml_tensor * fused    = ggml_mul(ctx, ggml_rms_norm(ctx, x, 1e-6f), wn);
    struct ggml_tensor * normed   = ggml_rms_norm(ctx, x, 1e-6f);
    struct ggml_tensor * unfused  = ggml_mul(ctx, normed, wn);
    ggml_set_output(normed);
    struct ggml_tensor * yf = ggml_mul_mat(ctx, wf, x);
    struct ggml_tensor * yq = ggml_mul_mat(ctx, wq, x);
    struct ggml_tensor * yb = ggml_mul_mat(ctx, wb, x);
    struct ggml_tensor * x9 = ggml_view_2d(ctx, x, D, 9, x->nb[1], 0);
    struct ggml_tensor * wf37 = ggml_view_2d(ctx, wf, D, 37, wf->nb[1], 0);
    struct ggml_tensor * wb37 = ggml_view_2d(ctx, wb, D, 37, wb->nb[1], 0);
    ggml_backend_view_init(wf37);  // the views live in the weights' buffer too
    ggml_backend_view_init(wb37);
    struct ggml_tensor * yf_tail = ggml_mul_mat(ctx, wf37, x9);
    struct ggml_tensor * yb_tail = ggml_mul_mat(ctx, wb37, x9);
    struct ggml_tensor * at = ggml_flash_attn_ext(ctx, q, k, v, m, 0.125f, 0.0f, 0.0f);
    ggml_flash_attn_ext_set_prec(at, GGML_PREC_F32);
    struct ggml_tensor * outs[] = { fused, unfused, yf, yq, yb, yf_tail, yb_tail, at };
    enum { N_OUTS = sizeof(outs) / sizeof(outs[0]) };
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    for (size_t i = 0; i < sizeof(outs) / sizeof(outs[0]); i++) {
        ggml_set_output(outs[i]);
        ggml_build_forward_expand(gf, outs[i]);
    }
    ggml_build_forward_expand(gf, normed);
    // 1 and 3 threads first, keeping their outputs; the 2-thread run's are written out
    void * first[N_OUTS];
    for (int n_threads = 1; n_threads <= 3; n_threads++) {
        const int nt = n_threads == 1 ? 1 : n_threads == 2 ? 3 : 2;
        if (ggml_graph_compute_with_ctx(ctx, gf, nt) != GGML_STATUS_SUCCESS) {
            fprintf(stderr, "compute failed\n");
            return 1;
        }
        for (size_t i = 0; i < N_OUTS; i++) {
            if (n_threads == 1) {
                first[i] = malloc(ggml_nbytes(outs[i]));
                memcpy(first[i], outs[i]->data, ggml_nbytes(outs[i]));
            } else if (outs[i] != at && memcmp(first[i], outs[i]->data, ggml_nbytes(outs[i])) != 0) {
                fprintf(stderr, "output %zu differs between 1 and %d threads\n", i, nt);
                return 3;
            }
        }
    }
    FILE * o = fopen(argv[2], "wb");
    if (!o) {
        fprintf(stderr, "cannot write %s\n", argv[2]);
        return 2;
    }
    for (size_t i = 0; i < N_OUTS; i++) {
        if (fwrite(outs[i]->data, 1, ggml_nbytes(outs[i]), o) != ggml_nbytes(outs[i])) {
            fprintf(stderr, "short write to %s\n", argv[2]);
            return 2;
        }
    }
    fclose(o);
    for (size_t i = 0; i < N_OUTS; i++) {
        free(first[i]);
    }
    ggml_free(ctx);
    ggml_backend_buffer_free(wbuf);
    ggml_free(wctx);
    free(in);
    return 0;
}
