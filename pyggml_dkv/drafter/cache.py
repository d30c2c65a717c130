"""DraftKvCache: the drafter's context-KV ring cache with one fixed-topology step graph.

Each committed position's context K/V is computed once (fold-in append, or bulk append for many
rows) and kept in per-layer ring caches on the backend; every step replays the same graph:
append up to `a_step` new rows, then the noise-block forward attending over the whole cache span,
with masks carrying window membership, causality and slot validity. The design, and why, is in
docs/design.md; the pieces live beside this file: `step_graph` (device memory and the graph),
`slots` (which position each slot holds), `masks`, `bulk_append`, `args`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..common.checks import check_choice
from ..ggml import Backend, GGMLError, Graph, Tensor, host_array
from ..ggml.delta import DeltaUpload
from ..ggml.writer import TensorWriter
from ..model.backend_weights import BackendWeights
from ..model.config import DraftConfig
from . import layers as L
from .args import check_drafter_args, check_noise_embed, check_token_ids, vocab_matrix
from .bulk_append import bulk_append
from .features import FeatureRing, RingWatch, check_window
from .head_screen import LM_HEAD_SCREENS, HeadScreen
from .masks import StepMasks
from .slots import SlotBook
from .step_graph import CacheMemory, Geometry, build_step_graph
from .step_inputs import StepInputs

log = logging.getLogger(__name__)


class DraftKvCache:
    """Context-KV ring cache + the once-built step graphs of a DFlash drafter."""

    def __init__(self, weights: BackendWeights, backend: Backend, cap: int, lm_head: Any = None,
                 cache_type: str = "f16", swa: str = "seed", embed_tokens: Any = None, attention: str = "f32",
                 lm_head_dtype: str | None = None, lm_head_screen: str | None = None) -> None:
        """`lm_head` / `embed_tokens`: the target's (vocab, hidden) head and token embedding, as
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
        geo = Geometry.of(cap, cfg.block_size, groups)
        self.geometry = geo
        self.cap, self.q_len, self.a_step, self.trash_slot = geo.cap, geo.q_len, geo.a_step, geo.trash_slot
        self.kv_total, self.mask_rows, self.fc_in = geo.kv_total, geo.mask_rows, cfg.fc_in
        # over RPC, masks whose context part is one row for all query rows travel as that row and
        # the device adds it to their base (drafter.masks); in local memory a whole upload is cheaper
        masks = StepMasks(geo.q_len, groups, cap, geo.kv_total, cap, self.any_full, self.any_swa, swa,
                          cfg.swa_window, split=backend.kind == "rpc")
        try:
            self.lm_head = self._vocab_matrix(lm_head, "lm_head", lm_head_dtype)
            self.head_screen = None
            if lm_head_screen is not None:
                check_choice("lm_head_screen", lm_head_screen, LM_HEAD_SCREENS)
                if self.lm_head is None:
                    raise ValueError(f"lm_head_screen={lm_head_screen!r} was given without an lm_head")
                self.head_screen = self._own(HeadScreen(backend, self.lm_head, cfg))
            self.embed_tokens = self._vocab_matrix(embed_tokens, "embed_tokens")
            self.memory = self._own(CacheMemory(weights, backend, geo, cache_type, masks,
                                                token_input=self.embed_tokens is not None))
            # one graph per fold-in size (geometry.fold_buckets), all over the same memory; a step
            # computes the smallest that takes its new rows, the last (a_step rows) is `gf`. With a
            # screen these yield the screened ids, and a second set the logits (logit_graphs)
            self.graphs = self._build_graphs(self.head_screen)
            self.logit_graphs = self._build_graphs(None) if self.head_screen is not None else self.graphs
        except BaseException:
            self.close()
            raise
        mem = self.memory
        self.k_cache, self.v_cache, self.mem_ctx, self.mem_buf = mem.k_cache, mem.v_cache, mem.ctx, mem.buf
        self.inp_embed, self.inp_tokens, self.pos_q, self.noise_rows = mem.inp_embed, mem.inp_tokens, mem.pos_q, mem.noise_rows
        self.mask_full, self.mask_swa = mem.mask_full, mem.mask_swa
        # of the noise block typically only the first row changes (the mask token's embedding
        # repeats): over RPC only those bytes travel (the masks likewise, in StepInputs)
        self._embed_upload = DeltaUpload.for_tensor(self.inp_embed) if self.inp_embed is not None else None
        self._tokens_in = TensorWriter(self.inp_tokens) if self.inp_tokens is not None else None
        self.ap_feat, self.ap_pos, self.ap_rows = mem.ap_feat, mem.ap_pos, mem.ap_rows
        built = self.graphs[geo.a_step]  # the graph every begin_step's inputs fit (the C-style API's)
        self.g_ctx, self.gf, self.galloc = built.ctx, built.graph, built.galloc
        self._bucket = geo.a_step  # what compute() runs next: the smallest graph for the pending rows
        self._computed = built  # the graph computed last: whose outputs are the step's
        self.n_nodes = self.gf.n_nodes

        # host side: slot bookkeeping, masks, and the staging arrays of every step input
        self.slots = SlotBook(cap)
        self._inputs = StepInputs(self.memory, geo, self.fc_in, masks)
        self._pending: np.ndarray | None = None  # fold-in positions filled in but not yet computed
        self._ring = RingWatch()  # what the ring dropped since the last step
        log.debug("DraftKvCache %s: %d graph nodes", geo, self.n_nodes)

    def _build_graphs(self, head_screen: HeadScreen | None) -> dict[int, Any]:
        return {rows: self._own(build_step_graph(self.weights, self.backend, self.memory, self.layer_swa, self.fold_gqa,
                                                 self.attention == "bf16" and self.backend.is_cpu, self.lm_head,
                                                 self.embed_tokens, self._fold_in_computed, rows, head_screen))
                for rows in self.geometry.fold_buckets}

    def _own(self, obj: Any) -> Any:
        self._owned.append(obj)
        return obj

    def _vocab_matrix(self, matrix: Any, name: str, dtype: str | None = None) -> Any:
        tensor, buf = vocab_matrix(matrix, name, self.weights, self.backend, dtype)
        if buf is not None:
            self._own(tensor.ctx)  # its metadata context too (closed after the buffer): nothing outlives close()
            self._own(buf)
        return tensor

    # ------------------------------------------------------------------ state
    @property
    def next_pos(self) -> int:
        return self.slots.next_pos

    @property
    def slot_pos(self) -> np.ndarray:
        return self.slots.slot_pos

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

    def __enter__(self) -> "DraftKvCache":
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

    def reset(self) -> None:
        """Forget every cached row (new or restarted request). Cheap: no device work."""
        with self._exclusive("reset it from that thread"):
            self._check_usable()
            self.slots.clear()
            self._pending = None

    def rewind(self, pos: int) -> None:
        """Drop the cached rows of positions >= pos; the next step refolds what its window needs."""
        with self._exclusive("rewind it from that thread"):
            self._check_usable()
            self._rewind(pos)

    def _rewind(self, pos: int) -> None:
        self._forget_pending()
        self.slots.rewind(pos)

    def _forget_pending(self) -> None:
        if self._pending is not None:  # the last fold-in was never computed: its slots hold no known rows
            self.slots.forget(self._pending)
            self._pending = None

    def _fold_in_computed(self, graph: Any) -> None:
        self._pending = None
        self._computed = next(b for graphs in (self.graphs, self.logit_graphs) for b in graphs.values()
                              if b.graph is graph)

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
    def _sync_with_ring(self, ring: FeatureRing) -> None:
        """Drop cached rows the ring no longer vouches for (all of them for another ring)."""
        dropped = self._ring.dropped(ring)
        if dropped is not None and dropped < self.slots.next_pos:
            self._rewind(dropped)

    def begin_step(self, ring: FeatureRing, committed: int) -> None:
        """Bring the cache up to `committed` and fill every step input except the noise block."""
        self._check_usable()
        committed = check_window(ring, committed, self.cap, self.fc_in)
        self._forget_pending()
        self._sync_with_ring(ring)
        if committed < self.slots.next_pos:  # the host rewound: stale rows would shadow live positions
            self._rewind(committed)
        lo = committed - min(committed, self.cap)
        new = self.slots.missing(lo, committed)
        if new.size > self.a_step:  # too many for the fold-in: temporary graphs
            try:
                bulk_append(self.weights, self.backend, self.k_cache, self.v_cache, ring, new, self.cap)
            except BaseException:
                self.slots.clear()
                raise
            self.slots.record(new)
            new = new[:0]
        self._inputs.fold_in(ring, new)
        self._bucket = self.geometry.bucket_for(new.size)
        if new.size:
            self.slots.record(new)
            self._pending = new
        self.slots.next_pos = committed
        self._ring.look(ring)
        self._inputs.noise_and_masks(self.slots.slot_pos, lo, committed)

    def next_graph(self, logits: bool = False) -> Graph:
        """The graph compute(logits) runs: the smallest whose fold-in takes the rows the last
        begin_step left pending (before the first begin_step, the a_step graph `gf`). For timing or
        profiling the step's own graph."""
        self._check_usable()
        return (self.logit_graphs if logits else self.graphs)[self._bucket].graph

    def _output_in_new_array(self, output: str, logits: bool) -> tuple[Tensor, np.ndarray | None]:
        """The step's `output` tensor ("logits", "draft_ids" or "hidden_states") of the graph
        compute(logits) runs next, and a new array that graph writes it into, so that it needs no
        copy out (logits: 3 MB a step at a 49152-token vocabulary, ~0.3 ms); the array is then the
        tensor's data until the next step. None where the tensor is not in host memory (GPU, RPC:
        it is downloaded after the compute)."""
        tensor = getattr((self.logit_graphs if logits else self.graphs)[self._bucket], output)
        if not tensor.in_host_memory:
            return tensor, None
        out = host_array(tensor.shape, tensor.numpy_dtype)
        tensor.place_in(out)
        return tensor, out

    def compute(self, logits: bool = False) -> None:
        """Run the step graph (after begin_step and the noise block are set). `logits`: a cache
        with lm_head_screen runs its graph with the full head product (its `logits`), not the
        screened one (its exact `draft_ids` only)."""
        self.next_graph(logits).compute(self.backend)

    def step(self, ring: FeatureRing, committed: int, noise_embed: np.ndarray) -> np.ndarray:
        """One draft step: hidden states (q_len, hidden), or logits (q_len, vocab) with an lm_head
        (with lm_head_screen too: the full head's product). A new array each step; on the CPU the
        step computes straight into it (no copy out), and `logits` (`hidden_states`) reads it until
        the next step."""
        with self._exclusive("use one cache per thread"):
            self._check_usable()
            if self.inp_embed is None:
                raise GGMLError("this cache takes token ids (it was built with embed_tokens): use step_tokens()")
            emb = check_noise_embed(noise_embed, self.q_len, self.cfg.hidden)
            self.begin_step(ring, committed)
            self._embed_upload.upload(emb)  # type: ignore[union-attr]
            tensor, out = self._output_in_new_array("hidden_states" if self.lm_head is None else "logits", logits=True)
            self.compute(logits=True)
            return tensor.numpy() if out is None else out

    def step_tokens(self, ring: FeatureRing, committed: int, tokens: Any, output: str = "ids") -> np.ndarray:
        """One draft step from token ids (needs embed_tokens): `output` "ids" (per-row argmax,
        needs lm_head), "logits" or "hidden". A new array each step, computed into as step()'s."""
        with self._exclusive("use one cache per thread"):
            self._check_usable()
            if self.inp_tokens is None:
                raise GGMLError("this cache takes embeddings (built without embed_tokens): use step()")
            check_choice("output", output, ("ids", "logits", "hidden"))
            if output != "hidden" and self.lm_head is None:
                raise GGMLError(f"output={output!r} needs the cache to be built with an lm_head")
            ids = check_token_ids(tokens, self.q_len, self.embed_tokens.ne[1])
            self.begin_step(ring, committed)
            self._tokens_in.write(ids)  # type: ignore[union-attr]
            name = {"ids": "draft_ids", "logits": "logits", "hidden": "hidden_states"}[output]
            tensor, out = self._output_in_new_array(name, logits=output == "logits")
            self.compute(logits=output == "logits")
            if out is None:
                out = tensor.numpy()
            if output == "ids" and self.head_screen is not None and (out < 0).any():
                # the screened argmax marks rows it has no id for (ggml/ops_screen.py)
                if (out == -2).any():
                    raise MemoryError("the screened argmax could not allocate its scratch memory: no draft ids")
                raise FloatingPointError(f"the drafter's hidden states at noise rows {np.nonzero(out < 0)[0].tolist()} "
                                         "are not finite: no draft ids")
            return out
