"""TensorWriter: the upload route of one persistent input tensor, checked once.

Tensor.set checks everything on every call (the tensor's context and buffer, contiguity, a
repacking buffer, the array's shape, dtype and integer range) and converts the array to the
tensor's type. A step graph's inputs are written every step from staging arrays that already have
the tensor's storage dtype: a TensorWriter does the tensor-side checks once, at creation, and each
write checks only what can change (the array, and that the tensor's context and buffer are still
alive) before the copy: ~1 us a write against Tensor.set's ~5.5 us in a warm loop (Zen 5), and
the step's Python runs from cold caches, where each operation saved counts several times over.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import liveness
from ._lowlevel import ffi, lib
from .errors import GGMLError
from .tensor import Tensor, _on_rpc, check_rpc_transfer

# ggml types whose storage is a numpy dtype (no conversion between the array and the tensor)
_STORAGE_DTYPES = {
    "f32": np.float32,
    "f16": np.float16,
    "f64": np.float64,
    "i8": np.int8,
    "i16": np.int16,
    "i32": np.int32,
    "i64": np.int64,
}


def writes_type(ty: str) -> bool:
    """Whether a TensorWriter takes tensors of ggml type `ty`."""
    return ty in _STORAGE_DTYPES


class TensorWriter:
    """Writes numpy arrays of exactly the tensor's storage dtype into it: whole (`write`) or its
    first rows along numpy's leading axis (`write_rows`)."""

    def __init__(self, tensor: Tensor) -> None:
        tensor._check_io()
        tensor._check_partial_io("write rows into")  # a repacking buffer takes whole, converted tensors
        ty = tensor.type
        if ty not in _STORAGE_DTYPES:
            raise TypeError(
                f"tensor {tensor.name!r} is {ty}: a TensorWriter writes only "
                f"{', '.join(_STORAGE_DTYPES)} tensors (use Tensor.set, which converts)"
            )
        p = tensor.ptr
        self.tensor = tensor
        self.name = tensor.name
        self.dtype = np.dtype(_STORAGE_DTYPES[ty])
        self.shape = tensor.shape
        self.nbytes = tensor.nbytes
        self._ptr = p
        self._buffer = liveness.addr(p.buffer)
        self._token = liveness.live_buffers.get(self._buffer)
        self._rpc = _on_rpc(p)

    def _check_live(self) -> None:
        if self.tensor.ctx.closed:
            raise GGMLError(f"tensor {self.name!r} written after its Context was closed")
        if self._token is None or liveness.live_buffers.get(self._buffer) != self._token:
            # its buffer was closed (Tensor's own checks raise), or a Gallocr placed it anew: check again
            self.tensor._check_io()
            p = self.tensor.ptr
            self._buffer = liveness.addr(p.buffer)
            self._token = liveness.live_buffers.get(self._buffer)

    def _check_array(self, array: Any, shape_ok: bool) -> np.ndarray:
        if not isinstance(array, np.ndarray) or array.dtype != self.dtype:
            got = array.dtype if isinstance(array, np.ndarray) else type(array).__name__
            raise TypeError(f"tensor {self.name!r}: its writer takes {self.dtype} arrays, got {got}")
        if not shape_ok:
            raise ValueError(f"tensor {self.name!r} has numpy shape {self.shape}, got an array of shape {array.shape}")
        if not array.flags.c_contiguous:
            raise ValueError(f"tensor {self.name!r}: its writer takes C-contiguous arrays")
        return array

    def _copy(self, array: np.ndarray, offset: int = 0) -> None:
        if liveness.delta_uploads:  # (the data address read now: a Gallocr may place a tensor anew)
            start = liveness.addr(self._ptr.data) + offset
            liveness.forget_deltas_overlapping(start, start + array.nbytes)
        lib.ggml_backend_tensor_set(self._ptr, ffi.from_buffer(array), offset, array.nbytes)
        if self._rpc:
            check_rpc_transfer(self._ptr, self.name)

    def write(self, array: np.ndarray) -> None:
        """The whole tensor: an array of its numpy shape and storage dtype."""
        self._check_live()
        self._copy(self._check_array(array, array.shape == self.shape if isinstance(array, np.ndarray) else False))

    def write_rows(self, array: np.ndarray) -> None:
        """The tensor's first len(array) rows (numpy's leading axis); the rest keep their bytes."""
        self._check_live()
        ok = (
            isinstance(array, np.ndarray)
            and array.ndim == len(self.shape)
            and array.shape[1:] == self.shape[1:]
            and array.shape[0] <= self.shape[0]
        )
        self._copy(self._check_array(array, ok))

    def write_rows_at(self, first: int, array: np.ndarray) -> None:
        """The tensor's rows [first, first + len(array)) (numpy's leading axis); the rest keep their bytes."""
        self._check_live()
        ok = (
            isinstance(array, np.ndarray)
            and array.ndim == len(self.shape)
            and array.shape[1:] == self.shape[1:]
            and first >= 0
            and first + array.shape[0] <= self.shape[0]
        )
        row_bytes = self.nbytes // self.shape[0]
        self._copy(self._check_array(array, ok), first * row_bytes)
