// AMX tile helpers our kernels share (from pyggml_dkv's patch 0031 to ggml 0.10.1): whether this
// process may use the tiles, PYGGML_DKV_NO_AMX, loading a tile configuration, and putting back
// the one ggml's AMX matmuls use.
//
// Why the last: ggml's AMX matmuls (amx/mmq.cpp, ggml_tile_config_init) in another ggml of the
// process (llama.cpp's, beside pyggml_dkv) load their configuration once per thread and trust it
// from then on; both ggmls run on the same OpenMP threads, and llama.cpp's next batched decode after
// our AMX kernels returned NaN logits on an Emerald Rapids (old patch 0028). So every kernel of ours
// that loads its own configuration loads ggml's back when it is done with the tiles.
//
// Plain inline assembly and a run-time answer from Linux, as pyggml_dkv/_cffi/amx_tiles.c (the
// host's copy, which must not depend on how this ggml was compiled).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && defined(__linux__)
#    include <sys/syscall.h>
#    include <unistd.h>
#endif

namespace ggml::cpu::dkv {

// Linux hands out the tile state on request (ggml's AMX buffer asks too); a CPU without AMX gets an
// error. The answer cannot change within a process.
inline bool amx_permitted() {
#if defined(__x86_64__) && defined(__linux__)
    static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    return permitted;
#else
    return false;
#endif
}

// PYGGML_DKV_NO_AMX=1: the paths of CPUs without AMX (capabilities.no_amx_requested reads it too)
inline bool amx_vetoed() {
    static const bool vetoed = [] {
        const char * e = getenv("PYGGML_DKV_NO_AMX");
        return e != nullptr && e[0] != '\0' && strcmp(e, "0") != 0;
    }();
    return vetoed;
}

// our kernels may run on AMX tiles in this process
inline bool amx_usable() {
    return amx_permitted() && !amx_vetoed();
}

// palette 1 with these rows / bytes per row for tiles 0-7, on the calling thread
inline void amx_load_config(const uint8_t rows[8], const uint16_t colsb[8]) {
#if defined(__x86_64__)
    alignas(64) uint8_t cfg[64];
    memset(cfg, 0, sizeof(cfg));
    cfg[0] = 1;  // palette
    for (int t = 0; t < 8; t++) {
        memcpy(cfg + 16 + 2*t, &colsb[t], 2);  // little-endian u16
        cfg[48 + t] = rows[t];
    }
    // an "m" operand of the whole 64 bytes, so the stores above cannot be dropped (GCC 12 dropped
    // them before _tile_loadconfig, which declares an 8-byte read)
    __asm__ __volatile__("ldtilecfg %0" : : "m"(*(const uint8_t (*)[64]) cfg) : "memory");
#else
    (void) rows;
    (void) colsb;
#endif
}

// ggml_tile_config_init's configuration as of ggml 0.25.3 (tiles 0-1: B, 8 rows x 64 bytes; 2-3: A,
// 16 x 32; 4-7: C, 16 x 64)
inline void amx_load_ggml_matmul_config() {
    static const uint8_t  rows[8]  = {8, 8, 16, 16, 16, 16, 16, 16};
    static const uint16_t colsb[8] = {64, 64, 32, 32, 64, 64, 64, 64};
    amx_load_config(rows, colsb);
}

}  // namespace ggml::cpu::dkv
