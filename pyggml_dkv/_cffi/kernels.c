/* The extension's one capability query: which of our fixes to ggml's own code and of our kernels
   this build carries (docs/ggml-port-plan.md, step 3). Decided at compile time from the macros
   build_ggml.sh writes into _libs/include/pyggml_dkv_build.h, one per applied patch (from the
   "Pyggml-Dkv-Capability:" line of its header) and, later, one per kernel file. Python asks this
   (pyggml_dkv.ggml.built_capabilities) and never looks at patch files.

   Also the build stamp the import-time check compares (pyggml_dkv/_cffi/stamp.py): the ggml
   version, variant and build id the extension was compiled against. ggml_commit() of the ggml
   that actually answers the extension's calls must return the same build id. */

#include "custom_ops.h"
#include "pyggml_dkv_build.h"

#if defined(PYGGML_DKV_HAS_RPC_ERRORS) && defined(PYGGML_DKV_WITH_RPC)
#include "ggml-rpc.h"
#ifndef GGML_RPC_FAILURES_ARE_ERRORS
#error "the build says it carries rpc-errors, but ggml-rpc.h does not declare it"
#endif
#endif

/* each name preceded by a comma; the query skips the first */
static const char kernels[] = ""
#ifdef PYGGML_DKV_HAS_FA_MASKED_KEYS
    ",fa-masked-keys"   /* P5: masked non-finite K/V stay out of ggml's tiled flash attention */
#endif
#if defined(PYGGML_DKV_HAS_RPC_ERRORS) && defined(PYGGML_DKV_WITH_RPC)
    ",rpc-errors"       /* P3: RPC failures are errors, timeouts, the server's device-type command */
#endif
#ifdef PYGGML_DKV_HAS_GRAPH_UID
    ",graph-uid"        /* ggml_graph_renew_uid: a graph built once is recomputed by its uid (RPC) */
#endif
#ifdef PYGGML_DKV_HAS_BARRIER_FUTEX
    ",barrier-futex"    /* P2: ggml's node barrier spins, then sleeps on a futex (OpenMP on Linux) */
#endif
#ifdef PYGGML_DKV_HAS_FA_BF16
    ",fa-bf16"          /* ggml's CPU flash attention takes GGML_PREC_BF16 (computes it in f32) */
#endif
#ifdef PYGGML_DKV_HAS_AMX_TILE_CONFIG
    ",amx-tile-config"  /* P4: ggml's AMX matmuls keep their tile config (GCC 12), batched products */
#endif
#ifdef PYGGML_DKV_HAS_ARGMAX_ROWS
    ",argmax-rows"      /* P8: ggml's argmax over the threads, 16 values at a time (AVX-512) */
#endif
#ifdef PYGGML_DKV_HAS_CPU_DKV_HOOK
    ",cpu-dkv-hook"     /* P1: ggml-cpu compiles our kernel files behind their extra buffer type */
#endif
#if defined(PYGGML_DKV_HAS_DKV_BUFFER) && defined(PYGGML_DKV_HAS_CPU_DKV_HOOK)
    ",dkv-buffer"       /* kernels/buffer.cpp: the CPU_DKV extra buffer type */
#endif
/* the narrow products of f16 / bf16 weights in CPU_DKV buffers (kernels/mm-narrow.h) */
#if defined(PYGGML_DKV_HAS_MM_F16_NARROW) && defined(PYGGML_DKV_HAS_DKV_BUFFER)
    ",mm-f16-narrow"    /* mm-f16-narrow.cpp: f16 x <= 64 f32 columns on AVX-512 FMAs */
#endif
#if defined(PYGGML_DKV_HAS_MM_BF16_FMA) && defined(PYGGML_DKV_HAS_DKV_BUFFER)
    ",mm-bf16-fma"      /* mm-bf16-fma.cpp: bf16 x <= 64 f32 columns on AVX-512 FMAs */
#endif
#if defined(PYGGML_DKV_HAS_MM_BF16_DPBF16) && defined(PYGGML_DKV_HAS_DKV_BUFFER)
    ",mm-bf16-dpbf16"   /* mm-bf16-dpbf16.cpp: bf16 x <= 64 columns rounded to bf16, vdpbf16ps */
#endif
#if defined(PYGGML_DKV_HAS_MM_BF16_AMX) && defined(PYGGML_DKV_HAS_DKV_BUFFER)
    ",mm-bf16-amx"      /* mm-bf16-amx.cpp: bf16 x <= 64 columns rounded to bf16, AMX-BF16 tiles */
#endif
#if defined(PYGGML_DKV_HAS_MM_HALF_AVX2) && defined(PYGGML_DKV_HAS_DKV_BUFFER)
    ",mm-half-avx2"     /* mm-half-avx2.cpp: f16 / bf16 x <= 64 f32 columns on AVX2 FMAs */
#endif
#if defined(PYGGML_DKV_HAS_DKV_REPACK_BUFFER) && defined(PYGGML_DKV_HAS_CPU_DKV_HOOK)
    ",dkv-repack-buffer" /* kernels/repack.cpp: the CPU_DKV_REPACK extra buffer type */
#endif
/* the int8 products of weights repacked in CPU_DKV_REPACK buffers (kernels/mm-vnni.h) */
#if defined(PYGGML_DKV_HAS_VNNI_Q8_0) && defined(PYGGML_DKV_HAS_DKV_REPACK_BUFFER)
    ",vnni-q8_0"        /* mm-vnni-q8_0.cpp: q8_0 in 16-row groups, vpdpbusd (AVX512-VNNI) */
#endif
#if defined(PYGGML_DKV_HAS_MM_AMX_Q8_0) && defined(PYGGML_DKV_HAS_DKV_REPACK_BUFFER)
    ",mm-amx-q8_0"      /* mm-amx-q8_0.cpp: wide q8_0 products of the VNNI layout on AMX-INT8 tiles */
#endif
#if defined(PYGGML_DKV_HAS_VNNI_Q4_0) && defined(PYGGML_DKV_HAS_DKV_REPACK_BUFFER)
    ",vnni-q4_0"        /* mm-vnni-q4_0.cpp: q4_0 in 16-row groups, vpdpbusd (AVX512-VNNI) */
#endif
#if defined(PYGGML_DKV_HAS_VNNI_Q6_K) && defined(PYGGML_DKV_HAS_DKV_REPACK_BUFFER)
    ",vnni-q6_k"        /* mm-vnni-q6_k.cpp: q6_K in 16-row groups, codes one per byte */
#endif
#if defined(PYGGML_DKV_HAS_VNNI_Q4_K) && defined(PYGGML_DKV_HAS_DKV_REPACK_BUFFER)
    ",vnni-q4_k"        /* mm-vnni-q4_k.cpp: q4_K in 16-row groups, scales by vpdpwssd */
#endif
#if defined(PYGGML_DKV_HAS_VNNI_Q5_K) && defined(PYGGML_DKV_HAS_DKV_REPACK_BUFFER)
    ",vnni-q5_k"        /* mm-vnni-q5_k.cpp: q5_K in 16-row groups, nibbles and a fifth-bit plane */
#endif
/* flash attention over K/V caches in CPU_DKV buffers (kernels/flash-attn.h) */
#if defined(PYGGML_DKV_HAS_FA_TILED) && defined(PYGGML_DKV_HAS_DKV_BUFFER)
    ",fa-tiled"         /* flash-attn-tiled.cpp: f32 64 x 64 tiles from 8 query rows (AVX-512) */
#endif
#if defined(PYGGML_DKV_HAS_FA_BF16_AVX512) && defined(PYGGML_DKV_HAS_FA_TILED) && defined(PYGGML_DKV_HAS_DKV_BUFFER)
    ",fa-bf16-avx512"   /* flash-attn-bf16.cpp: the tiled kernel's products with bf16 inputs, vdpbf16ps */
#endif
#if defined(PYGGML_DKV_HAS_FA_BF16_AMX) && defined(PYGGML_DKV_HAS_FA_BF16_AVX512) && defined(PYGGML_DKV_HAS_FA_TILED)
    ",fa-bf16-amx"      /* flash-attn-bf16-amx.cpp: the same products on AMX-BF16 tiles */
#endif
    ;

#if defined(PYGGML_DKV_HAS_DKV_BUFFER) && defined(PYGGML_DKV_HAS_CPU_DKV_HOOK)
/* kernels/dkv.h (inside ggml-cpu; not installed) */
ggml_backend_dev_t ggml_backend_cpu_dkv_device(void);
#endif

ggml_backend_dev_t pyggml_dkv_cpu_dkv_device(void) {
#if defined(PYGGML_DKV_HAS_DKV_BUFFER) && defined(PYGGML_DKV_HAS_CPU_DKV_HOOK)
    return ggml_backend_cpu_dkv_device();
#else
    return NULL;
#endif
}

const char * pyggml_dkv_kernels(void) {
    return kernels[0] ? kernels + 1 : kernels;
}

const char * pyggml_dkv_build_capabilities(void) {
    return PYGGML_DKV_BUILD_CAPABILITIES;
}

const char * pyggml_dkv_built_ggml_version(void) {
    return PYGGML_DKV_GGML_VERSION;
}

const char * pyggml_dkv_built_variant(void) {
    return PYGGML_DKV_GGML_VARIANT;
}

const char * pyggml_dkv_built_ggml_build_id(void) {
    return PYGGML_DKV_GGML_BUILD_ID;
}
