// q5_K weights times f32 rows on AVX512-VNNI (vpdpbusd), for weights in our CPU_DKV_REPACK buffer
// (repack.cpp; the layout kmv<5> in mm-vnni-kquant.h). From pyggml_dkv's patches to ggml 0.10.1:
// 0021 (layout, tile), 0023, 0032 (tiles of 16 rows), 0037 (codes as nibbles and a fifth-bit
// plane). ggml 0.25.3 has no x86 repacked layout for q5_K (its CPU_REPACK takes none here).
//
// Figure: against ggml 0.25.3's own q5_K path (CPU buffer: its tiled/ kernel from 8 rows; no x86
// CPU_REPACK layout), as for q8_0 (mm-vnni-q8_0.cpp: same machine, load and benchmark), 2 threads.
// Microseconds a product, ours / ggml's:
//   3072 x 1024 x 16 columns  364 /  794 (0.46)    1024 x 3072 x 16  249 /  519 (0.48)
//   1024 x 1024 x 16          147 /  249 (0.59)    3072 x 1024 x 34  538 /  914 (0.59)
//   8192 x 1024 x  9          461 / 1239 (0.37)    115-202 G multiply-adds/s
//
// Pyggml-Dkv-Capability: vnni-q5_k

#include "mm-vnni-kquant.h"

namespace ggml::cpu::dkv {

#ifdef PYGGML_DKV_VNNI

static const repack_layout layout = k_vnni<kmv<5>>::layout("q5_K VNNI");

const repack_layout * vnni_q5_k_layout() {
    return &layout;
}

#else

const repack_layout * vnni_q5_k_layout() {
    return nullptr;
}

#endif

}  // namespace ggml::cpu::dkv
