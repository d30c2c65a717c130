"""Drafters the llama.cpp host can drive, and the checks that one fits a target.

The generation loop needs this of a drafter (`DraftSource`), which `pyggml_dkv.Drafter` has:
`cfg` (a DraftConfig: block_size, target_layer_ids, hidden), `vocab`, `committed`,
`add_features(rows)`, `rewind(n)`, `reset()`, `propose(last, temperature=, top_k=, top_p=, rng=)`.

Besides the real `Drafter` (built by `ggml_drafter()` from a DraftWeights and the target GGUF's
token embedding), two drafters that need no ggml of ours:
- `OracleDrafter`: proposes the target's own greedy continuation (given up front), cut at a random
  length and followed by a wrong token, so that every acceptance length occurs (tests).
- `ReferenceDrafter`: the DFlash math in numpy (`pyggml_dkv.reference`), slow but exact; lets the
  host run a DFlash-shaped drafter in a process where our ggml cannot load next to llama.cpp's.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from ... import reference
from ...model.config import DraftConfig
from ...model.weights import DraftWeights

# the SmolLM2 drafter shape lives beside the model's download (hosts/smollm2.py), free of ggml and
# llama.cpp so that a GPU training machine reads it without either; re-exported here
from ..smollm2 import SMOLLM2_LAYER_IDS, SMOLLM2_VOCAB, smollm2_draft_config  # noqa: F401
from .errors import IncompatibleDrafterError
from .gguf import GGUFFile
from .sampling import draw_rows, sampling_probs

log = logging.getLogger(__name__)


class DraftSource(Protocol):
    cfg: DraftConfig
    vocab: int

    @property
    def committed(self) -> int: ...
    def add_features(self, rows: Any) -> None: ...
    def rewind(self, n_committed: int) -> None: ...
    def reset(self) -> None: ...
    def propose(
        self,
        last_token: int,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        rng: np.random.Generator | None = None,
    ) -> Any: ...


def check_fits(
    cfg: DraftConfig, vocab: int, *, n_embd: int, n_layer: int, n_vocab: int, where: str = "the target"
) -> None:
    """Raise IncompatibleDrafterError unless a drafter (cfg, vocab) fits a target of this shape."""
    ids = list(cfg.target_layer_ids)
    if not ids:
        raise IncompatibleDrafterError("the drafter's config names no target_layer_ids")
    if cfg.hidden != n_embd:
        raise IncompatibleDrafterError(f"the drafter expects target hidden size {cfg.hidden}, {where} has {n_embd}")
    bad = [i for i in ids if not 0 <= i < n_layer]
    if bad:
        raise IncompatibleDrafterError(f"target layer ids {bad} are out of range: {where} has {n_layer} layers")
    if len(set(ids)) != len(ids):
        raise IncompatibleDrafterError(f"target layer ids must be distinct, got {ids}")
    if vocab != n_vocab:
        raise IncompatibleDrafterError(f"the drafter's vocab has {vocab} tokens, {where} has {n_vocab}")
    if not 0 <= cfg.mask_token_id < n_vocab:
        raise IncompatibleDrafterError(f"mask_token_id {cfg.mask_token_id} is outside {where}'s vocab of {n_vocab}")


def check_fits_target(target: Any, drafter: Any, target_kind: str) -> None:
    """Raise unless `drafter` fits a loaded target (a LlamaTarget or BatchedLlamaTarget, named
    `target_kind` in the message): shape and vocabulary, the captured layers, n_batch >= its block."""
    from .errors import HostError

    cfg = drafter.cfg
    check_fits(cfg, drafter.vocab, n_embd=target.n_embd, n_layer=target.n_layer, n_vocab=target.n_vocab)
    cap = target.capture
    if cap is None or list(cap.layer_ids) != list(cfg.target_layer_ids):
        have = None if cap is None else list(cap.layer_ids)
        raise HostError(
            f"the target must capture the drafter's layers {list(cfg.target_layer_ids)} "
            f"({target_kind}(capture_layers=...)), it captures {have}"
        )
    if target.n_batch < cfg.block_size:
        raise HostError(f"n_batch {target.n_batch} is smaller than the drafter's block size {cfg.block_size}")


def check_fits_gguf(cfg: DraftConfig, vocab: int, gguf: GGUFFile) -> None:
    """check_fits against a GGUF's metadata (before any model is loaded)."""
    n_embd = gguf.arch_value("embedding_length")
    n_layer = gguf.arch_value("block_count")
    tokens = gguf.meta.get("tokenizer.ggml.tokens")
    n_vocab = gguf.arch_value("vocab_size", len(tokens) if tokens is not None else None)
    if n_embd is None or n_layer is None or n_vocab is None:
        raise IncompatibleDrafterError(f"{gguf.path.name} lacks embedding_length / block_count / vocab size metadata")
    check_fits(cfg, vocab, n_embd=int(n_embd), n_layer=int(n_layer), n_vocab=int(n_vocab), where=gguf.path.name)


def target_embeddings(gguf: GGUFFile) -> tuple[np.ndarray, np.ndarray]:
    """(embed_tokens, lm_head), both (vocab, hidden) float32, from the target GGUF
    (`token_embd.weight`; `output.weight`, or the tied embedding when absent)."""
    embed = gguf.array("token_embd.weight")
    head = gguf.array("output.weight") if "output.weight" in gguf.tensors else embed
    return embed, head


def ggml_drafter(weights: DraftWeights, gguf_path: str | GGUFFile, **drafter_kwargs: Any) -> Any:
    """A `pyggml_dkv.Drafter` for the target in `gguf_path` (its token embedding and lm_head; an
    open GGUFFile saves reading the file's metadata again). Runs on our private ggml, beside
    llama.cpp's in the same process."""
    from ...drafter.drafter import Drafter

    gguf = gguf_path if isinstance(gguf_path, GGUFFile) else GGUFFile(gguf_path)
    embed, head = target_embeddings(gguf)
    check_fits_gguf(weights.cfg, head.shape[0], gguf)
    return Drafter(weights, embed_tokens=embed, lm_head=head, **drafter_kwargs)


def random_smollm2_weights(seed: int = 0, **changes: Any) -> DraftWeights:
    """Random drafter weights of the SmolLM2 drafter shape (no trained drafter ships yet)."""
    warnings.warn(
        "using a drafter with RANDOM weights: drafts will almost always be rejected "
        "(the output stays lossless; only the speed-up is missing)",
        stacklevel=2,
    )
    return DraftWeights.random(smollm2_draft_config(**changes), seed=seed)


def lifted_smollm2_dflash2(
    seed: int = 0, kernel: int = 3, group: int = 64, rank: int = 64, top_k: int = 8
) -> DraftWeights:
    """The shipped (DFlash-1) SmolLM2 drafter with DFlash-2 parts added, for tests and benchmarks
    (no trained DFlash-2 drafter ships): base kernels near the identity (tap 0 = 1, earlier rows
    0.02), small tap projections, and codebooks whose edge term is ~0.1-0.3 logits, enough to
    reorder close candidates. Its drafts are accepted about as often as the shipped drafter's,
    while every DFlash-2 part of a step runs and matters."""
    from ...model.weights import load_gguf
    from ..pretrained import smollm2_drafter_path

    w1 = load_gguf(smollm2_drafter_path())
    vocab = w1.cfg.vocab or SMOLLM2_VOCAB  # the target's (the shipped file borrows its head)
    cfg = w1.cfg.replace(
        vocab=vocab,
        conv_kernel_size=kernel,
        conv_group_size=group,
        selector_rank=rank,
        selector_top_k=top_k,
    )
    rng = np.random.default_rng(seed)
    h, groups = cfg.hidden, cfg.hidden // group
    extra: dict[str, np.ndarray] = {}
    for layer in range(cfg.n_layer):
        for conv in ("attention_conv", "mlp_conv"):
            base = (rng.standard_normal((2, kernel, h)) * 0.02).astype(np.float32)
            base[:, 0, :] = 1.0
            extra[f"layers.{layer}.{conv}.base_kernel"] = base
            extra[f"layers.{layer}.{conv}.kernel_projection.weight"] = (
                rng.standard_normal((2 * kernel * groups, h)) * 0.002
            ).astype(np.float32)
    extra["candidate_selector.hidden_projection.weight"] = (rng.standard_normal((rank, h)) / np.sqrt(h)).astype(
        np.float32
    )
    for book in ("predecessor_codebook", "successor_codebook"):
        extra[f"candidate_selector.{book}"] = (rng.standard_normal((vocab, rank)) * 0.15).astype(np.float32)
    return DraftWeights(cfg, {**dict(w1.items()), **extra}, stored=dict(w1.stored))


class _FeatureCounter:
    """Feature bookkeeping shared by the numpy drafters: keeps every committed row."""

    def __init__(self, cfg: DraftConfig, vocab: int, capacity: int = 8192) -> None:
        self.cfg = cfg
        self.vocab = int(vocab)
        self._feats = np.zeros((capacity, cfg.fc_in), dtype=np.float32)
        self._n = 0

    @property
    def committed(self) -> int:
        return self._n

    @property
    def features(self) -> np.ndarray:
        """Every committed row, (committed, fc_in)."""
        return self._feats[: self._n]

    def add_features(self, rows: Any) -> None:
        arr = np.asarray(rows, dtype=np.float32)
        if arr.ndim != 2 or arr.shape[1] != self.cfg.fc_in:
            raise ValueError(f"feature rows must be (n, {self.cfg.fc_in}), got {arr.shape}")
        if not np.isfinite(arr).all():
            raise ValueError("feature rows contain NaN or inf")
        if self._n + arr.shape[0] > self._feats.shape[0]:
            grown = np.zeros((max(2 * self._feats.shape[0], self._n + arr.shape[0]), self.cfg.fc_in), np.float32)
            grown[: self._n] = self._feats[: self._n]
            self._feats = grown
        self._feats[self._n : self._n + arr.shape[0]] = arr
        self._n += arr.shape[0]

    def rewind(self, n_committed: int) -> None:
        if not 0 <= n_committed <= self._n:
            raise ValueError(f"cannot rewind to {n_committed} (committed {self._n})")
        self._n = n_committed

    def reset(self) -> None:
        self._n = 0


class OracleDrafter(_FeatureCounter):
    """Drafts the reference continuation `reference_tokens` (prompt + the target's greedy output),
    cut at a random length in [0, block_size - 1] and followed by wrong tokens. The lengths come
    in shuffled cycles of every length, so that any 16 on-track rounds exercise them all.

    Off the reference (the emitted text diverged from it), it drafts wrong tokens only."""

    def __init__(self, cfg: DraftConfig, vocab: int, reference_tokens: Sequence[int], seed: int = 0) -> None:
        super().__init__(cfg, vocab)
        self.reference = np.asarray(reference_tokens, dtype=np.int64)
        self.rng = np.random.default_rng(seed)
        self.lengths: list[int] = []  # the cut chosen in each propose()
        self._cycle: list[int] = []

    def _wrong(self, token: int) -> int:
        return (int(token) + 1) % self.vocab

    def propose(
        self,
        last_token: int,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        rng: np.random.Generator | None = None,
    ) -> Any:
        k = self.cfg.block_size - 1
        pos = self.committed  # position of last_token
        ref = self.reference
        on_track = pos < ref.size and ref[pos] == last_token
        avail = max(0, min(k, ref.size - pos - 1)) if on_track else 0
        if not self._cycle:  # every length 0..k once per cycle, in random order
            self._cycle = self.rng.permutation(k + 1).tolist()
        # the next length of the cycle that fits what is left of the reference (else all of it)
        fits = [i for i, c in enumerate(self._cycle) if c <= avail]
        cut = self._cycle.pop(fits[0]) if fits else avail
        self.lengths.append(cut)
        draft = np.empty(k, dtype=np.int64)
        draft[:cut] = ref[pos + 1 : pos + 1 + cut]
        for j in range(cut, k):
            follow = ref[pos + 1 + j] if on_track and pos + 1 + j < ref.size else draft[j - 1] if j else last_token
            draft[j] = self._wrong(follow)
        if temperature == 0:
            return draft
        # a peaked draft distribution on the drafted token (any q works for rejection sampling)
        probs = np.full((k, self.vocab), 0.1 / (self.vocab - 1))
        probs[np.arange(k), draft] = 0.9
        return draft, probs


class ReferenceDrafter(_FeatureCounter):
    """The DFlash drafter computed by `pyggml_dkv.reference` in numpy (float32), window `cap`."""

    def __init__(self, weights: DraftWeights, embed_tokens: np.ndarray, lm_head: np.ndarray, cap: int = 4096) -> None:
        super().__init__(weights.cfg, lm_head.shape[0])
        if embed_tokens.shape != lm_head.shape or embed_tokens.shape[1] != weights.cfg.hidden:
            raise ValueError(
                f"embed_tokens and lm_head must both be (vocab, {weights.cfg.hidden}), "
                f"got {embed_tokens.shape} and {lm_head.shape}"
            )
        self.weights = weights
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.cap = int(cap)

    def propose(
        self,
        last_token: int,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        rng: np.random.Generator | None = None,
    ) -> Any:
        if self.committed <= 0:
            raise ValueError("propose() needs the features of at least one committed token")
        cfg = self.cfg
        ids = np.full(cfg.block_size, cfg.mask_token_id, dtype=np.int64)
        ids[0] = last_token
        noise = self.embed_tokens[ids] * np.float32(cfg.input_embedding_scale)
        logits = reference.reference_step(
            self.weights, self.features, self.committed, self.cap, noise, lm_head=self.lm_head, dtype=np.float32
        )[1:]
        if temperature == 0:
            return np.argmax(logits, axis=1).astype(np.int64)
        probs = sampling_probs(logits, temperature, top_k, top_p)
        return draw_rows(probs, rng or np.random.default_rng()), probs
