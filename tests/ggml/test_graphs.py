"""Contexts (caller-owned arenas, running out of room), graphs and the graph allocator."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest

from pyggml_dkv.ggml import (
    Backend,
    Buffer,
    Context,
    Gallocr,
    GGMLError,
    Graph,
    live_objects,
)
from pyggml_dkv.ggml._lowlevel import ffi, lib

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kind", ["bytearray", "numpy"])
def test_context_with_caller_owned_arena(be, kind):
    size = 16 * 1024
    arena = bytearray(size) if kind == "bytearray" else np.zeros(size, np.uint8)
    addr = int(ffi.cast("uintptr_t", ffi.from_buffer(arena)))
    # metadata-only context: tensor headers live in the arena, their data in a backend buffer
    with Context(size, arena=arena) as ctx:
        assert ctx.mem_size == size and ctx.no_alloc
        x = ctx.new_tensor("f32", 4, 2)
        assert addr <= int(ffi.cast("uintptr_t", x.ptr)) < addr + size
        assert any(arena)  # ggml wrote its object headers into our memory
        with Buffer.alloc_ctx_tensors(ctx, be):
            x.set(np.arange(8, dtype=np.float32).reshape(2, 4))
            np.testing.assert_array_equal(x.numpy().ravel(), np.arange(8))
    # no_alloc=False: the tensor data is in the arena too
    arena2 = np.zeros(size, np.uint8)
    addr2 = int(ffi.cast("uintptr_t", ffi.from_buffer(arena2)))
    with Context(size, arena=arena2, no_alloc=False) as ctx:
        y = ctx.new_tensor("f32", 64)
        assert addr2 <= y.data_address < addr2 + size - 256
        # ... but only backend buffers are readable through this layer
        assert not y.is_allocated


def test_context_sizes():
    ctx = Context(n_tensors=3, graph_size=16)
    assert ctx.mem_size >= 3 * lib.ggml_tensor_overhead() + lib.ggml_graph_overhead_custom(16, False)
    Graph(ctx, 16)
    ctx.close()
    assert Context().mem_size >= 1024


def test_gallocr_recompute_with_new_inputs(be, rng):
    with Context(n_tensors=2) as ctx, Context(n_tensors=32, graph_size=32) as g:
        x = ctx.new_tensor("f32", 16, 4, name="x").set_input()
        w = ctx.new_tensor("f32", 16, 8, name="w")
        with Buffer.alloc_ctx_tensors(ctx, be):
            wv = rng.standard_normal((8, 16)).astype(np.float32)
            w.set(wv)
            graph = Graph(g, 32)
            out = graph.expand(g.silu(g.mul_mat(w, g.scale(x, 0.5))).set_output())
            assert (
                graph.n_nodes == 3
                and graph.node(-1) == out
                and [n.op for n in graph.nodes()] == ["SCALE", "MUL_MAT", "SILU"]
            )
            with Gallocr(be) as galloc:
                galloc.reserve(graph)
                reserved = galloc.buffer_size
                galloc.alloc_graph(graph)
                assert galloc.n_allocs == 1 and galloc.buffer_size == reserved > 0
                results = []
                for _ in range(3):
                    xv = rng.standard_normal((4, 16)).astype(np.float32)
                    x.set(xv)
                    graph.compute(be)
                    z = (0.5 * xv.astype(np.float64)) @ wv.T
                    np.testing.assert_allclose(out.numpy(), z / (1 + np.exp(-z)), rtol=1e-5, atol=1e-6)
                    results.append(out.numpy())
                    assert galloc.buffer_size == reserved
                assert not np.array_equal(results[0], results[1])
                galloc.alloc_graph(graph)  # allocating the same graph again changes nothing
                assert galloc.n_allocs == 2 and galloc.buffer_size == reserved
                be.compute(graph)
                np.testing.assert_array_equal(out.numpy(), results[-1])
                with pytest.raises(IndexError):
                    graph.node(3)


def test_gallocr_growth_detaches_older_graphs(be):
    """A bigger graph makes ggml free the allocator's buffer: older graphs must be re-allocated, not read freed memory."""
    with (
        Context(n_tensors=2) as ctx,
        Context(n_tensors=8, graph_size=8) as g1,
        Context(n_tensors=8, graph_size=8) as g2,
    ):
        a = ctx.new_tensor("f32", 4, 2)
        big = ctx.new_tensor("f32", 4096, 16)
        with Buffer.alloc_ctx_tensors(ctx, be), Gallocr(be) as galloc:
            a.set(np.ones((2, 4), np.float32))
            big.set(np.ones((16, 4096), np.float32))
            graph1 = Graph(g1, 8)
            out1 = graph1.expand(g1.scale(a, 2.0))
            galloc.alloc_graph(graph1)
            graph1.compute(be)
            small = galloc.buffer_size
            graph2 = Graph(g2, 8)
            out2 = graph2.expand(g2.scale(g2.add(big, big), 3.0))
            galloc.alloc_graph(graph2)
            assert galloc.buffer_size > small
            graph2.compute(be)
            np.testing.assert_array_equal(out2.numpy(), 6.0)
            with pytest.raises(GGMLError):
                out1.numpy()
            with pytest.raises(GGMLError):
                graph1.compute(be)
            galloc.alloc_graph(graph1)  # placed again, in the new buffer
            graph1.compute(be)
            np.testing.assert_array_equal(out1.numpy(), 2.0)


def test_close_is_idempotent_and_live_objects_balance(be):
    gc.collect()
    before = live_objects()
    backend = Backend("cpu", n_threads=1)
    ctx = Context(n_tensors=1)
    t = ctx.new_tensor("f32", 4)
    buf = Buffer.alloc_ctx_tensors(ctx, backend)
    g = Context(n_tensors=4, graph_size=4)
    graph = Graph(g, 4)
    graph.expand(g.scale(t, 2.0))
    galloc = Gallocr(backend)
    galloc.alloc_graph(graph)
    now = live_objects()
    for kind, extra in (("backend", 1), ("context", 2), ("buffer", 1), ("gallocr", 1)):
        assert now.get(kind, 0) == before.get(kind, 0) + extra, (kind, now, before)
    for obj in (galloc, g, buf, ctx, backend):
        obj.close()
        assert obj.closed
        obj.close()
    assert {k: v for k, v in live_objects().items() if v} == {k: v for k, v in before.items() if v}
    # the garbage collector frees what was never closed
    with Context(n_tensors=1):
        pass
    Context(n_tensors=1)
    gc.collect()
    assert {k: v for k, v in live_objects().items() if v} == {k: v for k, v in before.items() if v}
