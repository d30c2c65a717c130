"""DFlash-2's additions to the drafter's graphs (docs/dflash2.md): the grouped dynamic causal
convolutions around each sublayer of the noise block, and the candidate selector whose greedy
walk gives the draft ids in-graph.

Shapes are ggml order (a row's vector is ne0). The noise block of a step is `lanes` blocks of
`block` rows one after another; a convolution never reaches from one block into another, and
the selector walks each block on its own (row 0 of a block is its anchor token's row).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ggml import Context, Graph, Tensor
from .backend_weights import Matrices

ATTENTION_CONV = "attention_conv"
MLP_CONV = "mlp_conv"
SELECTOR_GATE = "candidate_selector.hidden_projection.weight"
PREDECESSOR_CODEBOOK = "candidate_selector.predecessor_codebook"
SUCCESSOR_CODEBOOK = "candidate_selector.successor_codebook"


def graph_nodes(cfg_block: int, n_layer: int, kernel_size: int) -> int:
    """Nodes + leafs the DFlash-2 parts add to a step graph: per layer two convolved sublayers
    (two sides, each ~2 ops a tap + 4, plus views), and the selector's walk (~6 per block row)."""
    per_side = 6 * kernel_size + 8
    return n_layer * (4 * per_side + 4) + 12 * cfg_block + 32


def conv_deltas(g: Context, w: Matrices, layer: int, sublayer: str, normed: Tensor) -> Tensor:
    """The per-row tap offsets of one sublayer: kernel_projection @ normed -> [2*K*G, rows].

    Row i's entry s*K*G + t*G + group is the offset of tap t of side s for that group's channels;
    both sides come from the un-convolved normed input."""
    return g.mul_mat(w.layer(layer, f"{sublayer}.kernel_projection.weight"), normed)


def dynamic_conv(
    g: Context,
    w: Matrices,
    layer: int,
    sublayer: str,
    x: Tensor,
    deltas: Tensor,
    side: int,
    lanes: int,
    custom_op: bool,
) -> Tensor:
    """One side of a sublayer's convolution over x [H, block * lanes]:

        out[c, i] = sum_t (base[side, t, c] + deltas[i, side, t, c // g]) * x[c, i - t]

    with x[., i - t] zero before the row's block starts (taps never cross blocks). `custom_op`
    (CPU backend): one op in C (ggml/ops_conv.py); otherwise ggml's standard ops, which any
    backend runs."""
    cfg = w.cfg
    hidden, kernel, groups = cfg.hidden, cfg.conv_kernel_size, cfg.conv_groups
    rows = x.ne[1]
    block = rows // lanes
    base = w.layer(layer, f"{sublayer}.base_kernel")  # [H, K, 2]
    base_side = g.view(base, (hidden, kernel), (base.nb[1],), side * base.nb[2])
    if custom_op:
        side_deltas = g.view(deltas, (kernel * groups, rows), (deltas.nb[1],), side * kernel * groups * deltas.nb[0])
        return g.dynamic_conv(x if x.is_contiguous else g.cont(x), side_deltas, base_side, block)
    taps = min(kernel, block)  # a tap reaching past the block start reads only zeros
    # each row's tap weights [H, K, rows]: its offsets repeated over their group's channels, + base
    f32 = deltas.nb[0]
    offsets = g.view(deltas, (1, groups, kernel, rows), (f32, groups * f32, deltas.nb[1]), side * kernel * groups * f32)
    tap_weights = g.add(
        g.reshape(g.repeat(offsets, cfg.conv_group_size, groups, kernel, rows), hidden, kernel, rows), base_side
    )
    # tap t of row i reads row i - t of its block: the block with taps - 1 zero rows on top,
    # seen from row taps - 1 - t
    blocks = g.reshape(x if x.is_contiguous else g.cont(x), hidden, block, lanes)
    padded = g.pad(blocks, (0, taps - 1)) if taps > 1 else blocks
    out = None
    for t in range(taps):
        weight_t = g.view(
            tap_weights, (hidden, block, lanes), (tap_weights.nb[2], tap_weights.nb[2] * block), t * tap_weights.nb[1]
        )
        x_t = g.view(padded, (hidden, block, lanes), (padded.nb[1], padded.nb[2]), (taps - 1 - t) * padded.nb[1])
        term = g.mul(weight_t, x_t)
        out = term if out is None else g.add(out, term)
    assert out is not None
    return g.reshape(out, hidden, rows)


@dataclass
class SelectorOutputs:
    """The lattice a step's selector leaves for the host (sampled walks, p_min), beside the ids
    its greedy walk wrote.

    candidates [k, rows] i32: each row's top-k tokens; first [k, 1, lanes]: the scores of block
    row 1's candidates after the anchor; rest [k (j), k (p), block - 1, lanes]: at index i - 1 the
    scores s_i(C_{i-1}[p] -> C_i[j]) for block rows i >= 2 (index 0 is unused)."""

    candidates: Tensor
    first: Tensor
    rest: Tensor


def selector(
    g: Context, gf: Graph, w: Matrices, hidden: Tensor, logits: Tensor, tokens: Tensor, lanes: int, walk_ids: Tensor
) -> SelectorOutputs:
    """The candidate selector of every block and its greedy walk (docs/dflash2.md, section 2).

    hidden [H, rows] the final normed hidden states, logits [V, rows] the scaled, soft-capped
    logits, tokens [rows] i32 the noise block's ids (row 0 of a block is its anchor). The walk
    writes block row i's draft id into walk_ids[block * lane + i] (row 0 is left as it was)."""
    cfg = w.cfg
    k, rank = cfg.selector_top_k, cfg.selector_rank
    vocab, rows = logits.ne[0], logits.ne[1]
    block = rows // lanes
    candidates = g.top_k(logits, k)  # [k, rows] i32
    unary = g.reshape(g.get_rows(g.reshape(logits, 1, vocab, rows), candidates), k, block, lanes)
    gate = g.mul_mat(w[SELECTOR_GATE], hidden)  # [R, rows]
    flat = g.view(candidates, (k * rows,))
    successors = g.reshape(g.get_rows(w[SUCCESSOR_CODEBOOK], flat), rank, k, rows)
    gated = g.reshape(g.mul(successors, g.reshape(gate, rank, 1, rows)), rank, k, block, lanes)
    predecessors = g.reshape(g.get_rows(w[PREDECESSOR_CODEBOOK], flat), rank, k, block, lanes)
    anchors = g.reshape(g.get_rows(w[PREDECESSOR_CODEBOOK], tokens), rank, block, lanes)  # row 0: the anchor's code

    def block_rows(t: Tensor, first: int, n: int) -> Tensor:
        """Rows first..first+n-1 of every block of a [., k, block, lanes] tensor."""
        return g.view(t, (t.ne[0], t.ne[1], n, lanes), (t.nb[1], t.nb[2], t.nb[3]), first * t.nb[2])

    unary4 = g.reshape(unary, k, 1, block, lanes)
    # block row 1 follows the anchor
    first = g.mul_mat(
        g.view(gated, (rank, k, lanes), (gated.nb[1], gated.nb[3]), gated.nb[2]),
        g.view(anchors, (rank, 1, lanes), (anchors.nb[1], anchors.nb[2])),
    )
    first = g.add(first, g.view(unary, (k, 1, lanes), (unary.nb[1], unary.nb[2]), unary.nb[1]))
    # rows i >= 2 follow every candidate of row i - 1: [k (j), k (p), block - 1, lanes] at i - 1
    rest = g.mul_mat(block_rows(gated, 1, block - 1), block_rows(predecessors, 0, block - 1))
    rest = g.add(rest, block_rows(unary4, 1, block - 1))
    for t in (candidates, first, rest):
        t.set_output()
        gf.expand(t)

    # the greedy walk: each row takes its best candidate after the previous pick (ties: the first)
    scores = g.reshape(first, k, lanes)  # row 1's
    for i in range(1, block):
        pick = g.reshape(g.argmax(scores), 1, lanes)
        row_candidates = g.view(
            candidates, (1, k, lanes), (candidates.nb[0], block * candidates.nb[1]), i * candidates.nb[1]
        )
        token = g.get_rows(row_candidates, pick)  # [1, 1, lanes]
        slot = g.view(walk_ids, (1, 1, lanes), (walk_ids.nb[0], block * walk_ids.nb[0]), i * walk_ids.nb[0])
        gf.expand(g.cpy(token, slot))
        if i + 1 < block:  # row i + 1's scores: its candidates after this pick
            row_scores = g.view(rest, (k, k, lanes), (rest.nb[1], rest.nb[3]), i * rest.nb[2])
            scores = g.reshape(g.get_rows(row_scores, pick), k, lanes)
    return SelectorOutputs(candidates, first, rest)
