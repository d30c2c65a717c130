// q8_0 weights in our VNNI layout (mm-vnni-q8_0.cpp, CPU_DKV_REPACK) times many f32 rows on
// AMX-INT8 tiles, on Xeons since Sapphire Rapids: the wide products of the same repacked tensor (a
// prompt's bulk append, the one-shot graph's context rows), where a step's few rows stay on VNNI.
// From pyggml_dkv's patches to ggml 0.10.1: 0002 / 0007 / 0039 (a 16-row pass over ggml's AMX
// layout, its sums in registers across the K blocks), here over our own layout, so one copy of the
// weights serves both kernels.
//
// Why this works on the VNNI layout: a 16-row x 32-input block of it is 8 rows of 64 bytes, row j
// holding inputs 4j .. 4j + 3 of the 16 weight rows; that is exactly the B operand of a tile
// product (K / 4 rows of N x 4 bytes). Its codes are offset by +128 (unsigned, for vpdpbusd), so the
// product is `tdpbsud` (signed activations x unsigned weights) and the block's int32 sums start
// from the same -128 * sum(x) as the VNNI tile's. The activations are the VNNI driver's, quantized
// by 16-row tiles for these products (q8v_rows::tiled): 16 rows of one block are one contiguous
// 512-byte A tile, and a tile's blocks follow each other. Per block and row the int32 sum, its f32
// conversion and scaling are the VNNI tile's, in the same order: the two kernels give the same
// bits, and the thread count changes none. mm-vnni.h's driver runs the tiles of 16 rows here from
// AMX_Q8_0_MIN_ROWS rows (the rest of the rows on VNNI), in row chunks whose activations stay in L2.
//
// The tile shapes are ggml's own AMX matmul configuration (tiles 0-1: 8 x 64 bytes, 2-3: 16 x 32,
// 4-7: 16 x 64), loaded on each thread before its products, so an AMX matmul of the host's ggml
// that trusts its configuration (llama.cpp's) still finds it.
//
// Figure (model-167 Xeon, 2 threads, against the 0.10.1 build's AMX kernel, alternated): a
// 1024 x 5120 product at 512 / 1024 rows 5.5-6.2 / 11.5-12.4 ms against 5.7-6.4 / 12.1-12.8;
// bulk appends of 512-2048 rows 1.05-1.06x the old build's time, 1.27-1.31x on ggml 0.25.3's own
// AMX kernel (benchmarks/README.md, "On an AMX Xeon").
//
// Pyggml-Dkv-Capability: mm-amx-q8_0

#include "mm-vnni.h"

#include "amx-tiles.h"

namespace ggml::cpu::dkv {

#if defined(PYGGML_DKV_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)

// prefetch distance in blocks: the weights of a group are read once per 16 rows, from L2 after the
// first pass; the first pass streams them from memory
constexpr int AMX_PF_BLOCKS = 4;

constexpr size_t AMX_BLOCK_BYTES = VNNI_ROWS * sizeof(block_q8_0);  // 512 codes + 16 f16 scales

// the block's weights (B_, 8 rows of 64 bytes) times the 16 rows' codes (A_) into C_: a macro, as
// GCC's tile intrinsics paste the tile number into their assembly
#define AMX_Q8_0_PRODUCT(B_, A_, C_, blk) \
    _tile_loadd(B_, blk, 64);             \
    _tile_zero(C_);                       \
    _tile_dpbsud(C_, A_, B_)

static inline __attribute__((always_inline)) void amx_prefetch(const uint8_t * blk) {
    for (size_t l = 0; l < AMX_BLOCK_BYTES; l += 64) {
        _mm_prefetch((const char *) blk + AMX_PF_BLOCKS * AMX_BLOCK_BYTES + l, _MM_HINT_T0);
    }
}

// block pb's int32 sums of 16 rows x one group (s: 16 x 16, row-major) times its scales, added to
// the rows' f32 sums: the VNNI tile's operations (i0: row r0's index in x for block pb)
static inline __attribute__((always_inline)) void amx_scale(const int32_t * s, const uint8_t * blk, const q8v_rows & x,
                                                            int64_t i0, __m512 * acc) {
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (blk + 512)));
    for (int m = 0; m < 16; m++) {
        const __m512i sum = _mm512_add_epi32(_mm512_load_si512((const void *) (s + 16 * m)), _mm512_set1_epi32(x.c[i0 + m]));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, _mm512_set1_ps(x.d[i0 + m])), acc[m]);
    }
}

// The tile instructions run in order, and a product's sums take ~50 cycles to come out: storing them
// right after the product left every block waiting for that (at 16 rows as slow as the VNNI tile).
// So block b's products are issued, then block b - 1's sums stored, then block b - 2's scaled.
// Blocks alternate tiles by parity: B in TMM0 / TMM1, A in TMM2 / TMM3, C in TMM4 / TMM5. (Two
// weight groups per A tile were slower: their 32 f32 sums take every zmm register, and spill.)
static void amx_q8_0_tile16(const uint8_t * GGML_RESTRICT wg, const q8v_rows & x, int64_t r0, float * const * y) {
    const int64_t nb = x.nb, first = x.first(r0);
    alignas(64) int32_t sums[2][16 * 16];
    __m512 acc[16];
    for (int m = 0; m < 16; m++) {
        acc[m] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nb + 2; b++) {
        if (b < nb) {
            const uint8_t * blk = wg + b * AMX_BLOCK_BYTES;
            amx_prefetch(blk);
            const int8_t * a = x.q + (b * x.step + first) * QK8_0;
            if (b & 1) {
                _tile_loadd(3, a, QK8_0);
                AMX_Q8_0_PRODUCT(1, 3, 5, blk);
            } else {
                _tile_loadd(2, a, QK8_0);
                AMX_Q8_0_PRODUCT(0, 2, 4, blk);
            }
        }
        if (b >= 1 && b <= nb) {
            if ((b - 1) & 1) {
                _tile_stored(5, sums[1], 64);
            } else {
                _tile_stored(4, sums[0], 64);
            }
        }
        if (b >= 2) {
            const int64_t pb = b - 2;
            amx_scale(sums[pb & 1], wg + pb * AMX_BLOCK_BYTES, x, pb * x.step + first, acc);
        }
    }
    for (int m = 0; m < 16; m++) {
        _mm512_storeu_ps(y[m], acc[m]);
    }
}

#undef AMX_Q8_0_PRODUCT

q8v_wide_tile amx_q8_0_tile_on_this_thread() {
    if (!amx_usable()) {
        return nullptr;
    }
    amx_load_ggml_matmul_config();
    return amx_q8_0_tile16;
}

#elif defined(PYGGML_DKV_VNNI)

q8v_wide_tile amx_q8_0_tile_on_this_thread() {
    return nullptr;
}

#endif

}  // namespace ggml::cpu::dkv
