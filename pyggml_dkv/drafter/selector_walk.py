"""DFlash-2's candidate lattice on the host: the walks a step graph's greedy walk cannot take for
the host (a p_min cut-off, a sampled path), in numpy. docs/dflash2.md, section 2.

The step graph computes the lattice of each block (drafter.dflash2_graph.selector): for the draft
positions i = 1..block-1 the top-k candidates C_i and the scores S_i[p, j] of candidate j after
candidate p of position i-1 (position 1 follows the anchor token: all its rows are equal).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SelectorLattice:
    """One block's lattice: candidates[i-1] (k,) = C_i, scores[i-1, p, j] = S_i[p, j]."""

    candidates: np.ndarray  # (positions, k) int64
    scores: np.ndarray  # (positions, k, k) float32

    @property
    def positions(self) -> int:
        return int(self.candidates.shape[0])


def _softmax(row: np.ndarray) -> np.ndarray:
    z = np.exp(row.astype(np.float64) - row.max())
    return z / z.sum()


def greedy_walk(lattice: SelectorLattice, p_min: float = 0.0) -> np.ndarray:
    """llama.cpp's draft ids: from the anchor, each position's best candidate after the previous
    pick (the first on a tie); with p_min > 0 the walk stops before a pick whose softmax over its
    k scores is below p_min."""
    ids: list[int] = []
    pred = 0  # position 1's rows are all the anchor's
    for i in range(lattice.positions):
        row = lattice.scores[i, pred]
        pick = int(np.argmax(row))
        if p_min > 0.0 and _softmax(row)[pick] < p_min:
            break
        ids.append(int(lattice.candidates[i, pick]))
        pred = pick
    return np.array(ids, dtype=np.int64)


def sampled_walk(
    lattice: SelectorLattice, temperature: float, vocab: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """A path drawn at `temperature`: at each position j ~ q_i = softmax(S_i[pred] / T) over its
    k candidates. Returns (ids, probs) with probs[i] the distribution position i's id was drawn
    from, over the whole vocabulary (support C_i): what rejection sampling needs, since q_i
    depends on the drafted prefix only through the previous pick."""
    ids = np.empty(lattice.positions, dtype=np.int64)
    probs = np.zeros((lattice.positions, vocab), dtype=np.float32)
    pred = 0
    for i in range(lattice.positions):
        q = _softmax(lattice.scores[i, pred] / temperature)
        pick = int(rng.choice(q.size, p=q))
        ids[i] = lattice.candidates[i, pick]
        np.add.at(probs[i], lattice.candidates[i], q.astype(np.float32))  # a token listed twice adds up
        pred = pick
    return ids, probs
