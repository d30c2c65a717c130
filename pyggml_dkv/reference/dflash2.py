"""A pure-numpy float64 reference of what DFlash-2 adds to a DFlash drafter (docs/dflash2.md).

Two additions, each stated here once, as plainly as the math allows (no ggml, no batching tricks):

* the grouped dynamic causal convolution wrapped around every attention and MLP sublayer of the
  noise block (`conv_deltas`, `dynamic_conv`, `conv_sublayer`);
* the candidate selector that turns the block's logits into draft ids (`top_k_candidates`,
  `selector_gate`, `edge_scores`, `selector_scores`, `greedy_walk`, `sample_path`,
  `draft_distribution`, and `pack_lattice` for llama.cpp's packed output).

Layout, as in `pyggml_dkv.reference`: one row per token, weights in PyTorch `(out, in)` layout
(the reverse of ggml's `ne` order), so `y = x @ W.T`.

    x, normed              (n, H)          rows of the noise block (row 0 = the anchor token)
    base_kernel            (2, K, H)       HF `*_conv.base_kernel`; GGUF `blk.N.*_conv_base` {H, K, 2}
    kernel_projection      (2*K*G, H)      HF `*_conv.kernel_projection.weight`; GGUF {H, 2*K*G}
    deltas                 (n, 2, K, G)    normed @ kernel_projection.T, reshaped [side, tap, group]
    hidden_projection      (R, H)          HF `candidate_selector.hidden_projection.weight`
    predecessor_codebook   (V, R)          HF `candidate_selector.predecessor_codebook`
    successor_codebook     (V, R)          HF `candidate_selector.successor_codebook`

with K = conv_kernel_size, G = H / conv_group_size groups, R = selector_rank, V = vocab.

`selector_lattice` and `draft_step_dflash2` apply the selector to a drafter's own weights
(DraftWeights of a DFlash-2 config); `reference.decoder_layer` applies the convolutions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..common.checks import is_int
from ..model.tensor_names import SELECTOR_HIDDEN, SELECTOR_PREDECESSOR, SELECTOR_SUCCESSOR
from ..model.weights import DraftWeights

if TYPE_CHECKING:  # pragma: no cover
    from . import SwaMode

__all__ = [
    "Lattice",
    "SampledPath",
    "conv_deltas",
    "conv_sublayer",
    "draft_distribution",
    "draft_step_dflash2",
    "dynamic_conv",
    "edge_scores",
    "greedy_walk",
    "pack_lattice",
    "sample_path",
    "selector_gate",
    "selector_lattice",
    "selector_scores",
    "top_k_candidates",
]

SIDES = (0, 1)  # 0: convolve the sublayer input; 1: convolve the sublayer output


# --------------------------------------------------------------------------------------------
# validation helpers


def _positive_int(name: str, value: object) -> int:
    if not is_int(value) or int(value) < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _array(name: str, x: object, ndim: int, *, allow_neg_inf: bool = False) -> np.ndarray:
    """`x` as a float64 array of `ndim` dimensions; NaN and +inf are always refused.

    -inf is allowed only where llama.cpp can produce it (logits of a reduced-vocab draft, whose
    non-draft rows it fills with -inf).
    """
    arr = np.asarray(x)
    if arr.dtype.kind not in "fiu":
        raise ValueError(f"{name} must be a real numeric array, got dtype {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    arr = arr.astype(np.float64)
    bad = np.isnan(arr) | (arr == np.inf) | ((arr == -np.inf) & (not allow_neg_inf))
    if bad.any():
        raise ValueError(f"{name} contains NaN or inf")
    return arr


def _ids(name: str, ids: object, ndim: int, vocab: int) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != ndim or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{name} must be a {ndim}-D integer array, got {arr.dtype} {arr.shape}")
    arr = arr.astype(np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= vocab):
        raise ValueError(f"{name} holds ids outside [0, {vocab})")
    return arr


def _side(side: object) -> int:
    if not is_int(side) or int(side) not in SIDES:
        raise ValueError(f"side must be 0 (sublayer input) or 1 (sublayer output), got {side!r}")
    return int(side)


def _block_len(n_rows: int, block_len: object) -> int:
    """The block length, defaulting to all rows; the rows must split into whole blocks."""
    if block_len is None:
        return n_rows
    length = _positive_int("block_len", block_len)
    if n_rows % length:
        raise ValueError(f"{n_rows} rows do not split into blocks of {length}")
    return length


def _softmax(scores: np.ndarray) -> np.ndarray:
    shifted = np.exp(scores - scores.max())
    return shifted / shifted.sum()


# --------------------------------------------------------------------------------------------
# the grouped dynamic causal convolution


def conv_deltas(normed: np.ndarray, kernel_projection: np.ndarray, kernel_size: int, group_size: int) -> np.ndarray:
    """The dynamic part of both kernels of one sublayer: (n, 2, K, G), indexed [row, side, tap, group].

    One linear map (no bias, no activation) of the sublayer's normed input feeds both sides, so it
    is computed once, before side 0 replaces `normed` with its convolution. The flat projection
    index is `side*K*G + tap*G + group` (ggml reshapes it to {G, K, 2}, fastest first).
    """
    normed = _array("normed", normed, 2)
    proj = _array("kernel_projection", kernel_projection, 2)
    kernel_size = _positive_int("kernel_size", kernel_size)
    group_size = _positive_int("group_size", group_size)
    hidden = normed.shape[1]
    if hidden % group_size:
        raise ValueError(f"hidden size {hidden} is not a multiple of group_size {group_size}")
    groups = hidden // group_size
    if proj.shape != (2 * kernel_size * groups, hidden):
        raise ValueError(f"kernel_projection must be (2*K*G={2 * kernel_size * groups}, H={hidden}), got {proj.shape}")
    return (normed @ proj.T).reshape(normed.shape[0], 2, kernel_size, groups)


def dynamic_conv(
    x: np.ndarray,
    base_kernel: np.ndarray,
    deltas: np.ndarray,
    side: int,
    block_len: int | None = None,
) -> np.ndarray:
    """One side of the convolution, over the rows of each block only:

        out[i, c] = sum_{t < K} (base_kernel[side, t, c] + deltas[i, side, t, c // g]) * x[i - t, c]

    with g = H / G channels per group, and x[i - t] read as zero when i - t falls before the first
    row of row i's block: nothing crosses a block's first row (the anchor row), and the context
    (target-feature) rows are never part of x. The tap weight is the output row's (i), not the
    input row's (i - t). `block_len=None` treats all rows as one block; otherwise the rows are
    consecutive blocks of `block_len` rows (llama.cpp: one block per sequence of the batch).
    """
    x = _array("x", x, 2)
    base = _array("base_kernel", base_kernel, 3)
    deltas = _array("deltas", deltas, 4)
    side = _side(side)
    n_rows, hidden = x.shape
    if n_rows < 1:
        raise ValueError("x must hold at least one row")
    _, kernel_size, _ = base.shape
    groups = deltas.shape[3]
    if base.shape != (2, kernel_size, hidden):
        raise ValueError(f"base_kernel must be (2, K, H={hidden}), got {base.shape}")
    if deltas.shape[:3] != (n_rows, 2, kernel_size) or groups < 1 or hidden % groups:
        raise ValueError(f"deltas must be (n={n_rows}, 2, K={kernel_size}, G | {hidden}), got {deltas.shape}")
    length = _block_len(n_rows, block_len)

    weights = base[side][None] + np.repeat(deltas[:, side], hidden // groups, axis=2)  # (n, K, H)
    blocks = x.reshape(n_rows // length, length, hidden)
    out = np.zeros_like(blocks)
    for tap in range(min(kernel_size, length)):  # later taps read only the zero padding
        shifted = np.zeros_like(blocks)
        shifted[:, tap:] = blocks[:, : length - tap]
        out += weights[:, tap].reshape(blocks.shape) * shifted
    return out.reshape(n_rows, hidden)


def conv_sublayer(
    normed: np.ndarray,
    base_kernel: np.ndarray,
    kernel_projection: np.ndarray,
    sublayer: Callable[[np.ndarray], np.ndarray],
    group_size: int,
    block_len: int | None = None,
) -> np.ndarray:
    """A sublayer (attention incl. o_proj, or the MLP) wrapped in its two convolutions.

        deltas = conv_deltas(normed)                  # from the normed input, once
        y      = sublayer(dynamic_conv(normed, side 0))
        return   dynamic_conv(y, side 1)              # the caller adds the residual after this

    `normed` is the sublayer's RMS-normed input: RMSNorm(h) * input_layernorm for attention,
    RMSNorm(h) * post_attention_layernorm for the MLP. Optional post-norms and the residual add
    come after side 1 (llama.cpp src/models/dflash.cpp).
    """
    normed = _array("normed", normed, 2)
    base = _array("base_kernel", base_kernel, 3)
    deltas = conv_deltas(normed, kernel_projection, base.shape[1], group_size)
    inner = np.asarray(sublayer(dynamic_conv(normed, base, deltas, 0, block_len)), dtype=np.float64)
    if inner.shape != normed.shape:
        raise ValueError(f"sublayer must map {normed.shape} rows to the same shape, got {inner.shape}")
    return dynamic_conv(inner, base, deltas, 1, block_len)


# --------------------------------------------------------------------------------------------
# the candidate selector


def top_k_candidates(logits: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's `top_k` largest logits: (candidate ids (n, k) int64, their logits (n, k)).

    Ordered by descending logit, ties by ascending token id. llama.cpp's `ggml_top_k` returns the
    same set in no particular order (and the upstream reference uses `topk(sorted=False)`), so the
    order only matters where a walk meets an exact tie of scores.
    """
    logits = _array("logits", logits, 2, allow_neg_inf=True)
    top_k = _positive_int("top_k", top_k)
    if top_k > logits.shape[1]:
        raise ValueError(f"top_k={top_k} exceeds the vocabulary of {logits.shape[1]}")
    order = np.argsort(-logits, axis=1, kind="stable")[:, :top_k]
    return order.astype(np.int64), np.take_along_axis(logits, order, axis=1)


def selector_gate(hidden: np.ndarray, hidden_projection: np.ndarray) -> np.ndarray:
    """gamma_i = hidden_projection @ out_i, (n, R): one gate per block row, from the final normed
    hidden state (the rows the lm_head reads)."""
    hidden = _array("hidden", hidden, 2)
    proj = _array("hidden_projection", hidden_projection, 2)
    if proj.shape[1] != hidden.shape[1]:
        raise ValueError(f"hidden_projection must be (R, H={hidden.shape[1]}), got {proj.shape}")
    return hidden @ proj.T


def edge_scores(
    predecessors: np.ndarray,
    gate: np.ndarray,
    candidates: np.ndarray,
    unary: np.ndarray,
    predecessor_codebook: np.ndarray,
    successor_codebook: np.ndarray,
) -> np.ndarray:
    """s(p -> c) = <A[p] * gamma, B[c]> + z[c] for every predecessor id p and candidate c: (P, k).

    predecessors (P,) ids; gate (R,) the position's gamma; candidates (k,) ids with unary (k,)
    their (scaled, soft-capped) logits z; A, B the predecessor / successor codebooks (V, R).
    """
    a = _array("predecessor_codebook", predecessor_codebook, 2)
    b = _array("successor_codebook", successor_codebook, 2)
    if a.shape != b.shape:
        raise ValueError(f"the codebooks must share one shape (V, R), got {a.shape} and {b.shape}")
    vocab, rank = a.shape
    gate = _array("gate", gate, 1)
    unary = _array("unary", unary, 1, allow_neg_inf=True)
    pred = _ids("predecessors", predecessors, 1, vocab)
    cand = _ids("candidates", candidates, 1, vocab)
    if gate.shape != (rank,) or unary.shape != cand.shape:
        raise ValueError(
            f"gate must be (R={rank},) and unary match candidates {cand.shape}, got {gate.shape}, {unary.shape}"
        )
    return (a[pred] * gate) @ b[cand].T + unary[None, :]


@dataclass(frozen=True)
class Lattice:
    """The selector's scores for the draft positions i = 1..m of one block (m = rows - 1).

    candidates[i-1] (k,) holds C_i; scores[i-1, p, j] = s_i(C_{i-1}[p] -> C_i[j]), the score of
    candidate j at position i after candidate p of position i-1. Position 1 follows the anchor
    token, not a candidate set, so every row p of scores[0] is the same (llama.cpp repeats it).
    """

    candidates: np.ndarray  # (m, k) int64
    scores: np.ndarray  # (m, k, k) float64

    @property
    def n_positions(self) -> int:
        return int(self.candidates.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.candidates.shape[1])


def selector_scores(
    hidden: np.ndarray,
    logits: np.ndarray,
    anchor: int,
    hidden_projection: np.ndarray,
    predecessor_codebook: np.ndarray,
    successor_codebook: np.ndarray,
    top_k: int,
) -> Lattice:
    """The lattice of one block: hidden (n, H) its final normed hidden states and logits (n, V)
    its scaled, soft-capped logits (`reference.lm_logits`), both including row 0 (the anchor's),
    which the selector does not read; `anchor` is the anchor token id (the last committed token).

    Callers that run a block longer than the trained block size pass its first block_size rows:
    llama.cpp's selector reads only min(rows, dflash.block_size) of them.
    """
    hidden = _array("hidden", hidden, 2)
    logits = _array("logits", logits, 2, allow_neg_inf=True)
    if hidden.shape[0] != logits.shape[0] or hidden.shape[0] < 2:
        raise ValueError(f"hidden {hidden.shape} and logits {logits.shape} must share n >= 2 rows")
    if not is_int(anchor):
        raise ValueError(f"anchor must be a token id, got {anchor!r}")
    candidates, unary = top_k_candidates(logits[1:], top_k)
    gates = selector_gate(hidden[1:], hidden_projection)
    books = (predecessor_codebook, successor_codebook)

    first = edge_scores(np.array([anchor]), gates[0], candidates[0], unary[0], *books)
    scores = [np.repeat(first, candidates.shape[1], axis=0)]
    for i in range(1, candidates.shape[0]):
        scores.append(edge_scores(candidates[i - 1], gates[i], candidates[i], unary[i], *books))
    return Lattice(candidates=candidates, scores=np.stack(scores))


def pack_lattice(lattice: Lattice, n_embd: int) -> np.ndarray:
    """The lattice as llama.cpp hands it to the walk (`build_dflash2_selector`, read back through
    `llama_get_embeddings_nextn`): one n_embd-wide row per block row, (m + 1, n_embd).

    Row 0 (the anchor's) is all zeros; row i holds C_i's ids (as floats), then the k*k scores
    predecessor-major (entry k + p*k + j is scores[i-1, p, j]), then zeros.
    """
    n_embd = _positive_int("n_embd", n_embd)
    k = lattice.top_k
    if n_embd < k * (k + 1):
        raise ValueError(f"n_embd={n_embd} cannot hold k + k*k = {k * (k + 1)} lattice entries")
    packed = np.zeros((lattice.n_positions + 1, n_embd))
    packed[1:, :k] = lattice.candidates
    packed[1:, k : k + k * k] = lattice.scores.reshape(lattice.n_positions, k * k)
    return packed


def greedy_walk(lattice: Lattice, p_min: float = 0.0) -> np.ndarray:
    """The draft ids llama.cpp takes from a lattice (common/speculative.cpp, DFlash-2 branch).

    Greedy per step, not a best-path search: from the anchor, each position takes the candidate
    with the highest score after the previous pick (the first one on an exact tie), which then
    becomes the predecessor. With p_min > 0 the walk stops before a position whose pick has
    softmax(scores)[pick] < p_min (temperature 1, over that position's k candidates).
    """
    if not isinstance(p_min, (int, float)) or not 0.0 <= p_min <= 1.0:
        raise ValueError(f"p_min must be in [0, 1], got {p_min!r}")
    drafted: list[int] = []
    pred = 0  # position 1's rows are all equal: any index stands for the anchor
    for i in range(lattice.n_positions):
        row = lattice.scores[i, pred]
        pick = int(np.argmax(row))
        if p_min > 0.0 and _softmax(row)[pick] < p_min:
            break
        drafted.append(int(lattice.candidates[i, pick]))
        pred = pick
    return np.array(drafted, dtype=np.int64)


@dataclass(frozen=True)
class SampledPath:
    """A path drawn at temperature T and what lossless verification needs to judge it.

    tokens[i-1] = C_i[indices[i-1]]; probs[i-1] (k,) is q_i, the distribution the pick at
    position i was drawn from, over C_i, given the pick before it.
    """

    tokens: np.ndarray  # (m,) int64
    indices: np.ndarray  # (m,) int64
    probs: np.ndarray  # (m, k) float64


def sample_path(lattice: Lattice, temperature: float, rng: np.random.Generator) -> SampledPath:
    """Draw a path left to right: q_i = softmax(scores[i-1, pred] / T), pick j ~ q_i, pred = j.

    This is the upstream PyTorch reference's `CandidateSelector.select` at temperature > 0 (the
    `dflash` package; llama.cpp 0.3.36 has no sampled walk). q_i depends on the drafted prefix
    only through the previous pick, so the joint draft probability of the path is prod_i q_i, and
    `draft_distribution` of these rows is the per-position draft distribution that speculative
    sampling compares with the target's. The user's top-p / top-k are not applied to q_i.
    """
    if not isinstance(temperature, (int, float)) or not np.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng must be a numpy Generator, got {type(rng).__name__}")
    indices, probs = [], []
    pred = 0
    for i in range(lattice.n_positions):
        q = _softmax(lattice.scores[i, pred] / temperature)
        pred = int(rng.choice(q.size, p=q))
        indices.append(pred)
        probs.append(q)
    idx = np.array(indices, dtype=np.int64)
    tokens = np.take_along_axis(lattice.candidates, idx[:, None], axis=1)[:, 0]
    return SampledPath(tokens=tokens, indices=idx, probs=np.array(probs).reshape(-1, lattice.top_k))


def draft_distribution(candidates: np.ndarray, probs: np.ndarray, vocab: int) -> np.ndarray:
    """q_i over the whole vocabulary, (m, vocab): probs[i, j] at candidates[i, j], zero elsewhere.

    This is what the acceptance test min(1, p(x) / q(x)) and the residual max(0, p - q) read.
    """
    vocab = _positive_int("vocab", vocab)
    probs = _array("probs", probs, 2)
    cand = _ids("candidates", candidates, 2, vocab)
    if cand.shape != probs.shape:
        raise ValueError(f"candidates {cand.shape} and probs {probs.shape} must match")
    full = np.zeros((cand.shape[0], vocab))
    np.put_along_axis(full, cand, probs, axis=1)
    return full


# --------------------------------------------------------------------------------------------
# a DFlash-2 drafter's selector and draft step


def _dflash2_weights(w: object) -> DraftWeights:
    if not isinstance(w, DraftWeights):
        raise ValueError(f"w must be DraftWeights, got {type(w).__name__}")
    if not w.cfg.is_dflash2:
        raise ValueError("w is a DFlash-1 drafter (its config has no conv_kernel_size / selector_top_k)")
    return w


def selector_lattice(w: DraftWeights, out_hidden: np.ndarray, logits: np.ndarray, anchor: int) -> Lattice:
    """The lattice of one block from a DFlash-2 drafter's selector weights.

    out_hidden (n, H): the block's final normed hidden rows (`draft_forward` without lm_head);
    logits (n, V): their scaled, soft-capped logits (`lm_logits`); both include row 0 (the
    anchor's); `anchor`: the anchor token id. As llama.cpp, only the first min(n, block_size)
    rows are scored (see `selector_scores`).
    """
    w = _dflash2_weights(w)
    cfg = w.cfg
    hidden = _array("out_hidden", out_hidden, 2)
    logits = _array("logits", logits, 2, allow_neg_inf=True)
    if hidden.shape[1] != cfg.hidden or logits.shape[1] != cfg.vocab:
        raise ValueError(
            f"out_hidden must be (n, H={cfg.hidden}) and logits (n, V={cfg.vocab}), "
            f"got {hidden.shape} and {logits.shape}"
        )
    rows = min(hidden.shape[0], cfg.block_size)
    if not is_int(anchor) or not 0 <= int(anchor) < int(cfg.vocab or 0):
        raise ValueError(f"anchor must be a token id in [0, {cfg.vocab}), got {anchor!r}")
    return selector_scores(
        hidden[:rows],
        logits[:rows],
        int(anchor),
        w[SELECTOR_HIDDEN],
        w[SELECTOR_PREDECESSOR],
        w[SELECTOR_SUCCESSOR],
        cfg.selector_top_k,
    )


def draft_step_dflash2(
    w: DraftWeights,
    all_feats: np.ndarray,
    committed: int,
    cap: int,
    noise_embed: np.ndarray,
    anchor: int,
    lm_head: np.ndarray,
    *,
    swa: SwaMode = "seed",
    p_min: float = 0.0,
    dtype: np.dtype | type = np.float64,
) -> tuple[Lattice, np.ndarray]:
    """One DFlash-2 draft step as llama.cpp takes it: (the block's lattice, the greedy walk's ids).

    The inputs are `reference_step`'s (noise_embed row 0 is the anchor token's embedding) plus the
    anchor's id and the lm_head (V, H). The forward pass runs in `dtype`, the selector in float64.
    """
    # imported here: the package's __init__ imports this module for its convolutions
    from . import lm_logits, reference_step

    w = _dflash2_weights(w)
    head = _array("lm_head", lm_head, 2)
    if head.shape != (w.cfg.vocab, w.cfg.hidden):
        raise ValueError(f"lm_head must be (V={w.cfg.vocab}, H={w.cfg.hidden}), got {head.shape}")
    out = reference_step(w, all_feats, committed, cap, noise_embed, swa=swa, dtype=dtype)
    logits = lm_logits(out, head.astype(out.dtype), w.cfg)
    lattice = selector_lattice(w, out, logits, anchor)
    return lattice, greedy_walk(lattice, p_min)
