"""Layout ops (views, reshapes, copies, type casts) as Context methods."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ._lowlevel import ffi, lib
from .op_checks import F32, OpBuilder, check_convert, check_type, fail
from .types import ggml_type

if TYPE_CHECKING:  # pragma: no cover
    from .tensor import Tensor


class LayoutOps(OpBuilder):
    def view(self, a: Tensor, ne: tuple[int, ...], nb: tuple[int, ...] = (), offset: int = 0) -> Tensor:
        """ggml_view_Nd: `ne` in ggml order, `nb` the strides of dims 1.. in bytes (default: a's)."""
        self._same_ctx("view", a)
        n = len(ne)
        if not 1 <= n <= 4 or any(int(d) <= 0 for d in ne):
            fail("view", f"ne must be 1..4 positive dims, got {ne}")
        strides = list(nb) if nb else list(a.nb[1:n])
        if len(strides) != n - 1:
            fail("view", f"expected {n - 1} strides for a {n}-d view, got {len(strides)}")
        if offset < 0:
            fail("view", f"negative offset {offset}")
        if ne[0] % lib.ggml_blck_size(a.type_id):
            fail("view", f"ne0={ne[0]} is not a multiple of the {a.type} block size")
        row = int(lib.ggml_row_size(a.type_id, ne[0]))
        end = offset + row + sum((int(d) - 1) * int(s) for d, s in zip(ne[1:], strides))
        if end > a.nbytes:
            fail("view", f"view ends at byte {end}, beyond the {a.nbytes} bytes of {a.name!r}")
        # ggml also asserts that ne's packed size fits from the view's offset in the base tensor
        base = a.ptr.view_src if a.ptr.view_src != ffi.NULL else a.ptr
        base_offset = offset + (int(a.ptr.view_offs) if a.ptr.view_src != ffi.NULL else 0)
        if base_offset + row * math.prod(int(d) for d in ne[1:]) > lib.ggml_nbytes(base):
            fail(
                "view",
                f"ne={tuple(ne)} holds more bytes than {a.name!r} has from offset {offset} (overlapping strides?)",
            )
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

    def reshape(self, a: Tensor, *ne: int) -> Tensor:
        self._same_ctx("reshape", a)
        if not 2 <= len(ne) <= 4:
            fail("reshape", f"2..4 dims supported, got {ne}")
        if not a.is_contiguous:
            fail("reshape", f"{a.name!r} is not contiguous; ggml_cont it first")
        if math.prod(ne) != a.nelements:
            fail("reshape", f"cannot reshape {a.nelements} elements of {a.name!r} into {ne}")
        if ne[0] % lib.ggml_blck_size(a.type_id):  # a quantized row must stay whole blocks
            fail("reshape", f"ne0={ne[0]} is not a multiple of the {a.type} block size")
        self._reserve()
        fn = {2: lib.ggml_reshape_2d, 3: lib.ggml_reshape_3d, 4: lib.ggml_reshape_4d}[len(ne)]
        out = self._wrap(fn(self.handle, a.ptr, *ne))
        out._ndim = len(ne)
        return out

    def permute(self, a: Tensor, axis0: int, axis1: int, axis2: int, axis3: int) -> Tensor:
        self._same_ctx("permute", a)
        if sorted((axis0, axis1, axis2, axis3)) != [0, 1, 2, 3]:
            fail("permute", f"axes must be a permutation of 0..3, got {(axis0, axis1, axis2, axis3)}")
        if axis0 != 0 and lib.ggml_blck_size(a.type_id) > 1:  # blocks live along ne0: moving it corrupts the heap
            fail("permute", f"a quantized ({a.type}) tensor cannot move its ne0 (block) axis")
        self._reserve()
        out = self._wrap(lib.ggml_permute(self.handle, a.ptr, axis0, axis1, axis2, axis3))
        # source dim i moves to dim axis_i: the result spans the destinations of a's dims
        out._ndim = max((axis0, axis1, axis2, axis3)[i] + 1 for i in range(a.ndim))
        return out

    def cont(self, a: Tensor) -> Tensor:
        self._same_ctx("cont", a)
        self._reserve(None)
        out = self._wrap(lib.ggml_cont(self.handle, a.ptr))
        out._ndim = a.ndim
        return out

    def concat(self, a: Tensor, b: Tensor, dim: int) -> Tensor:
        self._same_ctx("concat", a, b)
        if not 0 <= dim < 4:
            fail("concat", f"dim must be 0..3, got {dim}")
        if a.type_id != b.type_id:
            fail("concat", f"types differ: {a.type} vs {b.type}")
        for d in range(4):
            if d != dim and a.ne[d] != b.ne[d]:
                fail("concat", f"ne[{d}] differs: {a.ne} vs {b.ne}")
        self._reserve(None)
        out = self._wrap(lib.ggml_concat(self.handle, a.ptr, b.ptr, dim))
        out._ndim = max(a.ndim, b.ndim, dim + 1)
        return out

    def repeat(self, a: Tensor, *ne: int) -> Tensor:
        """ggml_repeat_4d: a tiled to shape `ne` (each of a's dims must divide the new one)."""
        self._same_ctx("repeat", a)
        if not 1 <= len(ne) <= 4 or any(not isinstance(d, int) or d <= 0 for d in ne):
            fail("repeat", f"ne must be 1..4 positive ints, got {ne}")
        full = (*ne, *(1,) * (4 - len(ne)))
        if any(d % s for d, s in zip(full, a.ne)):
            fail("repeat", f"{a.name!r} {a.ne} does not tile {full}")
        check_type("repeat", a, (F32,))
        if a.nb[0] != lib.ggml_type_size(a.type_id):
            fail("repeat", f"{a.name!r} must have packed rows (not transposed)")
        self._reserve(None)
        out = self._wrap(lib.ggml_repeat_4d(self.handle, a.ptr, *full))
        out._ndim = max(len(ne), a.ndim)
        return out

    def pad(self, a: Tensor, before: tuple[int, ...], after: tuple[int, ...] = ()) -> Tensor:
        """ggml_pad_ext: zeros added before / after each dim (ggml order, missing dims 0)."""
        self._same_ctx("pad", a)
        lp = (*before, *(0,) * (4 - len(before)))
        rp = (*after, *(0,) * (4 - len(after)))
        if len(lp) != 4 or len(rp) != 4 or any(not isinstance(p, int) or p < 0 for p in (*lp, *rp)):
            fail("pad", f"padding must be up to 4 ints >= 0 per side, got {before} / {after}")
        check_type("pad", a, (F32,))
        if a.nb[0] != lib.ggml_type_size(a.type_id):
            fail("pad", f"{a.name!r} must have packed rows (not transposed)")
        self._reserve(None)
        out = self._wrap(lib.ggml_pad_ext(self.handle, a.ptr, lp[0], rp[0], lp[1], rp[1], lp[2], rp[2], lp[3], rp[3]))
        out._ndim = max(a.ndim, *(d + 1 for d in range(4) if lp[d] or rp[d]))
        return out

    def cpy(self, a: Tensor, b: Tensor) -> Tensor:
        self._same_ctx("cpy", a, b)
        if a.nelements != b.nelements:
            fail("cpy", f"element counts differ: {a.nelements} vs {b.nelements}")
        check_convert("cpy", a, b.type_id, b.is_contiguous, b.nb[0])
        self._reserve()
        return self._wrap(lib.ggml_cpy(self.handle, a.ptr, b.ptr))

    def cast(self, a: Tensor, type: str) -> Tensor:
        self._same_ctx("cast", a)
        t = ggml_type(type)
        if a.ne[0] % lib.ggml_blck_size(t):
            fail("cast", f"ne0={a.ne[0]} is not a multiple of the {type} block size")
        check_convert("cast", a, t, True, int(lib.ggml_type_size(t)))
        self._reserve(None)
        out = self._wrap(lib.ggml_cast(self.handle, a.ptr, t))
        out._ndim = a.ndim
        return out
