"""Context: the metadata arena tensors and graphs are created in; ops are its methods."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ..common.checks import is_int
from ._lowlevel import ffi, lib
from .errors import GGMLError
from .ops import OpsMixin
from .owned import Owned
from .tensor import Tensor
from .types import MAX_DIMS, TYPE_NAMES, ggml_type


class Context(OpsMixin, Owned):
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
        if not is_int(mem_size) or mem_size <= 0:
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
                raise ValueError(
                    "the context arena must be 16-byte aligned (numpy arrays and bytearrays of this size usually are)"
                )
        params = ffi.new(
            "struct ggml_init_params *", {"mem_size": mem_size, "mem_buffer": mem_buffer, "no_alloc": bool(no_alloc)}
        )
        handle = lib.ggml_init(params[0])
        if handle == ffi.NULL:
            raise GGMLError(f"ggml_init failed for a {mem_size}-byte context")
        self._own(handle, lib.ggml_free, "context")
        self.mem_size = int(lib.ggml_get_mem_size(handle))
        self.no_alloc = bool(no_alloc)
        self._src_ctxs: set[Context] = set()  # other contexts whose tensors this one's ops point at
        self._placed: dict[int, Any] = {}  # tensor address -> the numpy array it was placed in (Tensor.place_in)

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
                raise GGMLError(
                    "ops that make new data need a no_alloc Context (their results are placed by a Gallocr)"
                )
            data_bytes = 0
        need = lib.ggml_tensor_overhead() + (0 if self.no_alloc else ((data_bytes + 15) // 16) * 16)
        if self.used_mem + need > self.mem_size:
            raise GGMLError(
                f"ggml context out of memory: {self.used_mem} of {self.mem_size} bytes used, next object needs {need}; "
                "create the Context with more n_tensors / mem_size"
            )

    def _wrap(self, ptr: Any) -> Tensor:
        if ptr == ffi.NULL:
            raise GGMLError("ggml returned no tensor")
        return Tensor(ptr, self)

    def new_tensor(self, type: str | int, *ne: int, name: str | None = None) -> Tensor:
        """A new tensor with ggml dims `ne` (ne0 fastest), e.g. new_tensor("f32", hidden, tokens)."""
        t = ggml_type(type)
        if not 1 <= len(ne) <= MAX_DIMS:
            raise ValueError(f"a tensor has 1 to {MAX_DIMS} dims, got {len(ne)}")
        dims = []
        for d in ne:
            if not is_int(d) or d <= 0:
                raise ValueError(f"tensor dims must be positive ints, got {ne}")
            dims.append(int(d))
        if dims[0] % lib.ggml_blck_size(t):
            raise ValueError(
                f"ne0={dims[0]} must be a multiple of the {TYPE_NAMES[t]} block size {lib.ggml_blck_size(t)}"
            )
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

    def tensors(self) -> Iterator[Tensor]:
        """Every tensor in the context, in creation order."""
        ptr = lib.ggml_get_first_tensor(self.handle)
        while ptr != ffi.NULL:
            yield Tensor(ptr, self)
            ptr = lib.ggml_get_next_tensor(self.handle, ptr)

    def get_tensor(self, name: str) -> Tensor:
        ptr = lib.ggml_get_tensor(self.handle, name.encode())
        if ptr == ffi.NULL:
            raise KeyError(f"no tensor named {name!r} in this context")
        return Tensor(ptr, self)
