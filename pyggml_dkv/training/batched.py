"""The DFlash objective (objective.py) over a batch of sequences at once, all tensors on one device.

objective.py runs one sequence per forward pass, which suits a CPU. On a GPU a pass that small is
all kernel launches, so here several sequences go through the drafter together: their contexts
are padded to one length, each sequence brings the same number of anchors (short ones repeat an
anchor whose labels are then switched off), and the attention mask of objective.block_inputs is
built per sequence. Padded context keys are never visible (an anchor p sees keys [0, p) only), so
a batch computes what objective.sequence_loss computes for each of its sequences, a DFlash-2
drafter's selector loss included (objective.selector_terms).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.nn import functional as F

from .evaluate import replay_summary
from .objective import anchor_range, blockwise_convolutions, draft_logits, is_dflash2, selector_terms, simulated_rounds

if TYPE_CHECKING:  # pragma: no cover
    from dflash.model import DFlashDraftModel  # (no type information: Any to mypy)


@dataclass
class DeviceCorpus:
    """Sequences on the training device: tokens (N, L) int64, greedy (N, L) bool (the token is the
    target's argmax after its prefix), features (N, L, fc_in), lengths (N,), prompt_lengths (N,)."""

    tokens: torch.Tensor
    greedy: torch.Tensor
    features: torch.Tensor
    lengths: np.ndarray
    prompt_lengths: np.ndarray

    @property
    def n_sequences(self) -> int:
        return int(self.lengths.size)

    @classmethod
    def allocate(
        cls,
        tokens: list[np.ndarray],
        prompt_lengths: list[int],
        fc_in: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> DeviceCorpus:
        """The sequences' tokens in place, greedy flags and features zero until `fill`."""
        n, width = len(tokens), max(t.size for t in tokens)
        tok = torch.zeros((n, width), dtype=torch.long, device=device)
        for i, t in enumerate(tokens):
            tok[i, : t.size] = torch.from_numpy(t.astype(np.int64))
        return cls(
            tok,
            torch.zeros((n, width), dtype=torch.bool, device=device),
            torch.zeros((n, width, fc_in), dtype=dtype, device=device),
            np.array([t.size for t in tokens]),
            np.array(prompt_lengths),
        )

    def fill(self, i: int, features: torch.Tensor, greedy: np.ndarray) -> None:
        n = int(self.lengths[i])
        if features.shape[0] != n or greedy.shape != (n,):
            raise ValueError(
                f"sequence {i} has {n} tokens, got {features.shape[0]} feature rows / {greedy.shape} flags"
            )
        self.features[i, :n] = features.to(self.features.device, self.features.dtype)
        self.greedy[i, :n] = torch.from_numpy(np.asarray(greedy, bool)).to(self.greedy.device)

    @classmethod
    def build(
        cls,
        tokens: list[np.ndarray],
        greedy: list[np.ndarray],
        features: list[torch.Tensor],
        prompt_lengths: list[int],
        device: torch.device | str,
    ) -> DeviceCorpus:
        c = cls.allocate(tokens, prompt_lengths, int(features[0].shape[1]), features[0].dtype, device)
        for i, (g, f) in enumerate(zip(greedy, features)):
            c.fill(i, f, g)
        return c


def choose_anchors(
    corpus: DeviceCorpus, rows: np.ndarray, per_seq: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(anchors (S, A), real (S, A)) for the sequences `rows`: A random anchors of each sequence
    (sorted); a sequence with fewer repeats its last one, marked not real."""
    anchors = np.zeros((rows.size, per_seq), np.int64)
    real = np.zeros((rows.size, per_seq), bool)
    for r, i in enumerate(rows):
        cand = anchor_range(int(corpus.lengths[i]), int(corpus.prompt_lengths[i]))
        if cand.size == 0:
            cand, ok = np.array([max(0, int(corpus.lengths[i]) - 1)]), False
        else:
            ok = True
        pick = np.sort(rng.choice(cand, per_seq, replace=False)) if cand.size > per_seq else cand
        anchors[r, : pick.size] = pick
        anchors[r, pick.size :] = pick[-1]
        real[r, : pick.size] = ok
    return anchors, real


def batch_hidden(
    model: DFlashDraftModel, embed: torch.Tensor, corpus: DeviceCorpus, rows: np.ndarray, anchors: np.ndarray
) -> torch.Tensor:
    """The drafter's final hidden states (S, A, B, hidden) at every anchor's block."""
    dev = corpus.tokens.device
    block, mask_token = int(model.block_size), int(model.mask_token_id)
    s, a = anchors.shape
    ctx = int(anchors.max())
    rows_t = torch.from_numpy(rows).to(dev)
    anc = torch.from_numpy(anchors).to(dev)  # (S, A)
    ids = torch.full((s, a, block), mask_token, dtype=torch.long, device=dev)
    ids[:, :, 0] = corpus.tokens[rows_t[:, None], anc]
    noise = embed[ids.view(s, a * block)]
    block_pos = (anc[:, :, None] + torch.arange(block, device=dev)).view(s, a * block)
    pos = torch.cat([torch.arange(ctx, device=dev)[None].expand(s, ctx), block_pos], dim=1)
    q_anchor = anc.repeat_interleave(block, dim=1)  # (S, A*B)
    ctx_visible = torch.arange(ctx, device=dev)[None, None, :] < q_anchor[:, :, None]
    q_block = torch.arange(a, device=dev).repeat_interleave(block)
    blk_visible = (q_block[:, None] == q_block[None, :])[None].expand(s, -1, -1)
    visible = torch.cat([ctx_visible, blk_visible], dim=2)
    feats = corpus.features[rows_t, :ctx].float()
    with blockwise_convolutions(model, block):
        out = model(position_ids=pos, attention_mask=visible[:, None], noise_embedding=noise, target_hidden=feats)
    return out.view(s, a, block, -1)


def _head(lm_head: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The frozen lm_head as the callable the model's compute_logits applies (products in its dtype)."""
    return lambda hidden: (hidden.to(lm_head.dtype) @ lm_head.T).float()


def batch_labels(
    corpus: DeviceCorpus, rows: np.ndarray, anchors: np.ndarray, real: np.ndarray, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """labels (S, A, B-1) = x_{p+k} and valid: inside the sequence, x_{p+1..p+k} all greedy, real anchor."""
    dev = corpus.tokens.device
    at = torch.from_numpy(anchors).to(dev)[:, :, None] + torch.arange(1, block, device=dev)
    lengths = torch.from_numpy(corpus.lengths[rows]).to(dev)[:, None, None]
    inside = at < lengths
    safe = torch.minimum(at, lengths - 1)
    rows_t = torch.from_numpy(rows).to(dev)[:, None, None]
    labels = torch.where(inside, corpus.tokens[rows_t, safe], 0)
    ok = inside & corpus.greedy[rows_t, safe] & torch.from_numpy(real).to(dev)[:, :, None]
    valid = torch.cumprod(ok.long(), dim=2).bool()
    return labels, valid


def batch_loss(
    model: DFlashDraftModel,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    corpus: DeviceCorpus,
    rows: np.ndarray,
    anchors: np.ndarray,
    real: np.ndarray,
    gamma: float,
    selector_weight: float = 1.0,
) -> tuple[torch.Tensor, dict]:
    """objective.sequence_loss over the whole batch: sum of weighted CE / sum of weights (for a
    DFlash-2 drafter plus selector_weight times its selector loss, weighted alike)."""
    block = int(model.block_size)
    labels, valid = batch_labels(corpus, rows, anchors, real, block)
    hidden = batch_hidden(model, embed, corpus, rows, anchors)[:, :, 1:].reshape(-1, model.config.hidden_size)
    logits = draft_logits(model, _head(lm_head), hidden)
    ce = F.cross_entropy(logits, labels.reshape(-1), reduction="none").view(labels.shape)
    dev = ce.device
    w = torch.exp(-torch.arange(block - 1, dtype=torch.float32, device=dev) / gamma) * valid
    total = w.sum()
    loss = (ce * w).sum() / total.clamp_min(1e-9)
    with torch.no_grad():
        correct = (logits.argmax(-1).view(labels.shape) == labels) & valid
    stats = {
        "weight": float(total),
        "block_loss": float(loss.detach()),
        "correct": correct[:, :, 0].sum().item(),
        "valid": valid[:, :, 0].sum().item(),
    }
    if is_dflash2(model):
        rows_t, anc = torch.from_numpy(rows).to(dev), torch.from_numpy(anchors).to(dev)
        previous = torch.cat([corpus.tokens[rows_t[:, None], anc][:, :, None], labels[:, :, :-1]], dim=2)
        sce, scorrect = selector_terms(model, hidden, logits, previous.reshape(-1), labels.reshape(-1))
        selector_loss = (sce.view(labels.shape) * w).sum() / total.clamp_min(1e-9)
        stats["selector_loss"] = float(selector_loss.detach())
        stats["selector_correct"] = (scorrect.view(labels.shape) & valid)[:, :, 0].sum().item()
        loss = loss + selector_weight * selector_loss
    return loss, stats


@torch.no_grad()
def batch_acceptance(
    model: DFlashDraftModel, embed: torch.Tensor, lm_head: torch.Tensor, corpus: DeviceCorpus, seqs_per_batch: int = 8
) -> dict:
    """evaluate.offline_acceptance on a DeviceCorpus: every anchor of every sequence, replayed."""
    was_training = model.training
    model.eval()
    block = int(model.block_size)
    rounds: list[int] = []
    every: list[np.ndarray] = []
    for lo in range(0, corpus.n_sequences, seqs_per_batch):
        rows = np.arange(lo, min(lo + seqs_per_batch, corpus.n_sequences))
        ranges = [anchor_range(int(corpus.lengths[i]), int(corpus.prompt_lengths[i])) for i in rows]
        keep = [r.size > 0 for r in ranges]
        rows, ranges = rows[keep], [r for r, k in zip(ranges, keep) if k]
        if rows.size == 0:
            continue
        width = max(r.size for r in ranges)
        anchors = np.stack([np.concatenate([r, np.full(width - r.size, r[-1])]) for r in ranges])
        real = np.stack([np.arange(width) < r.size for r in ranges])
        labels, valid = batch_labels(corpus, rows, anchors, real, block)
        hidden = batch_hidden(model, embed, corpus, rows, anchors)[:, :, 1:]
        if is_dflash2(model):  # the selector's greedy walk, as objective.predictions
            anchor_ids = corpus.tokens[
                torch.from_numpy(rows).to(hidden.device)[:, None], torch.from_numpy(anchors).to(hidden.device)
            ]
            path, _, _ = model.propose(hidden.flatten(0, 1), anchor_ids.reshape(-1), _head(lm_head), 0.0)
            drafts = path.view(labels.shape)
        else:
            drafts = draft_logits(model, _head(lm_head), hidden).argmax(-1)
        accepted = torch.cumprod(((drafts == labels) & valid).long(), dim=2).sum(2).cpu().numpy()
        for r, (i, rng_) in enumerate(zip(rows, ranges)):
            acc = accepted[r, : rng_.size]
            every.append(acc + 1)
            rounds += simulated_rounds(acc, rng_, int(corpus.lengths[i]))
    model.train(was_training)
    return replay_summary(corpus.n_sequences, rounds, every, block)
