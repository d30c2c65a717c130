/* The AMX tile configuration ggml's AMX matmuls use, loaded on the calling thread.

   ggml's AMX matmuls (ggml-cpu/amx/mmq.cpp, ggml_tile_config_init) load this configuration once per
   thread and trust it from then on. In a host process llama.cpp's ggml runs them on the thread that
   calls llama_decode, which other code may have left with other tiles: oneDNN (PyTorch's bf16 matmuls)
   releases them after its kernels, and llama.cpp's next tile instruction then dies of SIGILL. A host
   calls this before handing the thread to llama.cpp (hosts/llama_cpp/target.py). Our own ggml reloads
   its tiles before each use (vendor/patches/0002, 0009) and puts this configuration back (0028). */

#include <stdint.h>
#include <string.h>

#include "custom_ops.h"

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

static int amx_permitted(void) {
    static int state = -1; /* unknown; set once (the answer cannot change within a process) */
    if (state < 0) {
        unsigned a, b, c, d;
        /* AMX-TILE is CPUID.(EAX=7, ECX=0):EDX[24]; Linux then hands out the tile state on request */
        const int has_tiles = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 24));
        state = has_tiles && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    }
    return state;
}

int pyggml_dkv_load_ggml_matmul_tiles(void) {
    static const uint8_t rows[8]  = {8, 8, 16, 16, 16, 16, 16, 16};
    static const uint8_t colsb[8] = {64, 64, 32, 32, 64, 64, 64, 64};
    _Alignas(64) uint8_t cfg[64];
    if (!amx_permitted()) {
        return 0;
    }
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1; /* palette */
    for (int t = 0; t < 8; t++) {
        cfg[16 + 2*t] = colsb[t]; /* little-endian u16 */
        cfg[48 + t]   = rows[t];
    }
    __asm__ __volatile__("ldtilecfg %0" : : "m"(cfg) : "memory");
    return 1;
}
#else
int pyggml_dkv_load_ggml_matmul_tiles(void) {
    return 0;
}
#endif
