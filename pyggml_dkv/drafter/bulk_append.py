"""Bulk append: K/V of more rows than the step graph folds in, with temporary exact-size graphs
freed afterwards (a long prompt, a jump past a_step, refilling a window after a rewind)."""

from __future__ import annotations

import numpy as np

from ..ggml import Backend, Buffer, Context, Gallocr, Graph, Tensor
from . import layers as L
from .backend_weights import BackendWeights
from .features import FeatureRing

BULK_CHUNK = 1024  # rows per temporary graph


def contiguous_runs(positions: np.ndarray) -> list[tuple[int, int]]:
    """[(start, end), ...] of the ascending `positions`, one pair per unbroken run."""
    if positions.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [positions.size]])
    return [(int(positions[a]), int(positions[b - 1]) + 1) for a, b in zip(starts, ends)]


def read_rows(ring: FeatureRing, positions: np.ndarray) -> np.ndarray:
    """The ring's features of ascending `positions`, (n, fc_in) float32."""
    return np.concatenate([ring.read(a, b - a) for a, b in contiguous_runs(positions)])


def bulk_append(
    weights: BackendWeights,
    backend: Backend,
    k_cache: list[Tensor],
    v_cache: list[Tensor],
    ring: FeatureRing,
    positions: np.ndarray,
    cap: int,
    first_row: int = 0,
) -> None:
    """Write the K/V of ascending `positions` into ring slots positions % cap, BULK_CHUNK at a time;
    the slots of a lane start at `first_row` of the caches."""
    cfg = weights.cfg
    size = 64 * cfg.n_layer + 64
    matrices = weights.bulk  # hundreds of rows: the kernels' copies for those (q8_0 on AMX CPUs)
    for first in range(0, positions.size, BULK_CHUNK):
        chunk = positions[first : first + BULK_CHUNK]
        n = chunk.size
        with Context(n_tensors=3) as in_ctx, Context(n_tensors=size, graph_size=size) as g:
            feat = in_ctx.new_tensor("f32", cfg.fc_in, n, name="bulk_feat")
            pos = in_ctx.new_tensor("i32", n, name="bulk_pos")
            rows = in_ctx.new_tensor("i32", n, name="bulk_rows")
            with Buffer.alloc_ctx_tensors(in_ctx, backend):
                feat.set(read_rows(ring, chunk))
                pos.set(chunk.astype(np.int32))
                rows.set((chunk % cap + first_row).astype(np.int32))
                graph = Graph(g, size)
                ks, vs = L.append_rows(g, matrices, k_cache, v_cache, feat, pos, rows)
                for t in (*ks, *vs):
                    graph.expand(t)
                with Gallocr(backend) as galloc:
                    galloc.alloc_graph(graph)
                    graph.compute(backend)


def copy_lane_rows(backend: Backend, caches: list[Tensor], rows: int, src_row: int, dst_row: int) -> None:
    """Copy rows [src_row, src_row + rows) of every K/V cache onto rows [dst_row, ...), on the
    device, with one temporary graph freed afterwards (DraftKvCache.move_lane)."""
    size = 4 * len(caches) + 16
    with Context(n_tensors=size, graph_size=size) as g:
        graph = Graph(g, size)
        for cache in caches:
            row_bytes = cache.nb[1]
            src = g.view(cache, (cache.ne[0], rows), (row_bytes,), src_row * row_bytes)
            dst = g.view(cache, (cache.ne[0], rows), (row_bytes,), dst_row * row_bytes)
            graph.expand(g.cpy(src, dst))
        with Gallocr(backend) as galloc:
            galloc.alloc_graph(graph)
            graph.compute(backend)
