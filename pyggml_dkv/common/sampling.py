"""The sampling transform a drafter's drafts and a host's target share: softmax at a temperature,
restricted to top-k, then to top-p (numpy only)."""

from __future__ import annotations

import numpy as np


def sampling_probs(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """Row-wise softmax(logits / temperature) restricted to the top_k largest, then to the smallest
    prefix (by probability) whose mass reaches top_p; float64, rows sum to 1."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature!r}")
    z = np.atleast_2d(np.asarray(logits, dtype=np.float64)) / temperature
    vocab = z.shape[1]
    if 0 < top_k < vocab:
        kth = np.partition(z, vocab - top_k, axis=1)[:, vocab - top_k][:, None]
        z = np.where(z < kth, -np.inf, z)
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    if top_p < 1.0:
        order = np.argsort(-p, axis=1, kind="stable")
        sorted_p = np.take_along_axis(p, order, axis=1)
        keep_sorted = (np.cumsum(sorted_p, axis=1) - sorted_p) < top_p  # the first token always stays
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(axis=1, keepdims=True)
    return p
