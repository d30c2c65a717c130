"""The ring cache's device side: its memory (K/V rings + persistent inputs in one buffer) and
its once-built step graph (fold-in append, then the noise-block forward). docs/design.md, "The
step graph".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..ggml import Backend, Buffer, Context, Gallocr, Graph, Tensor
from . import dflash2_graph as D2
from . import layers as L
from .backend_weights import BackendWeights
from .head_screen import HeadScreen
from .masks import SplitMask, StepMasks


@dataclass(frozen=True)
class Geometry:
    """Sizes of the cache (docs/design.md, "Geometry" and "Lanes"). Every per-lane size is the
    same as a single-lane cache's; lane l's K/V rows are [l * kv_total, (l + 1) * kv_total)."""

    cap: int  # ring slots per layer: the longest context window
    q_len: int  # the noise block: one draft block
    a_step: int  # rows the step graph can fold in: 2 * q_len + 2
    trash_slot: int  # where fold-in padding rows are written: cap + q_len
    kv_total: int  # K/V rows per layer: cap ring slots, q_len noise rows, trash, padded to 32
    mask_rows: int  # rows of each mask: q_len, times the query heads per K/V head when folded
    fold_buckets: tuple[int, ...]  # fold-in sizes with a step graph of their own, ascending, the last a_step
    lanes: int = 1  # requests drafted in one step, each with its own rings of K/V rows
    lane_counts: tuple[int, ...] = (1,)  # numbers of leading lanes with step graphs of their own, the last `lanes`

    @classmethod
    def of(cls, cap: int, q_len: int, groups: int, lanes: int = 1) -> Geometry:
        kv_total = (cap + q_len + 1 + 31) // 32 * 32
        a_step = 2 * q_len + 2
        return cls(
            cap,
            q_len,
            a_step,
            cap + q_len,
            kv_total,
            q_len * groups,
            fold_buckets(q_len, a_step),
            lanes,
            lane_counts(lanes),
        )

    def bucket_for(self, n_rows: int, n_lanes: int = 1) -> int:
        """The smallest fold-in size of an `n_lanes` graph that takes `n_rows` new rows (<= n_lanes * a_step)."""
        return next(n_lanes * b for b in self.fold_buckets if n_lanes * b >= n_rows)

    def lanes_for(self, highest_lane: int) -> int:
        """The smallest lane count with graphs that computes lanes 0..highest_lane."""
        return next(n for n in self.lane_counts if n > highest_lane)

    def graph_keys(self) -> list[tuple[int, int]]:
        """(lanes computed, fold-in rows) of every step graph, the last the whole cache's widest."""
        return [(n, n * b) for n in self.lane_counts for b in self.fold_buckets]


def fold_buckets(q_len: int, a_step: int) -> tuple[int, ...]:
    """The fold-in sizes that get a step graph of their own.

    Every row of a fold-in costs its products through fc and each layer's K/V, padding rows too;
    a round of speculative decoding commits 1..q_len rows (accepted drafts + the bonus token), so a
    few sizes cover the common cases: a quarter block, half a block + 1 (an average round), a
    block + 2, and the full a_step (refills after a rewind, skipped steps). Each size is one more
    graph built at init and replayed as it is (docs/design.md, "Fold-in and bulk append").
    """
    return tuple(sorted({max(1, q_len // 4), q_len // 2 + 1, min(q_len + 2, a_step), a_step}))


def lane_counts(lanes: int) -> tuple[int, ...]:
    """The numbers of leading lanes that get step graphs of their own: 1, 2, 4, ... below `lanes`,
    and `lanes`.

    A step computes the smallest count that covers its highest active lane; the lanes past it cost
    nothing, an idle lane below it the products of its q_len rows (its attention is masked to its
    own noise block and skipped). Powers of two keep the graphs (and their compute buffers) to
    about log2(lanes) per fold-in size while wasting at most half the rows (docs/design.md, "Lanes").
    """
    counts = {lanes}
    n = 1
    while n < lanes:
        counts.add(n)
        n *= 2
    return tuple(sorted(counts))


class StepGraph(Graph):
    """A once-built step graph. Computing it, by any route, tells its owner (the fold-in rows are
    written; its outputs are the step's): hosts of the C-style API compute it with
    Backend.compute directly."""

    def __init__(self, ctx: Context, size: int, on_computed: Callable[[StepGraph], None]) -> None:
        super().__init__(ctx, size)
        self._on_computed = on_computed

    def compute(self, backend: Backend) -> None:
        super().compute(backend)
        self._on_computed(self)


@dataclass
class LaneInputs:
    """One lane's part of the step inputs: views of the shared tensors, written by that lane alone."""

    pos_q: Tensor
    noise: Tensor  # its token ids (inp_tokens) or embeddings (inp_embed)
    masks: dict[str, Tensor]  # per mask name: its plane, or for a split mask its row
    mask_bases: dict[str, Tensor]  # per split mask name: its base plane


class CacheMemory:
    """The K/V rings of every layer and every step input, in ONE zero-filled backend buffer.

    With lanes, every per-request tensor holds all lanes one after another: K/V rows (kv_total a
    lane), noise rows (q_len a lane), mask planes (ne3: one a lane); `lane_inputs[l]` are lane l's
    views. The fold-in inputs hold the new rows of every lane of a step packed together."""

    def __init__(
        self,
        weights: BackendWeights,
        backend: Backend,
        geo: Geometry,
        cache_type: str,
        masks: StepMasks,
        token_input: bool,
        selector: bool = False,
    ) -> None:
        cfg = weights.cfg
        kv_width = cfg.head_dim * cfg.n_head_kv
        lanes = geo.lanes
        self.ctx = Context(n_tensors=2 * cfg.n_layer + 15 + 8 * lanes)
        m = self.ctx
        self.k_cache = [
            m.new_tensor(cache_type, kv_width, geo.kv_total * lanes, name=f"k_cache.{i}") for i in range(cfg.n_layer)
        ]
        self.v_cache = [
            m.new_tensor(cache_type, kv_width, geo.kv_total * lanes, name=f"v_cache.{i}") for i in range(cfg.n_layer)
        ]
        # the noise block enters as embeddings the host fills, or as token ids looked up in-graph
        # (`noise`: whichever of the two it is)
        q_rows = geo.q_len * lanes
        self.noise = (
            m.new_tensor("i32", q_rows, name="inp_tokens")
            if token_input
            else m.new_tensor("f32", cfg.hidden, q_rows, name="inp_embed")
        )
        self.inp_tokens = self.noise if token_input else None
        self.inp_embed = None if token_input else self.noise
        self.pos_q = m.new_tensor("i32", q_rows, name="pos_q")
        self.noise_rows = m.new_tensor("i32", q_rows, name="noise_rows")
        # each mask as attention reads it (a plane per lane); a SplitMask's is written by every step
        # graph from its base (uploaded once) and its context row (uploaded each step): drafter.masks
        planes = (1, lanes) if lanes > 1 else ()
        self.mask_full = (
            m.new_tensor("f16", geo.kv_total, geo.mask_rows, *planes, name="mask_full") if masks.full else None
        )
        self.mask_swa = (
            m.new_tensor("f16", geo.kv_total, geo.mask_rows, *planes, name="mask_swa") if masks.sliding else None
        )
        self.mask_parts: dict[str, tuple[Tensor, Tensor]] = {}  # name -> (base, row) of a split mask
        for name, mask in (("mask_full", masks.full), ("mask_swa", masks.sliding)):
            if isinstance(mask, SplitMask):
                self.mask_parts[name] = (
                    m.new_tensor("f16", geo.kv_total, geo.mask_rows, *planes, name=f"{name}_base"),
                    m.new_tensor("f16", geo.kv_total, 1, *planes, name=f"{name}_row"),
                )
        self.ap_feat = m.new_tensor("f32", cfg.fc_in, geo.a_step * lanes, name="ap_feat")
        self.ap_pos = m.new_tensor("i32", geo.a_step * lanes, name="ap_pos")
        self.ap_rows = m.new_tensor("i32", geo.a_step * lanes, name="ap_rows")
        # DFlash-2: the selector's greedy walk writes each block's draft ids here (row 0 unused)
        self.walk_ids = m.new_tensor("i32", q_rows, name="walk_ids") if selector else None
        for t in self.inputs():
            t.set_input()
        self.lane_inputs = [self._lane_views(lane, geo) for lane in range(lanes)] if lanes > 1 else [self._whole_lane()]
        # on the CPU in our CPU_DKV buffer: attention over these K/V runs our tiled kernel
        self.buf = Buffer.alloc_ctx_tensors_for_kernels(m, backend)
        self.buf.clear(0)
        self.noise_rows.set(
            np.concatenate(
                [np.arange(geo.cap, geo.cap + geo.q_len, dtype=np.int32) + lane * geo.kv_total for lane in range(lanes)]
            )
        )
        self.ap_rows.set(np.full(geo.a_step * lanes, geo.trash_slot, dtype=np.int32))

    def _mask_names(self) -> list[str]:
        return [n for n in ("mask_full", "mask_swa") if getattr(self, n) is not None]

    def _whole_lane(self) -> LaneInputs:
        masks = {n: self.mask_parts[n][1] if n in self.mask_parts else getattr(self, n) for n in self._mask_names()}
        return LaneInputs(self.pos_q, self.noise, masks, {n: base for n, (base, _) in self.mask_parts.items()})

    def _lane_views(self, lane: int, geo: Geometry) -> LaneInputs:
        m, q = self.ctx, geo.q_len

        def plane(t: Tensor) -> Tensor:
            return m.view(t, t.ne[:2], (t.nb[1],), lane * t.nb[3])

        pos_q = m.view(self.pos_q, (q,), (), lane * q * self.pos_q.nb[0])
        e = self.noise
        if self.inp_tokens is not None:
            noise = m.view(e, (q,), (), lane * q * e.nb[0])
        else:
            noise = m.view(e, (e.ne[0], q), (e.nb[1],), lane * q * e.nb[1])
        masks, bases = {}, {}
        for name in self._mask_names():
            if name in self.mask_parts:
                base, row = self.mask_parts[name]
                masks[name], bases[name] = plane(row), plane(base)
            else:
                masks[name] = plane(getattr(self, name))
        return LaneInputs(pos_q, noise, masks, bases)

    def inputs(self) -> list[Tensor]:
        masks = [getattr(self, n) for n in ("mask_full", "mask_swa") if n not in self.mask_parts]
        parts = [t for pair in self.mask_parts.values() for t in pair]
        return [
            t
            for t in (
                self.inp_embed,
                self.inp_tokens,
                self.pos_q,
                self.noise_rows,
                self.ap_feat,
                self.ap_pos,
                self.ap_rows,
                *masks,
                *parts,
            )
            if t is not None
        ]

    def attention_mask(self, g: Context, gf: Graph, name: str, n_lanes: int) -> Tensor | None:
        """The mask `name` of the first `n_lanes` lanes for a graph: the leaf itself (or its
        leading planes), or for a split mask base + row written into the leaf by this graph (so
        the leaf always holds the mask the last step used)."""
        mask = getattr(self, name)
        if mask is None:
            return None
        lanes = mask.ne[3]

        def leading(t: Tensor) -> Tensor:
            return t if n_lanes == lanes else g.view(t, (*t.ne[:3], n_lanes), t.nb[1:4])

        if name not in self.mask_parts:
            return leading(mask)
        base, row = self.mask_parts[name]
        return gf.expand(g.cpy(g.add(leading(base), leading(row)), leading(mask)))

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
    n_lanes: int = 1  # the leading lanes it computes
    fold_rows: int = 0  # the fold-in rows it takes
    selector: D2.SelectorOutputs | None = None  # DFlash-2: the walk's ids (draft_ids) and its lattice

    def close(self) -> None:
        self.galloc.close()
        self.ctx.close()


def first_rows(g: Context, t: Tensor, n: int) -> Tensor:
    """The first n rows (ne1) of a 2-D tensor, or the first n values of a 1-D one (a view)."""
    if len(t.shape) == 1:
        return t if n == t.ne[0] else g.view(t, (n,))
    return t if n == t.ne[1] else g.view(t, (t.ne[0], n), (t.nb[1],))


def build_step_graph(
    weights: BackendWeights,
    backend: Backend,
    mem: CacheMemory,
    geo: Geometry,
    layer_swa: list[bool],
    fold: bool,
    bf16_products: bool,
    lm_head: Tensor | None,
    embed_table: Tensor | None,
    on_computed: Callable[[StepGraph], None],
    n_lanes: int,
    fold_rows: int,
    head_screen: HeadScreen | None = None,
) -> BuiltStepGraph:
    """Build and allocate a step graph of the first `n_lanes` lanes folding in the first
    `fold_rows` rows of the fold-in inputs, once; every step recomputes it as it is. With a
    `head_screen` the draft ids come from the screened argmax (drafter.head_screen) and this
    graph has no logits. A DFlash-2 drafter's graph convolves the noise block's sublayers and,
    with token input and an lm_head, takes its draft ids from the candidate selector's walk."""
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

        # (b) noise forward of the lanes' blocks: their own K/V go to their lanes' ring rows, each
        # lane attends over its kv_total rows
        q_rows = n_lanes * geo.q_len
        pos_q, noise_rows = first_rows(g, mem.pos_q, q_rows), first_rows(g, mem.noise_rows, q_rows)

        def kv_of_layer(layer: int, hn: Tensor) -> tuple[Tensor, Tensor]:
            k_all = gf.expand(g.set_rows(k_caches[layer], L.keys(g, weights, layer, hn, pos_q), noise_rows))
            v_all = gf.expand(g.set_rows(v_caches[layer], L.values(g, weights, layer, hn), noise_rows))
            return k_all, v_all

        if mem.inp_tokens is not None:
            assert embed_table is not None  # token input: the cache holds the target's embedding table
            h = L.embed_tokens(g, cfg, embed_table, first_rows(g, mem.inp_tokens, q_rows))
        else:
            h = first_rows(g, mem.noise, q_rows)
        masks = {
            False: mem.attention_mask(g, gf, "mask_full", n_lanes),
            True: mem.attention_mask(g, gf, "mask_swa", n_lanes),
        }
        convs = L.Convolutions(n_lanes, custom_op=backend.is_cpu) if cfg.is_dflash2 else None
        head = L.noise_forward(
            g,
            weights,
            h,
            pos_q,
            kv_of_layer,
            masks,
            layer_swa,
            fold,
            bf16_products,
            lm_head if head_screen is None else None,
            n_lanes,
            geo.kv_total,
            convs,
        )

        # (c) outputs
        hidden = gf.expand(head.hidden)
        logits = gf.expand(head.logits) if head.logits is not None else None
        draft_ids, selector = None, None
        if mem.walk_ids is not None and logits is not None:
            tokens = first_rows(g, mem.noise, q_rows)  # the ids: a selector implies token input
            selector = D2.selector(
                g, gf, weights, head.hidden, logits, tokens, n_lanes, first_rows(g, mem.walk_ids, q_rows)
            )
            draft_ids = mem.walk_ids  # in the cache's memory: every lane's ids, read after the compute
        elif logits is not None:
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
    return BuiltStepGraph(g, gf, galloc, hidden, logits, draft_ids, n_lanes, fold_rows, selector)
