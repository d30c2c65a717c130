// The tiled flash attention's two bf16 products (flash-attn.h, fa_bf16_products) on AMX-BF16 tiles,
// for GGML_PREC_BF16 (attention="bf16") on Xeons since Sapphire Rapids. From pyggml_dkv's patches to
// ggml 0.10.1: 0009 (the products on tiles) and 0028 (ggml's matmul tile configuration put back
// when attention is done with the tiles). Q, K and V are packed as for vdpbf16ps
// (flash-attn-bf16.cpp, whose packing this table shares); the softmax weights go query-major, as
// an A tile wants them.
//
// Why: vdpbf16ps runs at half an f32 FMA's multiply-adds on Intel's cores; one tile product
// multiplies 16 x 32 by 32 x 16 bf16 values.
//
// Ported from the 0.10.1 build. On a model-167 Xeon (family 6, model 167) the small drafter's q8_0
// step with attention="bf16" takes 5.55 / 6.88 / 10.11 ms at window 64 / 1024 / 4096 (0.99-1.02 of
// the 0.10.1 build's; f32 attention: 5.78 / 7.73 / 13.01; benchmarks/README.md). tests/ggml/test_ops.py's bf16 tests and tests/ggml/test_amx.py check it
// where the CPU has AMX.
//
// Pyggml-Dkv-Capability: fa-bf16-amx

#include "amx-tiles.h"
#include "flash-attn.h"

#include "common.h"

#include <algorithm>

namespace ggml::cpu::dkv {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)

static constexpr int KV_TILE_SZ = ggml_fa_tile_config::KV;  // the weights' row length (keys)

// all eight tiles 16 rows x 64 bytes, for the calling thread's products
static void begin() {
    static const uint8_t  rows[8]  = {16, 16, 16, 16, 16, 16, 16, 16};
    static const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    amx_load_config(rows, colsb);
}

static void end() {
    amx_load_ggml_matmul_config();
}

// Up to four 16x16 f32 accumulator tiles TMM0-3 (n_acc of them) += A (TMM4, loaded once) x B_i
// (TMM5 / TMM6 alternating, so a load overlaps the previous product). Tile numbers are part of the
// instructions: one line per accumulator.
static inline void row_of_products(int n_acc, const void * a, int lda, const char * b, size_t b_step, int ldb) {
    _tile_loadd(4, a, lda);
    _tile_loadd(5, b, ldb);
    _tile_dpbf16ps(0, 4, 5);
    if (n_acc > 1) { _tile_loadd(6, b + 1*b_step, ldb); _tile_dpbf16ps(1, 4, 6); }
    if (n_acc > 2) { _tile_loadd(5, b + 2*b_step, ldb); _tile_dpbf16ps(2, 4, 5); }
    if (n_acc > 3) { _tile_loadd(6, b + 3*b_step, ldb); _tile_dpbf16ps(3, 4, 6); }
}

static inline void zero_acc(int n_acc) {
    _tile_zero(0);
    if (n_acc > 1) { _tile_zero(1); }
    if (n_acc > 2) { _tile_zero(2); }
    if (n_acc > 3) { _tile_zero(3); }
}

static inline void load_acc(int n_acc, const float * c, size_t c_step, int ldc) {
    _tile_loadd(0, c, ldc);
    if (n_acc > 1) { _tile_loadd(1, c + 1*c_step, ldc); }
    if (n_acc > 2) { _tile_loadd(2, c + 2*c_step, ldc); }
    if (n_acc > 3) { _tile_loadd(3, c + 3*c_step, ldc); }
}

static inline void store_acc(int n_acc, float * c, size_t c_step, int ldc) {
    _tile_stored(0, c, ldc);
    if (n_acc > 1) { _tile_stored(1, c + 1*c_step, ldc); }
    if (n_acc > 2) { _tile_stored(2, c + 2*c_step, ldc); }
    if (n_acc > 3) { _tile_stored(3, c + 3*c_step, ldc); }
}

// ST[k][q] = sum_d Kb[k][d] * Q[q][d] for k < n_keys (rounded up to 16; the rows past n_keys are
// never read): A = 16 keys x 32 dims of the bf16 K rows, B = 16 dimension pairs x 16 queries of QT2
static void scores(float * ST, int QN, const uint16_t * Kb, int DK, const uint32_t * QT2, int n_keys) {
    for (int k0 = 0; k0 < n_keys; k0 += 16) {
        for (int q0 = 0; q0 < QN; q0 += 64) {
            const int n_acc = std::min(4, (QN - q0) / 16);
            zero_acc(n_acc);
            for (int d0 = 0; d0 < DK; d0 += 32) {
                row_of_products(n_acc, Kb + (size_t) k0*DK + d0, DK*2,
                                (const char *) (QT2 + (size_t) (d0/2)*QN + q0), 16*sizeof(uint32_t), QN*4);
            }
            store_acc(n_acc, ST + (size_t) k0*QN + q0, 16, QN*4);
        }
    }
}

// Pq[q][k] = bf16(P[k][q]) for k < n_keys32 (zeros past the tile's keys): gathered down ST's columns
static void pack_weights(void * weights, const float * ST, int QN, int kv_tile, int n_keys32) {
    uint16_t * Pq = (uint16_t *) weights;
    const __m512i key_offs = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                _mm512_set1_epi32(QN));
    for (int k0 = 0; k0 < n_keys32; k0 += 16) {
        const __mmask16 in = kv_tile - k0 >= 16 ? (__mmask16) 0xFFFF
                           : kv_tile - k0 > 0   ? (__mmask16) ((1u << (kv_tile - k0)) - 1)
                                                : (__mmask16) 0;
        for (int tq = 0; tq < QN; tq++) {
            const __m512 p = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), in, key_offs, ST + (size_t) k0*QN + tq, 4);
            _mm256_storeu_si256((__m256i *) (Pq + (size_t) tq*KV_TILE_SZ + k0), (__m256i) _mm512_cvtneps_pbh(p));
        }
    }
}

// O[q][v] += sum_k Pq[q][k] * V[k][v] for q < n_q, k < n_keys32 (a multiple of 32): A = 16 queries x
// 32 keys of the bf16 weights, B = 16 key pairs x 16 columns of V2
static void values(float * O, int DV, const void * weights, int QN, const uint32_t * V2, int n_q, int n_keys32) {
    GGML_UNUSED(QN);
    const uint16_t * Pq = (const uint16_t *) weights;
    for (int q0 = 0; q0 < n_q; q0 += 16) {
        for (int v0 = 0; v0 < DV; v0 += 64) {
            const int n_acc = std::min(4, (DV - v0) / 16);
            load_acc(n_acc, O + (size_t) q0*DV + v0, 16, DV*4);
            for (int k0 = 0; k0 < n_keys32; k0 += 32) {
                row_of_products(n_acc, Pq + (size_t) q0*KV_TILE_SZ + k0, KV_TILE_SZ*2,
                                (const char *) (V2 + (size_t) (k0/2)*DV + v0), 16*sizeof(uint32_t), DV*4);
            }
            store_acc(n_acc, O + (size_t) q0*DV + v0, 16, DV*4);
        }
    }
}

const fa_bf16_products * fa_bf16_amx_products() {
    static const fa_bf16_products * table = []() -> const fa_bf16_products * {
        const fa_bf16_products * packing = fa_bf16_avx512_products();
        if (packing == nullptr || !amx_usable()) {
            return nullptr;
        }
        static fa_bf16_products amx = *packing;  // its packing of Q, K and V
        amx.begin        = begin;
        amx.end          = end;
        amx.scores       = scores;
        amx.pack_weights = pack_weights;
        amx.values       = values;
        return &amx;
    }();
    return table;
}

#else

const fa_bf16_products * fa_bf16_amx_products() {
    return nullptr;
}

#endif

}  // namespace ggml::cpu::dkv
