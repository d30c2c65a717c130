"""The ggml ops a drafter needs, as Context methods that check ggml's preconditions first.

ggml answers a violated precondition with GGML_ASSERT -> abort(); each method here raises a
ValueError naming the problem instead. Shapes in messages are ggml order (ne0 first).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ._lowlevel import ffi, lib
from .capabilities import BF16_ATTENTION_PATCH, GGML_PREC_BF16, bf16_attention_supported
from .types import QUANT_TYPES, TYPES, ggml_type

if TYPE_CHECKING:  # pragma: no cover
    from .tensor import Tensor

_I32 = lib.GGML_TYPE_I32
_I64 = lib.GGML_TYPE_I64
_F32 = lib.GGML_TYPE_F32
_F16 = lib.GGML_TYPE_F16
_BF16 = lib.GGML_TYPE_BF16
_FLOAT = (_F32, _F16, _BF16)
_QUANT = (lib.GGML_TYPE_Q8_0, lib.GGML_TYPE_Q4_0)
# weight matrices (mul_mat's a, get_rows' table) may also be the k-quants GGUF drafters ship
_WEIGHT_QUANT = tuple(TYPES[n] for n in QUANT_TYPES)
# (a, b) type pairs ggml's CPU add/sub/mul kernels implement (the result has a's type)
_BINARY_TYPES = {(_F32, _F32), (_F16, _F16), (_BF16, _BF16), (_F16, _F32), (_BF16, _F32)}
_ROPE_MODES = (0, lib.GGML_ROPE_TYPE_NEOX)  # ggml_rope_ext: normal or NEOX (M-RoPE/vision need ggml_rope_multi)


def _ne(t: "Tensor") -> tuple[int, int, int, int]:
    return t.ne


def _fail(op: str, msg: str) -> None:
    raise ValueError(f"{op}: {msg}")


def _finite(op: str, name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        _fail(op, f"{name} must be a finite number, got {value!r}")
    return float(value)


def _can_repeat(b: "Tensor", a: "Tensor") -> bool:
    """ggml_can_repeat(b, a): b broadcasts to a."""
    return all(x % y == 0 for x, y in zip(_ne(a), _ne(b)))


def _is_transposed(t: "Tensor") -> bool:
    nb = t.nb
    return nb[0] > nb[1]


def _rows_contiguous(t: "Tensor") -> bool:
    """ggml_is_contiguous_rows: the elements of a row are packed (ne0 is not strided)."""
    return t.ne[0] == lib.ggml_blck_size(t.type_id) or t.nb[0] == lib.ggml_type_size(t.type_id)


def _check_type(op: str, t: "Tensor", allowed: tuple[int, ...], what: str = "input") -> None:
    if t.type_id not in allowed:
        names = "/".join(ffi.string(lib.ggml_type_name(x)).decode() for x in allowed)
        _fail(op, f"{what} must be {names}, got {t.type}")


def _check_convert(op: str, src: "Tensor", dst_type: int, dst_contiguous: bool, dst_nb0: int) -> None:
    """The type conversions ggml's CPU copy kernel implements (anything else aborts at compute)."""
    st = src.type_id
    if st == dst_type or (st in _FLOAT and dst_type in _FLOAT) or (st, dst_type) in ((_F32, _I32), (_I32, _F32)):
        return
    if st in _FLOAT and dst_type in _QUANT:
        if src.nb[0] != lib.ggml_type_size(st) or not dst_contiguous:
            _fail(op, "quantizing needs a source with packed rows and a contiguous destination")
        return
    if st in _QUANT and dst_type == _F32:
        if dst_nb0 != 4:
            _fail(op, "dequantizing needs a destination with packed rows")
        return
    _fail(op, f"cannot convert {src.type} to {ffi.string(lib.ggml_type_name(dst_type)).decode()}")


class OpsMixin:
    """Graph-building ops; mixed into Context."""

    # provided by Context
    def _reserve(self, data_bytes: int | None = 0) -> None: ...  # pragma: no cover
    def _wrap(self, ptr: Any) -> "Tensor": ...  # pragma: no cover
    handle: Any
    _src_ctxs: set[Any]

    def _same_ctx(self, op: str, *tensors: "Tensor | None") -> None:
        for t in tensors:
            if t is not None:
                t._live_ptr()
                if t.ctx is not self:  # ops point into t's context: a graph must not outlive it
                    self._src_ctxs |= {t.ctx, *t.ctx._src_ctxs}

    # -- layout ------------------------------------------------------------------------------
    def view(self, a: "Tensor", ne: tuple[int, ...], nb: tuple[int, ...] = (), offset: int = 0) -> "Tensor":
        """ggml_view_Nd: `ne` in ggml order, `nb` the strides of dims 1.. in bytes (default: a's)."""
        self._same_ctx("view", a)
        n = len(ne)
        if not 1 <= n <= 4 or any(int(d) <= 0 for d in ne):
            _fail("view", f"ne must be 1..4 positive dims, got {ne}")
        strides = list(nb) if nb else list(a.nb[1:n])
        if len(strides) != n - 1:
            _fail("view", f"expected {n - 1} strides for a {n}-d view, got {len(strides)}")
        if offset < 0:
            _fail("view", f"negative offset {offset}")
        if ne[0] % lib.ggml_blck_size(a.type_id):
            _fail("view", f"ne0={ne[0]} is not a multiple of the {a.type} block size")
        row = int(lib.ggml_row_size(a.type_id, ne[0]))
        end = offset + row + sum((int(d) - 1) * int(s) for d, s in zip(ne[1:], strides))
        if end > a.nbytes:
            _fail("view", f"view ends at byte {end}, beyond the {a.nbytes} bytes of {a.name!r}")
        # ggml also asserts that ne's packed size fits from the view's offset in the base tensor
        base = a.ptr.view_src if a.ptr.view_src != ffi.NULL else a.ptr
        base_offset = offset + (int(a.ptr.view_offs) if a.ptr.view_src != ffi.NULL else 0)
        if base_offset + row * math.prod(int(d) for d in ne[1:]) > lib.ggml_nbytes(base):
            _fail("view", f"ne={tuple(ne)} holds more bytes than {a.name!r} has from offset {offset} (overlapping strides?)")
        self._reserve()
        if n == 1:
            ptr = lib.ggml_view_1d(self.handle, a.ptr, ne[0], offset)
        elif n == 2:
            ptr = lib.ggml_view_2d(self.handle, a.ptr, ne[0], ne[1], strides[0], offset)
        elif n == 3:
            ptr = lib.ggml_view_3d(self.handle, a.ptr, ne[0], ne[1], ne[2], strides[0], strides[1], offset)
        else:
            ptr = lib.ggml_view_4d(self.handle, a.ptr, *ne, *strides, offset)
        out = self._wrap(ptr)
        out._ndim = n
        return out

    def reshape(self, a: "Tensor", *ne: int) -> "Tensor":
        self._same_ctx("reshape", a)
        if not 2 <= len(ne) <= 4:
            _fail("reshape", f"2..4 dims supported, got {ne}")
        if not a.is_contiguous:
            _fail("reshape", f"{a.name!r} is not contiguous; ggml_cont it first")
        if math.prod(ne) != a.nelements:
            _fail("reshape", f"cannot reshape {a.nelements} elements of {a.name!r} into {ne}")
        if ne[0] % lib.ggml_blck_size(a.type_id):  # a quantized row must stay whole blocks
            _fail("reshape", f"ne0={ne[0]} is not a multiple of the {a.type} block size")
        self._reserve()
        fn = {2: lib.ggml_reshape_2d, 3: lib.ggml_reshape_3d, 4: lib.ggml_reshape_4d}[len(ne)]
        out = self._wrap(fn(self.handle, a.ptr, *ne))
        out._ndim = len(ne)
        return out

    def permute(self, a: "Tensor", axis0: int, axis1: int, axis2: int, axis3: int) -> "Tensor":
        self._same_ctx("permute", a)
        if sorted((axis0, axis1, axis2, axis3)) != [0, 1, 2, 3]:
            _fail("permute", f"axes must be a permutation of 0..3, got {(axis0, axis1, axis2, axis3)}")
        if axis0 != 0 and lib.ggml_blck_size(a.type_id) > 1:  # blocks live along ne0: moving it corrupts the heap
            _fail("permute", f"a quantized ({a.type}) tensor cannot move its ne0 (block) axis")
        self._reserve()
        out = self._wrap(lib.ggml_permute(self.handle, a.ptr, axis0, axis1, axis2, axis3))
        # source dim i moves to dim axis_i: the result spans the destinations of a's dims
        out._ndim = max((axis0, axis1, axis2, axis3)[i] + 1 for i in range(a.ndim))
        return out

    def cont(self, a: "Tensor") -> "Tensor":
        self._same_ctx("cont", a)
        self._reserve(None)
        out = self._wrap(lib.ggml_cont(self.handle, a.ptr))
        out._ndim = a.ndim
        return out

    def concat(self, a: "Tensor", b: "Tensor", dim: int) -> "Tensor":
        self._same_ctx("concat", a, b)
        if not 0 <= dim < 4:
            _fail("concat", f"dim must be 0..3, got {dim}")
        if a.type_id != b.type_id:
            _fail("concat", f"types differ: {a.type} vs {b.type}")
        for d in range(4):
            if d != dim and a.ne[d] != b.ne[d]:
                _fail("concat", f"ne[{d}] differs: {a.ne} vs {b.ne}")
        self._reserve(None)
        out = self._wrap(lib.ggml_concat(self.handle, a.ptr, b.ptr, dim))
        out._ndim = max(a.ndim, b.ndim, dim + 1)
        return out

    def cpy(self, a: "Tensor", b: "Tensor") -> "Tensor":
        self._same_ctx("cpy", a, b)
        if a.nelements != b.nelements:
            _fail("cpy", f"element counts differ: {a.nelements} vs {b.nelements}")
        _check_convert("cpy", a, b.type_id, b.is_contiguous, b.nb[0])
        self._reserve()
        return self._wrap(lib.ggml_cpy(self.handle, a.ptr, b.ptr))

    def cast(self, a: "Tensor", type: str) -> "Tensor":
        self._same_ctx("cast", a)
        t = ggml_type(type)
        if a.ne[0] % lib.ggml_blck_size(t):
            _fail("cast", f"ne0={a.ne[0]} is not a multiple of the {type} block size")
        _check_convert("cast", a, t, True, int(lib.ggml_type_size(t)))
        self._reserve(None)
        out = self._wrap(lib.ggml_cast(self.handle, a.ptr, t))
        out._ndim = a.ndim
        return out

    # -- arithmetic --------------------------------------------------------------------------
    def _binary(self, op: str, fn: Any, a: "Tensor", b: "Tensor") -> "Tensor":
        self._same_ctx(op, a, b)
        if not _can_repeat(b, a):
            _fail(op, f"b {b.ne} does not broadcast to a {a.ne}")
        if (a.type_id, b.type_id) not in _BINARY_TYPES:
            _fail(op, f"unsupported types a={a.type}, b={b.type} (f32/f16/bf16 alike, or f16/bf16 with f32)")
        if a.nb[0] != lib.ggml_type_size(a.type_id):
            _fail(op, f"a {a.name!r} must have packed rows (not transposed)")
        self._reserve(None)
        out = self._wrap(fn(self.handle, a.ptr, b.ptr))
        out._ndim = a.ndim
        return out

    def add(self, a: "Tensor", b: "Tensor") -> "Tensor":
        return self._binary("add", lib.ggml_add, a, b)

    def sub(self, a: "Tensor", b: "Tensor") -> "Tensor":
        return self._binary("sub", lib.ggml_sub, a, b)

    def mul(self, a: "Tensor", b: "Tensor") -> "Tensor":
        return self._binary("mul", lib.ggml_mul, a, b)

    def _unary(self, op: str, fn: Any, a: "Tensor", *args: Any, types: tuple[int, ...] = _FLOAT) -> "Tensor":
        self._same_ctx(op, a)
        _check_type(op, a, types)
        if not _rows_contiguous(a):
            _fail(op, f"{a.name!r} must have packed rows (not transposed)")
        self._reserve(None)
        out = self._wrap(fn(self.handle, a.ptr, *args))
        out._ndim = a.ndim
        return out

    def silu(self, a: "Tensor") -> "Tensor":
        return self._unary("silu", lib.ggml_silu, a, types=(_F32, _F16))

    def tanh(self, a: "Tensor") -> "Tensor":
        return self._unary("tanh", lib.ggml_tanh, a)

    def softplus(self, a: "Tensor") -> "Tensor":
        return self._unary("softplus", lib.ggml_softplus, a)

    def scale(self, a: "Tensor", s: float) -> "Tensor":
        ne, nb = a.ne, a.nb
        if nb[2] != nb[1] * ne[1] or nb[3] != nb[2] * ne[2]:  # ggml_is_padded_1d
            _fail("scale", f"{a.name!r} must be contiguous beyond its rows (ggml_cont a permuted tensor first)")
        return self._unary("scale", lib.ggml_scale, a, _finite("scale", "s", s), types=(_F32,))

    def rms_norm(self, a: "Tensor", eps: float) -> "Tensor":
        eps = _finite("rms_norm", "eps", eps)
        if eps < 0:
            _fail("rms_norm", f"eps must be >= 0, got {eps}")
        return self._unary("rms_norm", lib.ggml_rms_norm, a, eps, types=(_F32,))

    def argmax(self, a: "Tensor") -> "Tensor":
        self._same_ctx("argmax", a)
        if a.ne[2] != 1 or a.ne[3] != 1:
            _fail("argmax", f"needs a matrix, got ne={a.ne}")
        _check_type("argmax", a, (_F32,))
        self._reserve(None)
        out = self._wrap(lib.ggml_argmax(self.handle, a.ptr))
        out._ndim = 1
        return out

    def mul_mat(self, a: "Tensor", b: "Tensor", prec_f32: bool = False) -> "Tensor":
        """ggml_mul_mat(a, b): a [K, M], b [K, N] -> [M, N] (a is the weight, PyTorch (out, in))."""
        self._same_ctx("mul_mat", a, b)
        ea, eb = a.ne, b.ne
        if ea[0] != eb[0] or eb[2] % ea[2] or eb[3] % ea[3]:
            _fail("mul_mat", f"cannot multiply a {ea} by b {eb} (need a.ne0 == b.ne0 and b.ne2/ne3 multiples of a's)")
        if _is_transposed(a):
            _fail("mul_mat", "a must not be transposed")
        _check_type("mul_mat", a, _FLOAT + _WEIGHT_QUANT, "a")
        if not (b.type_id == _F32 or (b.type_id == a.type_id and a.type_id in (_F16, _BF16))):
            _fail("mul_mat", f"b must be f32 (or a's type for f16/bf16 a), got {b.type} with a {a.type}")
        if a.nb[0] != lib.ggml_type_size(a.type_id) or b.nb[0] != lib.ggml_type_size(b.type_id):
            _fail("mul_mat", "a and b must have packed rows (ggml_cont a transposed b first)")
        self._reserve(None)
        out = self._wrap(lib.ggml_mul_mat(self.handle, a.ptr, b.ptr))
        if prec_f32:
            lib.ggml_mul_mat_set_prec(out.ptr, lib.GGML_PREC_F32)
        out._ndim = max(2, b.ndim)
        return out

    def soft_max_ext(self, a: "Tensor", mask: "Tensor | None", scale: float, max_bias: float = 0.0) -> "Tensor":
        self._same_ctx("soft_max_ext", a, mask)
        _check_type("soft_max_ext", a, (_F32,))
        if not a.is_contiguous:
            _fail("soft_max_ext", f"{a.name!r} must be contiguous")
        if mask is not None:
            if mask.type_id not in (_F16, _F32):
                _fail("soft_max_ext", "mask must be f16 or f32")
            if not mask.is_contiguous:
                _fail("soft_max_ext", "mask must be contiguous")
            if mask.ne[0] != a.ne[0] or mask.ne[1] < a.ne[1] or a.ne[2] % mask.ne[2] or a.ne[3] % mask.ne[3]:
                _fail("soft_max_ext", f"mask {mask.ne} does not cover scores {a.ne}")
        elif max_bias > 0:
            _fail("soft_max_ext", "max_bias needs a mask")
        self._reserve(None)
        out = self._wrap(lib.ggml_soft_max_ext(self.handle, a.ptr, mask.ptr if mask is not None else ffi.NULL,
                                               _finite("soft_max_ext", "scale", scale), _finite("soft_max_ext", "max_bias", max_bias)))
        out._ndim = a.ndim
        return out

    # -- positional / attention ------------------------------------------------------------
    def rope_ext(self, a: "Tensor", pos: "Tensor", n_dims: int, mode: int, n_ctx_orig: int, freq_base: float,
                 freq_scale: float = 1.0, ext_factor: float = 0.0, attn_factor: float = 1.0,
                 beta_fast: float = 32.0, beta_slow: float = 1.0, freq_factors: "Tensor | None" = None) -> "Tensor":
        """ggml_rope_ext on a [head_dim, n_head, tokens] tensor with i32 positions [tokens] (YaRN args included)."""
        self._same_ctx("rope_ext", a, pos, freq_factors)
        if pos.type_id != _I32:
            _fail("rope_ext", f"positions must be i32, got {pos.type}")
        if pos.ne[1:] != (1, 1, 1) or pos.ne[0] != a.ne[2]:
            _fail("rope_ext", f"positions {pos.ne} must be a vector of a.ne2={a.ne[2]} entries")
        if mode not in _ROPE_MODES:
            _fail("rope_ext", f"mode must be 0 (normal) or {lib.GGML_ROPE_TYPE_NEOX} (NEOX), got {mode}")
        _check_type("rope_ext", a, (_F32, _F16))
        if a.nb[0] != lib.ggml_type_size(a.type_id):  # the CPU kernel asserts nb0 == nb00
            _fail("rope_ext", f"{a.name!r} must have packed rows (not transposed)")
        if n_dims <= 0 or n_dims % 2 or n_dims > a.ne[0]:
            _fail("rope_ext", f"n_dims must be even and in (0, ne0={a.ne[0]}], got {n_dims}")
        if freq_factors is not None and (freq_factors.type_id != _F32 or freq_factors.ne[0] < n_dims // 2):
            _fail("rope_ext", "freq_factors must be f32 with at least n_dims/2 entries")
        args = [_finite("rope_ext", n, v) for n, v in (("freq_base", freq_base), ("freq_scale", freq_scale),
                                                        ("ext_factor", ext_factor), ("attn_factor", attn_factor),
                                                        ("beta_fast", beta_fast), ("beta_slow", beta_slow))]
        self._reserve(None)
        out = self._wrap(lib.ggml_rope_ext(self.handle, a.ptr, pos.ptr,
                                           freq_factors.ptr if freq_factors is not None else ffi.NULL,
                                           n_dims, mode, int(n_ctx_orig), *args))
        out._ndim = a.ndim
        return out

    def flash_attn_ext(self, q: "Tensor", k: "Tensor", v: "Tensor", mask: "Tensor | None", scale: float,
                       max_bias: float = 0.0, logit_softcap: float = 0.0, prec_f32: bool = False,
                       prec_bf16: bool = False) -> "Tensor":
        """q [D, n_q, H, 1], k/v [D, n_kv, H_kv, 1], mask f16 [n_kv, >= n_q] -> [D, H, n_q, 1].

        prec_bf16: the CPU kernel may run both products with bf16 inputs on AMX tiles (f32 sums;
        needs vendor/patches/0009, head sizes multiples of 32; elsewhere it computes in f32).
        """
        self._same_ctx("flash_attn_ext", q, k, v, mask)
        if prec_f32 and prec_bf16:
            _fail("flash_attn_ext", "prec_f32 and prec_bf16 exclude each other")
        if prec_bf16:
            if not bf16_attention_supported():
                _fail("flash_attn_ext", f"prec_bf16 needs a ggml built with vendor/patches/{BF16_ATTENTION_PATCH}")
        # the CPU kernel reads q as f32 and needs a dot product for k's type / a conversion for v's
        # (an i32 k would call a NULL vec_dot: a segfault, not an abort)
        _check_type("flash_attn_ext", q, (_F32,), "q")
        _check_type("flash_attn_ext", k, _FLOAT + _QUANT, "k")
        _check_type("flash_attn_ext", v, _FLOAT + _QUANT, "v")
        if any(t.nb[0] != lib.ggml_type_size(t.type_id) for t in (q, k, v)):
            _fail("flash_attn_ext", "q, k and v must have packed rows (not transposed)")
        eq, ek, ev = q.ne, k.ne, v.ne
        if eq[0] != ek[0]:
            _fail("flash_attn_ext", f"q head size {eq[0]} != k head size {ek[0]}")
        if ek[1] != ev[1]:
            _fail("flash_attn_ext", f"k has {ek[1]} rows, v has {ev[1]}")
        if ek[2] != ev[2] or eq[2] % ek[2]:
            _fail("flash_attn_ext", f"query heads {eq[2]} must be a multiple of kv heads {ek[2]} (k and v alike)")
        if eq[3] != ek[3] or eq[3] != ev[3]:
            _fail("flash_attn_ext", "q, k and v must agree on ne3")
        if mask is not None:
            em = mask.ne
            if mask.type_id != _F16:
                _fail("flash_attn_ext", f"mask must be f16, got {mask.type}")
            if not mask.is_contiguous:
                _fail("flash_attn_ext", "mask must be contiguous")
            if em[0] != ek[1] or em[1] < eq[1] or eq[2] % em[2] or eq[3] % em[3]:
                _fail("flash_attn_ext", f"mask {em} does not match k rows {ek[1]} x queries {eq[1]}")
        elif max_bias > 0:
            _fail("flash_attn_ext", "max_bias needs a mask")
        self._reserve(None)
        out = self._wrap(lib.ggml_flash_attn_ext(self.handle, q.ptr, k.ptr, v.ptr,
                                                 mask.ptr if mask is not None else ffi.NULL,
                                                 _finite("flash_attn_ext", "scale", scale),
                                                 _finite("flash_attn_ext", "max_bias", max_bias),
                                                 _finite("flash_attn_ext", "logit_softcap", logit_softcap)))
        if prec_f32:
            lib.ggml_flash_attn_ext_set_prec(out.ptr, lib.GGML_PREC_F32)
        elif prec_bf16:
            lib.ggml_flash_attn_ext_set_prec(out.ptr, GGML_PREC_BF16)
        out._ndim = 4
        return out

    # -- rows ------------------------------------------------------------------------------
    def set_rows(self, a: "Tensor", b: "Tensor", rows: "Tensor") -> "Tensor":
        """Write the rows of f32 `b` [ne0, n] into destination `a` at indices `rows` [n] (i32/i64)."""
        self._same_ctx("set_rows", a, b, rows)
        ea, eb, ec = a.ne, b.ne, rows.ne
        if b.type_id != _F32:
            _fail("set_rows", f"source rows must be f32, got {b.type}")
        if rows.type_id not in (_I32, _I64):
            _fail("set_rows", f"row indices must be i32 or i64, got {rows.type}")
        # the CPU kernel converts with the destination type's from_float (NULL for i8/i16/i64/f64: a segfault)
        _check_type("set_rows", a, _FLOAT + _QUANT + (_I32,), "destination")
        if ea[0] != eb[0] or ea[2] != eb[2] or ea[3] != eb[3]:
            _fail("set_rows", f"destination {ea} and source {eb} rows differ")
        if eb[1] != ec[0] or eb[2] % ec[1] or eb[3] % ec[2] or ec[3] != 1:
            _fail("set_rows", f"{eb[1]} source rows but index tensor {ec}")
        if not (_rows_contiguous(a) and _rows_contiguous(b)):
            _fail("set_rows", "destination and source must have packed rows")
        self._reserve()
        out = self._wrap(lib.ggml_set_rows(self.handle, a.ptr, b.ptr, rows.ptr))
        out._ndim = a.ndim
        return out

    def get_rows(self, a: "Tensor", rows: "Tensor") -> "Tensor":
        """Gather rows of `a` [ne0, n_rows] at i32 indices [n] -> f32 [ne0, n]."""
        self._same_ctx("get_rows", a, rows)
        if rows.type_id != _I32:
            _fail("get_rows", f"row indices must be i32, got {rows.type}")
        _check_type("get_rows", a, _FLOAT + _WEIGHT_QUANT + (_I32,), "data")
        if a.ne[2] != rows.ne[1] or a.ne[3] != rows.ne[2] or rows.ne[3] != 1:
            _fail("get_rows", f"indices {rows.ne} do not match data {a.ne}")
        self._reserve(None)
        out = self._wrap(lib.ggml_get_rows(self.handle, a.ptr, rows.ptr))
        out._ndim = max(2, a.ndim)
        return out
