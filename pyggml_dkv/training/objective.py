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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F


@dataclass
class Frozen:
    """The target's frozen token embedding (noise inputs) and lm_head (bf16 for the products)."""
    embed: torch.Tensor  # (vocab, hidden) float32
    lm_head: torch.Tensor  # (vocab, hidden) bfloat16

    @classmethod
    def from_arrays(cls, embed: np.ndarray, lm_head: np.ndarray) -> "Frozen":
        return cls(torch.from_numpy(np.ascontiguousarray(embed, np.float32)),
                   torch.from_numpy(np.ascontiguousarray(lm_head, np.float32)).to(torch.bfloat16))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden.to(torch.bfloat16) @ self.lm_head.T).float()


def block_inputs(tokens: np.ndarray, anchors: np.ndarray, block: int, mask_token: int,
                 frozen: Frozen) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
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


def block_labels(tokens: np.ndarray, greedy: np.ndarray, anchors: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """labels (A, B-1) = x_{p+k}, valid (A, B-1): inside the sequence and x_{p+1..p+k} all greedy."""
    n = tokens.size
    at = anchors[:, None] + np.arange(1, block)[None, :]
    inside = at < n
    safe = np.minimum(at, n - 1)
    labels = np.where(inside, tokens[safe], 0).astype(np.int64)
    valid = np.cumprod(inside & greedy[safe], axis=1).astype(bool)
    return labels, valid


def draft_hidden(model: torch.nn.Module, features: np.ndarray, tokens: np.ndarray, anchors: np.ndarray,
                 frozen: Frozen) -> torch.Tensor:
    """The drafter's final hidden states (A, B, hidden) for every anchor's block."""
    block, mask_token = int(model.block_size), int(model.mask_token_id)
    noise, pos, visible, ctx = block_inputs(tokens, anchors, block, mask_token, frozen)
    feats = torch.from_numpy(np.ascontiguousarray(features[:ctx], np.float32))
    out = model(position_ids=pos[None], attention_mask=visible[None, None], noise_embedding=noise[None],
                target_hidden=feats[None])
    return out[0].view(anchors.size, block, -1)


def anchor_range(n: int, prompt_length: int) -> np.ndarray:
    """Anchors with at least one label: the first generated token .. the second to last token."""
    return np.arange(max(prompt_length, 1), n - 1)


def sequence_loss(model: torch.nn.Module, frozen: Frozen, tokens: np.ndarray, features: np.ndarray,
                  greedy: np.ndarray, anchors: np.ndarray, gamma: float) -> tuple[torch.Tensor, dict]:
    """Weighted CE over the anchors' labels; returns (loss, stats) with per-row accuracy."""
    block = int(model.block_size)
    labels, valid = block_labels(tokens, greedy, anchors, block)
    hidden = draft_hidden(model, features, tokens, anchors, frozen)[:, 1:]
    logits = frozen.logits(hidden.reshape(-1, hidden.shape[-1]))
    ce = F.cross_entropy(logits, torch.from_numpy(labels.reshape(-1)), reduction="none").view(labels.shape)
    w = torch.exp(-torch.arange(block - 1, dtype=torch.float32) / gamma)[None, :] * torch.from_numpy(valid)
    total = w.sum()
    loss = (ce * w).sum() / total.clamp_min(1e-9)
    with torch.no_grad():
        correct = (logits.argmax(-1).view(labels.shape).numpy() == labels) & valid
    return loss, {"weight": float(total), "correct": correct.sum(0), "valid": valid.sum(0)}


@torch.no_grad()
def predictions(model: torch.nn.Module, frozen: Frozen, tokens: np.ndarray, features: np.ndarray,
                anchors: np.ndarray, chunk: int = 128) -> np.ndarray:
    """Greedy drafts (A, B-1) at every anchor, in chunks of anchors."""
    out = []
    for lo in range(0, anchors.size, chunk):
        a = anchors[lo:lo + chunk]
        hidden = draft_hidden(model, features, tokens, a, frozen)[:, 1:]
        out.append(frozen.logits(hidden.reshape(-1, hidden.shape[-1])).argmax(-1).view(a.size, -1).numpy())
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
