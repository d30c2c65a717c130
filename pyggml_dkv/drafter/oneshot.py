"""OneShotDrafter: the full-window recompute graph (the baseline the cache replaces).

Every step recomputes features and context K/V for the whole window of the last
`min(committed, cap)` tokens, at window-rebased positions. The graph depends on the window
length, so it is rebuilt whenever that changes (every step until the window is full). It is the
baseline of every benchmark and a second parity reference for the cache; it shares the cache's
layer builders (`layers`), masks and argument checks, so the two differ only in where the
context K/V come from.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from ..common.checks import check_int
from ..ggml import Backend, Buffer, Context, Gallocr, GGMLError, Graph, Tensor
from . import layers as L
from .args import check_drafter_args, vocab_matrix
from .backend_weights import BackendWeights
from .features import FeatureRing
from .masks import StepMasks

log = logging.getLogger(__name__)


class _WindowGraph:
    """The graph, inputs and allocator for one window length."""

    def __init__(self, drafter: OneShotDrafter, ctx_len: int) -> None:
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
        fold = L.fold_gqa(cfg, be.computes_on_cpu)  # also on an RPC server's CPU
        groups = L.group_size(cfg) if fold else 1
        self.mask_full = i.new_tensor("f16", n_kv, q_len * groups, name="mask_full")
        self.mask_swa = i.new_tensor("f16", n_kv, q_len * groups, name="mask_swa")
        self.buffer = Buffer.alloc_ctx_tensors(i, be)
        # keys: the window's rows in order at rebased positions 0..ctx_len-1, then the noise block
        self.masks = StepMasks(q_len, groups, ctx_len, n_kv, ctx_len, True, True, drafter.swa, cfg.swa_window)

        size = L.graph_size_for(cfg)
        self.g = Context(n_tensors=size, graph_size=size)
        g = self.g
        self.graph = Graph(g, size)
        wc = w.bulk  # the context's rows are many: the kernels' copies for those (q8_0 on AMX CPUs)
        fused = L.fuse_features(g, wc, self.feat)

        def kv_of_layer(layer: int, hn: Tensor) -> tuple[Tensor, Tensor]:
            # [context rows ++ noise rows], stored in the cache's type like the ring cache does
            k = g.concat(L.keys(g, wc, layer, fused, self.pos_ctx), L.keys(g, w, layer, hn, self.pos_q), 1)
            v = g.concat(L.values(g, wc, layer, fused), L.values(g, w, layer, hn), 1)
            return g.cast(k, drafter.cache_type), g.cast(v, drafter.cache_type)

        head = L.noise_forward(
            g,
            w,
            self.inp_embed,
            self.pos_q,
            kv_of_layer,
            {False: self.mask_full, True: self.mask_swa},
            drafter.layer_swa,
            fold,
            drafter.attention == "bf16" and be.is_cpu,
            drafter.lm_head,
            convs=L.Convolutions(1, custom_op=be.is_cpu) if cfg.is_dflash2 else None,
        )
        self.out = self.graph.expand(head.logits if head.logits is not None else head.hidden)
        self.galloc = Gallocr(be)
        self.galloc.alloc_graph(self.graph)

    def close(self) -> None:
        for obj in (self.galloc, self.g, self.buffer, self.inputs):
            obj.close()


class OneShotDrafter:
    """Recompute-everything drafter with the same `step(ring, committed, noise_embed)` as DraftKvCache."""

    def __init__(
        self,
        weights: BackendWeights,
        backend: Backend,
        cap: int,
        lm_head: Any = None,
        cache_type: str = "f16",
        swa: str = "seed",
        attention: str = "f32",
    ) -> None:
        self.cap = check_drafter_args(weights, backend, cap, cache_type, swa, attention)
        self.cfg = weights.cfg
        self.weights = weights
        self.backend = backend
        self.q_len = self.cfg.block_size
        self.cache_type, self.swa, self.attention = cache_type, swa, attention
        self.layer_swa = [t == "sliding" and swa != "off" for t in self.cfg.layer_types]
        self._lock = threading.Lock()
        self.lm_head, self._lm_buf = vocab_matrix(lm_head, "lm_head", weights, backend)
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

    def step(self, ring: FeatureRing, committed: int, noise_embed: np.ndarray) -> np.ndarray:
        if self._closed:
            raise GGMLError("OneShotDrafter is closed")
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("this OneShotDrafter is being stepped from another thread")
        try:
            self.backend._check_open()
            if not isinstance(ring, FeatureRing) or ring.fc_in != self.cfg.fc_in:
                raise ValueError(f"ring must be a FeatureRing with fc_in={self.cfg.fc_in}")
            committed = check_int("committed", committed, 1)
            emb = np.asarray(noise_embed)
            if emb.shape != (self.q_len, self.cfg.hidden) or emb.dtype.kind != "f":
                raise ValueError(
                    f"noise_embed must be a float (q_len={self.q_len}, hidden={self.cfg.hidden}) array, got {emb.dtype} {emb.shape}"
                )
            ctx_len = min(committed, self.cap)
            feats = ring.read(committed - ctx_len, ctx_len)
            wg = self._graph_for(ctx_len)
            wg.feat.set(feats)
            rebased = np.arange(ctx_len, dtype=np.int32)
            wg.pos_ctx.set(rebased)
            wg.pos_q.set(ctx_len + np.arange(self.q_len, dtype=np.int32))
            wg.inp_embed.set(emb)
            full, sliding = wg.masks.fill(rebased, 0, ctx_len)
            wg.mask_full.set(full)
            wg.mask_swa.set(sliding)
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

    def __enter__(self) -> OneShotDrafter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
