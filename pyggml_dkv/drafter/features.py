"""FeatureRing: the host's ring of captured target features, one row per committed token (docs/design.md, "Positions and the ring")."""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any

import numpy as np

from ..common.bf16 import from_bf16_bits, to_bf16_bits
from ..common.checks import is_int

RING_DTYPES = ("f32", "f16", "bf16")


class FeatureRing:
    """`cap` rows of `fc_in` features; position p lives in row p % cap.

    Positions [oldest, written) are readable. Writing at a position below `written` (after a
    rewind) discards every later position. Unwritten storage is NaN, so reading a row that was
    never written could not go unnoticed.
    """

    def __init__(self, cap: int, fc_in: int, dtype: str = "f32") -> None:
        for name, value in (("cap", cap), ("fc_in", fc_in)):
            if not is_int(value) or value <= 0:
                raise ValueError(f"FeatureRing {name} must be a positive int, got {value!r}")
        if dtype not in RING_DTYPES:
            raise ValueError(f"FeatureRing dtype must be one of {RING_DTYPES}, got {dtype!r}")
        if int(cap) * int(fc_in) > 2**33:
            raise ValueError(f"FeatureRing of {cap} x {fc_in} is too large")
        self.cap = int(cap)
        self.fc_in = int(fc_in)
        self.dtype = dtype
        if dtype == "bf16":
            self._rows = np.full((self.cap, self.fc_in), 0x7FC0, dtype=np.uint16)
        else:
            self._rows = np.full((self.cap, self.fc_in), np.nan, dtype=np.float32 if dtype == "f32" else np.float16)
        self.written = 0  # next position to write
        self.oldest = 0  # first position still readable
        # consumers that keep state derived from positions (the ring cache) must learn when written
        # positions are dropped (truncate, clear, or a write below `written`): each drop bumps
        # `epoch`, and the last few drops are kept as (epoch, first dropped position)
        self.epoch = 0
        self._drops: deque[tuple[int, int]] = deque(maxlen=64)

    def _dropped(self, pos: int) -> None:
        self.epoch += 1
        self._drops.append((self.epoch, int(pos)))

    def dropped_since(self, epoch: int) -> int | None:
        """The lowest position dropped after `epoch` (None: nothing dropped; 0 when the history
        no longer reaches back that far)."""
        if epoch == self.epoch:
            return None
        if not self._drops or self._drops[0][0] > epoch + 1:
            return 0
        return min(p for e, p in self._drops if e > epoch)

    def __len__(self) -> int:
        return self.written - self.oldest

    def _encode(self, rows: np.ndarray) -> np.ndarray:
        if self.dtype == "bf16":
            return to_bf16_bits(rows)
        return rows.astype(self._rows.dtype, copy=False)

    def _check_rows(self, rows: object) -> np.ndarray:
        arr = np.asarray(rows)
        shape = arr.shape
        if arr.ndim == 1:
            arr = arr[None, :]
        if arr.ndim != 2 or arr.shape[1] != self.fc_in:
            raise ValueError(f"feature rows must have shape (n, {self.fc_in}), got {shape}")
        if arr.dtype.kind != "f":
            raise TypeError(f"feature rows must be floating point, got dtype {arr.dtype}")
        if not np.isfinite(arr).all():
            bad = int(np.argwhere(~np.isfinite(arr))[0][0])
            raise ValueError(f"feature rows contain NaN or inf (first at row {bad})")
        return arr

    def append(self, rows: object) -> None:
        """Write rows for positions written, written+1, ..."""
        self.write(self.written, rows)

    def write(self, pos: int, rows: object) -> None:
        """Write rows at absolute positions pos.. ; pos <= written (a pos below truncates the ring there)."""
        if not is_int(pos):
            raise TypeError(f"pos must be an int, got {type(pos).__name__}")
        pos = int(pos)
        if pos < 0 or pos > self.written:
            raise ValueError(f"cannot write at position {pos}: positions must be contiguous (written={self.written})")
        if pos < self.oldest:
            raise ValueError(f"cannot write at position {pos}: it is older than the oldest kept position {self.oldest}")
        arr = self._check_rows(rows)
        n = arr.shape[0]
        if n == 0:
            return
        if pos < self.written:
            self._dropped(pos)
        if n > self.cap:  # only the last cap rows survive
            arr, pos, skipped = arr[n - self.cap :], pos + n - self.cap, n - self.cap
            n = self.cap
        else:
            skipped = 0
        enc = self._encode(arr)
        first = pos % self.cap
        head = min(n, self.cap - first)
        self._rows[first : first + head] = enc[:head]
        self._rows[: n - head] = enc[head:]
        self.written = pos + n
        self.oldest = max(self.oldest, self.written - self.cap) if skipped == 0 else self.written - self.cap

    def truncate(self, pos: int) -> None:
        """Forget positions >= pos (after verification rejected them)."""
        if not is_int(pos):
            raise TypeError(f"pos must be an int, got {type(pos).__name__}")
        if not self.oldest <= pos <= self.written:
            raise ValueError(f"cannot truncate to {pos}: readable positions are [{self.oldest}, {self.written})")
        if pos < self.written:
            self._dropped(pos)
        self.written = int(pos)

    def clear(self) -> None:
        """Forget everything (a new request)."""
        if self.written:
            self._dropped(0)
        self.written = 0
        self.oldest = 0

    def read(self, start: int, n: int) -> np.ndarray:
        """Positions [start, start+n) as float32 (n, fc_in); refuses overwritten or unwritten ones."""
        for name, value in (("start", start), ("n", n)):
            if not is_int(value):
                raise TypeError(f"read {name} must be an int, got {value!r}")
        if n < 0 or start < 0:
            raise ValueError(f"bad read range start={start}, n={n}")
        out = np.empty((int(n), self.fc_in), dtype=np.float32)
        self.read_into(start, out)
        return out

    def read_into(self, start: int, out: np.ndarray) -> None:
        """Like read(), into a caller-owned float32 (n, fc_in) array (no allocation)."""
        n = out.shape[0]
        start = int(start)
        if n < 0 or start < 0:
            raise ValueError(f"bad range start={start}, n={n}")
        if n == 0:
            return
        if start < self.oldest:
            raise ValueError(
                f"positions from {start} were overwritten (oldest kept: {self.oldest}, ring cap {self.cap})"
            )
        if start + n > self.written:
            raise ValueError(f"positions up to {start + n - 1} were never written (written={self.written})")
        first = start % self.cap
        head = min(n, self.cap - first)
        if self.dtype == "bf16":
            out[:head] = from_bf16_bits(self._rows[first : first + head])
            out[head:] = from_bf16_bits(self._rows[: n - head])
        else:
            out[:head] = self._rows[first : first + head]
            out[head:] = self._rows[: n - head]


def check_window(ring: FeatureRing, committed: Any, cap: int, fc_in: int) -> int:
    """`committed` as an int, after checking `ring` holds every feature row of the window
    [committed - min(committed, cap), committed) a drafter of this fc_in needs."""
    if not isinstance(ring, FeatureRing):
        raise TypeError(f"ring must be a FeatureRing, got {type(ring).__name__}")
    if ring.fc_in != fc_in:
        raise ValueError(f"ring has fc_in={ring.fc_in}, this drafter needs fc_in={fc_in}")
    if not is_int(committed):
        raise TypeError(f"committed must be an int, got {type(committed).__name__}")
    committed = int(committed)
    if committed <= 0:
        raise ValueError(f"committed must be > 0 (the drafter needs at least one context token), got {committed}")
    if committed > ring.written:
        raise ValueError(f"committed={committed} but the ring only holds features up to position {ring.written - 1}")
    lo = committed - min(committed, cap)
    if lo < ring.oldest:
        raise ValueError(
            f"the window [{lo}, {committed}) needs positions the ring has overwritten "
            f"(oldest kept: {ring.oldest}); make the ring at least cap={cap} rows"
        )
    return committed


class RingWatch:
    """For a consumer that keeps state derived from a ring's positions (the ring cache): which
    positions it must forget since it last looked."""

    def __init__(self) -> None:
        self._seen: tuple[Any, int] | None = None  # (weakref to the ring, its epoch then)

    def look(self, ring: FeatureRing) -> None:
        self._seen = (weakref.ref(ring), ring.epoch)

    def dropped(self, ring: FeatureRing) -> int | None:
        """The lowest position to forget: 0 for another ring than last time, the lowest position
        the ring dropped (and maybe rewrote) since, or None when nothing changed."""
        if self._seen is None:
            return None
        ref, epoch = self._seen
        return 0 if ref() is not ring else ring.dropped_since(epoch)
