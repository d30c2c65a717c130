"""The screened argmax op: argmax_t (exact_t . x) per column x, with only the rows a q8_0 screen
cannot rule out multiplied exactly (a custom op in C: pyggml_dkv/_cffi/screened_argmax.c; the
bound it uses is derived in docs/design.md, "Exact draft ids from a screened head")."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lowlevel import ffi, lib
from .liveness import reads_repacked
from .op_checks import BF16, F16, F32, OpBuilder, check_type, fail

if TYPE_CHECKING:  # pragma: no cover
    from .tensor import Tensor

SCREEN_BLOCK = 32  # the screen product quantizes x per 32 values (q8_0's block)


def _contiguous_matrix(op: str, name: str, t: Tensor) -> None:
    if t.ne[2] != 1 or t.ne[3] != 1:
        fail(op, f"{name} must be a matrix, got ne={t.ne}")
    if not t.is_contiguous:
        fail(op, f"{name} {t.name!r} must be contiguous (packed rows, one after the other)")


def _in_host_memory(op: str, name: str, t: Tensor) -> None:
    """The op reads `t` directly: allocated, in CPU-addressable memory, not repacked."""
    p = t.ptr
    if not t.is_allocated:
        fail(op, f"{name} {t.name!r} must already be allocated (the op reads it as it is)")
    if not lib.ggml_backend_buffer_is_host(p.buffer):
        fail(op, f"{name} {t.name!r} is not in host memory: the op runs on the CPU backend only")
    if reads_repacked(p):
        fail(op, f"{name} {t.name!r} is stored repacked for a CPU kernel; the op reads plain rows")


class ScreenOps(OpBuilder):
    def screened_argmax(self, scores: Tensor, x: Tensor, exact: Tensor, bounds: Tensor) -> Tensor:
        """ids [Q] i32: for each column x_q of x [H, Q], argmax_t of exact_t . x_q over the V rows
        of `exact` [H, V] (f32 / f16 / bf16, in host memory), the lowest t on a tie; -1 for a column
        that is not finite, -2 if the op could not allocate its scratch memory.

        `scores` [V, Q] f32 = mul_mat(screen, x) with `screen` the q8_0 quantization of `exact`, and
        `bounds` [2, V + 1] f32 = pyggml_dkv.ggml.screen.screen_bounds(exact) for that screen:
        (|exact_t - screen_t|, |screen_t|) per row, then their maxima. Only the rows whose score is
        within the bound of the best are multiplied exactly (in double precision). CPU backend only.
        """
        op = "screened_argmax"
        self._same_ctx(op, scores, x, exact, bounds)
        check_type(op, scores, (F32,), "scores")
        check_type(op, x, (F32,), "x")
        check_type(op, exact, (F32, F16, BF16), "exact")
        check_type(op, bounds, (F32,), "bounds")
        for name, t in (("scores", scores), ("x", x), ("exact", exact), ("bounds", bounds)):
            _contiguous_matrix(op, name, t)
        h, q = x.ne[0], x.ne[1]
        v = exact.ne[1]
        if exact.ne[0] != h:
            fail(op, f"exact rows have {exact.ne[0]} values, x columns {h}")
        if h % SCREEN_BLOCK:
            fail(op, f"x columns must be a multiple of {SCREEN_BLOCK} values (q8_0 blocks), got {h}")
        if scores.ne[:2] != (v, q):
            fail(op, f"scores must be [{v}, {q}] (one per row of exact and column of x), got {scores.ne[:2]}")
        if bounds.ne[:2] != (2, v + 1):
            fail(op, f"bounds must be [2, {v + 1}] (two per row of exact, then their maxima), got {bounds.ne[:2]}")
        if v >= 2**31:
            fail(op, f"exact has {v} rows; ids are int32")
        _in_host_memory(op, "exact", exact)
        _in_host_memory(op, "bounds", bounds)
        self._reserve(None)
        args = ffi.new("struct ggml_tensor *[4]", [scores.ptr, x.ptr, exact.ptr, bounds.ptr])
        out = self._wrap(
            lib.ggml_custom_4d(
                self.handle,
                lib.GGML_TYPE_I32,
                q,
                1,
                1,
                1,
                args,
                4,
                ffi.addressof(lib, "pyggml_dkv_screened_argmax"),
                lib.GGML_N_TASKS_MAX,
                ffi.NULL,
            )
        )
        out._ndim = 1
        return out
