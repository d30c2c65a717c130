"""A small Pythonic layer over ggml. It knows nothing of DFlash.

It reads like ggml's `examples/simple/simple-backend.cpp`:

    backend = Backend("cpu")                      # 1. backend
    ctx = Context(n_tensors=8)                    # 2. metadata-only context (no_alloc)
    a = ctx.new_tensor("f32", 4, 2)               #    ggml order: ne0=4 columns, ne1=2 rows
    buf = Buffer.alloc_ctx_tensors(ctx, backend)  # 3. one backend buffer for its tensors
    a.set(np.ones((2, 4), np.float32))            #    numpy order: (rows, columns)
    gctx = Context(n_tensors=64, graph_size=64)
    graph = Graph(gctx, size=64)                  # 4. graph in its own context
    graph.expand(gctx.scale(a, 2.0))
    galloc = Gallocr(backend); galloc.alloc_graph(graph)
    graph.compute(backend)                        # 5. compute, then read outputs with .numpy()

One module per object: `backend`, `context` (+ `ops`, the ops as Context methods), `tensor`,
`buffer`, `gallocr`, `graph`; `writer` and `delta` (per-step uploads of persistent inputs: checked
once, or only the changed bytes); `types` (type names, quantization), `capabilities` (what the build
and machine offer), `owned` / `liveness` (handle and buffer lifetimes), `_lowlevel` (the raw
cffi `ffi` / `lib`). Owning objects free their ggml handle exactly once: `close()`, a `with`
block, or the garbage collector. Every call that ggml would answer with an abort is checked
first and raises a Python exception instead.
"""

from __future__ import annotations

from ._lowlevel import ffi, lib
from .backend import Backend
from .buffer import Buffer
from .capabilities import (
    AMX_KERNEL,
    AMX_TYPES,
    BF16_ATTENTION_AVX512_KERNEL,
    BF16_ATTENTION_KERNEL,
    DKV_BUFFER_TYPE,
    FA_MASKED_KEYS_FIX,
    FA_TILED_KERNEL,
    GRAPH_UID_FIX,
    RPC_ERRORS_FIX,
    VNNI_KERNEL,
    GGML_PREC_BF16,
    GGML_REPACK_TYPES,
    REPACKING_BUFFER_TYPES,
    BackendInfo,
    amx_available,
    amx_fits,
    available_backends,
    bf16_attention_kernel,
    bf16_matmul_kernel,
    bf16_products_on_fma,
    half_matmul_avx2,
    bf16_attention_supported,
    built_backends,
    built_capabilities,
    cpu_extra_buffer_types,
    cpu_features,
    cpu_repack_fits,
    cpu_repack_kernel,
    cuda_graph_stats,
    default_n_threads,
    dkv_buffer_available,
    f16_matmul_kernel,
    flash_attn_kernel,
    ggml_repack_fits,
    list_devices,
    version,
    vnni_available,
    vnni_fits,
    vnni_repack_fits,
)
from .context import Context
from .errors import BackendUnavailableError, GGMLError, RemoteBackendError
from .gallocr import Gallocr
from .graph import Graph
from .owned import live_objects
from .tensor import Tensor, host_array
from .types import MAX_DIMS, TYPE_NAMES, TYPES, dequantize, ggml_type, quantize

__all__ = [
    "AMX_KERNEL", "AMX_TYPES", "BF16_ATTENTION_KERNEL", "FA_MASKED_KEYS_FIX", "FA_TILED_KERNEL", "GRAPH_UID_FIX", "RPC_ERRORS_FIX", "GGML_PREC_BF16", "GGML_REPACK_TYPES", "MAX_DIMS", "REPACKING_BUFFER_TYPES",
    "TYPES", "TYPE_NAMES", "Backend", "BackendInfo", "BackendUnavailableError", "RemoteBackendError", "Buffer", "Context",
    "GGMLError", "Gallocr", "Graph", "Tensor", "amx_available", "amx_fits", "available_backends",
    "bf16_attention_kernel", "bf16_attention_supported", "bf16_matmul_kernel", "bf16_products_on_fma", "dkv_buffer_available", "f16_matmul_kernel", "flash_attn_kernel", "half_matmul_avx2", "built_backends", "cpu_features", "cpu_repack_fits", "cpu_repack_kernel", "ggml_repack_fits", "vnni_available", "vnni_fits", "vnni_repack_fits",
    "BF16_ATTENTION_AVX512_KERNEL", "DKV_BUFFER_TYPE", "VNNI_KERNEL", "built_capabilities", "cpu_extra_buffer_types",
    "cuda_graph_stats", "default_n_threads", "dequantize", "ffi", "ggml_type", "host_array", "lib", "list_devices",
    "live_objects", "quantize", "version",
]
