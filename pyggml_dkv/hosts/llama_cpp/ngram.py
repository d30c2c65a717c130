"""Drafting from the context itself (prompt lookup), and the hybrid of it with a DFlash drafter.

`NgramDrafter` drafts the continuation of the most recent earlier occurrence of the context's
last n tokens (n from `max_ngram` down to `min_ngram`), like llama-cpp-python's
LlamaPromptLookupDecoding (which takes the earliest occurrence and n down to 1). It needs no
features and no model: text that repeats itself (code, lists, quoted input) drafts well, fresh
text drafts nothing.

`HybridDrafter` drafts with the n-gram lookup when the context has a match and with the DFlash
drafter otherwise. The DFlash drafter's features are kept up to date either way (every
add_features goes to it), so it can take over at any round.

Both learn the token history through `observe(tokens)`, which SpeculativeGenerator calls with the
committed tokens (the prompt, then [last] + accepted drafts of each round).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...model.config import DraftConfig


class TokenHistory:
    """The committed tokens, grown by observe(); rewound with the drafter."""

    def __init__(self, capacity: int = 4096) -> None:
        self._tokens = np.zeros(capacity, dtype=np.int64)
        self._n = 0

    @property
    def tokens(self) -> np.ndarray:
        return self._tokens[: self._n]

    def observe(self, tokens: Any) -> None:
        arr = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if self._n + arr.size > self._tokens.size:
            grown = np.zeros(max(2 * self._tokens.size, self._n + arr.size), dtype=np.int64)
            grown[: self._n] = self._tokens[: self._n]
            self._tokens = grown
        self._tokens[self._n : self._n + arr.size] = arr
        self._n += arr.size

    def rewind(self, n: int) -> None:
        self._n = min(self._n, n)

    def reset(self) -> None:
        self._n = 0


def ngram_lookup(context: np.ndarray, max_ngram: int, min_ngram: int, n_pred: int) -> np.ndarray:
    """The tokens after the most recent earlier occurrence of context's last n tokens, for the
    largest n in [min_ngram, max_ngram] that occurs; empty when none does."""
    size = context.size
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        tail = context[size - n :]
        windows = np.lib.stride_tricks.sliding_window_view(context[: size - 1], n)  # occurrences ending before the tail
        hits = np.nonzero((windows == tail).all(axis=1))[0]
        if hits.size:
            start = int(hits[-1]) + n
            return context[start : start + n_pred].copy()
    return np.zeros(0, dtype=np.int64)


class NgramDrafter:
    """Prompt-lookup drafting through the DraftSource interface (greedy verification)."""

    def __init__(
        self, cfg: DraftConfig, vocab: int, *, max_ngram: int = 3, min_ngram: int = 2, n_pred: int | None = None
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.cfg = cfg
        self.vocab = int(vocab)
        self.max_ngram, self.min_ngram = int(max_ngram), int(min_ngram)
        self.n_pred = int(n_pred if n_pred is not None else cfg.block_size - 1)
        self.history = TokenHistory()
        self._committed = 0
        self.matched = 0  # rounds with a match (statistics)

    @property
    def committed(self) -> int:
        return self._committed

    def add_features(self, rows: Any) -> None:
        self._committed += int(np.shape(rows)[0])

    def observe(self, tokens: Any) -> None:
        self.history.observe(tokens)

    def rewind(self, n_committed: int) -> None:
        self._committed = min(self._committed, n_committed)
        self.history.rewind(n_committed)

    def reset(self) -> None:
        self._committed = 0
        self.history.reset()

    def draft(self, last_token: int) -> np.ndarray:
        context = np.append(self.history.tokens, int(last_token))
        return ngram_lookup(context, self.max_ngram, self.min_ngram, self.n_pred)

    def propose(self, last_token: int, *, temperature: float = 0.0, **_: Any) -> Any:
        if temperature != 0:
            raise ValueError("NgramDrafter drafts for greedy verification only (temperature 0)")
        out = self.draft(last_token)
        self.matched += bool(out.size)
        return out


class HybridDrafter:
    """n-gram drafts when the context has a match, the DFlash drafter's otherwise."""

    def __init__(self, dflash: Any, *, max_ngram: int = 3, min_ngram: int = 2, n_pred: int | None = None) -> None:
        self.dflash = dflash
        self.cfg = dflash.cfg
        self.vocab = dflash.vocab
        self.ngram = NgramDrafter(dflash.cfg, dflash.vocab, max_ngram=max_ngram, min_ngram=min_ngram, n_pred=n_pred)
        self.rounds = {"ngram": 0, "dflash": 0}  # which drafter drafted, over every generation

    @property
    def committed(self) -> int:
        return self.dflash.committed

    def add_features(self, rows: Any) -> None:
        self.dflash.add_features(rows)
        self.ngram.add_features(rows)

    def observe(self, tokens: Any) -> None:
        self.ngram.observe(tokens)

    def rewind(self, n_committed: int) -> None:
        self.dflash.rewind(n_committed)
        self.ngram.rewind(n_committed)

    def reset(self) -> None:
        self.dflash.reset()
        self.ngram.reset()

    def propose(self, last_token: int, *, temperature: float = 0.0, **kwargs: Any) -> Any:
        if temperature != 0:
            raise ValueError("HybridDrafter drafts for greedy verification only (temperature 0)")
        out = self.ngram.draft(last_token)
        if out.size:
            self.rounds["ngram"] += 1
            return out
        self.rounds["dflash"] += 1
        return self.dflash.propose(last_token, **kwargs)

    def close(self) -> None:
        if hasattr(self.dflash, "close"):
            self.dflash.close()
