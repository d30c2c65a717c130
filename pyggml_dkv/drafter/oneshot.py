"""OneShotDrafter: the legacy full-window recompute graph (SPEC.md §2).

Every step recomputes features and context K/V for the whole window of the last
`min(committed, cap)` tokens, at window-rebased positions. The graph depends on the window
length, so it is rebuilt whenever that changes (every step until the window is full). It is the
baseline of every benchmark and a second parity reference for the cache.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from . import layers as G
from ..model.backend_weights import BackendWeights, upload_matrix
from .cache import check_drafter_args
from .features import FeatureRing
from ..ggml import Backend, Buffer, Context, Gallocr, GGMLError, Graph, Tensor

log = logging.getLogger(__name__)


class _WindowGraph:
    """The graph, inputs and allocator for one window length."""

    def __init__(self, drafter: "OneShotDrafter", ctx_len: int) -> None:
        cfg, w, be = drafter.cfg, drafter.weights, drafter.backend
        q_len = cfg.block_size
        n_kv = ctx_len + q_len
        self.ctx_len = ctx_len
        self.inputs = Context(n_tensors=6)
        i = self.inputs
        self.feat = i.new_tensor("f32", cfg.fc_in, ctx_len, name="feat")
        self.pos_ctx = i.new_tensor("i32", ctx_len, name="pos_ctx")
        self.pos_q = i.new_tensor("i32", q_len, name="pos_q")
        self.inp_embed = i.new_tensor("f32", cfg.hidden, q_len, name="inp_embed")
        # one mask row per folded query row (see DraftKvCache.mask_rows)
        fold = G.fold_gqa(cfg, be.computes_on_cpu)
        self.groups = G.group_size(cfg) if fold else 1
        self.mask_full = i.new_tensor("f16", n_kv, q_len * self.groups, name="mask_full")
        self.mask_swa = i.new_tensor("f16", n_kv, q_len * self.groups, name="mask_swa")
        self.buffer = Buffer.alloc_ctx_tensors(i, be)

        size = G.graph_size_for(cfg)
        self.g = Context(n_tensors=size, graph_size=size)
        g = self.g
        self.graph = Graph(g, size)
        fused = G.fuse_features(g, w, self.feat)
        h = self.inp_embed
        masks = {False: self.mask_full, True: self.mask_swa}
        for layer in range(cfg.n_layer):
            hn = G.norm(g, h, w.layer(layer, "input_layernorm.weight"), cfg.rms_eps)
            q = G.queries(g, w, layer, hn, self.pos_q)
            # K/V of [context rows ++ noise rows], stored in the cache's type like the ring cache does
            k_all = g.cast(g.concat(G.keys(g, w, layer, fused, self.pos_ctx), G.keys(g, w, layer, hn, self.pos_q), 1), drafter.cache_type)
            v_all = g.cast(g.concat(G.values(g, w, layer, fused), G.values(g, w, layer, hn), 1), drafter.cache_type)
            h = g.add(h, G.attend(g, w, layer, q, k_all, v_all, masks[drafter.layer_swa[layer]], fold))
            h = G.feed_forward(g, w, layer, h)
        head = G.output_head(g, w, h, drafter.lm_head)
        self.out = self.graph.expand(head.logits if head.logits is not None else head.hidden)
        self.galloc = Gallocr(be)
        self.galloc.alloc_graph(self.graph)

    def close(self) -> None:
        for obj in (self.galloc, self.g, self.buffer, self.inputs):
            obj.close()


class OneShotDrafter:
    """Recompute-everything drafter with the same `step(ring, committed, noise_embed)` as DraftKvCache."""

    def __init__(self, weights: BackendWeights, backend: Backend, cap: int, lm_head: Any = None,
                 cache_type: str = "f16", swa: str = "seed") -> None:
        check_drafter_args(weights, backend, cap, cache_type, swa)
        self.cfg = weights.cfg
        self.weights = weights
        self.backend = backend
        self.cap = int(cap)
        self.q_len = self.cfg.block_size
        self.cache_type = cache_type
        self.swa = swa
        self.layer_swa = [t == "sliding" and swa != "off" for t in self.cfg.layer_types]
        self._lock = threading.Lock()
        self._lm_buf: Buffer | None = None
        self.lm_head: Tensor | None = None
        if lm_head is not None:
            if isinstance(lm_head, Tensor):
                self.lm_head = lm_head
            else:
                arr = np.asarray(lm_head)
                if arr.ndim != 2 or arr.shape[1] != self.cfg.hidden:
                    raise ValueError(f"lm_head must be a (vocab, hidden={self.cfg.hidden}) array, got shape {arr.shape}")
                self.lm_head, self._lm_buf = upload_matrix(backend, arr, weights.dtype, "lm_head", matmul_only=weights.repack)
        self._wg: _WindowGraph | None = None
        self.n_builds = 0
        self._closed = False

    def _graph_for(self, ctx_len: int) -> _WindowGraph:
        if self._wg is None or self._wg.ctx_len != ctx_len:
            if self._wg is not None:
                self._wg.close()
                self._wg = None
            self._wg = _WindowGraph(self, ctx_len)
            self.n_builds += 1
        return self._wg

    def _masks(self, ctx_len: int) -> tuple[np.ndarray, np.ndarray]:
        """Window-rebased masks: context rows 0..ctx_len-1, noise rows after them; committed ~ ctx_len."""
        q_len, neg = self.q_len, np.float16(-np.inf)
        full = np.zeros((q_len, ctx_len + q_len), dtype=np.float16)
        swa = np.full((q_len, ctx_len + q_len), neg, dtype=np.float16)
        window = self.cfg.swa_window
        ctx = np.arange(ctx_len)
        qpos = ctx_len + np.arange(q_len)[:, None]
        if self.swa == "seed":
            eff = window if 0 < window < ctx_len else ctx_len
            swa[:, :ctx_len] = np.where(ctx >= ctx_len - eff, np.float16(0), neg)
            swa[:, ctx_len:] = np.where(np.tril(np.ones((q_len, q_len), dtype=bool)), np.float16(0), neg)
        elif self.swa == "per_row":
            swa[:, :ctx_len] = np.where(qpos - ctx[None, :] < window, np.float16(0), neg)
            dist = np.arange(q_len)[:, None] - np.arange(q_len)[None, :]
            swa[:, ctx_len:] = np.where((dist >= 0) & (dist < window), np.float16(0), neg)
        return full, swa

    def step(self, ring: FeatureRing, committed: int, noise_embed: np.ndarray) -> np.ndarray:
        if self._closed:
            raise GGMLError("OneShotDrafter is closed")
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("this OneShotDrafter is being stepped from another thread")
        try:
            self.backend._check_open()
            if not isinstance(ring, FeatureRing) or ring.fc_in != self.cfg.fc_in:
                raise ValueError(f"ring must be a FeatureRing with fc_in={self.cfg.fc_in}")
            if isinstance(committed, bool) or not isinstance(committed, (int, np.integer)) or committed <= 0:
                raise ValueError(f"committed must be an int > 0, got {committed!r}")
            committed = int(committed)
            emb = np.asarray(noise_embed)
            if emb.shape != (self.q_len, self.cfg.hidden) or emb.dtype.kind != "f":
                raise ValueError(f"noise_embed must be a float (q_len={self.q_len}, hidden={self.cfg.hidden}) array, got {emb.dtype} {emb.shape}")
            ctx_len = min(committed, self.cap)
            feats = ring.read(committed - ctx_len, ctx_len)
            wg = self._graph_for(ctx_len)
            wg.feat.set(feats)
            wg.pos_ctx.set(np.arange(ctx_len, dtype=np.int32))
            wg.pos_q.set(ctx_len + np.arange(self.q_len, dtype=np.int32))
            wg.inp_embed.set(emb)
            full, swa = self._masks(ctx_len)
            wg.mask_full.set(np.tile(full, (wg.groups, 1)))
            wg.mask_swa.set(np.tile(swa, (wg.groups, 1)))
            wg.graph.compute(self.backend)
            return wg.out.numpy()
        finally:
            self._lock.release()

    def close(self) -> None:
        self._closed = True
        if self._wg is not None:
            self._wg.close()
            self._wg = None
        if self._lm_buf is not None:
            self._lm_buf.close()
            if self._lm_buf.ctx is not None:  # the upload's metadata context as well
                self._lm_buf.ctx.close()
            self._lm_buf = None

    def __enter__(self) -> "OneShotDrafter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
