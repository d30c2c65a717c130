"""Which backend buffers are alive, so nothing reads, writes or computes freed memory.

Every ggml backend buffer we own that is still alive (Buffers and Gallocr buffers) maps its
address to a token unique to that allocation. malloc reuses the address of a freed buffer for the
next one, so a graph remembers (address, token) pairs, and tensors placed in a freed buffer are
detached (data = buffer = NULL) where we can reach them.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator
from typing import Any

from ._lowlevel import ffi

live_buffers: dict[int, int] = {}
# the live buffers whose tensors were repacked on upload (REPACKING_BUFFER_TYPES): write-whole, never read
repacked_buffers: set[int] = set()
_tokens = itertools.count(1)


def new_token() -> int:
    """A token no earlier allocation had."""
    return next(_tokens)


def addr(ptr: Any) -> int:
    return int(ffi.cast("uintptr_t", ptr))


def reads_repacked(p: Any) -> bool:
    """Does tensor `p` (or the tensor it views) live in a repacking buffer?"""
    base = p.view_src if p.view_src != ffi.NULL else p
    return bool(repacked_buffers) and any(
        t.buffer != ffi.NULL and addr(t.buffer) in repacked_buffers for t in (p, base)
    )


def detach(ptrs: Iterator[Any], addrs: set[int] | None) -> None:
    """Forget the data of tensors placed in the freed buffers `addrs` (None: in any non-live buffer)."""
    for p in ptrs:
        if p.buffer != ffi.NULL and (
            addr(p.buffer) in addrs if addrs is not None else addr(p.buffer) not in live_buffers
        ):
            p.buffer = ffi.NULL
            p.data = ffi.NULL


# DeltaUploads (ggml.delta) remember what their tensor holds on the device. A write through the
# binding that overlaps their bytes, or a clear of their buffer, makes them forget it (the next
# upload is whole). Each has .span = (start, end) data addresses and .buffer_addr.
delta_uploads: weakref.WeakSet[Any] = weakref.WeakSet()


def forget_deltas_overlapping(start: int, end: int) -> None:
    for up in list(delta_uploads):
        s, e = up.span
        if start < e and s < end:
            up.invalidate()


def forget_deltas_in_buffer(buffer_addr: int) -> None:
    for up in list(delta_uploads):
        if up.buffer_addr == buffer_addr:
            up.invalidate()
