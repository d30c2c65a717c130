"""Helpers the ggml layer's tests share (fixtures: tests/ggml/conftest.py)."""

from __future__ import annotations


import numpy as np

from pyggml_dkv.ggml._lowlevel import lib
from pyggml_dkv.ggml import (
    Backend,
    Buffer,
    Context,
    Gallocr,
    Graph,
    Tensor,
)


NEOX = int(lib.GGML_ROPE_TYPE_NEOX)
RNG_SEED = 1234


def compute(backend: Backend, specs: list[tuple[str, np.ndarray]], build, graph_size: int = 128):
    """Upload `specs` (type, numpy array) into fresh tensors, run build(g, *tensors) -> output(s), return numpy."""
    with Context(n_tensors=len(specs)) as ctx, Context(n_tensors=graph_size, graph_size=graph_size) as g:
        tensors = [ctx.new_tensor(ty, *reversed(arr.shape)) for ty, arr in specs]
        with Buffer.alloc_ctx_tensors(ctx, backend):
            for t, (_, arr) in zip(tensors, specs):
                t.set(arr)
            graph = Graph(g, graph_size)
            outs = build(g, *tensors)
            single = isinstance(outs, Tensor)
            outs = [outs] if single else list(outs)
            for o in outs:
                graph.expand(o)
            with Gallocr(backend) as galloc:
                galloc.alloc_graph(graph)
                graph.compute(backend)
                results = [o.numpy() for o in outs]
    return results[0] if single else results


