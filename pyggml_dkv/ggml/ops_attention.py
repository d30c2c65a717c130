"""Position and attention ops (RoPE, flash attention) and row gathers / scatters as Context methods."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lowlevel import ffi, lib
from .capabilities import BF16_ATTENTION_KERNEL, GGML_PREC_BF16, bf16_attention_supported
from .op_checks import (
    F16,
    F32,
    FLOAT,
    I32,
    I64,
    QUANT,
    ROPE_MODES,
    WEIGHT_QUANT,
    OpBuilder,
    check_type,
    fail,
    finite,
    rows_contiguous,
)

if TYPE_CHECKING:  # pragma: no cover
    from .tensor import Tensor


class AttentionOps(OpBuilder):
    def rope_ext(
        self,
        a: Tensor,
        pos: Tensor,
        n_dims: int,
        mode: int,
        n_ctx_orig: int,
        freq_base: float,
        freq_scale: float = 1.0,
        ext_factor: float = 0.0,
        attn_factor: float = 1.0,
        beta_fast: float = 32.0,
        beta_slow: float = 1.0,
        freq_factors: Tensor | None = None,
    ) -> Tensor:
        """ggml_rope_ext on a [head_dim, n_head, tokens] tensor with i32 positions [tokens] (YaRN args included)."""
        self._same_ctx("rope_ext", a, pos, freq_factors)
        if pos.type_id != I32:
            fail("rope_ext", f"positions must be i32, got {pos.type}")
        if pos.ne[1:] != (1, 1, 1) or pos.ne[0] != a.ne[2]:
            fail("rope_ext", f"positions {pos.ne} must be a vector of a.ne2={a.ne[2]} entries")
        if mode not in ROPE_MODES:
            fail("rope_ext", f"mode must be 0 (normal) or {lib.GGML_ROPE_TYPE_NEOX} (NEOX), got {mode}")
        check_type("rope_ext", a, (F32, F16))
        if a.nb[0] != lib.ggml_type_size(a.type_id):  # the CPU kernel asserts nb0 == nb00
            fail("rope_ext", f"{a.name!r} must have packed rows (not transposed)")
        if n_dims <= 0 or n_dims % 2 or n_dims > a.ne[0]:
            fail("rope_ext", f"n_dims must be even and in (0, ne0={a.ne[0]}], got {n_dims}")
        if freq_factors is not None and (freq_factors.type_id != F32 or freq_factors.ne[0] < n_dims // 2):
            fail("rope_ext", "freq_factors must be f32 with at least n_dims/2 entries")
        args = [
            finite("rope_ext", n, v)
            for n, v in (
                ("freq_base", freq_base),
                ("freq_scale", freq_scale),
                ("ext_factor", ext_factor),
                ("attn_factor", attn_factor),
                ("beta_fast", beta_fast),
                ("beta_slow", beta_slow),
            )
        ]
        self._reserve(None)
        out = self._wrap(
            lib.ggml_rope_ext(
                self.handle,
                a.ptr,
                pos.ptr,
                freq_factors.ptr if freq_factors is not None else ffi.NULL,
                n_dims,
                mode,
                int(n_ctx_orig),
                *args,
            )
        )
        out._ndim = a.ndim
        return out

    def flash_attn_ext(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None,
        scale: float,
        max_bias: float = 0.0,
        logit_softcap: float = 0.0,
        prec_f32: bool = False,
        prec_bf16: bool = False,
    ) -> Tensor:
        """q [D, n_q, H, 1], k/v [D, n_kv, H_kv, 1], mask f16 [n_kv, >= n_q] -> [D, H, n_q, 1].

        prec_bf16: the CPU kernel may run both products with bf16 inputs on AMX tiles (f32 sums;
        needs our attention kernel, BF16_ATTENTION_KERNEL; head sizes multiples of 32; elsewhere it
        computes in f32).
        """
        self._same_ctx("flash_attn_ext", q, k, v, mask)
        if prec_f32 and prec_bf16:
            fail("flash_attn_ext", "prec_f32 and prec_bf16 exclude each other")
        if prec_bf16 and not bf16_attention_supported():
            fail(
                "flash_attn_ext",
                f"prec_bf16 needs a ggml build with our bf16 attention kernel "
                f"({BF16_ATTENTION_KERNEL!r}; built_capabilities() lists this build's)",
            )
        # the CPU kernel reads q as f32 and needs a dot product for k's type / a conversion for v's
        # (an i32 k would call a NULL vec_dot: a segfault, not an abort)
        check_type("flash_attn_ext", q, (F32,), "q")
        check_type("flash_attn_ext", k, FLOAT + QUANT, "k")
        check_type("flash_attn_ext", v, FLOAT + QUANT, "v")
        if any(t.nb[0] != lib.ggml_type_size(t.type_id) for t in (q, k, v)):
            fail("flash_attn_ext", "q, k and v must have packed rows (not transposed)")
        eq, ek, ev = q.ne, k.ne, v.ne
        if eq[0] != ek[0]:
            fail("flash_attn_ext", f"q head size {eq[0]} != k head size {ek[0]}")
        if ek[1] != ev[1]:
            fail("flash_attn_ext", f"k has {ek[1]} rows, v has {ev[1]}")
        if ek[2] != ev[2] or eq[2] % ek[2]:
            fail("flash_attn_ext", f"query heads {eq[2]} must be a multiple of kv heads {ek[2]} (k and v alike)")
        if eq[3] != ek[3] or eq[3] != ev[3]:
            fail("flash_attn_ext", "q, k and v must agree on ne3")
        if mask is not None:
            em = mask.ne
            if mask.type_id != F16:
                fail("flash_attn_ext", f"mask must be f16, got {mask.type}")
            if not mask.is_contiguous:
                fail("flash_attn_ext", "mask must be contiguous")
            if em[0] != ek[1] or em[1] < eq[1] or eq[2] % em[2] or eq[3] % em[3]:
                fail("flash_attn_ext", f"mask {em} does not match k rows {ek[1]} x queries {eq[1]}")
        elif max_bias > 0:
            fail("flash_attn_ext", "max_bias needs a mask")
        self._reserve(None)
        out = self._wrap(
            lib.ggml_flash_attn_ext(
                self.handle,
                q.ptr,
                k.ptr,
                v.ptr,
                mask.ptr if mask is not None else ffi.NULL,
                finite("flash_attn_ext", "scale", scale),
                finite("flash_attn_ext", "max_bias", max_bias),
                finite("flash_attn_ext", "logit_softcap", logit_softcap),
            )
        )
        if prec_f32:
            lib.ggml_prec_set_acc(out.ptr, lib.GGML_PREC_F32)
        elif prec_bf16:
            lib.ggml_prec_set_acc(out.ptr, GGML_PREC_BF16)
        out._ndim = 4
        return out

    # -- rows ------------------------------------------------------------------------------
    def set_rows(self, a: Tensor, b: Tensor, rows: Tensor) -> Tensor:
        """Write the rows of f32 `b` [ne0, n] into destination `a` at indices `rows` [n] (i32/i64)."""
        self._same_ctx("set_rows", a, b, rows)
        ea, eb, ec = a.ne, b.ne, rows.ne
        if b.type_id != F32:
            fail("set_rows", f"source rows must be f32, got {b.type}")
        if rows.type_id not in (I32, I64):
            fail("set_rows", f"row indices must be i32 or i64, got {rows.type}")
        # the CPU kernel converts with the destination type's from_float (NULL for i8/i16/i64/f64: a segfault)
        check_type("set_rows", a, FLOAT + QUANT + (I32,), "destination")
        if ea[0] != eb[0] or ea[2] != eb[2] or ea[3] != eb[3]:
            fail("set_rows", f"destination {ea} and source {eb} rows differ")
        if eb[1] != ec[0] or eb[2] % ec[1] or eb[3] % ec[2] or ec[3] != 1:
            fail("set_rows", f"{eb[1]} source rows but index tensor {ec}")
        if not (rows_contiguous(a) and rows_contiguous(b)):
            fail("set_rows", "destination and source must have packed rows")
        self._reserve()
        out = self._wrap(lib.ggml_set_rows(self.handle, a.ptr, b.ptr, rows.ptr))
        out._ndim = a.ndim
        return out

    def get_rows(self, a: Tensor, rows: Tensor) -> Tensor:
        """Gather rows of `a` [ne0, n_rows] at i32 indices [n] -> f32 [ne0, n]."""
        self._same_ctx("get_rows", a, rows)
        if rows.type_id != I32:
            fail("get_rows", f"row indices must be i32, got {rows.type}")
        check_type("get_rows", a, FLOAT + WEIGHT_QUANT + (I32,), "data")
        if a.ne[2] != rows.ne[1] or a.ne[3] != rows.ne[2] or rows.ne[3] != 1:
            fail("get_rows", f"indices {rows.ne} do not match data {a.ne}")
        self._reserve(None)
        out = self._wrap(lib.ggml_get_rows(self.handle, a.ptr, rows.ptr))
        out._ndim = max(2, a.ndim)
        return out
