"""A small Pythonic layer over ggml: Backend, Context, Tensor, Buffer, Gallocr, Graph.

It reads like ggml's `examples/simple/simple-backend.cpp`:

    backend = Backend("cpu")                    # 1. backend
    ctx = Context(n_tensors=8)                  # 2. metadata-only context (no_alloc)
    a = ctx.new_tensor("f32", 4, 2)             #    ggml order: ne0=4 columns, ne1=2 rows
    buf = Buffer.alloc_ctx_tensors(ctx, backend)  # 3. one backend buffer for its tensors
    a.set(np.ones((2, 4), np.float32))          #    numpy order: (rows, columns)
    gctx = Context(n_tensors=64, graph_size=64)
    graph = Graph(gctx, size=64)                # 4. graph in its own context
    graph.expand(gctx.scale(a, 2.0))
    galloc = Gallocr(backend); galloc.alloc_graph(graph)
    graph.compute(backend)                      # 5. compute, then read outputs with .numpy()

Owning objects free their ggml handle exactly once: `close()`, a `with` block, or the
garbage collector (weakref.finalize), whichever comes first. Every call that ggml would
answer with an abort is checked here first and raises a Python exception instead.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._lowlevel import ffi, lib
from .numeric import bf16_bits_to_fp32, fp32_to_bf16_bits
from .ops import OpsMixin

log = logging.getLogger(__name__)

MAX_DIMS = 4


class GGMLError(RuntimeError):
    """A ggml call failed (allocation, compute, closed object, ...)."""


class BackendUnavailableError(GGMLError):
    """The requested backend is not built into this ggml or has no device on this machine."""


# ----------------------------------------------------------------------------- types

TYPES: dict[str, int] = {
    "f32": lib.GGML_TYPE_F32,
    "f16": lib.GGML_TYPE_F16,
    "bf16": lib.GGML_TYPE_BF16,
    "q8_0": lib.GGML_TYPE_Q8_0,
    "q4_0": lib.GGML_TYPE_Q4_0,
    "i8": lib.GGML_TYPE_I8,
    "i16": lib.GGML_TYPE_I16,
    "i32": lib.GGML_TYPE_I32,
    "i64": lib.GGML_TYPE_I64,
    "f64": lib.GGML_TYPE_F64,
}
TYPE_NAMES = {v: k for k, v in TYPES.items()}
FLOAT_TYPES = {"f32", "f16", "bf16", "f64", "q8_0", "q4_0"}
INT_DTYPES = {"i8": np.int8, "i16": np.int16, "i32": np.int32, "i64": np.int64}


def ggml_type(name: str | int) -> int:
    """The ggml enum value of a type name like "f16" (or pass an enum value through)."""
    if isinstance(name, (int, np.integer)) and not isinstance(name, bool):
        if int(name) not in TYPE_NAMES:
            raise ValueError(f"unsupported ggml type id {name}; supported: {sorted(TYPES)}")
        return int(name)
    if isinstance(name, str) and name.lower() in TYPES:
        return TYPES[name.lower()]
    raise ValueError(f"unknown ggml type {name!r}; supported: {sorted(TYPES)}")


# ----------------------------------------------------------------------------- ownership


class _Owned:
    """An object owning one ggml handle, freed exactly once by close() or the finalizer."""

    _live: dict[str, int] = {}
    _live_lock = threading.Lock()

    def _own(self, handle: Any, free_fn: Any, kind: str) -> None:
        self._handle = handle
        self._kind = kind
        with _Owned._live_lock:
            _Owned._live[kind] = _Owned._live.get(kind, 0) + 1
        self._finalizer = weakref.finalize(self, _Owned._free, free_fn, handle, kind)
        # Not at interpreter exit: a daemon thread may still be stepping a cache (its compute runs
        # without the GIL), and freeing its buffers under it segfaults the exit. The OS reclaims
        # everything anyway; close() and garbage collection before exit still free as usual.
        self._finalizer.atexit = False

    @staticmethod
    def _free(free_fn: Any, handle: Any, kind: str) -> None:
        free_fn(handle)
        with _Owned._live_lock:
            _Owned._live[kind] -= 1

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Free the ggml handle now. Idempotent."""
        self._finalizer()

    def _check_open(self) -> None:
        if self.closed:
            raise GGMLError(f"{type(self).__name__} is closed")

    def __enter__(self):  # type: ignore[no-untyped-def]
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def live_objects() -> dict[str, int]:
    """How many ggml handles of each kind (backend, buffer, context, gallocr) are alive now."""
    with _Owned._live_lock:
        return dict(_Owned._live)


# ----------------------------------------------------------------------------- backends


@dataclass(frozen=True)
class BackendInfo:
    name: str  # what Backend() accepts: "cpu", "cuda:0", "rpc"
    available: bool
    description: str
    reason: str | None = None  # why it is unavailable

    def __repr__(self) -> str:
        state = "available" if self.available else f"unavailable: {self.reason}"
        return f"<{self.name}: {self.description} ({state})>"


def built_backends() -> list[str]:
    """Backends compiled into this ggml build."""
    names = ["cpu"]
    if hasattr(lib, "ggml_backend_cuda_init"):
        names.append("cuda")
    if hasattr(lib, "ggml_backend_rpc_init"):
        names.append("rpc")
    return names


def _cuda_device_count() -> int:
    return int(lib.ggml_backend_cuda_get_device_count()) if hasattr(lib, "ggml_backend_cuda_init") else 0


def cuda_graph_stats(reset: bool = False) -> dict[str, int]:
    """What ggml's CUDA backend reported about CUDA graphs since the last reset: warm-ups completed
    (a graph was captured: later identical computes replay it silently), warm-up resets (the graph
    changed between computes), failed updates, graphs disabled, and "reused" (scheduler graphs with
    a uid only). All zero on other backends, or with GGML_CUDA_DISABLE_GRAPHS=1."""
    from . import _lowlevel

    stats = dict(_lowlevel.cuda_graph_events)
    if reset:
        for key in _lowlevel.cuda_graph_events:
            _lowlevel.cuda_graph_events[key] = 0
    return stats


def available_backends() -> list[BackendInfo]:
    """What this build and this machine can run. CPU always; CUDA and RPC with the reason when not."""
    cpu_dev = lib.ggml_backend_dev_by_name(b"CPU")
    cpu_desc = ffi.string(lib.ggml_backend_dev_description(cpu_dev)).decode() if cpu_dev != ffi.NULL else "CPU"
    infos = [BackendInfo("cpu", True, cpu_desc)]
    if "cuda" not in built_backends():
        infos.append(BackendInfo("cuda", False, "CUDA", "this ggml build has no CUDA backend (rebuild: GGML_CUDA=1 ./build_ggml.sh)"))
    else:
        n = _cuda_device_count()
        if n == 0:
            infos.append(BackendInfo("cuda", False, "CUDA", "built with CUDA, but no CUDA device is visible (no GPU or no driver)"))
        for i in range(n):
            desc = ffi.new("char[256]")
            lib.ggml_backend_cuda_get_device_description(i, desc, 256)
            infos.append(BackendInfo(f"cuda:{i}", True, ffi.string(desc).decode()))
    if "rpc" in built_backends():
        infos.append(BackendInfo("rpc", True, "RPC client (Backend('rpc:HOST:PORT'))"))
    else:
        infos.append(BackendInfo("rpc", False, "RPC", "this ggml build has no RPC backend (rebuild: GGML_RPC=1 ./build_ggml.sh)"))
    return infos


def list_devices() -> list[dict[str, Any]]:
    """ggml's device registry: name, description, type and memory of every registered device."""
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ffi.new("size_t *"), ffi.new("size_t *")
        lib.ggml_backend_dev_memory(dev, free, total)
        out.append({
            "name": ffi.string(lib.ggml_backend_dev_name(dev)).decode(),
            "description": ffi.string(lib.ggml_backend_dev_description(dev)).decode(),
            "type": int(lib.ggml_backend_dev_type(dev)),
            "registry": ffi.string(lib.ggml_backend_reg_name(lib.ggml_backend_dev_backend_reg(dev))).decode(),
            "memory_free": int(free[0]),
            "memory_total": int(total[0]),
        })
    return out


def default_n_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


# The CPU backend's "extra" buffer types rewrite a weight matrix into the layout of a faster kernel
# as it is uploaded (AMX: int8 tiles for q8_0 / q4_0 on Xeons with AMX). Tensors stored there can
# only be written whole and used as the matrix of a matrix product: ggml cannot read them back.
REPACKING_BUFFER_TYPES = ("AMX", "CPU_REPACK")
# weight types with AMX kernels in ggml (amx/common.h: qtype_has_amx_kernels) that we can quantize
AMX_TYPES = ("q8_0", "q4_0")


def amx_fits(type_name: str, ne: tuple[int, ...]) -> bool:
    """Can ggml's AMX buffer hold this tensor for its kernels? It sizes and packs every tensor as one
    2-D matrix of whole 32 x 32 blocks (32-value input blocks, 32-column output blocks)."""
    ne4 = (tuple(ne) + (1, 1, 1, 1))[:4]
    return type_name in AMX_TYPES and ne4[0] % 32 == 0 and ne4[1] % 32 == 0 and ne4[2:] == (1, 1)


@functools.cache
def cpu_extra_buffer_types() -> dict[str, Any]:
    """Name -> buffer type of the extra buffer types this CPU offers (e.g. {"AMX": ..., "CPU_REPACK": ...})."""
    reg = lib.ggml_backend_cpu_reg()
    fn = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if fn == ffi.NULL:
        return {}
    bufts = ffi.cast("ggml_backend_dev_get_extra_bufts_t", fn)(lib.ggml_backend_reg_dev_get(reg, 0))
    found: dict[str, Any] = {}
    i = 0
    while bufts != ffi.NULL and bufts[i] != ffi.NULL:
        found[ffi.string(lib.ggml_backend_buft_name(bufts[i])).decode()] = bufts[i]
        i += 1
    return found


# ggml's AMX kernels are only safe with our patch (vendor/patches/0002: without it, a GCC 12 build
# dies with SIGILL at the first tile instruction); build_ggml.sh lists the patches it applied
AMX_PATCH = "0002-amx-kernels.patch"
_PATCHES_FILE = Path(__file__).resolve().parent / "_libs" / "patches"


@functools.cache
def built_with_patches() -> tuple[str, ...]:
    """The vendor/patches the ggml libraries were built with (none for a GGML_SRC build)."""
    try:
        return tuple(line.strip() for line in _PATCHES_FILE.read_text().splitlines() if line.strip())
    except OSError:
        return ()


# CPU flash attention with bf16 products on AMX tiles (vendor/patches/0009): ggml's precision
# GGML_PREC_BF16, a value only the patched ggml knows (an unpatched one aborts on it)
BF16_ATTENTION_PATCH = "0009-cpu-flash-attn-bf16-amx.patch"
GGML_PREC_BF16 = 16


def bf16_attention_supported() -> bool:
    """True when ggml was built with vendor/patches/0009, so attention may be asked for bf16
    products (it then runs them on AMX-BF16 tiles where the CPU has them, in f32 elsewhere)."""
    return BF16_ATTENTION_PATCH in built_with_patches()


# the same bf16 products with AVX512-BF16 dot products on CPUs without AMX-BF16 (vendor/patches/0011)
BF16_ATTENTION_AVX512_PATCH = "0011-cpu-flash-attn-bf16-avx512.patch"


def bf16_attention_kernel() -> str:
    """What attention="bf16" (GGML_PREC_BF16) runs its two products on here: "amx" (AMX-BF16
    tiles), "avx512_bf16" (vdpbf16ps, patch 0011) or "f32" (no bf16 products: the f32 kernel)."""
    if not bf16_attention_supported():
        return "f32"
    no_amx = os.environ.get("PYGGML_DKV_NO_AMX", "") not in ("", "0")  # patch 0011 honours it in ggml too
    try:
        if "amx_bf16" in Path("/proc/cpuinfo").read_text().split() and not no_amx:
            return "amx"
    except OSError:
        pass
    if BF16_ATTENTION_AVX512_PATCH in built_with_patches() and lib.ggml_cpu_has_avx512_bf16():
        return "avx512_bf16"
    return "f32"


def amx_available() -> bool:
    """True when ggml was built with (patched) AMX kernels and this CPU and kernel let us use them."""
    if os.environ.get("PYGGML_DKV_NO_AMX", "") not in ("", "0") or AMX_PATCH not in built_with_patches():
        return False
    return "AMX" in cpu_extra_buffer_types()


# q8_0 weights repacked for an AVX512-VNNI kernel in ggml's CPU_REPACK buffer (vendor/patches/0010):
# the fast q8_0 path of CPUs without AMX (AMD Zen 4/5, Intel Ice Lake .. Cascade Lake with VNNI).
# Its layout groups 16 output rows, so matrices need out % 16 == 0 and in % 32 == 0.
VNNI_PATCH = "0010-cpu-q8_0-avx512-vnni-repack.patch"


def vnni_fits(type_name: str, ne: tuple[int, ...]) -> bool:
    """Can the CPU_REPACK buffer hold this tensor for the VNNI q8_0 kernel (2-D q8_0, ne0 % 32, ne1 % 16)?"""
    ne4 = (tuple(ne) + (1, 1, 1, 1))[:4]
    return type_name == "q8_0" and ne4[0] % 32 == 0 and ne4[1] % 16 == 0 and ne4[2:] == (1, 1)


def vnni_available() -> bool:
    """True when ggml carries the VNNI q8_0 kernel (patch 0010) and was compiled for AVX512-VNNI."""
    return (VNNI_PATCH in built_with_patches() and bool(lib.ggml_cpu_has_avx512_vnni())
            and "CPU_REPACK" in cpu_extra_buffer_types())


def cpu_features() -> dict[str, bool]:
    """The SIMD features ggml's CPU backend was compiled for (GGML_NATIVE: those of the build machine),
    and whether AMX is usable now (amx_available: also honours PYGGML_DKV_NO_AMX)."""
    names = ("avx2", "fma", "f16c", "avx_vnni", "avx512", "avx512_vnni", "avx512_bf16", "amx_int8")
    found = {n: bool(getattr(lib, f"ggml_cpu_has_{n}")()) for n in names}
    found["amx_usable"] = amx_available()
    return found


class Backend(_Owned):
    """A ggml compute backend: "cpu", "cuda" / "cuda:N", or "rpc:HOST:PORT"."""

    def __init__(self, spec: str = "cpu", n_threads: int | None = None) -> None:
        if not isinstance(spec, str):
            raise TypeError(f"backend spec must be a string like 'cpu' or 'cuda:0', got {type(spec).__name__}")
        self.spec = spec.strip().lower()
        self.kind = self.spec.split(":", 1)[0]
        # graph computes on one backend are serialized: ggml backends are not re-entrant
        self.lock = threading.Lock()
        if self.kind == "cpu":
            if self.spec != "cpu":
                raise ValueError(f"CPU backend spec is just 'cpu', got {spec!r}")
            if n_threads is not None:
                Backend._check_n_threads(n_threads)  # before a handle exists to leak
            handle = lib.ggml_backend_cpu_init()
            if handle == ffi.NULL:
                raise GGMLError("ggml_backend_cpu_init failed")
            self._own(handle, lib.ggml_backend_free, "backend")
            self.set_n_threads(default_n_threads() if n_threads is None else n_threads)
        elif self.kind == "cuda":
            device = self._parse_index(spec)
            if "cuda" not in built_backends():
                raise BackendUnavailableError(
                    f"{spec!r}: this ggml build has no CUDA backend; rebuild with GGML_CUDA=1 ./build_ggml.sh and reinstall")
            n = _cuda_device_count()
            if n == 0:
                raise BackendUnavailableError(f"{spec!r}: ggml was built with CUDA but no CUDA device is visible (no GPU or no driver on this machine)")
            if device >= n:
                raise BackendUnavailableError(f"{spec!r}: CUDA device {device} does not exist ({n} visible)")
            handle = lib.ggml_backend_cuda_init(device)
            if handle == ffi.NULL:
                raise GGMLError(f"ggml_backend_cuda_init({device}) failed (see the pyggml_dkv.ggml log)")
            self._own(handle, lib.ggml_backend_free, "backend")
            self.n_threads = 0
        elif self.kind == "rpc":
            endpoint = spec.split(":", 1)[1] if ":" in spec else ""
            endpoint = endpoint.removeprefix("//")
            if "rpc" not in built_backends():
                raise BackendUnavailableError(f"{spec!r}: this ggml build has no RPC backend; rebuild with GGML_RPC=1 ./build_ggml.sh")
            if ":" not in endpoint:
                raise ValueError(f"RPC backend spec must be 'rpc:HOST:PORT', got {spec!r}")
            handle = lib.ggml_backend_rpc_init(endpoint.encode(), 0)
            if handle == ffi.NULL:
                raise BackendUnavailableError(f"could not connect to the RPC server at {endpoint}")
            self._own(handle, lib.ggml_backend_free, "backend")
            self.n_threads = 0
        else:
            raise ValueError(f"unknown backend {spec!r}; expected 'cpu', 'cuda', 'cuda:N' or 'rpc:HOST:PORT'")

    @staticmethod
    def _check_n_threads(n_threads: object) -> None:
        if isinstance(n_threads, bool) or not isinstance(n_threads, int) or not 1 <= n_threads <= 512:
            raise ValueError(f"n_threads must be an int in [1, 512], got {n_threads!r}")

    @staticmethod
    def _parse_index(spec: str) -> int:
        parts = spec.split(":")
        if len(parts) == 1:
            return 0
        if len(parts) == 2 and parts[1].isdigit():
            return int(parts[1])
        raise ValueError(f"bad device spec {spec!r}; expected 'cuda' or 'cuda:N'")

    @property
    def handle(self) -> Any:
        self._check_open()
        return self._handle

    @property
    def name(self) -> str:
        return ffi.string(lib.ggml_backend_name(self.handle)).decode()

    @property
    def is_cpu(self) -> bool:
        return self.kind == "cpu"

    def close(self) -> None:
        """Free the backend. Idempotent. A graph compute running on it in another thread finishes first."""
        with self.lock:
            super().close()

    def set_n_threads(self, n_threads: int) -> None:
        if not self.is_cpu:
            raise GGMLError(f"thread count applies to the CPU backend only, not {self.spec}")
        Backend._check_n_threads(n_threads)
        lib.ggml_backend_cpu_set_n_threads(self.handle, n_threads)
        self.n_threads = n_threads

    @property
    def buffer_type(self) -> Any:
        return lib.ggml_backend_get_default_buffer_type(self.handle)

    def synchronize(self) -> None:
        lib.ggml_backend_synchronize(self.handle)

    def compute(self, graph: "Graph") -> None:
        """Run a graph whose tensors are all allocated. The GIL is released meanwhile."""
        graph.compute(self)

    def supports(self, tensor: "Tensor") -> bool:
        return bool(lib.ggml_backend_supports_op(self.handle, tensor.ptr))

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.name
        return f"Backend({self.spec!r}, {state})"


# ----------------------------------------------------------------------------- context + tensors


class Context(OpsMixin, _Owned):
    """A ggml context: the metadata arena tensors and graphs are created in.

    `no_alloc=True` (the default) holds tensor headers only; their data lives in a backend
    Buffer or is assigned by a Gallocr. `arena` lets the caller own the memory (any writable
    buffer, e.g. a bytearray or numpy uint8 array), kept alive as long as the context.
    """

    def __init__(
        self,
        mem_size: int | None = None,
        *,
        n_tensors: int = 0,
        graph_size: int = 0,
        no_alloc: bool = True,
        arena: Any = None,
    ) -> None:
        if mem_size is None:
            if n_tensors < 0 or graph_size < 0:
                raise ValueError("n_tensors and graph_size must be >= 0")
            mem_size = n_tensors * lib.ggml_tensor_overhead()
            if graph_size:
                mem_size += lib.ggml_graph_overhead_custom(graph_size, False)
            mem_size = max(mem_size, 1024)
        if isinstance(mem_size, bool) or not isinstance(mem_size, int) or mem_size <= 0:
            raise ValueError(f"mem_size must be a positive int, got {mem_size!r}")
        self._arena = None
        mem_buffer = ffi.NULL
        if arena is not None:
            view = memoryview(arena)
            if view.readonly:
                raise ValueError("the context arena must be writable")
            if view.nbytes < mem_size:
                raise ValueError(f"arena has {view.nbytes} bytes, the context needs {mem_size}")
            self._arena = arena
            mem_buffer = ffi.from_buffer(arena, require_writable=True)
            if int(ffi.cast("uintptr_t", mem_buffer)) % 16:
                raise ValueError("the context arena must be 16-byte aligned (numpy arrays and bytearrays of this size usually are)")
        params = ffi.new("struct ggml_init_params *", {"mem_size": mem_size, "mem_buffer": mem_buffer, "no_alloc": bool(no_alloc)})
        handle = lib.ggml_init(params[0])
        if handle == ffi.NULL:
            raise GGMLError(f"ggml_init failed for a {mem_size}-byte context")
        self._own(handle, lib.ggml_free, "context")
        self.mem_size = int(lib.ggml_get_mem_size(handle))
        self.no_alloc = bool(no_alloc)
        self._src_ctxs: set[Context] = set()  # other contexts whose tensors this one's ops point at

    @property
    def handle(self) -> Any:
        self._check_open()
        return self._handle

    @property
    def used_mem(self) -> int:
        return int(lib.ggml_used_mem(self.handle))

    def _reserve(self, data_bytes: int | None = 0) -> None:
        """Raise instead of letting ggml abort when the next object does not fit (None: an op result of unknown size)."""
        if data_bytes is None:
            if not self.no_alloc:
                raise GGMLError("ops that make new data need a no_alloc Context (their results are placed by a Gallocr)")
            data_bytes = 0
        need = lib.ggml_tensor_overhead() + (0 if self.no_alloc else ((data_bytes + 15) // 16) * 16)
        if self.used_mem + need > self.mem_size:
            raise GGMLError(
                f"ggml context out of memory: {self.used_mem} of {self.mem_size} bytes used, next object needs {need}; "
                "create the Context with more n_tensors / mem_size")

    def _wrap(self, ptr: Any) -> "Tensor":
        if ptr == ffi.NULL:
            raise GGMLError("ggml returned no tensor")
        return Tensor(ptr, self)

    def new_tensor(self, type: str | int, *ne: int, name: str | None = None) -> "Tensor":
        """A new tensor with ggml dims `ne` (ne0 fastest), e.g. new_tensor("f32", hidden, tokens)."""
        t = ggml_type(type)
        if not 1 <= len(ne) <= MAX_DIMS:
            raise ValueError(f"a tensor has 1 to {MAX_DIMS} dims, got {len(ne)}")
        dims = []
        for d in ne:
            if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d <= 0:
                raise ValueError(f"tensor dims must be positive ints, got {ne}")
            dims.append(int(d))
        if dims[0] % lib.ggml_blck_size(t):
            raise ValueError(f"ne0={dims[0]} must be a multiple of the {TYPE_NAMES[t]} block size {lib.ggml_blck_size(t)}")
        total = int(np.prod(dims, dtype=np.float64))
        if total >= 2**62:
            raise ValueError(f"tensor of {dims} elements is too large")
        self._reserve(int(lib.ggml_row_size(t, dims[0])) * (total // dims[0]))
        dims4 = dims + [1] * (MAX_DIMS - len(dims))
        tensor = self._wrap(lib.ggml_new_tensor_4d(self.handle, t, *dims4))
        tensor._ndim = len(dims)
        if name is not None:
            tensor.name = name
        return tensor

    def tensors(self) -> Iterator["Tensor"]:
        """Every tensor in the context, in creation order."""
        ptr = lib.ggml_get_first_tensor(self.handle)
        while ptr != ffi.NULL:
            yield Tensor(ptr, self)
            ptr = lib.ggml_get_next_tensor(self.handle, ptr)

    def get_tensor(self, name: str) -> "Tensor":
        ptr = lib.ggml_get_tensor(self.handle, name.encode())
        if ptr == ffi.NULL:
            raise KeyError(f"no tensor named {name!r} in this context")
        return Tensor(ptr, self)


class Tensor:
    """A view of one ggml tensor. Keeps its Context alive; ggml order `ne`, numpy order `shape`."""

    __slots__ = ("ptr", "ctx", "_ndim", "__weakref__")

    def __init__(self, ptr: Any, ctx: Context) -> None:
        self.ptr = ptr
        self.ctx = ctx
        self._ndim = 0

    # -- metadata
    def _live_ptr(self) -> Any:
        if self.ctx.closed:
            raise GGMLError("tensor used after its Context was closed")
        return self.ptr

    @property
    def ne(self) -> tuple[int, int, int, int]:
        p = self._live_ptr()
        return (int(p.ne[0]), int(p.ne[1]), int(p.ne[2]), int(p.ne[3]))

    @property
    def nb(self) -> tuple[int, int, int, int]:
        p = self._live_ptr()
        return (int(p.nb[0]), int(p.nb[1]), int(p.nb[2]), int(p.nb[3]))

    @property
    def ndim(self) -> int:
        return max(self._ndim, int(lib.ggml_n_dims(self._live_ptr())))

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy-order shape: reversed ne over the tensor's dims (ne1 rows of ne0 values)."""
        return tuple(reversed(self.ne[: self.ndim]))

    @property
    def type(self) -> str:
        t = int(self._live_ptr().type)
        return TYPE_NAMES.get(t) or ffi.string(lib.ggml_type_name(t)).decode()

    @property
    def type_id(self) -> int:
        return int(self._live_ptr().type)

    @property
    def name(self) -> str:
        return ffi.string(lib.ggml_get_name(self._live_ptr())).decode()

    @name.setter
    def name(self, value: str) -> None:
        raw = value.encode()
        if len(raw) >= lib.GGML_MAX_NAME:
            raise ValueError(f"tensor name {value!r} is longer than {lib.GGML_MAX_NAME - 1} bytes")
        lib.ggml_set_name(self._live_ptr(), raw)

    @property
    def nbytes(self) -> int:
        return int(lib.ggml_nbytes(self._live_ptr()))

    @property
    def nelements(self) -> int:
        return int(lib.ggml_nelements(self._live_ptr()))

    @property
    def is_contiguous(self) -> bool:
        return bool(lib.ggml_is_contiguous(self._live_ptr()))

    @property
    def op(self) -> str:
        return ffi.string(lib.ggml_op_desc(self._live_ptr())).decode()

    @property
    def is_allocated(self) -> bool:
        p = self._live_ptr()
        return p.buffer != ffi.NULL and p.data != ffi.NULL

    @property
    def data_address(self) -> int:
        """Address of the tensor's data in its buffer (device address for GPU buffers)."""
        return int(ffi.cast("uintptr_t", self._live_ptr().data))

    def set_input(self) -> "Tensor":
        lib.ggml_set_input(self._live_ptr())
        return self

    def set_output(self) -> "Tensor":
        lib.ggml_set_output(self._live_ptr())
        return self

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tensor) and self.ptr == other.ptr

    def __hash__(self) -> int:
        return hash(int(ffi.cast("uintptr_t", self.ptr)))

    def __repr__(self) -> str:
        if self.ctx.closed:
            return "Tensor(<context closed>)"
        return f"Tensor({self.name!r}, {self.type}, ne={self.ne[: self.ndim]}, op={self.op})"

    # -- data
    def _check_io(self) -> None:
        p = self.ptr
        base = p.view_src if p.view_src != ffi.NULL else None
        if not self.is_allocated or (base is not None and (base.data == ffi.NULL or base.buffer == ffi.NULL)):
            raise GGMLError(f"tensor {self.name!r} has no data: allocate its context's tensors in a Buffer (or the graph "
                            "with a Gallocr) first; data is dropped when that Buffer / Gallocr is closed or reallocated")
        if _addr(p.buffer) not in _live_buffers:
            raise GGMLError(f"tensor {self.name!r} lives in a buffer that was closed")
        if not self.is_contiguous:
            raise GGMLError(f"tensor {self.name!r} is a non-contiguous view; copy it with ggml_cont first")

    @property
    def is_repacked(self) -> bool:
        """Stored in a repacking buffer (e.g. AMX): written whole with set(), never read back."""
        return _reads_repacked(self.ptr)

    def _check_partial_io(self, what: str) -> None:
        if self.is_repacked:
            raise GGMLError(f"cannot {what} tensor {self.name!r}: it is stored repacked for a CPU kernel "
                            "(AMX or CPU_REPACK buffer), so it can only be written whole with set(), never read back")

    def _to_bytes(self, array: Any) -> Any:
        """Convert `array` to this tensor's storage bytes, checking dtype and shape."""
        arr = np.asarray(array)
        if arr.shape != self.shape:
            raise ValueError(f"tensor {self.name!r} has numpy shape {self.shape}, got an array of shape {arr.shape}")
        kind = arr.dtype.kind
        ty = self.type
        if ty in FLOAT_TYPES:
            if kind != "f":
                raise TypeError(f"tensor {self.name!r} is {ty}: expected a floating-point array, got dtype {arr.dtype}")
        elif ty in INT_DTYPES:
            if kind not in "iu":
                raise TypeError(f"tensor {self.name!r} is {ty}: expected an integer array, got dtype {arr.dtype}")
            info = np.iinfo(INT_DTYPES[ty])
            if arr.size and (arr.min() < info.min or arr.max() > info.max):
                raise ValueError(f"values out of range for {ty} tensor {self.name!r}")
            return np.ascontiguousarray(arr, dtype=INT_DTYPES[ty])
        else:  # pragma: no cover - types we do not expose
            raise TypeError(f"cannot write numpy data into a {ty} tensor")
        if ty == "f32":
            return np.ascontiguousarray(arr, dtype=np.float32)
        if ty == "f64":
            return np.ascontiguousarray(arr, dtype=np.float64)
        if ty == "f16":
            return np.ascontiguousarray(arr, dtype=np.float16)
        if ty == "bf16":
            return fp32_to_bf16_bits(arr)
        return quantize(ty, np.ascontiguousarray(arr, dtype=np.float32))

    def set(self, array: Any) -> None:
        """Upload a numpy array of shape `self.shape` (converted to the tensor's type)."""
        self._check_io()
        if self.ptr.view_src != ffi.NULL:
            self._check_partial_io("write a view of")
        data = self._to_bytes(array)
        if data.nbytes != self.nbytes:  # pragma: no cover - guarded by the shape check
            raise GGMLError(f"size mismatch writing {self.name!r}: {data.nbytes} != {self.nbytes}")
        lib.ggml_backend_tensor_set(self.ptr, ffi.from_buffer(data), 0, data.nbytes)

    def set_bytes(self, data: np.ndarray, offset: int = 0) -> None:
        """Upload raw storage bytes (already in the tensor's type) at a byte offset."""
        self._check_io()
        self._check_partial_io("write raw bytes into")
        data = np.ascontiguousarray(data)
        if offset < 0 or offset + data.nbytes > self.nbytes:
            raise ValueError(f"write of {data.nbytes} bytes at offset {offset} exceeds tensor {self.name!r} ({self.nbytes} bytes)")
        lib.ggml_backend_tensor_set(self.ptr, ffi.from_buffer(data), offset, data.nbytes)

    def numpy(self) -> np.ndarray:
        """Download a copy: float32 for every floating type (exact; quantized types dequantized), intN for ints."""
        self._check_io()
        self._check_partial_io("read")
        ty = self.type
        raw = np.empty(self.nbytes, dtype=np.uint8)
        lib.ggml_backend_tensor_get(self.ptr, ffi.from_buffer(raw), 0, raw.nbytes)
        if ty == "f32":
            out = raw.view(np.float32)
        elif ty == "f16":
            out = raw.view(np.float16).astype(np.float32)
        elif ty == "bf16":
            out = bf16_bits_to_fp32(raw.view(np.uint16))
        elif ty == "f64":
            out = raw.view(np.float64)
        elif ty in INT_DTYPES:
            out = raw.view(INT_DTYPES[ty])
        elif ty in ("q8_0", "q4_0"):
            out = dequantize(ty, raw, self.nelements)
        else:  # pragma: no cover
            raise TypeError(f"cannot read a {ty} tensor into numpy")
        return out.reshape(self.shape)

    def fill(self, value: int) -> None:
        """Set every byte of the tensor's data to `value` (0..255)."""
        self._check_io()
        self._check_partial_io("fill")
        lib.ggml_backend_tensor_memset(self.ptr, value & 0xFF, 0, self.nbytes)


def quantize(type_name: str, x: np.ndarray) -> np.ndarray:
    """Quantize float32 rows (last axis = a row) with ggml_quantize_chunk; returns the raw bytes."""
    t = ggml_type(type_name)
    if lib.ggml_quantize_requires_imatrix(t):
        raise ValueError(f"{type_name} needs an importance matrix; not supported")
    x = np.ascontiguousarray(x, dtype=np.float32)
    n_per_row = x.shape[-1] if x.ndim else 1
    if n_per_row % lib.ggml_blck_size(t):
        raise ValueError(f"{type_name} rows must be a multiple of {lib.ggml_blck_size(t)} values, got {n_per_row}")
    nrows = x.size // n_per_row
    out = np.empty(int(lib.ggml_row_size(t, n_per_row)) * nrows, dtype=np.uint8)
    written = lib.ggml_quantize_chunk(t, ffi.from_buffer("float[]", x), ffi.from_buffer(out), 0, nrows, n_per_row, ffi.NULL)
    if written != out.nbytes:  # pragma: no cover
        raise GGMLError(f"ggml_quantize_chunk wrote {written} bytes, expected {out.nbytes}")
    return out


def dequantize(type_name: str, raw: np.ndarray, n: int) -> np.ndarray:
    traits = lib.ggml_get_type_traits(ggml_type(type_name))
    out = np.empty(n, dtype=np.float32)
    traits.to_float(ffi.from_buffer(raw), ffi.from_buffer("float[]", out), n)
    return out


# ----------------------------------------------------------------------------- buffers + allocation


# every ggml backend buffer we own that is still alive (Buffers and Gallocr buffers): address -> a
# token unique to that allocation. malloc reuses the address of a freed buffer for the next one, so
# a graph remembers (address, token) pairs, and tensors placed in a freed buffer are detached
# (data = buffer = NULL) where we can reach them: nothing may read, write or compute freed memory.
_live_buffers: dict[int, int] = {}
# the live buffers whose tensors were repacked on upload (REPACKING_BUFFER_TYPES): write-whole, never read
_repacked_buffers: set[int] = set()
_tokens = itertools.count(1)


def _addr(ptr: Any) -> int:
    return int(ffi.cast("uintptr_t", ptr))


def _reads_repacked(p: Any) -> bool:
    """Does tensor `p` (or the tensor it views) live in a repacking buffer?"""
    base = p.view_src if p.view_src != ffi.NULL else p
    return bool(_repacked_buffers) and any(
        t.buffer != ffi.NULL and _addr(t.buffer) in _repacked_buffers for t in (p, base))


def _detach(ptrs: Iterator[Any], addrs: "set[int] | None") -> None:
    """Forget the data of tensors placed in the freed buffers `addrs` (None: in any non-live buffer)."""
    for p in ptrs:
        if p.buffer != ffi.NULL and (_addr(p.buffer) in addrs if addrs is not None else _addr(p.buffer) not in _live_buffers):
            p.buffer = ffi.NULL
            p.data = ffi.NULL


class Buffer(_Owned):
    """A backend buffer holding the data of every tensor of one Context."""

    def __init__(self, handle: Any, backend: Backend | None, ctx: Context | None = None) -> None:
        if handle == ffi.NULL:
            raise GGMLError("backend buffer allocation failed (out of memory?)")
        ctx_ref = weakref.ref(ctx) if ctx is not None else None
        self._own(handle, functools.partial(Buffer._free_handle, ctx_ref=ctx_ref), "buffer")
        _live_buffers[_addr(handle)] = next(_tokens)
        self.backend = backend
        self.ctx = ctx  # keep the tensors' metadata alive as long as their data
        if self.name in REPACKING_BUFFER_TYPES:
            _repacked_buffers.add(_addr(handle))

    @staticmethod
    def _free_handle(handle: Any, ctx_ref: Any = None) -> None:
        ctx = ctx_ref() if ctx_ref is not None else None
        if ctx is not None and not ctx.closed:  # its tensors must not point at freed memory
            _detach((t.ptr for t in ctx.tensors()), {_addr(handle)})
        _live_buffers.pop(_addr(handle), None)
        _repacked_buffers.discard(_addr(handle))
        lib.ggml_backend_buffer_free(handle)

    @classmethod
    def alloc_ctx_tensors(cls, ctx: Context, backend: Backend) -> "Buffer":
        """Allocate one buffer on `backend` for every tensor of `ctx` that has no data yet."""
        if not ctx.no_alloc:
            raise GGMLError("alloc_ctx_tensors needs a no_alloc context")
        if all(t.is_allocated for t in ctx.tensors()):
            raise GGMLError("the context has no unallocated tensors to place in a buffer")
        handle = lib.ggml_backend_alloc_ctx_tensors(ctx.handle, backend.handle)
        return cls(handle, backend, ctx)

    @classmethod
    def alloc_ctx_tensors_from_buft(cls, ctx: Context, buffer_type: Any, backend: Backend) -> "Buffer":
        """Like alloc_ctx_tensors, in a buffer of `buffer_type` (e.g. one of cpu_extra_buffer_types())."""
        if not ctx.no_alloc:
            raise GGMLError("alloc_ctx_tensors_from_buft needs a no_alloc context")
        if all(t.is_allocated for t in ctx.tensors()):
            raise GGMLError("the context has no unallocated tensors to place in a buffer")
        name = ffi.string(lib.ggml_backend_buft_name(buffer_type)).decode()
        if name == "AMX":
            # anything else would overflow the buffer or never reach its kernels
            for t in ctx.tensors():
                if not t.is_allocated and not amx_fits(t.type, t.ne):
                    raise ValueError(f"tensor {t.name!r} ({t.type}, ne={t.ne}) cannot live in the AMX buffer: "
                                     f"it takes 2-D {'/'.join(AMX_TYPES)} matrices whose two sizes are multiples of 32")
        elif name == "CPU_REPACK" and vnni_available():
            # only our VNNI q8_0 layout: ggml's other CPU_REPACK layouts are untested here, and a
            # tensor no layout takes would crash ggml on upload
            for t in ctx.tensors():
                if not t.is_allocated and not vnni_fits(t.type, t.ne):
                    raise ValueError(f"tensor {t.name!r} ({t.type}, ne={t.ne}) cannot live in the CPU_REPACK buffer: "
                                     "it takes 2-D q8_0 matrices of whole 32-value blocks and 16-row groups")
        elif name in REPACKING_BUFFER_TYPES:
            raise GGMLError(f"the {name} buffer type is not supported by pyggml_dkv (only AMX, and CPU_REPACK "
                            "for q8_0 with vendor/patches/0010 on AVX512-VNNI, are)")
        handle = lib.ggml_backend_alloc_ctx_tensors_from_buft(ctx.handle, buffer_type)
        return cls(handle, backend, ctx)

    @classmethod
    def alloc(cls, backend: Backend, size: int) -> "Buffer":
        if size <= 0:
            raise ValueError(f"buffer size must be > 0, got {size}")
        return cls(lib.ggml_backend_alloc_buffer(backend.handle, size), backend)

    @property
    def handle(self) -> Any:
        self._check_open()
        return self._handle

    @property
    def size(self) -> int:
        return int(lib.ggml_backend_buffer_get_size(self.handle))

    @property
    def name(self) -> str:
        return ffi.string(lib.ggml_backend_buffer_name(self.handle)).decode()

    @property
    def is_host(self) -> bool:
        return bool(lib.ggml_backend_buffer_is_host(self.handle))

    def clear(self, value: int = 0) -> None:
        lib.ggml_backend_buffer_clear(self.handle, value & 0xFF)

    def set_usage_weights(self) -> None:
        lib.ggml_backend_buffer_set_usage(self.handle, lib.GGML_BACKEND_BUFFER_USAGE_WEIGHTS)


class Gallocr(_Owned):
    """ggml's graph allocator: places a graph's intermediate tensors in one reusable buffer."""

    def __init__(self, backend: Backend) -> None:
        handle = lib.ggml_gallocr_new(backend.buffer_type)
        if handle == ffi.NULL:
            raise GGMLError("ggml_gallocr_new failed")
        self._buffers: set[int] = set()  # ggml buffers this allocator owns (shared with the finalizer)
        self._graphs: "weakref.WeakSet[Graph]" = weakref.WeakSet()  # graphs placed in them
        self._own(handle, functools.partial(Gallocr._free_handle, buffers=self._buffers, graphs=self._graphs), "gallocr")
        self.backend = backend
        self.n_allocs = 0

    @staticmethod
    def _release(buffers: set[int], graphs: Any, keep: "Graph | None" = None) -> None:
        """ggml freed `buffers`: detach the tensors every graph (but `keep`) had placed in them."""
        for g in list(graphs):
            if g is not keep:
                g._detach(buffers)
        for a in buffers:
            _live_buffers.pop(a, None)
        buffers.clear()

    @staticmethod
    def _free_handle(handle: Any, buffers: set[int], graphs: Any) -> None:
        Gallocr._release(buffers, graphs)
        lib.ggml_gallocr_free(handle)

    @property
    def handle(self) -> Any:
        self._check_open()
        return self._handle

    def reserve(self, graph: "Graph") -> None:
        """Size the buffer for `graph` (and graphs no larger) without assigning addresses."""
        graph._check_nonempty()
        before = self.buffer_size
        ok = lib.ggml_gallocr_reserve(self.handle, graph.handle)
        if self.buffer_size != before:  # ggml freed the old buffer (and maybe made a bigger one)
            Gallocr._release(self._buffers, self._graphs)
        if not ok:
            raise GGMLError("ggml_gallocr_reserve failed (out of memory?)")

    def alloc_graph(self, graph: "Graph") -> None:
        """Assign every intermediate tensor of `graph` an address in this allocator's buffer."""
        graph._check_nonempty()
        graph.check_repacked_reads(self.backend)
        handle = self.handle
        for _ in range(2):
            before = self.buffer_size
            placed_before = graph._uses(self._buffers)
            ok = lib.ggml_gallocr_alloc_graph(handle, graph.handle)
            if self.buffer_size == before:
                break
            # ggml freed the old buffer: every tensor it held is gone, in other graphs and in this one
            Gallocr._release(self._buffers, self._graphs, keep=graph)
            if not (ok and placed_before):
                break
            graph._detach(None)  # part of this graph sat in the freed buffer: place all of it again
        if not ok:
            raise GGMLError("ggml_gallocr_alloc_graph failed (out of memory?)")
        self.n_allocs += 1
        # record where this graph's tensors now live (a new allocation gets a new token)
        own = {a for a, _ in graph._placements()} - (_live_buffers.keys() - self._buffers)
        for a in own - self._buffers:
            _live_buffers[a] = next(_tokens)
        self._buffers.update(own)
        self._graphs.add(graph)
        graph._deps = None
        graph._allocator = self  # the graph's intermediates live in our buffer: keep it alive
        try:  # remember the allocations the graph uses now, so a later free + address reuse is caught
            graph._deps = graph._collect_buffers()
        except GGMLError:
            pass  # a tensor still has no data: compute() will say so

    @property
    def buffer_size(self) -> int:
        return int(lib.ggml_gallocr_get_buffer_size(self.handle, 0))


# ----------------------------------------------------------------------------- graphs


class Graph:
    """A computation graph built in a Context (which must have room for it: graph_size=...)."""

    def __init__(self, ctx: Context, size: int = 2048) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"graph size must be a positive int, got {size!r}")
        need = lib.ggml_graph_overhead_custom(size, False)
        if ctx.used_mem + need > ctx.mem_size:
            raise GGMLError(f"context too small for a graph of size {size}: needs {need} more bytes; create it with graph_size={size}")
        self.ctx = ctx
        self._ctxs = {ctx}  # every context holding a tensor of the graph: all must stay open
        self.size = size
        self.handle = lib.ggml_new_graph_custom(ctx.handle, size, False)
        if self.handle == ffi.NULL:
            raise GGMLError("ggml_new_graph_custom failed")
        self._seen: set[int] = set()
        self._deps: frozenset[tuple[int, int | None]] | None = None  # (buffer, token) pairs the allocated graph uses

    def _count_new(self, root: Tensor) -> int:
        """Tensors (nodes + leafs) that expanding `root` would add, so we can refuse overflow."""
        new, stack = set(), [root.ptr]
        while stack:
            p = stack.pop()
            addr = int(ffi.cast("uintptr_t", p))
            if addr in self._seen or addr in new:
                continue
            new.add(addr)
            for i in range(10):
                s = p.src[i]
                if s != ffi.NULL:
                    stack.append(s)
        return len(new), new  # type: ignore[return-value]

    def expand(self, tensor: Tensor) -> Tensor:
        """ggml_build_forward_expand: add `tensor` and everything it depends on.

        The tensor is flagged as a graph output, so the allocator neither reuses its memory for a
        later node nor computes a later op in place over it: it can be read after compute().
        """
        self._check_ctxs()
        ctxs = {tensor.ctx, *tensor.ctx._src_ctxs}
        if any(c.closed for c in ctxs):
            raise GGMLError("tensor used after its Context (or one its ops read from) was closed")
        n_new, new = self._count_new(tensor)  # type: ignore[misc]
        if len(self._seen) + n_new > self.size:
            raise GGMLError(f"graph of size {self.size} is full ({len(self._seen)} tensors + {n_new} new); build it with a larger size")
        lib.ggml_set_output(tensor.ptr)
        lib.ggml_build_forward_expand(self.handle, tensor.ptr)
        self._seen |= new
        self._ctxs |= ctxs
        return tensor

    def check_repacked_reads(self, backend: Backend) -> None:
        """Refuse a graph that would read repacked weights (AMX buffer) where ggml has no kernel for them.

        Only a matrix product whose matrix is the whole repacked tensor, on a CPU backend that
        accepts that product, may read one; anything else would compute on the kernel-specific
        layout and return garbage without an error.
        """
        if not _repacked_buffers:
            return
        for node in self.nodes():
            p = node.ptr
            for i in range(10):
                src = p.src[i]
                if src == ffi.NULL or not _reads_repacked(src):
                    continue
                name = ffi.string(src.name).decode()
                ok = (node.op == "MUL_MAT" and i == 0 and src.view_src == ffi.NULL and backend.is_cpu
                      and backend.supports(node))
                if not ok:
                    raise GGMLError(f"{node.op} node {node.name!r} reads {name!r}, which is stored repacked for AMX or VNNI: "
                                    "only a matrix product (mul_mat) of the whole tensor by contiguous f32 rows on the "
                                    "CPU backend can use it; upload that tensor with repack=False")

    def _ctxs_open(self) -> bool:
        return not any(c.closed for c in self._ctxs)

    def _check_ctxs(self) -> None:
        self.ctx._check_open()
        if not self._ctxs_open():
            raise GGMLError("a Context holding tensors of this graph was closed")

    @property
    def n_nodes(self) -> int:
        self._check_ctxs()
        return int(lib.ggml_graph_n_nodes(self.handle))

    def node(self, i: int) -> Tensor:
        n = self.n_nodes
        if not -n <= i < n:
            raise IndexError(f"graph node {i} out of range ({n} nodes)")
        return Tensor(lib.ggml_graph_node(self.handle, i), self.ctx)

    def nodes(self) -> Iterator[Tensor]:
        for i in range(self.n_nodes):
            yield Tensor(lib.ggml_graph_node(self.handle, i), self.ctx)

    def _check_nonempty(self) -> None:
        self.ctx._check_open()
        if self.n_nodes == 0:
            raise GGMLError("graph is empty: expand() an output tensor first")

    def _tensor_ptrs(self) -> Iterator[Any]:
        """Every node, its sources and the tensors views look into (with repeats)."""
        for i in range(self.n_nodes):
            node = lib.ggml_graph_node(self.handle, i)
            for p in (node, node.view_src, *(node.src[j] for j in range(10))):
                if p != ffi.NULL:
                    yield p

    def _placements(self) -> Iterator[tuple[int, Any]]:
        for p in self._tensor_ptrs():
            if p.buffer != ffi.NULL:
                yield _addr(p.buffer), p

    def _uses(self, addrs: set[int]) -> bool:
        return any(a in addrs for a, _ in self._placements())

    def _detach(self, addrs: "set[int] | None") -> None:
        """Drop the data of this graph's tensors placed in the freed buffers `addrs` (None: any dead buffer)."""
        self._deps = None
        if self._ctxs_open():
            _detach(self._tensor_ptrs(), addrs)

    def _collect_buffers(self) -> frozenset[tuple[int, int | None]]:
        """(address, token) of every buffer the graph touches; raises if a tensor has no data (ggml would crash)."""
        self._check_nonempty()
        deps: set[tuple[int, int | None]] = set()
        for p in self._tensor_ptrs():
            if p.data == ffi.NULL or p.buffer == ffi.NULL:
                name = ffi.string(lib.ggml_get_name(p)).decode()
                raise GGMLError(f"graph tensor {name!r} has no data: allocate the graph with a Gallocr "
                                "and its inputs/weights in a Buffer before computing (closing or reallocating "
                                "those drops the data)")
            deps.add((_addr(p.buffer), _live_buffers.get(_addr(p.buffer))))
        return frozenset(deps)

    def compute(self, backend: Backend) -> None:
        """ggml_backend_graph_compute, releasing the GIL. Every tensor must be allocated."""
        self._check_ctxs()
        if self._deps is None:
            self._deps = self._collect_buffers()
        if any(token is None or _live_buffers.get(a) != token for a, token in self._deps):
            raise GGMLError("the graph uses a backend buffer that has been closed (or reallocated by its Gallocr)")
        with backend.lock:  # the handle is read under the lock: Backend.close() takes it too
            status = lib.ggml_backend_graph_compute(backend.handle, self.handle)
        if status != lib.GGML_STATUS_SUCCESS:
            raise GGMLError(f"graph compute failed: {ffi.string(lib.ggml_status_to_string(status)).decode()}")


def version() -> str:
    return ffi.string(lib.ggml_version()).decode()
