"""The ring cache's device side: its memory (K/V rings + persistent inputs in one buffer) and
its once-built step graph (fold-in append, then the noise-block forward). docs/design.md, "The
step graph".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..ggml import Backend, Buffer, Context, Gallocr, Graph, Tensor
from ..model.backend_weights import BackendWeights
from . import layers as L
from .head_screen import HeadScreen
from .masks import SplitMask, StepMasks


@dataclass(frozen=True)
class Geometry:
    """Sizes of the cache (docs/design.md, "Geometry")."""

    cap: int  # ring slots per layer: the longest context window
    q_len: int  # the noise block: one draft block
    a_step: int  # rows the step graph can fold in: 2 * q_len + 2
    trash_slot: int  # where fold-in padding rows are written: cap + q_len
    kv_total: int  # K/V rows per layer: cap ring slots, q_len noise rows, trash, padded to 32
    mask_rows: int  # rows of each mask: q_len, times the query heads per K/V head when folded
    fold_buckets: tuple[int, ...]  # fold-in sizes with a step graph of their own, ascending, the last a_step

    @classmethod
    def of(cls, cap: int, q_len: int, groups: int) -> "Geometry":
        kv_total = (cap + q_len + 1 + 31) // 32 * 32
        a_step = 2 * q_len + 2
        return cls(cap, q_len, a_step, cap + q_len, kv_total, q_len * groups, fold_buckets(q_len, a_step))

    def bucket_for(self, n_rows: int) -> int:
        """The smallest fold-in size that takes `n_rows` new rows (<= a_step)."""
        return next(b for b in self.fold_buckets if b >= n_rows)


def fold_buckets(q_len: int, a_step: int) -> tuple[int, ...]:
    """The fold-in sizes that get a step graph of their own.

    Every row of a fold-in costs its products through fc and each layer's K/V, padding rows too;
    a round of speculative decoding commits 1..q_len rows (accepted drafts + the bonus token), so a
    few sizes cover the common cases: a quarter block, half a block + 1 (an average round), a
    block + 2, and the full a_step (refills after a rewind, skipped steps). Each size is one more
    graph built at init and replayed as it is (docs/design.md, "Fold-in and bulk append").
    """
    return tuple(sorted({max(1, q_len // 4), q_len // 2 + 1, min(q_len + 2, a_step), a_step}))


class StepGraph(Graph):
    """A once-built step graph. Computing it, by any route, tells its owner (the fold-in rows are
    written; its outputs are the step's): hosts of the C-style API compute it with
    Backend.compute directly."""

    def __init__(self, ctx: Context, size: int, on_computed: Callable[["StepGraph"], None]) -> None:
        super().__init__(ctx, size)
        self._on_computed = on_computed

    def compute(self, backend: Backend) -> None:
        super().compute(backend)
        self._on_computed(self)


class CacheMemory:
    """The K/V rings of every layer and every step input, in ONE zero-filled backend buffer."""

    def __init__(self, weights: BackendWeights, backend: Backend, geo: Geometry, cache_type: str,
                 masks: StepMasks, token_input: bool) -> None:
        cfg = weights.cfg
        kv_width = cfg.head_dim * cfg.n_head_kv
        self.ctx = Context(n_tensors=2 * cfg.n_layer + 14)
        m = self.ctx
        self.k_cache = [m.new_tensor(cache_type, kv_width, geo.kv_total, name=f"k_cache.{i}") for i in range(cfg.n_layer)]
        self.v_cache = [m.new_tensor(cache_type, kv_width, geo.kv_total, name=f"v_cache.{i}") for i in range(cfg.n_layer)]
        # the noise block enters as embeddings the host fills, or as token ids looked up in-graph
        self.inp_tokens = m.new_tensor("i32", geo.q_len, name="inp_tokens") if token_input else None
        self.inp_embed = None if token_input else m.new_tensor("f32", cfg.hidden, geo.q_len, name="inp_embed")
        self.pos_q = m.new_tensor("i32", geo.q_len, name="pos_q")
        self.noise_rows = m.new_tensor("i32", geo.q_len, name="noise_rows")
        # each mask as attention reads it; a SplitMask's is written by every step graph from its
        # base (uploaded once) and its context row (uploaded each step): drafter.masks
        self.mask_full = m.new_tensor("f16", geo.kv_total, geo.mask_rows, name="mask_full") if masks.full else None
        self.mask_swa = m.new_tensor("f16", geo.kv_total, geo.mask_rows, name="mask_swa") if masks.sliding else None
        self.mask_parts: dict[str, tuple[Tensor, Tensor]] = {}  # name -> (base, row) of a split mask
        for name, mask in (("mask_full", masks.full), ("mask_swa", masks.sliding)):
            if isinstance(mask, SplitMask):
                self.mask_parts[name] = (m.new_tensor("f16", geo.kv_total, geo.mask_rows, name=f"{name}_base"),
                                         m.new_tensor("f16", geo.kv_total, 1, name=f"{name}_row"))
        self.ap_feat = m.new_tensor("f32", cfg.fc_in, geo.a_step, name="ap_feat")
        self.ap_pos = m.new_tensor("i32", geo.a_step, name="ap_pos")
        self.ap_rows = m.new_tensor("i32", geo.a_step, name="ap_rows")
        for t in self.inputs():
            t.set_input()
        self.buf = Buffer.alloc_ctx_tensors(m, backend)
        self.buf.clear(0)
        self.noise_rows.set(np.arange(geo.cap, geo.cap + geo.q_len, dtype=np.int32))
        self.ap_rows.set(np.full(geo.a_step, geo.trash_slot, dtype=np.int32))

    def inputs(self) -> list[Tensor]:
        masks = [getattr(self, n) for n in ("mask_full", "mask_swa") if n not in self.mask_parts]
        parts = [t for pair in self.mask_parts.values() for t in pair]
        return [t for t in (self.inp_embed, self.inp_tokens, self.pos_q, self.noise_rows, self.ap_feat,
                            self.ap_pos, self.ap_rows, *masks, *parts) if t is not None]

    def attention_mask(self, g: Context, gf: Graph, name: str) -> Tensor | None:
        """The mask `name` for a graph: the leaf itself, or for a split mask base + row written
        into the leaf by this graph (so the leaf always holds the mask the last step used)."""
        mask = getattr(self, name)
        if mask is None or name not in self.mask_parts:
            return mask
        base, row = self.mask_parts[name]
        return gf.expand(g.cpy(g.add(base, row), mask))

    def close(self) -> None:
        self.buf.close()
        self.ctx.close()


@dataclass
class BuiltStepGraph:
    ctx: Context
    graph: StepGraph
    galloc: Gallocr
    hidden_states: Tensor
    logits: Tensor | None
    draft_ids: Tensor | None

    def close(self) -> None:
        self.galloc.close()
        self.ctx.close()


def first_rows(g: Context, t: Tensor, n: int) -> Tensor:
    """The first n rows (ne1) of a 2-D tensor, or the first n values of a 1-D one (a view)."""
    if len(t.shape) == 1:
        return t if n == t.ne[0] else g.view(t, (n,))
    return t if n == t.ne[1] else g.view(t, (t.ne[0], n), (t.nb[1],))


def build_step_graph(weights: BackendWeights, backend: Backend, mem: CacheMemory, layer_swa: list[bool],
                     fold: bool, bf16_products: bool, lm_head: Tensor | None, embed_table: Tensor | None,
                     on_computed: Callable[[StepGraph], None], fold_rows: int,
                     head_screen: HeadScreen | None = None) -> BuiltStepGraph:
    """Build and allocate a step graph folding in the first `fold_rows` rows of the fold-in inputs,
    once; every step recomputes it as it is. With a `head_screen` the draft ids come from the
    screened argmax (drafter.head_screen) and this graph has no logits."""
    cfg = weights.cfg
    size = L.graph_size_for(cfg)
    g = Context(n_tensors=size, graph_size=size)
    try:
        gf = StepGraph(g, size, on_computed)
        # (a) fold-in append, expanded first: every later read goes through its results
        feat, pos, rows = (first_rows(g, t, fold_rows) for t in (mem.ap_feat, mem.ap_pos, mem.ap_rows))
        k_caches, v_caches = L.append_rows(g, weights, mem.k_cache, mem.v_cache, feat, pos, rows)
        for t in (*k_caches, *v_caches):
            gf.expand(t)

        # (b) noise forward: the block's own K/V go to its ring rows, attention spans all kv_total rows
        def kv_of_layer(layer: int, hn: Tensor) -> tuple[Tensor, Tensor]:
            k_all = gf.expand(g.set_rows(k_caches[layer], L.keys(g, weights, layer, hn, mem.pos_q), mem.noise_rows))
            v_all = gf.expand(g.set_rows(v_caches[layer], L.values(g, weights, layer, hn), mem.noise_rows))
            return k_all, v_all

        h = L.embed_tokens(g, cfg, embed_table, mem.inp_tokens) if mem.inp_tokens is not None else mem.inp_embed
        masks = {False: mem.attention_mask(g, gf, "mask_full"), True: mem.attention_mask(g, gf, "mask_swa")}
        head = L.noise_forward(g, weights, h, mem.pos_q, kv_of_layer, masks, layer_swa, fold, bf16_products,
                               lm_head if head_screen is None else None)

        # (c) outputs
        hidden = gf.expand(head.hidden)
        logits = gf.expand(head.logits) if head.logits is not None else None
        draft_ids = None
        if logits is not None:
            draft_ids = gf.expand(g.argmax(logits))
        elif head_screen is not None and lm_head is not None:
            scores = g.mul_mat(head_screen.scores_matrix, head.hidden)
            scores.name = "lm_head_scores"
            draft_ids = gf.expand(g.screened_argmax(scores, head.hidden, lm_head, head_screen.bounds))
        if draft_ids is not None:
            draft_ids.name = "draft_ids"
            draft_ids.set_output()
        galloc = Gallocr(backend)
        galloc.alloc_graph(gf)
    except BaseException:
        g.close()
        raise
    return BuiltStepGraph(g, gf, galloc, hidden, logits, draft_ids)
