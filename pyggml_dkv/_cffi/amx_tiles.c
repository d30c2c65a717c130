/* The AMX tile configuration ggml's AMX matmuls use, loaded on the calling thread.

   ggml's AMX matmuls (ggml-cpu/amx/mmq.cpp, ggml_tile_config_init) load this configuration once per
   thread and trust it from then on. In a host process llama.cpp's ggml runs them on the thread that
   calls llama_decode, which other code may have left with other tiles: oneDNN (PyTorch's bf16 matmuls)
   releases them after its kernels, and llama.cpp's next tile instruction then dies of SIGILL. A host
   calls this before handing the thread to llama.cpp (hosts/llama_cpp/target.py).

   Self-contained (no function of a patched ggml-cpu): plain inline assembly and a run-time answer
   from Linux rather than the compiler's AMX flags, so the host can load llama.cpp's configuration
   whatever our ggml was built for. ggml_tile_config_init's values as of ggml 0.25.3 (tiles 0-1: B,
   8 rows x 64 bytes; 2-3: A, 16 x 32; 4-7: C, 16 x 64). */

#include <stdint.h>
#include <string.h>

#include "custom_ops.h"

#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>

static int amx_permitted(void) {
    static int state = -1;  /* the answer cannot change within a process */
    if (state < 0) {
        /* Linux hands out the tile state on request (ggml's AMX buffer asks too); a CPU without
           AMX gets an error */
        state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    }
    return state;
}

int pyggml_dkv_load_ggml_matmul_tiles(void) {
    static const uint8_t  rows[8]  = {8, 8, 16, 16, 16, 16, 16, 16};
    static const uint16_t colsb[8] = {64, 64, 32, 32, 64, 64, 64, 64};
    if (!amx_permitted()) {
        return 0;
    }
    _Alignas(64) uint8_t cfg[64];
    memset(cfg, 0, sizeof(cfg));
    cfg[0] = 1;  /* palette */
    for (int t = 0; t < 8; t++) {
        memcpy(cfg + 16 + 2*t, &colsb[t], 2);  /* little-endian u16 */
        cfg[48 + t] = rows[t];
    }
    /* an "m" operand of the whole 64 bytes, so the compiler keeps every store above (GCC 12 dropped
       them before _tile_loadconfig, which declares an 8-byte read) */
    __asm__ __volatile__("ldtilecfg %0" : : "m"(*(const uint8_t (*)[64]) cfg) : "memory");
    return 1;
}

int pyggml_dkv_amx_tile_data_in_use(void) {
    if (!amx_permitted()) {
        return 0;
    }
    /* XGETBV with ECX = 1 reads XINUSE: bit 18 (XTILEDATA) is set from a thread's first tile load
       or product until it releases the tiles (every AMX CPU supports this form) */
    uint32_t eax, edx;
    __asm__ __volatile__("xgetbv" : "=a"(eax), "=d"(edx) : "c"(1));
    (void) edx;
    return (int) ((eax >> 18) & 1);
}
#else
int pyggml_dkv_load_ggml_matmul_tiles(void) {
    return 0;
}

int pyggml_dkv_amx_tile_data_in_use(void) {
    return 0;
}
#endif
