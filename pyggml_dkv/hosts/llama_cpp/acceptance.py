"""Verification: which drafted tokens the target accepts, greedy and sampled.

Greedy: accept the longest prefix of the draft that equals the target's argmax at each row, then
the target's argmax after it (the bonus token). Every emitted token is the argmax of the target's
logits for its position in the decode that verified it.

Sampling: standard speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023).
Draft token x_j drawn from q_j is accepted with probability min(1, p_j(x_j) / q_j(x_j)); at the
first rejection a token is drawn from norm(max(0, p_j - q_j)) and the round ends; if every draft is
accepted a bonus token is drawn from p_k. Each emitted token is then distributed exactly as the
target's p at its position.
"""

from __future__ import annotations

import numpy as np

from .sampling import draw, sampling_probs


def accept_greedy(draft: np.ndarray, target_logits: np.ndarray) -> tuple[int, np.ndarray]:
    """draft (k,), target_logits (k + 1, vocab): row j scores the token after draft[:j].

    Returns (n_accepted, emitted) with emitted = draft[:n_accepted] + [argmax of row n_accepted]."""
    draft = np.asarray(draft, dtype=np.int64).reshape(-1)
    k = draft.size
    if target_logits.shape[0] != k + 1:
        raise ValueError(f"need k+1={k + 1} target rows for {k} drafts, got {target_logits.shape[0]}")
    best = np.argmax(target_logits, axis=1)
    mismatch = np.nonzero(best[:k] != draft)[0]
    n = int(mismatch[0]) if mismatch.size else k
    return n, np.append(draft[:n], best[n]).astype(np.int64)


def target_probs(target_logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The target's sampling distribution per row (the same transform the drafter uses)."""
    return sampling_probs(target_logits, temperature, top_k, top_p)


def accept_sampled(
    draft: np.ndarray, draft_probs: np.ndarray, p: np.ndarray, rng: np.random.Generator
) -> tuple[int, np.ndarray]:
    """draft (k,), draft_probs (k, vocab) = q, p (k + 1, vocab) the target's distributions.

    Returns (n_accepted, emitted): n_accepted drafts then one corrected or bonus token."""
    draft = np.asarray(draft, dtype=np.int64).reshape(-1)
    k = draft.size
    if p.shape[0] != k + 1 or draft_probs.shape[0] != k:
        raise ValueError(f"need {k} draft rows and {k + 1} target rows, got {draft_probs.shape[0]} and {p.shape[0]}")
    for j in range(k):
        x = int(draft[j])
        qx, px = float(draft_probs[j, x]), float(p[j, x])
        if qx > 0 and rng.random() * qx < px:  # accept with probability min(1, px / qx)
            continue
        residual = np.maximum(p[j] - draft_probs[j], 0.0)
        total = residual.sum()
        # total == 0 only when p == q, where rejection has probability 0: fall back to p
        dist = residual / total if total > 0 else p[j]
        return j, np.append(draft[:j], draw(dist, rng)).astype(np.int64)
    return k, np.append(draft, draw(p[k], rng)).astype(np.int64)


def top2_gap(logits: np.ndarray) -> np.ndarray:
    """Per row: the largest logit minus the second largest (how close the argmax was to a tie)."""
    part = np.partition(logits, -2, axis=-1)
    return part[..., -1] - part[..., -2]
