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
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..common.checks import check_choice, is_int
from ..ggml import Backend, GGMLError
from ..ggml.delta import DeltaUpload
from ..model.backend_weights import BackendWeights
from ..model.config import DraftConfig
from . import layers as L
from .args import ATTENTION_PRECISIONS, CACHE_TYPES, MAX_CAP, check_drafter_args, vocab_matrix  # noqa: F401 (re-exported)
from .bulk_append import bulk_append, read_rows
from .features import FeatureRing
from .masks import SWA_MODES, StepMasks  # noqa: F401 (re-exported)
from .slots import SlotBook
from .step_graph import CacheMemory, Geometry, build_step_graph

log = logging.getLogger(__name__)


class DraftKvCache:
    """Context-KV ring cache + the once-built step graph of a DFlash drafter."""

    def __init__(self, weights: BackendWeights, backend: Backend, cap: int, lm_head: Any = None,
                 cache_type: str = "f16", swa: str = "seed", embed_tokens: Any = None, attention: str = "f32") -> None:
        """`lm_head` / `embed_tokens`: the target's (vocab, hidden) head and token embedding, as
        arrays (uploaded in the weights' dtype) or uploaded Tensors. With `embed_tokens` the step
        takes token ids (`inp_tokens`) and looks their embeddings up inside the graph; with
        `lm_head` the graph also yields `logits` and their per-row argmax `draft_ids`.
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
        try:
            self.lm_head = self._vocab_matrix(lm_head, "lm_head")
            self.embed_tokens = self._vocab_matrix(embed_tokens, "embed_tokens")
            self.memory = self._own(CacheMemory(weights, backend, geo, cache_type, self.any_full, self.any_swa,
                                                token_input=self.embed_tokens is not None))
            built = self._own(build_step_graph(weights, backend, self.memory, self.layer_swa, self.fold_gqa,
                                               attention == "bf16" and backend.is_cpu, self.lm_head,
                                               self.embed_tokens, self._fold_in_computed))
        except BaseException:
            self.close()
            raise
        mem = self.memory
        self.k_cache, self.v_cache, self.mem_ctx, self.mem_buf = mem.k_cache, mem.v_cache, mem.ctx, mem.buf
        self.inp_embed, self.inp_tokens, self.pos_q, self.noise_rows = mem.inp_embed, mem.inp_tokens, mem.pos_q, mem.noise_rows
        self.mask_full, self.mask_swa = mem.mask_full, mem.mask_swa
        # a step changes a few key columns of each mask, and of the noise block typically only the
        # first row (the mask token's embedding repeats): over RPC only those bytes travel
        self._mask_uploads = {id(t): DeltaUpload.for_tensor(t) for t in (self.mask_full, self.mask_swa) if t is not None}
        self._embed_upload = DeltaUpload.for_tensor(self.inp_embed) if self.inp_embed is not None else None
        self.ap_feat, self.ap_pos, self.ap_rows = mem.ap_feat, mem.ap_pos, mem.ap_rows
        self.g_ctx, self.gf, self.galloc = built.ctx, built.graph, built.galloc
        self.hidden_states, self.logits, self.draft_ids = built.hidden_states, built.logits, built.draft_ids
        self.n_nodes = self.gf.n_nodes

        # host side: slot bookkeeping, masks, and the staging arrays of every step input
        self.slots = SlotBook(cap)
        self._masks = StepMasks(geo.q_len, groups, cap, geo.kv_total, cap, self.any_full, self.any_swa, swa, cfg.swa_window)
        self._pending: np.ndarray | None = None  # fold-in positions filled in but not yet computed
        self._ring_seen: tuple[Any, int] | None = None  # (weakref to the last ring, its epoch then)
        self._ap_feat_host = np.zeros((geo.a_step, self.fc_in), dtype=np.float32)
        self._ap_pos_host = np.zeros(geo.a_step, dtype=np.int32)
        self._ap_rows_host = np.full(geo.a_step, geo.trash_slot, dtype=np.int32)
        self._pos_q_host = np.zeros(geo.q_len, dtype=np.int32)
        log.debug("DraftKvCache %s: %d graph nodes", geo, self.n_nodes)

    def _own(self, obj: Any) -> Any:
        self._owned.append(obj)
        return obj

    def _vocab_matrix(self, matrix: Any, name: str) -> Any:
        tensor, buf = vocab_matrix(matrix, name, self.weights, self.backend)
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

    def _fold_in_computed(self) -> None:
        self._pending = None

    # ------------------------------------------------------------------ step
    def _check_ring(self, ring: FeatureRing, committed: int) -> int:
        if not isinstance(ring, FeatureRing):
            raise TypeError(f"ring must be a FeatureRing, got {type(ring).__name__}")
        if ring.fc_in != self.fc_in:
            raise ValueError(f"ring has fc_in={ring.fc_in}, this drafter needs fc_in={self.fc_in}")
        if not is_int(committed):
            raise TypeError(f"committed must be an int, got {type(committed).__name__}")
        committed = int(committed)
        if committed <= 0:
            raise ValueError(f"committed must be > 0 (the drafter needs at least one context token), got {committed}")
        if committed > ring.written:
            raise ValueError(f"committed={committed} but the ring only holds features up to position {ring.written - 1}")
        if committed - min(committed, self.cap) < ring.oldest:
            raise ValueError(f"the window [{committed - min(committed, self.cap)}, {committed}) needs positions the ring "
                             f"has overwritten (oldest kept: {ring.oldest}); make the ring at least cap={self.cap} rows")
        return committed

    def _sync_with_ring(self, ring: FeatureRing) -> None:
        """Drop cached rows the ring no longer vouches for: all of them for another ring, else
        those at or after the lowest position the ring dropped (and maybe rewrote) since."""
        if self._ring_seen is None:
            return
        ref, epoch = self._ring_seen
        if ref() is not ring:
            self.slots.clear()
            return
        dropped = ring.dropped_since(epoch)
        if dropped is not None and dropped < self.slots.next_pos:
            self._rewind(dropped)

    def begin_step(self, ring: FeatureRing, committed: int) -> None:
        """Bring the cache up to `committed` and fill every step input except the noise block."""
        self._check_usable()
        committed = self._check_ring(ring, committed)
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
        self._fill_fold_in(ring, new)
        self.slots.next_pos = committed
        self._ring_seen = (weakref.ref(ring), ring.epoch)
        np.add(committed, np.arange(self.q_len, dtype=np.int32), out=self._pos_q_host)
        self.pos_q.set(self._pos_q_host)
        full, sliding = self._masks.fill(self.slots.slot_pos, lo, committed)
        if full is not None:
            self._mask_uploads[id(self.mask_full)].upload(full)
        if sliding is not None:
            self._mask_uploads[id(self.mask_swa)].upload(sliding)

    def _fill_fold_in(self, ring: FeatureRing, positions: np.ndarray) -> None:
        """Fold-in inputs for `positions` (<= a_step); padding rows go to pos 0, the trash slot."""
        n = positions.size
        self._ap_pos_host.fill(0)
        self._ap_rows_host.fill(self.trash_slot)
        if n:
            self._ap_pos_host[:n] = positions
            self._ap_rows_host[:n] = positions % self.cap
            if positions[-1] - positions[0] == n - 1:
                ring.read_into(int(positions[0]), self._ap_feat_host[:n])
            else:
                self._ap_feat_host[:n] = read_rows(ring, positions)
            self.ap_feat.set_bytes(self._ap_feat_host[:n])
            self.slots.record(positions)
            self._pending = positions
        self.ap_pos.set(self._ap_pos_host)
        self.ap_rows.set(self._ap_rows_host)

    def compute(self) -> None:
        """Run the step graph (after begin_step and the noise block are set)."""
        self._check_usable()
        self.gf.compute(self.backend)

    def step(self, ring: FeatureRing, committed: int, noise_embed: np.ndarray) -> np.ndarray:
        """One draft step: hidden states (q_len, hidden), or logits (q_len, vocab) with an lm_head."""
        with self._exclusive("use one cache per thread"):
            self._check_usable()
            if self.inp_embed is None:
                raise GGMLError("this cache takes token ids (it was built with embed_tokens): use step_tokens()")
            emb = np.asarray(noise_embed)
            if emb.shape != (self.q_len, self.cfg.hidden):
                raise ValueError(f"noise_embed must have shape (q_len={self.q_len}, hidden={self.cfg.hidden}), got {emb.shape}")
            if emb.dtype.kind != "f":
                raise TypeError(f"noise_embed must be floating point, got dtype {emb.dtype}")
            if not np.isfinite(emb).all():
                raise ValueError("noise_embed contains NaN or inf")
            self.begin_step(ring, committed)
            self._embed_upload.upload(emb)  # type: ignore[union-attr]
            self.compute()
            out = self.logits if self.logits is not None else self.hidden_states
            return out.numpy()

    def step_tokens(self, ring: FeatureRing, committed: int, tokens: Any, output: str = "ids") -> np.ndarray:
        """One draft step from token ids (needs embed_tokens): `output` "ids" (per-row argmax,
        needs lm_head), "logits" or "hidden"."""
        with self._exclusive("use one cache per thread"):
            self._check_usable()
            if self.inp_tokens is None:
                raise GGMLError("this cache takes embeddings (built without embed_tokens): use step()")
            check_choice("output", output, ("ids", "logits", "hidden"))
            if output != "hidden" and self.logits is None:
                raise GGMLError(f"output={output!r} needs the cache to be built with an lm_head")
            ids = np.asarray(tokens)
            if ids.shape != (self.q_len,) or ids.dtype.kind not in "iu":
                raise ValueError(f"tokens must be {self.q_len} integer ids, got {ids.dtype} {ids.shape}")
            vocab = self.embed_tokens.ne[1]
            if ids.min() < 0 or ids.max() >= vocab:
                raise ValueError(f"token ids must be in [0, {vocab}), got range [{ids.min()}, {ids.max()}]")
            self.begin_step(ring, committed)
            self.inp_tokens.set(ids)
            self.compute()
            out = {"ids": self.draft_ids, "logits": self.logits, "hidden": self.hidden_states}[output]
            return out.numpy()
