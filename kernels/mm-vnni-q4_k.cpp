// q4_K weights times f32 rows on AVX512-VNNI (vpdpbusd), for weights in our CPU_DKV_REPACK buffer
// (repack.cpp; the layout kmv<4> in mm-vnni-kquant.h). From pyggml_dkv's patches to ggml 0.10.1:
// 0021 (layout, tile), 0023, 0033 (pair tiles, runs of 8 rows), 0038 (sub-block scales by
// vpdpwssd). ggml 0.25.3's CPU_REPACK has an AVX2 8x8 layout for q4_K (llama.cpp's); this one takes
// matrices of whole 16-row groups where the CPU has AVX512-VNNI.
//
// Figure: against ggml 0.25.3's own q4_K path (CPU buffer: its tiled/ kernel from 8 rows) and its
// CPU_REPACK (AVX2 8x8), as for q8_0 (mm-vnni-q8_0.cpp: same machine, load and benchmark), 2
// threads. Microseconds a product, ours / ggml's plain / ggml's CPU_REPACK:
//   3072 x 1024 x 16 columns  279 /  509 /  532    1024 x 3072 x 16  352 /  630 /  580
//   1024 x 1024 x 16          143 /  230 /  212    3072 x 1024 x 34  660 / 1058 / 1211
//   8192 x 1024 x  9          543 / 1411 / 1309   (0.41-0.67 of CPU_REPACK's time; 118-181 G/s)
//
// Pyggml-Dkv-Capability: vnni-q4_k

#include "mm-vnni-kquant.h"

namespace ggml::cpu::dkv {

#ifdef PYGGML_DKV_VNNI

static const repack_layout layout = k_vnni<kmv<4>>::layout("q4_K VNNI");

const repack_layout * vnni_q4_k_layout() {
    return &layout;
}

#else

const repack_layout * vnni_q4_k_layout() {
    return nullptr;
}

#endif

}  // namespace ggml::cpu::dkv
