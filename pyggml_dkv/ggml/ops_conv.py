"""DFlash-2's dynamic convolution as one op: a custom op in C (pyggml_dkv/_cffi/dynamic_conv.c;
the math in docs/dflash2.md, section 1). CPU backend only; other backends build the same sum
from ggml's standard ops (pyggml_dkv.drafter.dflash2_graph)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lowlevel import ffi, lib
from .op_checks import F32, OpBuilder, check_type, fail

if TYPE_CHECKING:  # pragma: no cover
    from .tensor import Tensor


class ConvOps(OpBuilder):
    if TYPE_CHECKING:  # pragma: no cover

        def reshape(self, a: Tensor, *ne: int) -> Tensor: ...  # LayoutOps', beside this mixin in Context

    def dynamic_conv(self, x: Tensor, delta: Tensor, base: Tensor, block: int) -> Tensor:
        """out [H, rows] f32, rows = x's, in blocks of `block` rows that never see each other:

            out[c, i] = sum_{t < K, t <= i % block} (base[t, c] + delta[i, t, c // g]) * x[c, i - t]

        x [H, rows] f32; delta [K * G, rows] f32, tap-major (entry t * G + group, g = H / G
        channels per group); base [H, K] f32. Each with packed rows (views of wider rows are
        fine); x, delta and base are read as they are, so the op runs on the CPU backend only.
        """
        op = "dynamic_conv"
        self._same_ctx(op, x, delta, base)
        for name, t in (("x", x), ("delta", delta), ("base", base)):
            check_type(op, t, (F32,), name)
            if t.ne[2] != 1 or t.ne[3] != 1:
                fail(op, f"{name} must be a matrix, got ne={t.ne}")
            if t.nb[0] != 4:
                fail(op, f"{name} {t.name!r} must have packed rows")
        hidden, rows = x.ne[0], x.ne[1]
        kernel = base.ne[1]
        if base.ne[0] != hidden:
            fail(op, f"base must be [{hidden}, K], got {base.ne[:2]}")
        if delta.ne[1] != rows:
            fail(op, f"delta must have one row per row of x ({rows}), got {delta.ne[1]}")
        if delta.ne[0] % kernel or hidden % (delta.ne[0] // kernel):
            fail(op, f"delta rows of {delta.ne[0]} values are not K={kernel} taps of groups dividing H={hidden}")
        if not isinstance(block, int) or block <= 0 or rows % block:
            fail(op, f"block must be a positive int dividing the {rows} rows, got {block!r}")
        self._reserve(None)
        args = ffi.new("struct ggml_tensor *[3]", [x.ptr, delta.ptr, base.ptr])
        out = self._wrap(
            lib.ggml_custom_4d(
                self.handle,
                lib.GGML_TYPE_F32,
                hidden,
                block,
                rows // block,
                1,
                args,
                3,
                ffi.addressof(lib, "pyggml_dkv_dynamic_conv"),
                lib.GGML_N_TASKS_MAX,
                ffi.NULL,
            )
        )
        out._ndim = 3
        return self.reshape(out, hidden, rows)
