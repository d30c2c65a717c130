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

from .backend import Backend
from .buffer import Buffer
from .capabilities import BackendInfo, available_backends, list_devices, version
from .context import Context
from .errors import BackendUnavailableError, GGMLError, RemoteBackendError
from .gallocr import Gallocr
from .graph import Graph
from .owned import live_objects
from .tensor import Tensor
from .types import TYPES, dequantize, quantize

# The public names: the objects of the example above, their errors, what backends and devices this
# build and machine offer, and (de)quantization.
__all__ = [
    "Backend",
    "BackendInfo",
    "BackendUnavailableError",
    "Buffer",
    "Context",
    "GGMLError",
    "Gallocr",
    "Graph",
    "RemoteBackendError",
    "TYPES",
    "Tensor",
    "available_backends",
    "dequantize",
    "list_devices",
    "live_objects",
    "quantize",
    "version",
]

# Not public: the raw cffi objects and the build / CPU probes, importable from here only because
# modules outside this layer import them from the package today (drafter/, model/, serving/,
# tests/, benchmarks/). New code imports them from their defining modules: `_lowlevel` (ffi, lib),
# `capabilities` (the probes), `types`, `tensor`.
from ._lowlevel import ffi, lib  # noqa: E402,F401
from .capabilities import (  # noqa: E402,F401
    GGML_REPACK_TYPES,
    amx_available,
    amx_fits,
    bf16_attention_kernel,
    bf16_attention_supported,
    bf16_matmul_kernel,
    bf16_products_on_fma,
    built_backends,
    built_capabilities,
    cpu_extra_buffer_types,
    cpu_features,
    cpu_repack_fits,
    cpu_repack_kernel,
    cuda_graph_stats,
    ggml_repack_fits,
    half_matmul_avx2,
    vnni_available,
    vnni_repack_fits,
)
from .tensor import host_array  # noqa: E402,F401
from .types import TYPE_NAMES, ggml_type  # noqa: E402,F401
