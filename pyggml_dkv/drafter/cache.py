"""DraftKvCache: the drafter's context-KV ring cache with one fixed-topology step graph.

Each committed position's context K/V is computed once (fold-in append, or bulk append for many
rows) and kept in per-layer ring caches on the backend; every step replays the same graph:
append up to `a_step` new rows, then the noise-block forward attending over the whole cache span,
with masks carrying window membership, causality and slot validity. With `lanes=N` one cache drafts for N requests
in one compute: each lane has its own rings of K/V rows, slot bookkeeping and masks, all lanes
share the weights and the step graphs. The design, and why, is in docs/design.md; the pieces
live beside this file: `step_graph` (device memory and the graph), `slots` (which position each
slot holds), `masks`, `bulk_append`, `args`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..common.checks import check_choice, check_int, is_int
from ..ggml import Backend, GGMLError, Graph, Tensor, host_array
from ..ggml.delta import DeltaUpload
from ..ggml.writer import TensorWriter
from ..model.config import DraftConfig
from . import layers as L
from .args import MAX_LANES, check_drafter_args, check_noise_embed, check_token_ids, vocab_matrix
from .backend_weights import BackendWeights
from .bulk_append import bulk_append, copy_lane_rows
from .features import FeatureRing, check_window
from .head_screen import LM_HEAD_SCREENS, HeadScreen
from .masks import StepMasks
from .selector_walk import SelectorLattice
from .slots import LaneState, SlotBook
from .step_graph import BuiltStepGraph, CacheMemory, Geometry, build_step_graph
from .step_inputs import StepInputs

log = logging.getLogger(__name__)


class DraftKvCache:
    """Context-KV ring cache + the once-built step graphs of a DFlash drafter."""

    def __init__(
        self,
        weights: BackendWeights,
        backend: Backend,
        cap: int,
        lm_head: Any = None,
        cache_type: str = "f16",
        swa: str = "seed",
        embed_tokens: Any = None,
        attention: str = "f32",
        lm_head_dtype: str | None = None,
        lm_head_screen: str | None = None,
        lanes: int = 1,
    ) -> None:
        """`lanes`: requests drafted in one compute (docs/design.md, "Lanes"). With lanes > 1, `step`
        and `step_tokens` take a list with one entry per lane for `rings`, `committed` and the noise
        (None for an idle lane) and return a list of per-lane results (None for idle lanes);
        `rewind` and `begin_step` name their lane.
        `lm_head` / `embed_tokens`: the target's (vocab, hidden) head and token embedding, as
        arrays (uploaded in the weights' dtype) or uploaded Tensors. With `embed_tokens` the step
        takes token ids (`inp_tokens`) and looks their embeddings up inside the graph; with
        `lm_head` the graph also yields `logits` and their per-row argmax `draft_ids`.
        `lm_head_dtype` ("f32", "f16", "bf16", "q8_0"): upload an array lm_head in that type
        instead of the weights' (e.g. "q8_0" next to f16 weights: over a large vocabulary the
        product is ~40% of an f16 step at small windows, and on AMX / VNNI CPUs a q8_0 one costs a
        third; its logits then carry q8_0's int8 rounding, ~1e-2 relative, docs/design.md "Precision").
        `lm_head_screen="q8_0"` (CPU backend, f32 / f16 / bf16 lm_head): a step for draft ids
        multiplies a q8_0 copy of the head and only the tokens it cannot rule out exactly, so
        `draft_ids` are still the exact head's argmax, at about the cost of a q8_0 head; a step
        for logits (`step`, `step_tokens(output="logits")`, `compute(logits=True)`) runs a second
        set of graphs with the full head product (drafter.head_screen; docs/design.md, "Exact
        draft ids from a screened head").
        `attention="bf16"`: the CPU backend runs attention's two products with bf16 inputs on
        AMX tiles where it can (docs/design.md, "Precision")."""
        cap = check_drafter_args(weights, backend, cap, cache_type, swa, attention)
        lanes = check_int("lanes", lanes, 1, MAX_LANES)
        cfg: DraftConfig = weights.cfg
        self.cfg, self.weights, self.backend = cfg, weights, backend
        self.swa, self.cache_type, self.attention = swa, cache_type, attention
        self._lock = threading.Lock()
        self._owned: list[Any] = []  # ggml objects freed by close(), in reverse order
        self.layer_swa = [t == "sliding" and swa != "off" for t in cfg.layer_types]
        self.any_swa = any(self.layer_swa)
        self.any_full = not all(self.layer_swa)
        self.fold_gqa = L.fold_gqa(cfg, backend.computes_on_cpu)  # also on an RPC server's CPU
        groups = L.group_size(cfg) if self.fold_gqa else 1
        geo = Geometry.of(cap, cfg.block_size, groups, lanes)
        self.geometry = geo
        self.lanes = lanes
        self.cap, self.q_len, self.a_step, self.trash_slot = geo.cap, geo.q_len, geo.a_step, geo.trash_slot
        self.kv_total, self.mask_rows, self.fc_in = geo.kv_total, geo.mask_rows, cfg.fc_in
        # over RPC, masks whose context part is one row for all query rows travel as that row and
        # the device adds it to their base (drafter.masks); in local memory a whole upload is cheaper
        masks = [
            StepMasks(
                geo.q_len,
                groups,
                cap,
                geo.kv_total,
                cap,
                self.any_full,
                self.any_swa,
                swa,
                cfg.swa_window,
                split=backend.kind == "rpc",
            )
            for _ in range(lanes)
        ]
        try:
            self.lm_head = self._vocab_matrix(lm_head, "lm_head", lm_head_dtype)
            self.head_screen = None
            if lm_head_screen is not None:
                check_choice("lm_head_screen", lm_head_screen, LM_HEAD_SCREENS)
                if cfg.is_dflash2:
                    raise ValueError(
                        "lm_head_screen does not apply to a DFlash-2 drafter: its candidate "
                        "selector reads every row's top-k logits, so each step computes the full head"
                    )
                if self.lm_head is None:
                    raise ValueError(f"lm_head_screen={lm_head_screen!r} was given without an lm_head")
                self.head_screen = self._own(HeadScreen(backend, self.lm_head, cfg))
            self.embed_tokens = self._vocab_matrix(embed_tokens, "embed_tokens")
            # a DFlash-2 step drafts by its selector's walk: that needs the anchor ids (token input)
            # and the logits
            self.selector = cfg.is_dflash2 and self.embed_tokens is not None and self.lm_head is not None
            self.memory = self._own(
                CacheMemory(
                    weights,
                    backend,
                    geo,
                    cache_type,
                    masks[0],
                    token_input=self.embed_tokens is not None,
                    selector=self.selector,
                )
            )
            # one graph per number of leading lanes and fold-in size (geometry.graph_keys), all over
            # the same memory; a step computes the smallest that takes its lanes and new rows, the
            # last (every lane, lanes * a_step rows) is `gf`. With a screen these yield the screened
            # ids, and a second set the logits (logit_graphs)
            self.graphs = self._build_graphs(self.head_screen)
            self.logit_graphs = self._build_graphs(None) if self.head_screen is not None else self.graphs
            self._built_of = {id(b.graph): b for graphs in (self.graphs, self.logit_graphs) for b in graphs.values()}
        except BaseException:
            self.close()
            raise
        mem = self.memory
        self.k_cache, self.v_cache, self.mem_ctx, self.mem_buf = mem.k_cache, mem.v_cache, mem.ctx, mem.buf
        self.inp_embed, self.inp_tokens, self.pos_q, self.noise_rows = (
            mem.inp_embed,
            mem.inp_tokens,
            mem.pos_q,
            mem.noise_rows,
        )
        self.mask_full, self.mask_swa = mem.mask_full, mem.mask_swa
        # of the noise block typically only the first row changes (the mask token's embedding
        # repeats): over RPC only those bytes travel (the masks likewise, in StepInputs)
        views = mem.lane_inputs
        self._embed_uploads = [DeltaUpload.for_tensor(v.noise) for v in views] if self.inp_embed is not None else []
        self._token_writers = [TensorWriter(v.noise) for v in views] if self.inp_tokens is not None else []
        self.ap_feat, self.ap_pos, self.ap_rows = mem.ap_feat, mem.ap_pos, mem.ap_rows
        self._widest = geo.graph_keys()[-1]
        self._single_lane_graphs = [(1, geo.bucket_for(n)) for n in range(geo.a_step + 1)]
        built = self.graphs[self._widest]  # the graph every begin_step's inputs fit (the C-style API's)
        self.g_ctx, self.gf, self.galloc = built.ctx, built.graph, built.galloc
        self._bucket = self._widest  # what compute() runs next: the smallest graph for the begun lanes' rows
        self._computed = built  # the graph computed last: whose outputs are the step's
        self.n_nodes = self.gf.n_nodes

        # host side: per-lane slot bookkeeping and masks, and the staging arrays of every step input
        self._lanes = [LaneState(cap) for _ in range(lanes)]
        self._inputs = StepInputs(self.memory, geo, self.fc_in, masks)
        self._step_open = False  # some lane was begun since the last compute
        if lanes > 1:
            for lane_inputs in self._inputs.lanes:  # a lane never stepped costs no attention
                lane_inputs.make_idle()
        log.debug("DraftKvCache %s: %d graph nodes", geo, self.n_nodes)

    def _build_graphs(self, head_screen: HeadScreen | None) -> dict[tuple[int, int], BuiltStepGraph]:
        return {
            (n, rows): self._own(
                build_step_graph(
                    self.weights,
                    self.backend,
                    self.memory,
                    self.geometry,
                    self.layer_swa,
                    self.fold_gqa,
                    self.attention == "bf16" and self.backend.is_cpu,
                    self.lm_head,
                    self.embed_tokens,
                    self._fold_in_computed,
                    n,
                    rows,
                    head_screen,
                )
            )
            for n, rows in self.geometry.graph_keys()
        }

    def _own(self, obj: Any) -> Any:
        self._owned.append(obj)
        return obj

    def _vocab_matrix(self, matrix: Any, name: str, dtype: str | None = None) -> Any:
        tensor, buf = vocab_matrix(matrix, name, self.weights, self.backend, dtype)
        if tensor is not None and buf is not None:  # (a buffer comes with its tensor)
            self._own(tensor.ctx)  # its metadata context too (closed after the buffer): nothing outlives close()
            self._own(buf)
        return tensor

    # ------------------------------------------------------------------ state
    def _lane(self, lane: Any) -> LaneState:
        if not is_int(lane) or not 0 <= int(lane) < self.lanes:
            raise ValueError(f"lane must be an int in [0, {self.lanes}), got {lane!r}")
        return self._lanes[int(lane)]

    @property
    def slots(self) -> SlotBook:
        """Lane 0's slot bookkeeping (the only lane of a single-lane cache)."""
        return self._lanes[0].slots

    @property
    def next_pos(self) -> int:
        return self._lanes[0].slots.next_pos

    @property
    def slot_pos(self) -> np.ndarray:
        return self._lanes[0].slots.slot_pos

    def lane_next_pos(self, lane: int) -> int:
        """One past the highest position lane `lane` was brought up to."""
        return self._lane(lane).slots.next_pos

    def lane_slot_pos(self, lane: int) -> np.ndarray:
        """The position each ring slot of lane `lane` holds (-1: none)."""
        return self._lane(lane).slots.slot_pos

    @property
    def closed(self) -> bool:
        return getattr(self, "_closed", False)

    def _check_usable(self) -> None:
        if self.closed:
            raise GGMLError("DraftKvCache is closed")
        self.backend._check_open()
        self.backend.check_connection()  # RPC: a failed connection lost this cache's state for good
        if self.weights.closed:
            raise GGMLError("the cache's BackendWeights were closed")

    def close(self) -> None:
        """Free the caches, inputs, graph and allocator. Idempotent. A step running in another
        thread finishes first (freeing memory its compute is using would crash the process)."""
        with self._lock:
            self._closed = True
            while self._owned:
                self._owned.pop().close()

    def __enter__(self) -> DraftKvCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _exclusive(self, advice: str) -> Iterator[None]:
        """Hold the cache for one operation; a second thread gets a clear error, never a corrupt state."""
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(f"this DraftKvCache is being stepped from another thread; {advice}")
        try:
            yield
        finally:
            self._lock.release()

    def reset(self, lane: int | None = None) -> None:
        """Forget every cached row of `lane` (a new or restarted request), or of every lane when
        None. Cheap: no device work."""
        with self._exclusive("reset it from that thread"):
            self._check_usable()
            for state in self._lanes if lane is None else [self._lane(lane)]:
                state.slots.clear()
                state.pending = None

    def rewind(self, pos: int, lane: int | None = None) -> None:
        """Drop the cached rows of positions >= pos of `lane` (may be omitted with one lane); the
        next step refolds what its window needs."""
        with self._exclusive("rewind it from that thread"):
            self._check_usable()
            if lane is None and self.lanes > 1:
                raise ValueError(f"this cache has {self.lanes} lanes: rewind(pos, lane=i) names the lane")
            check_int("pos", pos, 0)
            self._lane(0 if lane is None else lane).rewind(pos)

    def move_lane(self, src: int, dst: int) -> None:
        """Move request `src`'s cached rows to lane `dst` (whatever dst held is dropped; src is
        left empty): one device copy of src's ring rows, no refold. A host that keeps its active
        requests in the lowest lanes (say, moving its highest lane into the hole a leaving request
        left) steps the graph of the fewest lanes (docs/design.md, "Lanes")."""
        with self._exclusive("move lanes from that thread"):
            self._check_usable()
            state, target = self._lane(src), self._lane(dst)
            if int(src) == int(dst):
                raise ValueError(f"move_lane: src and dst are both lane {src}")
            if self._step_open:
                raise GGMLError("move_lane between begin_step and compute: compute (or step) first")
            state.forget_pending()
            target.slots.clear()
            if (state.slots.slot_pos >= 0).any():
                copy_lane_rows(
                    self.backend,
                    [*self.k_cache, *self.v_cache],
                    self.cap,
                    int(src) * self.kv_total,
                    int(dst) * self.kv_total,
                )
            # the bookkeeping of the rows moves with them; dst's masks and noise inputs are its
            # own device planes (rewritten at its next step), so they stay
            self._lanes[int(dst)], self._lanes[int(src)] = state, LaneState(self.cap)

    def _fold_in_computed(self, graph: Any) -> None:
        self._computed = self._built_of[id(graph)]
        for state in self._lanes:
            if state.begun:
                state.pending = None  # written: the graph computed takes every begun lane's rows
                state.begun = False
        self._step_open = False

    # the outputs of the step graph computed last (the smallest one that took the step's rows)
    @property
    def hidden_states(self) -> Tensor:
        return self._computed.hidden_states

    @property
    def logits(self) -> Tensor | None:
        return self._computed.logits

    @property
    def draft_ids(self) -> Tensor | None:
        return self._computed.draft_ids

    # ------------------------------------------------------------------ step
    def _sync_with_ring(self, state: LaneState, ring: FeatureRing) -> None:
        """Drop cached rows the ring no longer vouches for (all of them for another ring)."""
        dropped = state.ring.dropped(ring)
        if dropped is not None and dropped < state.slots.next_pos:
            state.rewind(dropped)

    def _open_step(self) -> None:
        """The first begin_step since the last compute: no lane's rows packed yet."""
        if not self._step_open:
            self._inputs.start_fold()
            self._step_open = True

    def _restart_step(self) -> None:
        """A lane begun twice before a compute: start the step over. The lanes begun before lose
        their fold-in (their masks go idle) and must be begun again."""
        for lane, state in enumerate(self._lanes):
            if state.begun:
                state.forget_pending()
                state.begun = False
                if self.lanes > 1:
                    self._inputs.lanes[lane].make_idle()
        self._step_open = False

    def begin_step(self, ring: FeatureRing, committed: int, lane: int = 0) -> None:
        """Bring lane `lane` up to `committed` and fill its step inputs except the noise block.
        With lanes, begin each lane of a step once, then compute (or use step / step_tokens)."""
        self._check_usable()
        state = self._lane(lane)
        committed = check_window(ring, committed, self.cap, self.fc_in)
        self._begin_lane(int(lane), state, ring, committed)
        self._bucket = self._graph_for_begun()

    def _begin_lane(self, lane: int, state: LaneState, ring: FeatureRing, committed: int) -> None:
        if state.begun:
            self._restart_step()
        self._open_step()
        state.forget_pending()
        self._sync_with_ring(state, ring)
        slots = state.slots
        if committed < slots.next_pos:  # the host rewound: stale rows would shadow live positions
            state.rewind(committed)
        lo = committed - min(committed, self.cap)
        new = slots.missing(lo, committed)
        if new.size > self.a_step:  # too many for the fold-in: temporary graphs
            try:
                bulk_append(
                    self.weights, self.backend, self.k_cache, self.v_cache, ring, new, self.cap, lane * self.kv_total
                )
            except BaseException:
                slots.clear()
                raise
            slots.record(new)
            new = new[:0]
        self._inputs.fold_in(lane, ring, new)
        if new.size:
            slots.record(new)
            state.pending = new
        state.begun = True
        slots.next_pos = committed
        state.ring.look(ring)
        self._inputs.lanes[lane].noise_and_masks(slots.slot_pos, lo, committed)

    def _graph_for_begun(self) -> tuple[int, int]:
        """The smallest graph that computes every begun lane and takes their packed fold-in rows."""
        if self.lanes == 1:  # a table: a single-lane step pays no more host time than before lanes
            return self._single_lane_graphs[self._inputs.n_fold]
        highest = max((i for i, s in enumerate(self._lanes) if s.begun), default=0)
        n = self.geometry.lanes_for(highest)
        return n, self.geometry.bucket_for(self._inputs.n_fold, n)

    def next_graph(self, logits: bool = False) -> Graph:
        """The graph compute(logits) runs: the smallest that takes the lanes and rows the last
        begin_step calls left pending (before the first begin_step, the widest, `gf`). For timing
        or profiling the step's own graph."""
        self._check_usable()
        return (self.logit_graphs if logits else self.graphs)[self._bucket].graph

    def _output_in_new_array(self, output: str, logits: bool) -> tuple[Tensor, np.ndarray | None]:
        """The step's `output` tensor ("logits", "draft_ids" or "hidden_states") of the graph
        compute(logits) runs next, and a new array that graph writes it into, so that it needs no
        copy out (logits: 3 MB a step at a 49152-token vocabulary, ~0.3 ms); the array is then the
        tensor's data until the next step. None where the tensor is not in host memory (GPU, RPC:
        it is downloaded after the compute)."""
        built = (self.logit_graphs if logits else self.graphs)[self._bucket]
        tensor = getattr(built, output)
        if not tensor.in_host_memory or (output in ("draft_ids", "logits") and built.selector is not None):
            # a DFlash-2 graph's selector reads the logits through views made when the graph was
            # built, and its walk writes the ids into the cache's memory: neither tensor may move
            return tensor, None
        out = host_array(tensor.shape, tensor.numpy_dtype)
        tensor.place_in(out)
        return tensor, out

    def compute(self, logits: bool = False) -> None:
        """Run the step graph (after begin_step and the noise block are set). `logits`: a cache
        with lm_head_screen runs its graph with the full head product (its `logits`), not the
        screened one (its exact `draft_ids` only)."""
        self.next_graph(logits).compute(self.backend)

    def _lane_args(
        self, rings: Any, committed: Any, noise: Any, noise_name: str
    ) -> list[tuple[int, FeatureRing, int, Any]]:
        """The active lanes of a step as (lane, ring, committed, noise), every argument checked
        before any lane's state changes."""
        if self.lanes == 1:
            return [(0, rings, check_window(rings, committed, self.cap, self.fc_in), noise)]
        args = {"rings": rings, "committed": committed, noise_name: noise}
        for name, value in args.items():
            if (
                isinstance(value, (str, bytes, np.ndarray))
                or not isinstance(value, Sequence)
                or len(value) != self.lanes
            ):
                raise ValueError(
                    f"this cache has {self.lanes} lanes: {name} must be a list of {self.lanes} "
                    f"entries (None for an idle lane), got {type(value).__name__}"
                    + (f" of {len(value)}" if isinstance(value, Sequence) else "")
                )
        active = []
        for lane, (ring, pos, blk) in enumerate(zip(rings, committed, noise)):
            given = [ring is not None, pos is not None, blk is not None]
            if not any(given):
                continue
            if not all(given):
                raise ValueError(f"lane {lane}: rings, committed and {noise_name} are all given or all None")
            try:
                active.append((lane, ring, check_window(ring, pos, self.cap, self.fc_in), blk))
            except (TypeError, ValueError) as e:
                raise type(e)(f"lane {lane}: {e}") from None
        if not active:
            raise ValueError("no active lane: every lane's entries are None")
        return active

    def _begin_lanes(self, active: list[tuple[int, FeatureRing, int, Any]], writers: list[Any], write: str) -> None:
        """Begin the active lanes, write their noise (`writers[lane].<write>(block)`), and make
        the idle lanes the graph computes idle."""
        if self._step_open:
            self._restart_step()  # begin_step calls left unfinished: this step replaces them
        for lane, ring, pos, blk in active:
            self._begin_lane(lane, self._lanes[lane], ring, pos)
            getattr(writers[lane], write)(blk)
        self._bucket = self._graph_for_begun()
        if self.lanes > 1:
            for lane in range(self._bucket[0]):
                if not self._lanes[lane].begun:
                    self._inputs.lanes[lane].make_idle()

    def _split_lanes(self, out: np.ndarray, active: list[tuple[int, FeatureRing, int, Any]]) -> Any:
        """A step's output rows, as they are (one lane), or one block of q_len rows per lane (None for idle lanes)."""
        if self.lanes == 1:
            return out
        per_lane: list[np.ndarray | None] = [None] * self.lanes
        for lane, *_ in active:
            per_lane[lane] = out[lane * self.q_len : (lane + 1) * self.q_len]
        return per_lane

    def _split_lattices(self, active: list[tuple[int, FeatureRing, int, Any]]) -> Any:
        """The lattice of each active lane's block from the graph computed last (docs/dflash2.md)."""
        sel = self._computed.selector
        assert sel is not None
        candidates = sel.candidates.numpy().astype(np.int64)  # (rows, k)
        first, rest = sel.first.numpy(), sel.rest.numpy()  # (lanes, 1, k), (lanes, block - 1, k, k)
        q = self.q_len
        per_lane: list[SelectorLattice | None] = [None] * self.lanes
        for lane, *_ in active:
            scores = rest[lane].copy()
            scores[0] = first[lane, 0][None, :]  # position 1 follows the anchor, whatever the row
            per_lane[lane] = SelectorLattice(candidates[lane * q + 1 : (lane + 1) * q], scores)
        return per_lane if self.lanes > 1 else per_lane[0]

    def step(self, rings: Any, committed: Any, noise_embed: Any) -> Any:
        """One draft step: hidden states (q_len, hidden), or logits (q_len, vocab) with an lm_head
        (with lm_head_screen too: the full head's product). A new array each step; on the CPU the
        step computes straight into it (no copy out), and `logits` (`hidden_states`) reads it until
        the next step. With lanes: lists with one entry per lane (None: idle), and a list of
        per-lane results (None for idle lanes)."""
        with self._exclusive("use one cache per thread"):
            self._check_usable()
            if self.inp_embed is None:
                raise GGMLError("this cache takes token ids (it was built with embed_tokens): use step_tokens()")
            active = self._lane_args(rings, committed, noise_embed, "noise_embed")
            checked = [
                (lane, ring, pos, check_noise_embed(blk, self.q_len, self.cfg.hidden))
                for lane, ring, pos, blk in active
            ]
            self._begin_lanes(checked, self._embed_uploads, "upload")
            tensor, out = self._output_in_new_array("hidden_states" if self.lm_head is None else "logits", logits=True)
            self.compute(logits=True)
            return self._split_lanes(tensor.numpy() if out is None else out, checked)

    def step_tokens(self, rings: Any, committed: Any, tokens: Any, output: str = "ids") -> Any:
        """One draft step from token ids (needs embed_tokens): `output` "ids" (per-row argmax,
        needs lm_head; a DFlash-2 drafter's: row 0 unused, rows 1.. its selector's greedy walk),
        "logits", "hidden", or (DFlash-2) "lattice": the block's SelectorLattice
        (drafter.selector_walk), for walks the graph does not take. A new array each step,
        computed into as step()'s. With lanes: lists with one entry per lane (None: idle), and a
        list of per-lane results."""
        with self._exclusive("use one cache per thread"):
            self._check_usable()
            if self.inp_tokens is None:
                raise GGMLError("this cache takes embeddings (built without embed_tokens): use step()")
            check_choice("output", output, ("ids", "logits", "hidden", "lattice"))
            if output != "hidden" and self.lm_head is None:
                raise GGMLError(f"output={output!r} needs the cache to be built with an lm_head")
            if output == "lattice" and not self.selector:
                raise GGMLError("output='lattice' needs a DFlash-2 drafter (its candidate selector)")
            active = self._lane_args(rings, committed, tokens, "tokens")
            vocab = self.embed_tokens.ne[1]
            checked = []
            for lane, ring, pos, blk in active:
                try:
                    checked.append((lane, ring, pos, check_token_ids(blk, self.q_len, vocab)))
                except ValueError as e:
                    raise ValueError(f"lane {lane}: {e}" if self.lanes > 1 else str(e)) from None
            self._begin_lanes(checked, self._token_writers, "write")
            if output == "lattice":
                self.compute()
                return self._split_lattices(checked)
            name = {"ids": "draft_ids", "logits": "logits", "hidden": "hidden_states"}[output]
            tensor, out = self._output_in_new_array(name, logits=output == "logits")
            self.compute(logits=output == "logits")
            if out is None:
                out = tensor.numpy()
            if output == "ids" and self.head_screen is not None:
                rows = np.concatenate([np.arange(lane * self.q_len, (lane + 1) * self.q_len) for lane, *_ in checked])
                bad = rows[out[rows] < 0]
                if bad.size:  # the screened argmax marks rows it has no id for (ggml/ops_screen.py)
                    if (out[bad] == -2).any():
                        raise MemoryError("the screened argmax could not allocate its scratch memory: no draft ids")
                    raise FloatingPointError(
                        f"the drafter's hidden states at noise rows {bad.tolist()} are not finite: no draft ids"
                    )
            return self._split_lanes(out, checked)
