"""Requests of the speculative engine: their parameters, the handle a client holds, their statistics.

A `RequestHandle` is filled by the engine's thread and read by the client's: iterate it for the
generated token ids as rounds commit them (blocking), `result()` waits for the end,
`cancel()` ends it at once (the engine frees its sequence and lane before its next round).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..common.checks import is_int, is_real
from ..common.errors import PyggmlDkvError

log = logging.getLogger(__name__)


class EngineError(PyggmlDkvError, RuntimeError):
    """The engine could not run a request (a decode failed); the request ended with "error"."""


class EngineClosedError(EngineError):
    """The engine is shut down (or shutting down) and takes no more requests."""


class QueueFullError(EngineError):
    """Every sequence is busy and the waiting queue is full: try again later (HTTP 429)."""


FINISH_REASONS = ("stop", "length", "cancelled", "error")


@dataclass(frozen=True)
class RequestParams:
    """Sampling and stopping for one request (temperature 0: greedy)."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()  # besides the vocabulary's end-of-generation tokens
    stop_at_eog: bool = True
    record_gaps: bool = False  # keep each token's top-2 logit gap (compare_to_plain; ~0.3 ms a token)

    def validate(self, n_vocab: int) -> None:
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if self.seed is not None and (not is_int(self.seed) or self.seed < 0):
            raise ValueError(f"seed must be None or an int >= 0, got {self.seed!r}")
        bad = [t for t in self.stop_token_ids if not is_int(t) or not 0 <= t < n_vocab]
        if bad:
            raise ValueError(f"stop_token_ids must be token ids in [0, {n_vocab}), got {bad}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RequestStats:
    """Per request: tokens, verify rounds, the draft length chosen and the drafts accepted in each, times."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt positions kept from the previous request on its sequence (not decoded)
    speculative: bool = False  # started capturing features, free to draft (else plain from the start)
    stopped_speculating_at: int | None = None  # the verify round at which it gave drafting up
    n_tokens: int = 0  # generated tokens (the prefill's first one included, a stop token not)
    draft_lengths: list[int] = field(default_factory=list)  # k chosen per verify round
    accepted: list[int] = field(default_factory=list)  # drafts accepted per verify round
    emitted: list[int] = field(default_factory=list)  # tokens emitted per verify round
    lane: int | None = None  # the sequence / drafter lane it ran on
    submitted_at: float = 0.0  # time.perf_counter()
    started_at: float | None = None  # given a sequence
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def rounds(self) -> int:
        return len(self.draft_lengths)

    @property
    def tokens_per_round(self) -> float:
        """Tokens emitted per verify round (the prefill's token is not a round's)."""
        return sum(self.emitted) / len(self.emitted) if self.emitted else 0.0

    @property
    def mean_draft_length(self) -> float:
        return sum(self.draft_lengths) / len(self.draft_lengths) if self.draft_lengths else 0.0

    @property
    def queue_s(self) -> float:
        return (self.started_at or self.finished_at or self.submitted_at) - self.submitted_at

    @property
    def total_s(self) -> float:
        return (self.finished_at or time.perf_counter()) - self.submitted_at

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second after the first token."""
        if self.first_token_at is None or self.finished_at is None or self.n_tokens < 2:
            return 0.0
        dt = self.finished_at - self.first_token_at
        return (self.n_tokens - 1) / dt if dt > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "speculative": self.speculative,
            "stopped_speculating_at": self.stopped_speculating_at,
            "n_tokens": self.n_tokens,
            "rounds": self.rounds,
            "lane": self.lane,
            "tokens_per_round": self.tokens_per_round,
            "mean_draft_length": self.mean_draft_length,
            "draft_length_histogram": dict(sorted(Counter(self.draft_lengths).items())),
            "queue_s": self.queue_s,
            "total_s": self.total_s,
            "tokens_per_s": self.tokens_per_s,
        }


@dataclass
class RequestResult:
    """A finished request (`tokens` and `gaps` as `compare_to_plain` reads them)."""

    tokens: np.ndarray
    finish_reason: str
    stats: RequestStats
    gaps: np.ndarray  # per token: the top-2 logit gap of its row (empty unless record_gaps)


_END = object()


class RequestHandle:
    """The client's side of a request: iterate for token ids, `result()`, `cancel()`."""

    def __init__(
        self, request_id: str, prompt_tokens: int, params: RequestParams, on_cancel: Callable[[RequestHandle], None]
    ) -> None:
        self.id = request_id
        self.params = params
        self.stats = RequestStats(prompt_tokens=prompt_tokens, submitted_at=time.perf_counter())
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._tokens: list[int] = []
        self._gaps: list[float] = []
        self._on_cancel = on_cancel
        self._listener: Callable[[list[int] | None], None] | None = None

    def __repr__(self) -> str:
        return f"RequestHandle({self.id!r}, tokens={len(self._tokens)}, finish_reason={self.finish_reason!r})"

    # --- client side -------------------------------------------------------------------------

    def __iter__(self) -> Iterator[int]:
        return self.iter_tokens()

    def iter_tokens(self, timeout: float | None = None) -> Iterator[int]:
        """Token ids as they are committed, until the request ends (`timeout`: the longest wait
        for the next one, then queue.Empty)."""
        while True:
            item = self._queue.get(timeout=timeout)
            if item is _END:
                self._queue.put(_END)  # a later iteration ends at once too
                return
            yield item

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def cancelled(self) -> bool:
        return self.finish_reason == "cancelled"

    @property
    def tokens(self) -> list[int]:
        """The tokens generated so far."""
        with self._lock:
            return list(self._tokens)

    def subscribe(self, listener: Callable[[list[int] | None], None]) -> None:
        """Have `listener(tokens)` called with each round's committed tokens and `listener(None)`
        once at the end, on the engine's thread (what was committed before comes at once). One
        call per round, not per token, and no thread of the client's own: a server hands the
        tokens to its event loop this way. The listener must return at once (no blocking, no
        raising: an exception is logged and the listener dropped)."""
        with self._lock:
            if self._listener is not None:
                raise RuntimeError(f"request {self.id} already has a listener")
            self._listener = listener
            if self._tokens:
                self._notify(list(self._tokens))
            if self._done.is_set():
                self._notify(None)

    def _notify(self, item: list[int] | None) -> None:
        """Call the listener (under the lock: calls arrive in order, the end last)."""
        if self._listener is None:
            return
        try:
            self._listener(item)
        except Exception:
            log.exception("request %s: its listener failed; dropped", self.id)
            self._listener = None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the end; True when it ended."""
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> RequestResult:
        """Wait for the end and return the request's tokens (EngineError if it failed)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        if self.error is not None:
            raise EngineError(f"request {self.id} failed: {self.error!r}") from self.error
        with self._lock:
            return RequestResult(
                np.array(self._tokens, dtype=np.int64),
                self.finish_reason or "error",
                self.stats,
                np.array(self._gaps, dtype=np.float32),
            )

    def cancel(self) -> bool:
        """End the request now (finish_reason "cancelled"); False when it had already ended."""
        if not self._finish("cancelled"):
            return False
        self._on_cancel(self)
        return True

    # --- engine side -------------------------------------------------------------------------

    def _push(self, tokens: Sequence[int], gaps: Sequence[float] = ()) -> bool:
        """Append committed tokens (dropped once the request ended); False when it had ended."""
        with self._lock:
            if self._done.is_set():
                return False
            self._tokens.extend(tokens)
            self._gaps.extend(gaps)
            self.stats.n_tokens = len(self._tokens)
            if self.stats.first_token_at is None and self._tokens:
                self.stats.first_token_at = time.perf_counter()
            for t in tokens:
                self._queue.put(t)
            self._notify(list(tokens))
        return True

    def _finish(self, reason: str, error: BaseException | None = None) -> bool:
        """End the request once; False when it had already ended."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish reason must be one of {FINISH_REASONS}, got {reason!r}")
        with self._lock:
            if self._done.is_set():
                return False
            self.finish_reason = reason
            self.error = error
            self.stats.finished_at = time.perf_counter()
            self._done.set()
            self._queue.put(_END)
            self._notify(None)
        return True
