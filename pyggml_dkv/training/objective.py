"""The DFlash training objective on one sequence, many anchors sharing one context pass.

A drafting round at anchor position p: the drafter knows the features of tokens [0, p) and the
token x_p (the last one emitted, whose features come with its verification); its block is
[x_p, mask, ..., mask] at positions p .. p + B - 1 and block row k (1 <= k < B) predicts x_{p+k}.

Every anchor of a sequence attends to a prefix of the same context, so one forward pass serves
many: the context rows are projected once, the blocks of all chosen anchors are stacked as query
rows, and an attention mask lets the block of anchor p see context keys [0, p) and its own B
noise keys (no causal order inside a block, as at inference). Position ids are the true ones.

Loss: cross-entropy of row k's logits (the target's frozen lm_head) against x_{p+k}, weighted
exp(-(k - 1) / gamma) (early rows matter most: a round stops at the first miss), over labels
that a greedy verifier would see: x_{p+1} .. x_{p+k} all the target's argmax (`greedy` flags).

DFlash-2 (a DFlash2DraftModel, docs/dflash2.md): the convolutions run per block (stacked blocks
must not read each other's rows: `blockwise_convolutions`) and train through the same block loss;
the candidate selector adds its own loss (`selector_terms`, docs/training.md): at block row k,
given the true previous token (the anchor for k = 1, else x_{p+k-1}: teacher forcing), the
cross-entropy of its edge scores over the candidates C_k (the top-k of row k's logits, detached)
and the label x_{p+k} (added when not among them), weighted as the block loss. The objective is
block loss + selector_weight * selector loss.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.nn import functional as F

if TYPE_CHECKING:  # pragma: no cover
    from dflash.model import DFlashDraftModel  # (no type information: Any to mypy)


@dataclass
class Frozen:
    """The target's frozen token embedding (noise inputs) and lm_head (bf16 for the products)."""

    embed: torch.Tensor  # (vocab, hidden) float32
    lm_head: torch.Tensor  # (vocab, hidden) bfloat16

    @classmethod
    def from_arrays(cls, embed: np.ndarray, lm_head: np.ndarray) -> Frozen:
        # (np.require copies a read-only array, e.g. a float32 tensor memory-mapped from a GGUF)
        return cls(
            torch.from_numpy(np.require(embed, np.float32, ["C", "W"])),
            torch.from_numpy(np.require(lm_head, np.float32, ["C", "W"])).to(torch.bfloat16),
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden.to(torch.bfloat16) @ self.lm_head.T).float()


def draft_logits(model: DFlashDraftModel, head: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The drafter's logits as it runs them: the model's own compute_logits (output multiplier,
    soft cap) over `head` (a callable, e.g. Frozen.logits), in float32."""
    return model.compute_logits(hidden, head).float()


def is_dflash2(model: Any) -> bool:
    """A DFlash2DraftModel: convolutions and a candidate selector."""
    return getattr(model, "candidate_selector", None) is not None


def _prepare_per_block(conv: Any, block: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out, dynamic = type(conv).prepare(conv, hidden.reshape(-1, block, hidden.shape[-1]))
    return out.reshape(hidden.shape), dynamic


def _finish_per_block(conv: Any, block: int, hidden: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
    return type(conv).finish(conv, hidden.reshape(-1, block, hidden.shape[-1]), dynamic).reshape(hidden.shape)


@contextmanager
def blockwise_convolutions(model: DFlashDraftModel, block: int) -> Iterator[None]:
    """Within the block, every DFlash-2 convolution of `model` sees its noise rows as consecutive
    blocks of `block` rows, each convolved alone (taps before a block's first row read zeros), as
    at inference, where the noise rows are one block. Upstream's convolution runs along the whole
    sequence of noise rows, which here holds the blocks of many anchors, so row 0 of a block would
    read the previous anchor's rows. The convolution is still upstream's own (its `prepare` and
    `finish`, on the rows reshaped to (blocks, block, H)): an instance attribute shadows each
    method for the duration. A DFlash-1 model is left alone."""
    convs = [c for layer in model.layers for c in (layer.attention_conv, layer.mlp_conv) if c is not None]
    for conv in convs:
        conv.prepare = partial(_prepare_per_block, conv, block)
        conv.finish = partial(_finish_per_block, conv, block)
    try:
        yield
    finally:
        for conv in convs:
            del conv.prepare, conv.finish


def edge_scores(
    selector: Any, hidden: torch.Tensor, logits: torch.Tensor, predecessors: torch.Tensor, columns: torch.Tensor
) -> torch.Tensor:
    """s(p -> c) = <A[p] * gamma, B[c]> + z[c] with the upstream CandidateSelector's modules, as its
    `select` scores (which has no method of its own for them): hidden (..., H) the final normed
    rows, logits (..., V) their logits z (`draft_logits`), predecessors (...,) one token id per
    row, columns (..., n) the ids to score; returns (..., n)."""
    gate = selector.hidden_projection(hidden)
    pair = selector.predecessor_codebook(predecessors) * gate
    return torch.einsum("...r,...nr->...n", pair, selector.successor_codebook(columns)) + logits.gather(-1, columns)


def selector_terms(
    model: DFlashDraftModel,
    hidden: torch.Tensor,
    logits: torch.Tensor,
    predecessors: torch.Tensor,
    labels: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The selector's loss at every draft position, and whether it ranks the label first.

    hidden (..., H), logits (..., V): a draft position's final normed row and its logits;
    predecessors (...,): the true previous token (teacher forcing); labels (...,) the token to draft.
    With C the top-k of the logits (detached: which tokens are candidates is not differentiated)
    and y the label, the loss is the cross-entropy of the edge scores s(p -> c) over C ∪ {y}
    (k columns when y is in C, else k + 1) against y; the second result is whether argmax over C
    alone is y: what the greedy walk emits at this position when its previous pick was right.
    Returns (cross-entropy, correct), both shaped like labels.
    """
    sel = model.candidate_selector
    k = int(sel.top_k)
    cands = torch.topk(logits.detach(), k, dim=-1).indices
    scores = edge_scores(sel, hidden, logits, predecessors, torch.cat([cands, labels[..., None]], dim=-1)).float()
    in_set = cands == labels[..., None]
    has = in_set.any(-1)
    scores = torch.cat([scores[..., :k], scores[..., k:].masked_fill(has[..., None], float("-inf"))], dim=-1)
    target = torch.where(has, in_set.long().argmax(-1), k)
    ce = F.cross_entropy(scores.reshape(-1, k + 1), target.reshape(-1), reduction="none").view(labels.shape)
    with torch.no_grad():
        correct = has & (scores[..., :k].argmax(-1) == target)
    return ce, correct


def block_inputs(
    tokens: np.ndarray, anchors: np.ndarray, block: int, mask_token: int, frozen: Frozen
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(noise (A*B, hidden), position_ids (L + A*B,), visible (A*B, L + A*B) bool, L) for anchors."""
    n_anchor = anchors.size
    ctx = int(anchors.max())
    ids = np.full((n_anchor, block), mask_token, dtype=np.int64)
    ids[:, 0] = tokens[anchors]
    noise = frozen.embed[torch.from_numpy(ids.reshape(-1))]
    block_pos = anchors[:, None] + np.arange(block)[None, :]
    pos = np.concatenate([np.arange(ctx), block_pos.reshape(-1)])
    q_anchor = np.repeat(anchors, block)  # anchor of each query row
    visible = np.zeros((n_anchor * block, ctx + n_anchor * block), dtype=bool)
    visible[:, :ctx] = np.arange(ctx)[None, :] < q_anchor[:, None]
    q_block = np.repeat(np.arange(n_anchor), block)
    visible[:, ctx:] = q_block[:, None] == q_block[None, :]
    return noise, torch.from_numpy(pos), torch.from_numpy(visible), ctx


def block_labels(
    tokens: np.ndarray, greedy: np.ndarray, anchors: np.ndarray, block: int
) -> tuple[np.ndarray, np.ndarray]:
    """labels (A, B-1) = x_{p+k}, valid (A, B-1): inside the sequence and x_{p+1..p+k} all greedy."""
    n = tokens.size
    at = anchors[:, None] + np.arange(1, block)[None, :]
    inside = at < n
    safe = np.minimum(at, n - 1)
    labels = np.where(inside, tokens[safe], 0).astype(np.int64)
    valid = np.cumprod(inside & greedy[safe], axis=1).astype(bool)
    return labels, valid


def draft_hidden(
    model: DFlashDraftModel, features: np.ndarray, tokens: np.ndarray, anchors: np.ndarray, frozen: Frozen
) -> torch.Tensor:
    """The drafter's final hidden states (A, B, hidden) for every anchor's block."""
    block, mask_token = int(model.block_size), int(model.mask_token_id)
    noise, pos, visible, ctx = block_inputs(tokens, anchors, block, mask_token, frozen)
    feats = torch.from_numpy(np.ascontiguousarray(features[:ctx], np.float32))
    with blockwise_convolutions(model, block):
        out = model(
            position_ids=pos[None],
            attention_mask=visible[None, None],
            noise_embedding=noise[None],
            target_hidden=feats[None],
        )
    return out[0].view(anchors.size, block, -1)


def anchor_range(n: int, prompt_length: int) -> np.ndarray:
    """Anchors with at least one label: the first generated token .. the second to last token."""
    return np.arange(max(prompt_length, 1), n - 1)


def sequence_loss(
    model: DFlashDraftModel,
    frozen: Frozen,
    tokens: np.ndarray,
    features: np.ndarray,
    greedy: np.ndarray,
    anchors: np.ndarray,
    gamma: float,
    selector_weight: float = 1.0,
) -> tuple[torch.Tensor, dict]:
    """Weighted CE over the anchors' labels; returns (loss, stats) with per-row accuracy.

    stats: weight (the sum of the label weights), block_loss, correct / valid per row; for a
    DFlash-2 model the loss is block_loss + selector_weight * selector_loss, and stats add
    selector_loss and selector_correct per row (the selector's teacher-forced pick)."""
    block = int(model.block_size)
    labels, valid = block_labels(tokens, greedy, anchors, block)
    hidden = draft_hidden(model, features, tokens, anchors, frozen)[:, 1:].reshape(-1, model.config.hidden_size)
    logits = draft_logits(model, frozen.logits, hidden)
    target = torch.from_numpy(labels.reshape(-1))
    ce = F.cross_entropy(logits, target, reduction="none").view(labels.shape)
    w = torch.exp(-torch.arange(block - 1, dtype=torch.float32) / gamma)[None, :] * torch.from_numpy(valid)
    total = w.sum()
    loss = (ce * w).sum() / total.clamp_min(1e-9)
    with torch.no_grad():
        correct = (logits.argmax(-1).view(labels.shape).numpy() == labels) & valid
    stats = {
        "weight": float(total),
        "block_loss": float(loss.detach()),
        "correct": correct.sum(0),
        "valid": valid.sum(0),
    }
    if is_dflash2(model):
        previous = np.concatenate([tokens[anchors].astype(np.int64)[:, None], labels[:, :-1]], axis=1)
        sce, scorrect = selector_terms(model, hidden, logits, torch.from_numpy(previous.reshape(-1)), target)
        selector_loss = (sce.view(labels.shape) * w).sum() / total.clamp_min(1e-9)
        stats["selector_loss"] = float(selector_loss.detach())
        stats["selector_correct"] = (scorrect.view(labels.shape).numpy() & valid).sum(0)
        loss = loss + selector_weight * selector_loss
    return loss, stats


@torch.no_grad()
def predictions(
    model: DFlashDraftModel,
    frozen: Frozen,
    tokens: np.ndarray,
    features: np.ndarray,
    anchors: np.ndarray,
    chunk: int = 128,
    *,
    selector: bool = True,
) -> np.ndarray:
    """Greedy drafts (A, B-1) at every anchor, in chunks of anchors: the argmax of each row, or
    for a DFlash-2 model the selector's greedy walk (the model's own `propose` at temperature 0,
    what it drafts at inference); `selector=False` takes the argmax of a DFlash-2 model's rows."""
    out = []
    for lo in range(0, anchors.size, chunk):
        a = anchors[lo : lo + chunk]
        hidden = draft_hidden(model, features, tokens, a, frozen)[:, 1:]
        if selector and is_dflash2(model):
            path, _, _ = model.propose(hidden, torch.from_numpy(tokens[a].astype(np.int64)), frozen.logits, 0.0)
            out.append(path.numpy())
        else:
            out.append(draft_logits(model, frozen.logits, hidden).argmax(-1).numpy())
    return np.concatenate(out)


def accepted_lengths(drafts: np.ndarray, tokens: np.ndarray, greedy: np.ndarray, anchors: np.ndarray) -> np.ndarray:
    """At each anchor: how many leading drafts a greedy verifier accepts (the labels' prefix that matches)."""
    labels, valid = block_labels(tokens, greedy, anchors, drafts.shape[1] + 1)
    hits = (drafts == labels) & valid
    return np.cumprod(hits, axis=1).sum(axis=1)


def simulated_rounds(accepted: np.ndarray, anchors: np.ndarray, n: int) -> list[int]:
    """Greedy speculative decoding replayed on a greedy sequence: from the first anchor, each round
    emits accepted + 1 tokens and the next round starts there. Returns tokens per round."""
    where = {int(p): int(a) for p, a in zip(anchors, accepted)}
    rounds, p = [], int(anchors[0])
    while p in where:
        step = where[p] + 1
        rounds.append(step)
        p += step
    return rounds
