"""Tensor: a view of one ggml tensor, with numpy set / get."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..common.bf16 import from_bf16_bits, to_bf16_bits
from . import liveness
from ._lowlevel import ffi, lib
from .errors import GGMLError, RemoteBackendError
from .types import FLOAT_TYPES, INT_DTYPES, QUANT_TYPES, TYPE_NAMES, dequantize, quantize

if TYPE_CHECKING:  # pragma: no cover
    from .context import Context


_HAS_RPC = hasattr(lib, "ggml_backend_rpc_buffer_failed")


def check_rpc_transfer(ptr: Any, name: str) -> None:
    """After a transfer: raise if the tensor lives on an RPC connection that failed (the server
    went away, stalled past the timeout or replied malformed): the data moved is not valid."""
    if _HAS_RPC and lib.ggml_backend_rpc_buffer_failed(ptr.buffer):
        raise RemoteBackendError(
            f"tensor {name!r}: the connection to its RPC server failed, so the transfer did not "
            "happen (see the pyggml_dkv.ggml log); re-create the Backend and what lives on it"
        )


def _on_rpc(ptr: Any) -> bool:
    buft = lib.ggml_backend_buffer_get_type(ptr.buffer)
    return ffi.string(lib.ggml_backend_buft_name(buft)).decode().startswith("RPC")


def host_array(shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on a 64-byte boundary (a cache line:
    ggml's CPU kernels may use aligned vector stores), for Tensor.place_in."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    raw = np.empty(n + 64, dtype=np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start : start + n].view(dt).reshape(shape)


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
    def buffer_name(self) -> str | None:
        """The name of the buffer holding the data ("CPU", "AMX", "CPU_REPACK", "CUDA0", ...; the
        repacking ones say which kernels multiply the tensor), None while unallocated."""
        p = self._live_ptr()
        return ffi.string(lib.ggml_backend_buffer_name(p.buffer)).decode() if p.buffer != ffi.NULL else None

    @property
    def numpy_dtype(self) -> Any:
        """The numpy dtype of the tensor's storage (f32, f16, f64, iN), None for other types."""
        return {"f32": np.float32, "f16": np.float16, "f64": np.float64, **INT_DTYPES}.get(self.type)

    @property
    def in_host_memory(self) -> bool:
        """Allocated in memory this process addresses (CPU buffers; not GPU or RPC ones)."""
        p = self._live_ptr()
        return p.buffer != ffi.NULL and bool(lib.ggml_backend_buffer_is_host(p.buffer))

    @property
    def data_address(self) -> int:
        """Address of the tensor's data in its buffer (device address for GPU buffers)."""
        return int(ffi.cast("uintptr_t", self._live_ptr().data))

    def set_input(self) -> Tensor:
        lib.ggml_set_input(self._live_ptr())
        return self

    def set_output(self) -> Tensor:
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
            raise GGMLError(
                f"tensor {self.name!r} has no data: allocate its context's tensors in a Buffer (or the graph "
                "with a Gallocr) first; data is dropped when that Buffer / Gallocr is closed or reallocated"
            )
        if liveness.addr(p.buffer) not in liveness.live_buffers:
            raise GGMLError(f"tensor {self.name!r} lives in a buffer that was closed")
        if not self.is_contiguous:
            raise GGMLError(f"tensor {self.name!r} is a non-contiguous view; copy it with ggml_cont first")

    @property
    def is_repacked(self) -> bool:
        """Stored in a repacking buffer (e.g. AMX): written whole with set(), never read back."""
        return liveness.reads_repacked(self.ptr)

    def _check_partial_io(self, what: str) -> None:
        if self.is_repacked:
            raise GGMLError(
                f"cannot {what} tensor {self.name!r}: it is stored repacked for a CPU kernel "
                "(AMX, CPU_DKV_REPACK or CPU_REPACK buffer), so it can only be written whole with set(), never read back"
            )

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
            # an array of the tensor's own integer type holds only values it can take: no scan
            # (the step inputs are such arrays, written every step)
            if arr.dtype != INT_DTYPES[ty] and arr.size and (arr.min() < info.min or arr.max() > info.max):
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
            return to_bf16_bits(arr)
        return quantize(ty, np.ascontiguousarray(arr, dtype=np.float32))

    def set(self, array: Any) -> None:
        """Upload a numpy array of shape `self.shape` (converted to the tensor's type)."""
        self._check_io()
        if self.ptr.view_src != ffi.NULL:
            self._check_partial_io("write a view of")
        data = self._to_bytes(array)
        if data.nbytes != self.nbytes:  # pragma: no cover - guarded by the shape check
            raise GGMLError(f"size mismatch writing {self.name!r}: {data.nbytes} != {self.nbytes}")
        self._forget_deltas(0, data.nbytes)
        lib.ggml_backend_tensor_set(self.ptr, ffi.from_buffer(data), 0, data.nbytes)
        check_rpc_transfer(self.ptr, self.name)

    def set_bytes(self, data: np.ndarray, offset: int = 0) -> None:
        """Upload raw storage bytes (already in the tensor's type) at a byte offset (a repacked tensor: whole only)."""
        self._check_io()
        data = np.ascontiguousarray(data)
        if not (offset == 0 and data.nbytes == self.nbytes):  # a repacking buffer takes whole tensors only
            self._check_partial_io("write raw bytes into")
        if offset < 0 or offset + data.nbytes > self.nbytes:
            raise ValueError(
                f"write of {data.nbytes} bytes at offset {offset} exceeds tensor {self.name!r} ({self.nbytes} bytes)"
            )
        self._forget_deltas(offset, data.nbytes)
        lib.ggml_backend_tensor_set(self.ptr, ffi.from_buffer(data), offset, data.nbytes)
        check_rpc_transfer(self.ptr, self.name)

    def _forget_deltas(self, offset: int, size: int) -> None:
        """A DeltaUpload whose bytes this write overlaps no longer knows what the device holds."""
        if liveness.delta_uploads:
            start = liveness.addr(self.ptr.data) + offset
            liveness.forget_deltas_overlapping(start, start + size)

    def numpy(self) -> np.ndarray:
        """Download a copy: float32 for every floating type (exact; quantized types dequantized), intN for ints."""
        self._check_io()
        self._check_partial_io("read")
        ty = self.type
        raw = np.empty(self.nbytes, dtype=np.uint8)
        lib.ggml_backend_tensor_get(self.ptr, ffi.from_buffer(raw), 0, raw.nbytes)
        check_rpc_transfer(self.ptr, self.name)
        if ty == "f32":
            out = raw.view(np.float32)
        elif ty == "f16":
            out = raw.view(np.float16).astype(np.float32)
        elif ty == "bf16":
            out = from_bf16_bits(raw.view(np.uint16))
        elif ty == "f64":
            out = raw.view(np.float64)
        elif ty in INT_DTYPES:
            out = raw.view(INT_DTYPES[ty])
        elif ty in QUANT_TYPES:
            out = dequantize(ty, raw, self.nelements)
        else:  # pragma: no cover
            raise TypeError(f"cannot read a {ty} tensor into numpy")
        return out.reshape(self.shape)

    def place_in(self, array: np.ndarray) -> None:
        """Make `array`'s memory this tensor's data: a graph computed next writes the tensor's values
        straight into it, with no copy out afterwards (a draft step's logits: 3 MB a step).

        For a tensor in host memory (a CPU buffer, or placed there by a Gallocr; not a view, not
        repacked) and a C-contiguous, writable, 64-byte aligned `array` of its shape and storage dtype
        (float32 for f32, float16 for f16, intN for iN): see `host_array`. The tensor stays there until
        placed again; its Context keeps `array` alive meanwhile, and a Gallocr allocating its graph
        again leaves it there. `numpy()` and the graph read and write `array` itself, so writing into
        `array` changes what the tensor holds."""
        self._check_io()
        p = self.ptr
        if p.view_src != ffi.NULL:
            raise GGMLError(f"tensor {self.name!r} is a view: place the tensor it views instead")
        self._check_partial_io("place")
        if not self.in_host_memory:
            raise GGMLError(
                f"tensor {self.name!r} is in a {self.buffer_name} buffer, not host memory: its data cannot move into a numpy array"
            )
        want = self.numpy_dtype
        if want is None:
            raise TypeError(f"tensor {self.name!r} is {self.type}: no numpy dtype holds its storage")
        if not isinstance(array, np.ndarray):
            raise TypeError(f"expected a numpy array, got {type(array).__name__}")
        if array.dtype != want or array.shape != self.shape:
            raise ValueError(
                f"tensor {self.name!r} needs a {np.dtype(want).name} array of shape {self.shape}, "
                f"got {array.dtype.name} {array.shape}"
            )
        if not array.flags.c_contiguous or not array.flags.writeable:
            raise ValueError("the array must be C-contiguous and writable")
        if array.ctypes.data % 64:
            raise ValueError("the array must be 64-byte aligned (make it with host_array)")
        self._forget_deltas(0, self.nbytes)
        self.ctx._placed[int(ffi.cast("uintptr_t", p))] = array
        p.data = ffi.cast("void *", array.ctypes.data)

    def fill(self, value: int) -> None:
        """Set every byte of the tensor's data to `value` (0..255)."""
        self._check_io()
        self._check_partial_io("fill")
        if _HAS_RPC and _on_rpc(self.ptr):
            # ggml's RPC buffers have no memset (ggml would abort): upload the bytes instead
            self.set_bytes(np.full(self.nbytes, value & 0xFF, dtype=np.uint8))
            return
        self._forget_deltas(0, self.nbytes)
        lib.ggml_backend_tensor_memset(self.ptr, value & 0xFF, 0, self.nbytes)
