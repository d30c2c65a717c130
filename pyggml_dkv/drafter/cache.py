"""DraftKvCache: the drafter's context-KV ring cache with one fixed-topology step graph (SPEC.md §3).

Each committed position's context K/V is computed once (fold-in append) and kept in per-layer
ring caches on the backend; every step replays the same graph: append up to `a_step` new rows,
then the noise-block forward flash-attending over the whole cache span, with masks carrying
window membership, causality and slot validity. Inputs are persistent tensors in one buffer,
filled from numpy by `begin_step`.

Also here: the C-style drop-in API of the seed header (`DraftKvState`, `draft_kv_init`, ...).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from . import layers as G
from ..model.backend_weights import BackendWeights, upload_matrix
from ..model.config import DraftConfig
from .features import FeatureRing
from ..ggml.delta import DeltaUpload
from ..ggml import BF16_ATTENTION_PATCH, Backend, Buffer, Context, Gallocr, GGMLError, Graph, Tensor, bf16_attention_supported

log = logging.getLogger(__name__)

CACHE_TYPES = ("f16", "f32")
ATTENTION_PRECISIONS = ("f32", "bf16")
SWA_MODES = ("seed", "per_row", "off")
BULK_CHUNK = 1024  # rows per temporary bulk-append graph
MAX_CAP = 1 << 22


def align_up(x: int, n: int) -> int:
    return (x + n - 1) // n * n


class StepGraph(Graph):
    """The once-built step graph. Computing it (by any route) marks the fold-in rows as written."""

    def __init__(self, ctx: Context, size: int, cache: "DraftKvCache") -> None:
        super().__init__(ctx, size)
        self._cache = cache

    def compute(self, backend: Backend) -> None:
        super().compute(backend)
        self._cache._pending_from = None


def _check_backend_match(weights: BackendWeights, backend: Backend) -> None:
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be a pyggml_dkv Backend, got {type(backend).__name__}")
    backend._check_open()
    if weights.closed:
        raise GGMLError("the BackendWeights were closed")
    if weights.backend is not backend and not (weights.backend.is_cpu and backend.is_cpu):
        raise ValueError(f"weights live on {weights.backend.spec}, but the cache was asked to run on {backend.spec}")


def check_drafter_args(weights: Any, backend: Backend, cap: Any, cache_type: str, swa: str) -> None:
    """The constructor arguments DraftKvCache and OneShotDrafter share."""
    if not isinstance(weights, BackendWeights):
        raise TypeError("weights must be BackendWeights (DraftWeights.to_backend(backend, dtype))")
    _check_backend_match(weights, backend)
    if isinstance(cap, bool) or not isinstance(cap, (int, np.integer)) or not 1 <= cap <= MAX_CAP:
        raise ValueError(f"cap must be an int in [1, {MAX_CAP}], got {cap!r}")
    if cache_type not in CACHE_TYPES:
        raise ValueError(f"cache_type must be one of {CACHE_TYPES}, got {cache_type!r}")
    if swa not in SWA_MODES:
        raise ValueError(f"swa must be one of {SWA_MODES}, got {swa!r}")


class DraftKvCache:
    """Context-KV ring cache + the once-built step graph of a DFlash drafter."""

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
    ) -> None:
        """`lm_head` / `embed_tokens`: the target's (vocab, hidden) head and token embedding, as
        arrays (uploaded in the weights' dtype) or uploaded Tensors. With `embed_tokens` the step
        takes token ids (`inp_tokens`) and looks their embeddings up inside the graph; with
        `lm_head` the graph also yields `logits` and their per-row argmax `draft_ids`.

        `attention`: "f32" (default) computes attention in f32; "bf16" lets the CPU backend run
        its two products with bf16 inputs on AMX tiles (Q, K, V and the softmax weights rounded
        to bf16, f32 sums: PyTorch-bf16 precision, ~1.5-2x faster attention over long windows on
        Xeons with AMX; f32 where the CPU has no AMX-BF16 or the head size is not a multiple of
        32). Needs ggml built with vendor/patches/0009; other backends compute in f32."""
        check_drafter_args(weights, backend, cap, cache_type, swa)
        if attention not in ATTENTION_PRECISIONS:
            raise ValueError(f"attention must be one of {ATTENTION_PRECISIONS}, got {attention!r}")
        if attention == "bf16" and not bf16_attention_supported():
            raise ValueError(f"attention='bf16' needs ggml built with vendor/patches/{BF16_ATTENTION_PATCH} "
                             "(a GGML_SRC build lacks it)")
        cfg: DraftConfig = weights.cfg
        self.cfg = cfg
        self.weights = weights
        self.backend = backend
        self.swa = swa
        self.cache_type = cache_type
        self.attention = attention
        self._lock = threading.Lock()
        self._owned: list[Any] = []  # ggml objects freed by close(), in reverse order

        # geometry (SPEC.md §3)
        self.cap = int(cap)
        self.q_len = cfg.block_size
        self.a_step = 2 * self.q_len + 2
        self.trash_slot = self.cap + self.q_len
        self.kv_total = align_up(self.cap + self.q_len + 1, 32)
        self.fc_in = cfg.fc_in
        self.layer_swa = [t == "sliding" and swa != "off" for t in cfg.layer_types]
        self.any_swa = any(self.layer_swa)
        self.any_full = not all(self.layer_swa)
        # CPU flash attention: each K/V head's query heads folded into extra query rows, so the
        # masks carry one row per folded row (row j + q_len*g = query j), uploaded that way
        self.fold_gqa = G.fold_gqa(cfg, backend.computes_on_cpu)  # also on an RPC server's CPU
        self.mask_rows = self.q_len * (G.group_size(cfg) if self.fold_gqa else 1)
        kv_bytes = 2 * cfg.n_layer * self.kv_total * cfg.head_dim * cfg.n_head_kv * (2 if cache_type == "f16" else 4)
        log.debug("DraftKvCache cap=%d kv_total=%d a_step=%d: %.1f MiB of K/V", self.cap, self.kv_total, self.a_step, kv_bytes / 2**20)

        try:
            self.lm_head = self._init_vocab_matrix(lm_head, "lm_head")
            self.embed_tokens = self._init_vocab_matrix(embed_tokens, "embed_tokens")
            self._init_memory()
            self._build_step_graph()
        except BaseException:
            self.close()
            raise

        # host bookkeeping
        self.next_pos = 0
        self.slot_pos = np.full(self.cap, -1, dtype=np.int64)
        self._pending_from: int | None = None  # fold-in rows filled but not yet computed
        self._ring_seen: tuple[Any, int] | None = None  # (weakref to the last ring, its epoch then)
        self._ap_feat_host = np.zeros((self.a_step, self.fc_in), dtype=np.float32)
        self._ap_pos_host = np.zeros(self.a_step, dtype=np.int32)
        self._ap_rows_host = np.full(self.a_step, self.trash_slot, dtype=np.int32)
        self._pos_q_host = np.zeros(self.q_len, dtype=np.int32)
        self._init_mask_hosts()

    # ------------------------------------------------------------------ init
    def _own(self, obj: Any) -> Any:
        self._owned.append(obj)
        return obj

    def _init_vocab_matrix(self, matrix: Any, name: str) -> Tensor | None:
        """A (vocab, hidden) target matrix on the backend: given as a Tensor, or uploaded here."""
        if matrix is None:
            return None
        cfg = self.cfg
        if isinstance(matrix, Tensor):
            if matrix.ne[0] != cfg.hidden or matrix.ne[2:] != (1, 1):
                raise ValueError(f"{name} tensor must be [hidden={cfg.hidden}, vocab], got ne={matrix.ne}")
            return matrix
        arr = np.asarray(matrix)
        if arr.ndim != 2 or arr.shape[1] != cfg.hidden:
            raise ValueError(f"{name} must be a (vocab, hidden={cfg.hidden}) array, got shape {arr.shape}")
        if cfg.vocab is not None and arr.shape[0] != cfg.vocab:
            raise ValueError(f"{name} has {arr.shape[0]} rows, the config says vocab={cfg.vocab}")
        tensor, buf = upload_matrix(self.backend, arr, self.weights.dtype, name,
                                   matmul_only=name == "lm_head" and self.weights.repack)
        self._own(tensor.ctx)  # its metadata context too (closed after the buffer): nothing outlives close()
        self._own(buf)
        return tensor

    def _init_memory(self) -> None:
        """Caches + every graph input in ONE dedicated, zero-filled backend buffer."""
        cfg = self.cfg
        kv_width = cfg.head_dim * cfg.n_head_kv
        n_tensors = 2 * cfg.n_layer + 10
        self.mem_ctx = self._own(Context(n_tensors=n_tensors))
        m = self.mem_ctx
        self.k_cache = [m.new_tensor(self.cache_type, kv_width, self.kv_total, name=f"k_cache.{i}") for i in range(cfg.n_layer)]
        self.v_cache = [m.new_tensor(self.cache_type, kv_width, self.kv_total, name=f"v_cache.{i}") for i in range(cfg.n_layer)]
        # the noise block enters as embeddings the host fills, or as token ids looked up in-graph
        token_mode = self.embed_tokens is not None
        self.inp_tokens = m.new_tensor("i32", self.q_len, name="inp_tokens") if token_mode else None
        self.inp_embed = None if token_mode else m.new_tensor("f32", cfg.hidden, self.q_len, name="inp_embed")
        self.pos_q = m.new_tensor("i32", self.q_len, name="pos_q")
        self.noise_rows = m.new_tensor("i32", self.q_len, name="noise_rows")
        self.mask_full = m.new_tensor("f16", self.kv_total, self.mask_rows, name="mask_full") if self.any_full else None
        self.mask_swa = m.new_tensor("f16", self.kv_total, self.mask_rows, name="mask_swa") if self.any_swa else None
        self.ap_feat = m.new_tensor("f32", self.fc_in, self.a_step, name="ap_feat")
        self.ap_pos = m.new_tensor("i32", self.a_step, name="ap_pos")
        self.ap_rows = m.new_tensor("i32", self.a_step, name="ap_rows")
        for t in (self.inp_embed, self.inp_tokens, self.pos_q, self.noise_rows, self.ap_feat, self.ap_pos, self.ap_rows,
                  self.mask_full, self.mask_swa):
            if t is not None:
                t.set_input()
        self.mem_buf = self._own(Buffer.alloc_ctx_tensors(m, self.backend))
        self.mem_buf.clear(0)
        # masks change in a few key columns per step: over RPC only those bytes travel
        self._mask_uploads = {id(t): DeltaUpload.for_tensor(t) for t in (self.mask_full, self.mask_swa) if t is not None}
        self.noise_rows.set(np.arange(self.cap, self.cap + self.q_len, dtype=np.int32))
        self.ap_rows.set(np.full(self.a_step, self.trash_slot, dtype=np.int32))

    def _build_step_graph(self) -> None:
        cfg, w = self.cfg, self.weights
        size = G.graph_size_for(cfg)
        self.g_ctx = self._own(Context(n_tensors=size, graph_size=size))
        g = self.g_ctx
        self.gf = StepGraph(g, size, self)

        # (a) fold-in append, expanded first: every later read goes through its results
        k_caches, v_caches = G.append_rows(g, w, self.k_cache, self.v_cache, self.ap_feat, self.ap_pos, self.ap_rows)
        for t in (*k_caches, *v_caches):
            self.gf.expand(t)

        # (b) noise forward over the whole kv_total span of each cache
        if self.inp_tokens is not None:
            h = g.get_rows(self.embed_tokens, self.inp_tokens)
            if cfg.input_embedding_scale != 1.0:
                h = g.scale(h, cfg.input_embedding_scale)
        else:
            h = self.inp_embed
        masks = {False: self.mask_full, True: self.mask_swa}
        for layer in range(cfg.n_layer):
            hn = G.norm(g, h, w.layer(layer, "input_layernorm.weight"), cfg.rms_eps)
            q = G.queries(g, w, layer, hn, self.pos_q)
            k_all = self.gf.expand(g.set_rows(k_caches[layer], G.keys(g, w, layer, hn, self.pos_q), self.noise_rows))
            v_all = self.gf.expand(g.set_rows(v_caches[layer], G.values(g, w, layer, hn), self.noise_rows))
            mask = masks[self.layer_swa[layer]]
            h = g.add(h, G.attend(g, w, layer, q, k_all, v_all, mask, self.fold_gqa,
                                  bf16_products=self.attention == "bf16" and self.backend.is_cpu))
            h = G.feed_forward(g, w, layer, h)

        # (c) output
        head = G.output_head(g, w, h, self.lm_head)
        self.hidden_states = self.gf.expand(head.hidden)
        self.logits = self.gf.expand(head.logits) if head.logits is not None else None
        self.draft_ids = None
        if self.logits is not None:
            self.draft_ids = self.gf.expand(g.argmax(self.logits))
            self.draft_ids.name = "draft_ids"
            self.draft_ids.set_output()

        self.galloc = self._own(Gallocr(self.backend))
        self.galloc.alloc_graph(self.gf)
        self.gf._deps = self.gf._collect_buffers()
        self.n_nodes = self.gf.n_nodes

    def _init_mask_hosts(self) -> None:
        """Host mask images: the noise / trash / alignment columns never change, the ring part does.

        Each image has mask_rows rows; the [groups, q_len, kv_total] views write one query row's
        mask into all of its folded copies at once.
        """
        neg = np.float16(-np.inf)
        groups = self.mask_rows // self.q_len
        self._mask_full_host = np.full((self.mask_rows, self.kv_total), neg, dtype=np.float16)
        self._mask_full_host[:, self.cap:self.cap + self.q_len] = 0
        self._mask_swa_host = np.full((self.mask_rows, self.kv_total), neg, dtype=np.float16)
        self._mask_swa_rows = self._mask_swa_host.reshape(groups, self.q_len, self.kv_total)
        causal = np.tril(np.ones((self.q_len, self.q_len), dtype=bool))
        self._mask_swa_rows[:, :, self.cap:self.cap + self.q_len] = np.where(causal, 0, neg)
        self._q_offsets = np.arange(self.q_len, dtype=np.int64)[:, None]

    # ------------------------------------------------------------------ state
    @property
    def closed(self) -> bool:
        return getattr(self, "_closed", False)

    def _check_usable(self) -> None:
        if getattr(self, "_closed", False):
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

    def reset(self) -> None:
        """Forget every cached row (new or rewound request). Cheap: no device work."""
        with self._exclusive("reset it from that thread"):  # a reset in the middle of a step would corrupt it
            self._check_usable()
            self._reset()

    @contextmanager
    def _exclusive(self, advice: str) -> Iterator[None]:
        """Hold the cache for one operation; a second thread gets a clear error, never a corrupt state."""
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(f"this DraftKvCache is being stepped from another thread; {advice}")
        try:
            yield
        finally:
            self._lock.release()

    def _reset(self) -> None:
        self.slot_pos.fill(-1)
        self.next_pos = 0
        self._pending_from = None

    # ------------------------------------------------------------------ step
    def _check_ring(self, ring: FeatureRing, committed: int) -> int:
        if not isinstance(ring, FeatureRing):
            raise TypeError(f"ring must be a FeatureRing, got {type(ring).__name__}")
        if ring.fc_in != self.fc_in:
            raise ValueError(f"ring has fc_in={ring.fc_in}, this drafter needs fc_in={self.fc_in}")
        if isinstance(committed, bool) or not isinstance(committed, (int, np.integer)):
            raise TypeError(f"committed must be an int, got {type(committed).__name__}")
        committed = int(committed)
        if committed <= 0:
            raise ValueError(f"committed must be > 0 (the drafter needs at least one context token), got {committed}")
        if committed > ring.written:
            raise ValueError(f"committed={committed} but the ring only holds features up to position {ring.written - 1}")
        win = min(committed, self.cap)
        if committed - win < ring.oldest:
            raise ValueError(f"the window [{committed - win}, {committed}) needs positions the ring has overwritten "
                             f"(oldest kept: {ring.oldest}); make the ring at least cap={self.cap} rows")
        return committed

    def begin_step(self, ring: FeatureRing, committed: int) -> None:
        """Bring the cache up to `committed` and fill every step input except inp_embed."""
        self._check_usable()
        committed = self._check_ring(ring, committed)
        if self._pending_from is not None:  # the last fold-in was never computed: redo it
            self.next_pos = self._pending_from
            self._pending_from = None
        # 1. rewind: stale slots would shadow live positions. Also when the host dropped (and maybe
        # rewrote) positions this cache holds without lowering committed, or switched rings.
        if self.next_pos > committed or self._ring_changed_below(ring, self.next_pos):
            self._reset()
        # 2. what is missing from the window
        win = min(committed, self.cap)
        lo = committed - win
        start = max(self.next_pos, lo)
        n_new = committed - start
        # 3. too many for the fold-in: bulk append with temporary graphs
        if n_new > self.a_step:
            try:
                self._bulk_append(ring, start, committed)
            except BaseException:
                self._reset()
                raise
            n_new = 0
        # 4. fold-in inputs (padding rows: pos 0, trash slot)
        ap_pos, ap_rows = self._ap_pos_host, self._ap_rows_host
        ap_pos.fill(0)
        ap_rows.fill(self.trash_slot)
        if n_new:
            positions = np.arange(start, committed, dtype=np.int64)
            ap_pos[:n_new] = positions
            ap_rows[:n_new] = positions % self.cap
            ring.read_into(start, self._ap_feat_host[:n_new])
            self.slot_pos[positions % self.cap] = positions
            self._pending_from = start
            self.ap_feat.set_bytes(self._ap_feat_host[:n_new])
        self.ap_pos.set(ap_pos)
        self.ap_rows.set(ap_rows)
        self.next_pos = committed
        self._ring_seen = (weakref.ref(ring), ring.epoch)
        # 5. noise positions
        np.add(committed, np.arange(self.q_len, dtype=np.int32), out=self._pos_q_host)
        self.pos_q.set(self._pos_q_host)
        # 6. masks
        self._fill_masks(committed, win)

    def _ring_changed_below(self, ring: FeatureRing, pos: int) -> bool:
        """Did `ring` drop a position < pos since the last step (or is it another ring)?"""
        if pos <= 0 or self._ring_seen is None:
            return False
        ref, epoch = self._ring_seen
        if ref() is not ring:
            return True
        dropped = ring.dropped_since(epoch)
        return dropped is not None and dropped < pos

    def _fill_masks(self, committed: int, win: int) -> None:
        cap, neg = self.cap, np.float16(-np.inf)
        slot = self.slot_pos
        live = (slot >= committed - win) & (slot < committed)
        if self.mask_full is not None:
            self._mask_full_host[:, :cap] = np.where(live, np.float16(0), neg)
            self._mask_uploads[id(self.mask_full)].upload(self._mask_full_host)
        if self.mask_swa is not None:
            window = self.cfg.swa_window
            if self.swa == "seed":
                eff = window if 0 < window < win else win
                visible = live & (slot >= committed - eff)
                self._mask_swa_host[:, :cap] = np.where(visible, np.float16(0), neg)
            else:  # per_row: query row j at committed+j sees keys less than swa_window behind it
                visible = live[None, :] & ((committed + self._q_offsets - slot[None, :]) < window)
                self._mask_swa_rows[:, :, :cap] = np.where(visible, np.float16(0), neg)
                noise_dist = self._q_offsets - self._q_offsets.T  # q - i
                self._mask_swa_rows[:, :, cap:cap + self.q_len] = np.where((noise_dist >= 0) & (noise_dist < window), np.float16(0), neg)
            self._mask_uploads[id(self.mask_swa)].upload(self._mask_swa_host)

    def _bulk_append(self, ring: FeatureRing, start: int, end: int) -> None:
        """Append rows [start, end) with temporary exact-size graphs, freed afterwards."""
        cfg = self.cfg
        for chunk_start in range(start, end, BULK_CHUNK):
            n = min(BULK_CHUNK, end - chunk_start)
            positions = np.arange(chunk_start, chunk_start + n, dtype=np.int64)
            size = 64 * cfg.n_layer + 64
            with Context(n_tensors=3) as in_ctx, Context(n_tensors=size, graph_size=size) as g:
                feat = in_ctx.new_tensor("f32", self.fc_in, n, name="bulk_feat")
                pos = in_ctx.new_tensor("i32", n, name="bulk_pos")
                rows = in_ctx.new_tensor("i32", n, name="bulk_rows")
                with Buffer.alloc_ctx_tensors(in_ctx, self.backend):
                    feat.set(ring.read(chunk_start, n))
                    pos.set(positions.astype(np.int32))
                    rows.set((positions % self.cap).astype(np.int32))
                    graph = Graph(g, size)
                    ks, vs = G.append_rows(g, self.weights, self.k_cache, self.v_cache, feat, pos, rows)
                    for t in (*ks, *vs):
                        graph.expand(t)
                    with Gallocr(self.backend) as galloc:
                        galloc.alloc_graph(graph)
                        graph.compute(self.backend)
            self.slot_pos[positions % self.cap] = positions

    def compute(self) -> None:
        """Run the step graph (after begin_step and inp_embed are set)."""
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
            self.inp_embed.set(emb)
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
            if output not in ("ids", "logits", "hidden"):
                raise ValueError(f"output must be 'ids', 'logits' or 'hidden', got {output!r}")
            if output != "hidden" and self.logits is None:
                raise GGMLError(f"output={output!r} needs the cache to be built with an lm_head")
            ids = np.asarray(tokens)
            if ids.shape != (self.q_len,) or ids.dtype.kind not in "iu":
                raise ValueError(f"tokens must be {self.q_len} integer ids, got {ids.dtype} {ids.shape}")
            vocab = self.embed_tokens.ne[1]  # type: ignore[union-attr]
            if ids.min() < 0 or ids.max() >= vocab:
                raise ValueError(f"token ids must be in [0, {vocab}), got range [{ids.min()}, {ids.max()}]")
            self.begin_step(ring, committed)
            self.inp_tokens.set(ids)
            self.compute()
            out = {"ids": self.draft_ids, "logits": self.logits, "hidden": self.hidden_states}[output]
            return out.numpy()  # type: ignore[union-attr]


# ---------------------------------------------------------------------- C-style drop-in API

_STATE_FIELDS = (
    "cap", "q_len", "kv_total", "a_step", "trash_slot", "fc_in", "any_full", "any_swa",
    "mem_ctx", "mem_buf", "k_cache", "v_cache", "inp_embed", "pos_q", "noise_rows", "mask_full", "mask_swa",
    "ap_feat", "ap_pos", "ap_rows", "g_ctx", "gf", "galloc", "hidden_states", "logits", "next_pos", "slot_pos",
    "inp_tokens", "draft_ids",
)


class DraftKvState:
    """The header's `DraftKvState`: empty until draft_kv_init, then exposes the cache's fields."""

    def __init__(self) -> None:
        self.cache: DraftKvCache | None = None
        self.built_for: BackendWeights | None = None

    def __getattr__(self, name: str) -> Any:
        if name in _STATE_FIELDS:
            cache = self.__dict__.get("cache")
            if cache is None:
                raise GGMLError(f"DraftKvState.{name}: the state is not initialised (call draft_kv_init)")
            return getattr(cache, name)
        raise AttributeError(name)


def draft_kv_init(st: DraftKvState, dw: BackendWeights, backend: Backend, cap: int, lm_head: Any = None,
                  cache_type: str = "f16", swa: str = "seed") -> bool:
    """Allocate caches + inputs and build the step graph. Raises on bad input; returns True."""
    if st.cache is not None:
        draft_kv_free(st)
    st.cache = DraftKvCache(dw, backend, cap, lm_head=lm_head, cache_type=cache_type, swa=swa)
    st.built_for = dw
    return True


def draft_kv_reset(st: DraftKvState) -> None:
    if st.cache is not None:
        st.cache.reset()


def draft_kv_free(st: DraftKvState) -> None:
    if st.cache is not None:
        st.cache.close()
    st.cache = None
    st.built_for = None


def draft_kv_begin_step(st: DraftKvState, dw: BackendWeights, backend: Backend, ring: FeatureRing, committed: int) -> bool:
    """Bring the cache up to `committed` and fill the step inputs; then the host sets
    `st.inp_embed`, computes `st.gf` on the backend and reads `st.hidden_states`."""
    if st.cache is None:
        raise GGMLError("draft_kv_begin_step: the state is not initialised (call draft_kv_init)")
    if dw is not st.built_for:
        raise ValueError("draft_kv_begin_step: these weights are not the ones the state was built for")
    if backend is not st.cache.backend:
        raise ValueError("draft_kv_begin_step: this backend is not the one the state was built on")
    st.cache.begin_step(ring, committed)
    return True
