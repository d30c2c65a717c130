"""SlotBook: which absolute position each ring slot of the K/V caches holds; LaneState: one
lane's host bookkeeping (its SlotBook, pending fold-in, and watch on its feature ring).

Pure numpy host bookkeeping, no ggml: position p lives in slot p % cap. `slot_pos[s]` is the
position whose K/V slot s holds (-1: nothing valid), and it is the only source of truth, so
every question ("what does the window still need?", "which keys may a query see?") is answered
from it. See docs/design.md, "Positions and the ring".
"""

from __future__ import annotations

import numpy as np

from ..common.checks import check_int
from .features import RingWatch


class SlotBook:
    """Positions held by the `cap` ring slots, and the highest committed position so far."""

    def __init__(self, cap: int) -> None:
        self.cap = check_int("cap", cap, 1)
        self.slot_pos = np.full(self.cap, -1, dtype=np.int64)
        self.next_pos = 0  # one past the highest position the cache has been brought up to

    def clear(self) -> None:
        """Forget everything (a new request)."""
        self.slot_pos.fill(-1)
        self.next_pos = 0

    def missing(self, lo: int, committed: int) -> np.ndarray:
        """Positions of the window [lo, committed) whose slot does not hold them, ascending."""
        positions = np.arange(lo, committed, dtype=np.int64)
        return positions[self.slot_pos[positions % self.cap] != positions]

    def record(self, positions: np.ndarray) -> None:
        """The K/V of `positions` are being written into their slots (replacing older positions)."""
        self.slot_pos[positions % self.cap] = positions

    def forget(self, positions: np.ndarray) -> None:
        """`positions` were never written after all (a fold-in that was not computed): their slots
        no longer hold a known position."""
        slots = positions % self.cap
        self.slot_pos[slots[self.slot_pos[slots] == positions]] = -1

    def rewind(self, pos: int) -> None:
        """Drop every position >= pos (a partial rewind): only their slots are invalidated; the
        older positions they had overwritten are what `missing()` then reports for the window."""
        pos = check_int("pos", pos, 0)
        self.slot_pos[self.slot_pos >= pos] = -1
        self.next_pos = min(self.next_pos, pos)

    def live(self, lo: int, committed: int) -> np.ndarray:
        """bool (cap,): slots holding a position of the window [lo, committed)."""
        return (self.slot_pos >= lo) & (self.slot_pos < committed)


class LaneState:
    """One lane's host bookkeeping: which position each of its slots holds, what its last
    fold-in left pending, and what its ring dropped since its last step."""

    def __init__(self, cap: int) -> None:
        self.slots = SlotBook(cap)
        self.pending: np.ndarray | None = None  # fold-in positions filled in but not yet computed
        self.ring = RingWatch()
        self.begun = False  # begun for the next compute

    def forget_pending(self) -> None:
        if self.pending is not None:  # the last fold-in was never computed: its slots hold no known rows
            self.slots.forget(self.pending)
            self.pending = None

    def rewind(self, pos: int) -> None:
        self.forget_pending()
        self.slots.rewind(pos)
