"""Ownership of ggml handles: each freed exactly once, by close(), `with` or the garbage collector."""

from __future__ import annotations

import threading
import weakref
from typing import Any

from .errors import GGMLError


class Owned:
    """An object owning one ggml handle, freed exactly once by close() or the finalizer."""

    _live: dict[str, int] = {}
    _live_lock = threading.Lock()

    def _own(self, handle: Any, free_fn: Any, kind: str) -> None:
        self._handle = handle
        self._kind = kind
        with Owned._live_lock:
            Owned._live[kind] = Owned._live.get(kind, 0) + 1
        self._finalizer = weakref.finalize(self, Owned._free, free_fn, handle, kind)
        # Not at interpreter exit: a daemon thread may still be stepping a cache (its compute runs
        # without the GIL), and freeing its buffers under it segfaults the exit. The OS reclaims
        # everything anyway; close() and garbage collection before exit still free as usual.
        self._finalizer.atexit = False

    @staticmethod
    def _free(free_fn: Any, handle: Any, kind: str) -> None:
        free_fn(handle)
        with Owned._live_lock:
            Owned._live[kind] -= 1

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Free the ggml handle now. Idempotent."""
        self._finalizer()

    def _check_open(self) -> None:
        if self.closed:
            raise GGMLError(f"{type(self).__name__} is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def live_objects() -> dict[str, int]:
    """How many ggml handles of each kind (backend, buffer, context, gallocr) are alive now."""
    with Owned._live_lock:
        return dict(Owned._live)
