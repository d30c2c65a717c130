"""Checks every op builder shares: ggml's preconditions in Python, and the base class that gives
the op mixins their context (a ValueError naming the problem instead of ggml's abort())."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ._lowlevel import ffi, lib
from .types import QUANT_TYPES, TYPES

if TYPE_CHECKING:  # pragma: no cover
    from .tensor import Tensor

I32 = lib.GGML_TYPE_I32
I64 = lib.GGML_TYPE_I64
F32 = lib.GGML_TYPE_F32
F16 = lib.GGML_TYPE_F16
BF16 = lib.GGML_TYPE_BF16
FLOAT = (F32, F16, BF16)
QUANT = (lib.GGML_TYPE_Q8_0, lib.GGML_TYPE_Q4_0)
# weight matrices (mul_mat's a, get_rows' table) may also be the k-quants GGUF drafters ship
WEIGHT_QUANT = tuple(TYPES[n] for n in QUANT_TYPES)
# (a, b) type pairs ggml's CPU add/sub/mul kernels implement (the result has a's type)
BINARY_TYPES = {(F32, F32), (F16, F16), (BF16, BF16), (F16, F32), (BF16, F32)}
ROPE_MODES = (0, lib.GGML_ROPE_TYPE_NEOX)  # ggml_rope_ext: normal or NEOX (M-RoPE/vision need ggml_rope_multi)


def ne_of(t: Tensor) -> tuple[int, int, int, int]:
    return t.ne


def fail(op: str, msg: str) -> None:
    raise ValueError(f"{op}: {msg}")


def finite(op: str, name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        fail(op, f"{name} must be a finite number, got {value!r}")
    return float(value)


def can_repeat(b: Tensor, a: Tensor) -> bool:
    """ggml_can_repeat(b, a): b broadcasts to a."""
    return all(x % y == 0 for x, y in zip(ne_of(a), ne_of(b)))


def is_transposed(t: Tensor) -> bool:
    nb = t.nb
    return nb[0] > nb[1]


def rows_contiguous(t: Tensor) -> bool:
    """ggml_is_contiguous_rows: the elements of a row are packed (ne0 is not strided)."""
    return t.ne[0] == lib.ggml_blck_size(t.type_id) or t.nb[0] == lib.ggml_type_size(t.type_id)


def check_type(op: str, t: Tensor, allowed: tuple[int, ...], what: str = "input") -> None:
    if t.type_id not in allowed:
        names = "/".join(ffi.string(lib.ggml_type_name(x)).decode() for x in allowed)
        fail(op, f"{what} must be {names}, got {t.type}")


def check_convert(op: str, src: Tensor, dst_type: int, dst_contiguous: bool, dst_nb0: int) -> None:
    """The type conversions ggml's CPU copy kernel implements (anything else aborts at compute)."""
    st = src.type_id
    if st == dst_type or (st in FLOAT and dst_type in FLOAT) or (st, dst_type) in ((F32, I32), (I32, F32)):
        return
    if st in FLOAT and dst_type in QUANT:
        if src.nb[0] != lib.ggml_type_size(st) or not dst_contiguous:
            fail(op, "quantizing needs a source with packed rows and a contiguous destination")
        return
    if st in QUANT and dst_type == F32:
        if dst_nb0 != 4:
            fail(op, "dequantizing needs a destination with packed rows")
        return
    fail(op, f"cannot convert {src.type} to {ffi.string(lib.ggml_type_name(dst_type)).decode()}")


class OpBuilder:
    """What the op mixins need of the Context they are mixed into."""

    handle: Any
    _src_ctxs: set[Any]

    def _reserve(self, data_bytes: int | None = 0) -> None:  # pragma: no cover
        raise NotImplementedError  # Context's

    def _wrap(self, ptr: Any) -> Tensor:  # pragma: no cover
        raise NotImplementedError  # Context's

    def _same_ctx(self, op: str, *tensors: Tensor | None) -> None:
        for t in tensors:
            if t is not None:
                t._live_ptr()
                if t.ctx is not self:  # ops point into t's context: a graph must not outlive it
                    self._src_ctxs |= {t.ctx, *t.ctx._src_ctxs}
