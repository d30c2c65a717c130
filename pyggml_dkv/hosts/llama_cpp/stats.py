"""Per-round and per-generation statistics of speculative decoding."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class RoundStats:
    n_draft: int  # drafts verified this round (k)
    n_accepted: int  # drafts the target accepted (0..k)
    n_emitted: int  # tokens emitted: n_accepted + 1, fewer when a stop token or max_tokens cut the round
    draft_s: float
    verify_s: float  # the verifying decode, capture excluded
    capture_s: float
    host_s: float  # acceptance, bookkeeping, feature commit, KV removal


@dataclass
class GenerationStats:
    block_size: int
    prompt_tokens: int = 0
    prefill_s: float = 0.0
    total_s: float = 0.0  # prefill included
    rounds: list[RoundStats] = field(default_factory=list)
    n_tokens: int = 0  # emitted tokens (the prefill's first token included)

    def histogram(self) -> list[int]:
        """histogram[a] = rounds in which a drafts were accepted, a = 0 .. block_size - 1."""
        h = np.zeros(self.block_size, dtype=np.int64)
        for r in self.rounds:
            h[r.n_accepted] += 1
        return h.tolist()

    @property
    def tokens_per_round(self) -> float:
        """Mean tokens emitted per verify round (the speculative speed-up factor over plain decoding)."""
        if not self.rounds:
            return 0.0
        return sum(r.n_emitted for r in self.rounds) / len(self.rounds)

    @property
    def tokens_per_s(self) -> float:
        """Emitted tokens per second of generation after the prefill."""
        decode_s = self.total_s - self.prefill_s
        return (self.n_tokens - 1) / decode_s if decode_s > 0 and self.n_tokens > 1 else 0.0

    def time_split(self) -> dict[str, float]:
        """Seconds spent in draft / verify / capture / host over all rounds."""
        return {
            "draft_s": sum(r.draft_s for r in self.rounds),
            "verify_s": sum(r.verify_s for r in self.rounds),
            "capture_s": sum(r.capture_s for r in self.rounds),
            "host_s": sum(r.host_s for r in self.rounds),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "n_tokens": self.n_tokens,
            "prompt_tokens": self.prompt_tokens,
            "rounds": len(self.rounds),
            "tokens_per_round": self.tokens_per_round,
            "mean_accepted_per_round": float(np.mean([r.n_accepted for r in self.rounds])) if self.rounds else 0.0,
            "acceptance_histogram": self.histogram(),
            "tokens_per_s": self.tokens_per_s,
            "prefill_s": self.prefill_s,
            "total_s": self.total_s,
            **self.time_split(),
        }

    def summary(self) -> str:
        split = self.time_split()
        busy = sum(split.values()) or 1.0
        parts = ", ".join(f"{k[:-2]} {100 * v / busy:.0f}%" for k, v in split.items())
        return (
            f"{self.n_tokens} tokens in {len(self.rounds)} rounds, {self.tokens_per_round:.2f} tokens/round, "
            f"{self.tokens_per_s:.1f} tokens/s; histogram {self.histogram()}; time: {parts}"
        )
