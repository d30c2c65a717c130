"""The child side of tests/ggml/test_barrier.py: a graph of single-threaded nodes on two threads,
timed in wall and CPU time (printed as JSON)."""

from __future__ import annotations

import json
import time

import numpy as np

from pyggml_dkv.ggml import Backend, Buffer, Context, Gallocr, Graph


def run() -> None:
    backend = Backend("cpu", n_threads=2)
    x = np.random.default_rng(0).standard_normal((1, 1 << 23)).astype(np.float32)
    with Context(n_tensors=1) as ctx, Context(n_tensors=128, graph_size=128) as g:
        t = ctx.new_tensor("f32", 1 << 23, 1)
        with Buffer.alloc_ctx_tensors(ctx, backend):
            t.set(x)
            graph = Graph(g, 128)
            # the argmax of one row is computed by one thread (P8 gives each thread whole rows):
            # the other waits at each node's barrier
            outs = [g.argmax(t) for _ in range(96)]
            for o in outs:
                graph.expand(o)
            graph.expand(g.add(t, t))  # a node both threads work on, so the graph runs on 2 threads
            with Gallocr(backend) as galloc:
                galloc.alloc_graph(graph)
                graph.compute(backend)  # warm-up: OpenMP team started, pages touched
                wall0, cpu0 = time.perf_counter(), time.process_time()
                graph.compute(backend)
                wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
                ok = all(np.array_equal(o.numpy(), x.argmax(-1)) for o in outs)
    print(json.dumps({"wall": wall, "cpu": cpu, "ok": ok}))
