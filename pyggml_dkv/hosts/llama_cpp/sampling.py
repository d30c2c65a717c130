"""Sampling for the host (numpy only): the target's distribution at temperature T with top-k /
top-p (common.sampling, the same transform `pyggml_dkv.Drafter.propose` applies to the draft
logits), and categorical draws.
"""

from __future__ import annotations

import numpy as np

from ...common.sampling import sampling_probs

__all__ = ["draw", "draw_rows", "sampling_probs"]


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """One categorical draw from the distribution p (1-D, sums to ~1)."""
    c = np.cumsum(p)
    return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), p.size - 1))


def draw_rows(p: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One draw per row of p (n, vocab)."""
    return np.array([draw(row, rng) for row in p], dtype=np.int64)
