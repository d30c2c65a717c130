/* The AMX tile configuration ggml's AMX matmuls use, loaded on the calling thread.

   ggml's AMX matmuls (ggml-cpu/amx/mmq.cpp, ggml_tile_config_init) load this configuration once per
   thread and trust it from then on. In a host process llama.cpp's ggml runs them on the thread that
   calls llama_decode, which other code may have left with other tiles: oneDNN (PyTorch's bf16 matmuls)
   releases them after its kernels, and llama.cpp's next tile instruction then dies of SIGILL. A host
   calls this before handing the thread to llama.cpp (hosts/llama_cpp/target.py). Our own ggml reloads
   its tiles before each use (vendor/patches/0002, 0009) and puts this configuration back (0028, 0029)
   with the same function of our patched ggml-cpu (vendor/patches/0031), which this wraps. */

#include <stdbool.h>

#include "custom_ops.h"

/* ggml-cpu-impl.h (not on this module's include path: it needs ggml-cpu's internal headers) */
bool ggml_cpu_amx_load_matmul_config(void);

int pyggml_dkv_load_ggml_matmul_tiles(void) {
    return ggml_cpu_amx_load_matmul_config() ? 1 : 0;
}
