"""Measuring a drafter: offline replay on held-out greedy sequences (fast, used while training).

`offline_acceptance` replays greedy speculative decoding on sequences the target generated
greedily: at an anchor the drafter drafts B-1 tokens from the context features, a greedy verifier
accepts the longest prefix equal to the sequence (the target's argmax), and the round emits
accepted + 1 tokens. This is what the real loop does on the same prompt, up to the rounding of
batch shapes; the real loop's measurement is benchmarks/bench_drafter.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from .data import Corpus
from .objective import Frozen, accepted_lengths, anchor_range, predictions, simulated_rounds

if TYPE_CHECKING:  # pragma: no cover
    from dflash.model import DFlashDraftModel  # (no type information: Any to mypy)


@torch.no_grad()
def offline_acceptance(
    model: DFlashDraftModel, frozen: Frozen, corpus: Corpus, max_sequences: int | None = None, *, selector: bool = True
) -> dict:
    """tokens per round of the replay, the every-anchor mean, the histogram of round lengths.
    A DFlash-2 drafter drafts with its selector's greedy walk (`selector=False`: the argmax of
    each row instead, to measure what the selector adds)."""
    was_training = model.training
    model.eval()
    rounds: list[int] = []
    every: list[np.ndarray] = []
    n = corpus.n_sequences if max_sequences is None else min(max_sequences, corpus.n_sequences)
    for i in range(n):
        tokens, feats, greedy, plen = corpus.sequence(i)
        anchors = anchor_range(tokens.size, plen)
        if anchors.size == 0:
            continue
        drafts = predictions(model, frozen, tokens, feats, anchors, selector=selector)
        acc = accepted_lengths(drafts, tokens, greedy, anchors)
        every.append(acc + 1)
        rounds += simulated_rounds(acc, anchors, tokens.size)
    model.train(was_training)
    return replay_summary(n, rounds, every, int(model.block_size))


def replay_summary(sequences: int, rounds: list[int], every: list[np.ndarray], block: int) -> dict:
    """tokens per round of the replayed rounds, the every-anchor mean, the histogram of round lengths."""
    hist = np.bincount(np.array(rounds, dtype=np.int64) - 1, minlength=block).tolist() if rounds else []
    return {
        "sequences": sequences,
        "rounds": len(rounds),
        "tokens_per_round": float(np.mean(rounds)) if rounds else 0.0,
        "every_anchor_mean": float(np.concatenate(every).mean()) if every else 0.0,
        "histogram": hist,
    }
