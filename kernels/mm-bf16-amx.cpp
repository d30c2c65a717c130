// bf16 weights times a few f32 columns on AMX-BF16 tiles, for weights in our CPU_DKV buffer
// (mm-narrow.h), on Xeons since Sapphire Rapids. From pyggml_dkv's patches to ggml 0.10.1: 0029
// (the kernel) and 0043 (the columns laid out by input blocks per thread).
//
// The arithmetic of mm-bf16-dpbf16.cpp (columns rounded to bf16, exact bf16 products, f32 sums)
// where the CPU has tiles: vdpbf16ps runs at half an f32 FMA's multiply-adds on Intel's cores, and
// one tile product multiplies 16 weight rows by 32 inputs of 16 columns. A tile (TMM4) takes 16
// weight rows straight from memory; the columns are laid out as the other operand wants them
// (pairs of inputs of every column, 16 rows of pairs a tile); TMM0-3 hold the sums of up to four
// 16-column groups, the last group possibly narrower (TMM7). Every output is one thread's, summed in
// a fixed order: the thread count does not change a bit.
//
// Ported from the 0.10.1 build (where 0043 took a bf16 GGUF step from 12.3-12.9 to 10.1 ms at
// window 64 on a model-167 Xeon; docs/perf-notes.md). On the same kind of Xeon the small drafter's
// bf16 step takes 0.97-0.99 of the 0.10.1 build's time (benchmarks/README.md).
// tests/ggml/test_bf16_products.py and test_amx.py check it where the CPU has AMX.
//
// Pyggml-Dkv-Capability: mm-bf16-amx

#include "mm-narrow.h"

#include "amx-tiles.h"

namespace ggml::cpu::dkv {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)

// the sums of group G_ += the weight tile x its column tile; the last group, when narrower, has its
// own column tile (TMM7), the others alternate TMM5 / TMM6 so a load overlaps the last product. A
// macro: GCC's tile intrinsics paste the tile number into their assembly, so it must be a literal.
#define BF16_AMX_GROUP(G_)                                                                   \
    if (n_groups > (G_)) {                                                                   \
        const char * xg = xb + (size_t) (G_)*16*K*2 + (size_t) kb*16*width[G_]*4;            \
        if ((G_) == n_groups - 1 && width[G_] < 16) {                                        \
            _tile_loadd(7, xg, width[G_]*4);                                                 \
            _tile_dpbf16ps(G_, 4, 7);                                                        \
        } else if ((G_) % 2 == 0) {                                                          \
            _tile_loadd(5, xg, 64);                                                          \
            _tile_dpbf16ps(G_, 4, 5);                                                        \
        } else {                                                                             \
            _tile_loadd(6, xg, 64);                                                          \
            _tile_dpbf16ps(G_, 4, 6);                                                        \
        }                                                                                    \
    }

static bool bf16_amx_takes(const struct ggml_tensor * op) {
    return narrow_shape_ok(op, GGML_TYPE_BF16, 32) && op->src[0]->ne[1] % 16 == 0 && amx_usable();
}

static size_t bf16_amx_work_size(int, const struct ggml_tensor * op) {
    // one shared copy of the columns in bf16, laid out for the tiles
    return (size_t) (op->src[1]->ne[1] * op->src[0]->ne[0]) * sizeof(ggml_bf16_t);
}

static void bf16_amx_compute(const struct ggml_compute_params * params, struct ggml_tensor * op) {
    const struct ggml_tensor * src0 = op->src[0];
    const struct ggml_tensor * src1 = op->src[1];
    const int64_t K = src0->ne[0];
    const int64_t M = src0->ne[1];  // weight rows = output features
    const int     N = (int) src1->ne[1];  // columns = tokens
    const int64_t ldy = op->nb[1] / sizeof(float);
    const int ith = params->ith, nth = params->nth;

    const int n_groups = (N + 15) / 16;
    int width[4];
    for (int g = 0; g < 4; g++) {
        width[g] = g < n_groups ? std::min(16, N - 16*g) : 16;
    }

    // 1. the columns rounded to bf16 (nearest even) into the work buffer: group g's columns at
    //    g*16*K values, there per 32-input block 16 rows of (input pair of every column of the group).
    //    Split over the threads by blocks of 32 inputs (0043), so that each thread writes whole cache
    //    lines of its own: split by columns, two threads wrote every line (a line holds an input pair
    //    of 16 columns) and passed it back and forth (1024 x 1024 at 16 columns: 94 -> 50 us).
    char * xb = (char *) params->wdata;
    GGML_ASSERT(params->wsize >= bf16_amx_work_size(nth, op));
    const int64_t kb0 = ith*(K/32)/nth, kb1 = (ith + 1)*(K/32)/nth;
    for (int j = 0; j < N; j++) {
        const int g = j / 16, w = width[g];
        const float * xr = (const float *) ((const char *) src1->data + j*src1->nb[1]);
        const __m512i rows_of_pairs = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                         _mm512_set1_epi32(w));
        uint32_t * col = (uint32_t *) (xb + (size_t) g*16*K*2) + (j - 16*g);
        for (int64_t kb = kb0; kb < kb1; kb++) {
            const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + 32*kb + 16), _mm512_loadu_ps(xr + 32*kb));
            _mm512_i32scatter_epi32(col + kb*16*w, rows_of_pairs, (__m512i) h, 4);
        }
    }
    ggml_barrier(params->threadpool);

    // 2. each thread owns a range of whole 16-row blocks of the weights
    const int64_t blocks = M / 16;
    const int64_t per    = (blocks + nth - 1) / nth;
    const int64_t b0     = std::min(blocks, ith * per);
    const int64_t b1     = std::min(blocks, (ith + 1) * per);
    if (b0 >= b1) {
        return;
    }

    uint8_t  rows[8]  = {16, 16, 16, 16, 16, 16, 16, 16};
    uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    for (int g = 0; g < n_groups; g++) {
        colsb[g] = (uint16_t) (width[g]*4);  // 16 rows x width f32 sums
    }
    colsb[7] = (uint16_t) (width[n_groups - 1]*4);  // the narrower last group's columns
    amx_load_config(rows, colsb);

    alignas(64) float sums[16*16];
    const __m512i sum_col = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32(16));
    for (int64_t b = b0; b < b1; b++) {
        const char * w = (const char *) src0->data + (size_t) (16*b)*src0->nb[1];
        const char * next_w = b + 1 < b1 ? w + 16*src0->nb[1] : nullptr;
        _tile_zero(0);
        if (n_groups > 1) { _tile_zero(1); }
        if (n_groups > 2) { _tile_zero(2); }
        if (n_groups > 3) { _tile_zero(3); }
        for (int64_t kb = 0; kb < K/32; kb++) {
            // the weights stream from DRAM: the next block's rows of this step into L2, and this
            // block's rows four steps on into L1 (a tile load waits for all 16 of its lines); the
            // next block's into L1 alone: a 49152 x 1024 product at 16 columns 4.4 ms, this way 3.2
            if (next_w != nullptr) {
                for (int i = 0; i < 16; i++) {
                    _mm_prefetch(next_w + i*src0->nb[1] + kb*64, _MM_HINT_T1);
                }
            }
            if (kb + 4 < K/32) {
                for (int i = 0; i < 16; i++) {
                    _mm_prefetch(w + i*src0->nb[1] + (kb + 4)*64, _MM_HINT_T0);
                }
            }
            _tile_loadd(4, w + kb*64, src0->nb[1]);
            BF16_AMX_GROUP(0)
            BF16_AMX_GROUP(1)
            BF16_AMX_GROUP(2)
            BF16_AMX_GROUP(3)
        }
        // sums[r][c] of group g are weight row 16b + r times column 16g + c: dst column-major in c
        for (int g = 0; g < n_groups; g++) {
            switch (g) {
                case 0:  _tile_stored(0, sums, 64); break;
                case 1:  _tile_stored(1, sums, 64); break;
                case 2:  _tile_stored(2, sums, 64); break;
                default: _tile_stored(3, sums, 64); break;
            }
            for (int c = 0; c < width[g]; c++) {
                const __m512 col = _mm512_i32gather_ps(_mm512_add_epi32(sum_col, _mm512_set1_epi32(c)), sums, 4);
                _mm512_storeu_ps((float *) op->data + (size_t) (16*g + c)*ldy + 16*b, col);
            }
        }
    }
    // ggml's AMX matmuls in another ggml of the process trust the configuration they loaded
    amx_load_ggml_matmul_config();
}

#undef BF16_AMX_GROUP

static const op_kernel bf16_amx_kernel = {"bf16 narrow (AMX-BF16 tiles)", bf16_amx_takes, bf16_amx_work_size, bf16_amx_compute};

const op_kernel * mm_bf16_amx_kernel() {
    return &bf16_amx_kernel;
}

#else

const op_kernel * mm_bf16_amx_kernel() {
    return nullptr;
}

#endif

}  // namespace ggml::cpu::dkv
