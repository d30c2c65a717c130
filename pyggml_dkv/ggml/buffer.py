"""Buffer: backend memory holding the data of every tensor of one Context."""

from __future__ import annotations

import functools
import weakref
from typing import Any

from . import liveness
from ._lowlevel import ffi, lib
from .backend import Backend
from .capabilities import (
    AMX_TYPES,
    DKV_BUFFER_TYPE,
    DKV_REPACK_BUFFER_TYPE,
    REPACKING_BUFFER_TYPES,
    amx_fits,
    cpu_extra_buffer_types,
    cpu_repack_takes,
    dkv_buffer_available,
    ggml_repack_fits,
    vnni_repack_fits,
)
from .context import Context
from .errors import GGMLError, RemoteBackendError
from .owned import Owned


class Buffer(Owned):
    """A backend buffer holding the data of every tensor of one Context."""

    def __init__(self, handle: Any, backend: Backend | None, ctx: Context | None = None) -> None:
        if handle == ffi.NULL:
            raise GGMLError("backend buffer allocation failed (out of memory?)")
        ctx_ref = weakref.ref(ctx) if ctx is not None else None
        self._own(handle, functools.partial(Buffer._free_handle, ctx_ref=ctx_ref), "buffer")
        liveness.live_buffers[liveness.addr(handle)] = liveness.new_token()
        self.backend = backend
        self.ctx = ctx  # keep the tensors' metadata alive as long as their data
        if self.name in REPACKING_BUFFER_TYPES:
            liveness.repacked_buffers.add(liveness.addr(handle))

    @staticmethod
    def _free_handle(handle: Any, ctx_ref: Any = None) -> None:
        ctx = ctx_ref() if ctx_ref is not None else None
        if ctx is not None and not ctx.closed:  # its tensors must not point at freed memory
            liveness.detach((t.ptr for t in ctx.tensors()), {liveness.addr(handle)})
        liveness.live_buffers.pop(liveness.addr(handle), None)
        liveness.repacked_buffers.discard(liveness.addr(handle))
        lib.ggml_backend_buffer_free(handle)

    @classmethod
    def alloc_ctx_tensors(cls, ctx: Context, backend: Backend) -> Buffer:
        """Allocate one buffer on `backend` for every tensor of `ctx` that has no data yet."""
        if not ctx.no_alloc:
            raise GGMLError("alloc_ctx_tensors needs a no_alloc context")
        if all(t.is_allocated for t in ctx.tensors()):
            raise GGMLError("the context has no unallocated tensors to place in a buffer")
        handle = lib.ggml_backend_alloc_ctx_tensors(ctx.handle, backend.handle)
        return cls(handle, backend, ctx)

    @classmethod
    def alloc_ctx_tensors_for_kernels(cls, ctx: Context, backend: Backend) -> Buffer:
        """Like alloc_ctx_tensors, in our CPU_DKV buffer on a CPU backend whose ggml has it: host
        memory in ggml's layout where our kernels take the ops that read it (products of its f16 /
        bf16 matrices by a few columns, flash attention over K/V there). Elsewhere the backend's own."""
        if backend.is_cpu and dkv_buffer_available():
            return cls.alloc_ctx_tensors_from_buft(ctx, cpu_extra_buffer_types()[DKV_BUFFER_TYPE], backend)
        return cls.alloc_ctx_tensors(ctx, backend)

    @classmethod
    def alloc_ctx_tensors_from_buft(cls, ctx: Context, buffer_type: Any, backend: Backend) -> Buffer:
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
                    raise ValueError(
                        f"tensor {t.name!r} ({t.type}, ne={t.ne}) cannot live in the AMX buffer: "
                        f"it takes 2-D {'/'.join(AMX_TYPES)} matrices whose two sizes are multiples of 32"
                    )
        elif name in (DKV_REPACK_BUFFER_TYPE, "CPU_REPACK"):
            # only the layouts we test (ours: vnni_repack_fits; ggml's: ggml_repack_fits): a tensor
            # no layout takes would crash ggml's CPU_REPACK on upload (ours refuses the allocation),
            # and ggml's other layouts are untested here
            fits = vnni_repack_fits if name == DKV_REPACK_BUFFER_TYPE else ggml_repack_fits
            for t in ctx.tensors():
                if not t.is_allocated and not fits(t.type, t.ne):
                    raise ValueError(
                        f"tensor {t.name!r} ({t.type}, ne={t.ne}) cannot live in the {name} buffer "
                        f"on this CPU: it takes {cpu_repack_takes(name)}"
                    )
        elif name in REPACKING_BUFFER_TYPES:
            raise GGMLError(f"the {name} buffer type is not supported by pyggml_dkv")
        handle = lib.ggml_backend_alloc_ctx_tensors_from_buft(ctx.handle, buffer_type)
        return cls(handle, backend, ctx)

    @classmethod
    def alloc(cls, backend: Backend, size: int) -> Buffer:
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
        liveness.forget_deltas_in_buffer(liveness.addr(self.handle))
        lib.ggml_backend_buffer_clear(self.handle, value & 0xFF)
        if hasattr(lib, "ggml_backend_rpc_buffer_failed") and lib.ggml_backend_rpc_buffer_failed(self.handle):
            raise RemoteBackendError(
                f"buffer {self.name!r}: the connection to its RPC server failed; re-create the "
                "Backend and what lives on it"
            )

    def set_usage_weights(self) -> None:
        lib.ggml_backend_buffer_set_usage(self.handle, lib.GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
