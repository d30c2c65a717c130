"""Arithmetic ops (element-wise, norms, matrix products, softmax) as Context methods."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._lowlevel import ffi, lib
from .op_checks import (
    BF16,
    BINARY_TYPES,
    F16,
    F32,
    FLOAT,
    WEIGHT_QUANT,
    OpBuilder,
    can_repeat,
    check_type,
    fail,
    finite,
    is_transposed,
    rows_contiguous,
)

if TYPE_CHECKING:  # pragma: no cover
    from .tensor import Tensor


class MathOps(OpBuilder):
    def _binary(self, op: str, fn: Any, a: Tensor, b: Tensor) -> Tensor:
        self._same_ctx(op, a, b)
        if not can_repeat(b, a):
            fail(op, f"b {b.ne} does not broadcast to a {a.ne}")
        if (a.type_id, b.type_id) not in BINARY_TYPES:
            fail(op, f"unsupported types a={a.type}, b={b.type} (f32/f16/bf16 alike, or f16/bf16 with f32)")
        if a.nb[0] != lib.ggml_type_size(a.type_id):
            fail(op, f"a {a.name!r} must have packed rows (not transposed)")
        self._reserve(None)
        out = self._wrap(fn(self.handle, a.ptr, b.ptr))
        out._ndim = a.ndim
        return out

    def add(self, a: Tensor, b: Tensor) -> Tensor:
        return self._binary("add", lib.ggml_add, a, b)

    def sub(self, a: Tensor, b: Tensor) -> Tensor:
        return self._binary("sub", lib.ggml_sub, a, b)

    def mul(self, a: Tensor, b: Tensor) -> Tensor:
        return self._binary("mul", lib.ggml_mul, a, b)

    def _unary(self, op: str, fn: Any, a: Tensor, *args: Any, types: tuple[int, ...] = FLOAT) -> Tensor:
        self._same_ctx(op, a)
        check_type(op, a, types)
        if not rows_contiguous(a):
            fail(op, f"{a.name!r} must have packed rows (not transposed)")
        self._reserve(None)
        out = self._wrap(fn(self.handle, a.ptr, *args))
        out._ndim = a.ndim
        return out

    def silu(self, a: Tensor) -> Tensor:
        return self._unary("silu", lib.ggml_silu, a, types=(F32, F16))

    def tanh(self, a: Tensor) -> Tensor:
        return self._unary("tanh", lib.ggml_tanh, a)

    def softplus(self, a: Tensor) -> Tensor:
        return self._unary("softplus", lib.ggml_softplus, a)

    def scale(self, a: Tensor, s: float) -> Tensor:
        ne, nb = a.ne, a.nb
        if nb[2] != nb[1] * ne[1] or nb[3] != nb[2] * ne[2]:  # ggml_is_padded_1d
            fail("scale", f"{a.name!r} must be contiguous beyond its rows (ggml_cont a permuted tensor first)")
        return self._unary("scale", lib.ggml_scale, a, finite("scale", "s", s), types=(F32,))

    def rms_norm(self, a: Tensor, eps: float) -> Tensor:
        eps = finite("rms_norm", "eps", eps)
        if eps < 0:
            fail("rms_norm", f"eps must be >= 0, got {eps}")
        return self._unary("rms_norm", lib.ggml_rms_norm, a, eps, types=(F32,))

    def argmax(self, a: Tensor) -> Tensor:
        self._same_ctx("argmax", a)
        if a.ne[2] != 1 or a.ne[3] != 1:
            fail("argmax", f"needs a matrix, got ne={a.ne}")
        check_type("argmax", a, (F32,))
        self._reserve(None)
        out = self._wrap(lib.ggml_argmax(self.handle, a.ptr))
        out._ndim = 1
        return out

    def top_k(self, a: Tensor, k: int) -> Tensor:
        """ggml_top_k: the i32 indices [k, ...] of each row's k largest values, in no promised order."""
        self._same_ctx("top_k", a)
        check_type("top_k", a, (F32,))
        if not isinstance(k, int) or not 1 <= k <= a.ne[0]:
            fail("top_k", f"k must be an int in [1, {a.ne[0]}], got {k!r}")
        if not a.is_contiguous:  # the CPU kernel steps through rows by ne1's stride alone
            fail("top_k", f"{a.name!r} must be contiguous")
        self._reserve(None)
        out = self._wrap(lib.ggml_top_k(self.handle, a.ptr, k))
        out._ndim = max(1, a.ndim)
        return out

    def mul_mat(self, a: Tensor, b: Tensor, prec_f32: bool = False) -> Tensor:
        """ggml_mul_mat(a, b): a [K, M], b [K, N] -> [M, N] (a is the weight, PyTorch (out, in))."""
        self._same_ctx("mul_mat", a, b)
        ea, eb = a.ne, b.ne
        if ea[0] != eb[0] or eb[2] % ea[2] or eb[3] % ea[3]:
            fail("mul_mat", f"cannot multiply a {ea} by b {eb} (need a.ne0 == b.ne0 and b.ne2/ne3 multiples of a's)")
        if is_transposed(a):
            fail("mul_mat", "a must not be transposed")
        check_type("mul_mat", a, FLOAT + WEIGHT_QUANT, "a")
        if not (b.type_id == F32 or (b.type_id == a.type_id and a.type_id in (F16, BF16))):
            fail("mul_mat", f"b must be f32 (or a's type for f16/bf16 a), got {b.type} with a {a.type}")
        if a.nb[0] != lib.ggml_type_size(a.type_id) or b.nb[0] != lib.ggml_type_size(b.type_id):
            fail("mul_mat", "a and b must have packed rows (ggml_cont a transposed b first)")
        self._reserve(None)
        out = self._wrap(lib.ggml_mul_mat(self.handle, a.ptr, b.ptr))
        if prec_f32:
            lib.ggml_prec_set_acc(out.ptr, lib.GGML_PREC_F32)
        out._ndim = max(2, b.ndim)
        return out

    def soft_max_ext(self, a: Tensor, mask: Tensor | None, scale: float, max_bias: float = 0.0) -> Tensor:
        self._same_ctx("soft_max_ext", a, mask)
        check_type("soft_max_ext", a, (F32,))
        if not a.is_contiguous:
            fail("soft_max_ext", f"{a.name!r} must be contiguous")
        if mask is not None:
            if mask.type_id not in (F16, F32):
                fail("soft_max_ext", "mask must be f16 or f32")
            if not mask.is_contiguous:
                fail("soft_max_ext", "mask must be contiguous")
            if mask.ne[0] != a.ne[0] or mask.ne[1] < a.ne[1] or a.ne[2] % mask.ne[2] or a.ne[3] % mask.ne[3]:
                fail("soft_max_ext", f"mask {mask.ne} does not cover scores {a.ne}")
        elif max_bias > 0:
            fail("soft_max_ext", "max_bias needs a mask")
        self._reserve(None)
        out = self._wrap(
            lib.ggml_soft_max_ext(
                self.handle,
                a.ptr,
                mask.ptr if mask is not None else ffi.NULL,
                finite("soft_max_ext", "scale", scale),
                finite("soft_max_ext", "max_bias", max_bias),
            )
        )
        out._ndim = a.ndim
        return out
