"""Programs that end with ggml objects still open (each prints "child done" when it returns), each run in its own child interpreter by
tests/drafter/test_memory_threads.py: the interpreter must exit with status 0 and print nothing
on stderr however the objects are left (finalizers do not run at exit; see docs/design.md)."""

from __future__ import annotations

import threading

import numpy as np

from pyggml_dkv import Backend, DraftConfig, Drafter, DraftKvCache, DraftWeights, FeatureRing, OneShotDrafter
from pyggml_dkv.ggml import Buffer, Context, Gallocr, Graph

cfg = DraftConfig(
    hidden=64,
    n_layer=2,
    n_head=2,
    n_head_kv=1,
    head_dim=32,
    ffn=96,
    block_size=4,
    n_target_layers=2,
    layer_types=["full", "sliding"],
    swa_window=6,
)
w = DraftWeights.random(cfg)
ring = FeatureRing(64, cfg.fc_in)
ring.append(np.random.default_rng(0).standard_normal((60, cfg.fc_in)).astype(np.float32))
noise = np.zeros((4, 64), np.float32)
embed = np.random.default_rng(1).standard_normal((40, 64)).astype(np.float32)
LEFT_OPEN: list = []  # objects the scenarios leave to the interpreter's shutdown


def module_globals() -> None:
    """Objects kept by module globals, destroyed in arbitrary order at shutdown."""
    be = Backend("cpu", n_threads=1)
    bw = w.to_backend(be, "f16")
    cache = DraftKvCache(bw, be, 19, lm_head=embed)
    cache.step(ring, 60, noise)
    one = OneShotDrafter(bw, be, 19)
    one.step(ring, 60, noise)
    drafter = Drafter(w, embed_tokens=embed, lm_head=embed, cap=19)
    drafter.add_features(np.ones((5, cfg.fc_in), np.float32))
    drafter.propose(3)
    ctx = Context(n_tensors=2)
    t = ctx.new_tensor("f32", 8)
    buf = Buffer.alloc_ctx_tensors(ctx, be)
    g = Context(n_tensors=8, graph_size=8)
    graph = Graph(g, 8)
    graph.expand(g.scale(t, 2.0))
    galloc = Gallocr(be)
    galloc.alloc_graph(graph)
    graph.compute(be)
    LEFT_OPEN.extend([bw, cache, one, drafter, ctx, t, buf, g, graph, galloc])  # alive until shutdown
    be.close()  # the backend goes first; everything else is left to the finalizers
    print("child done", flush=True)


def cycles() -> None:
    """Reference cycles that only the collector (or shutdown) frees."""
    be = Backend("cpu", n_threads=1)
    bw = w.to_backend(be, "f32")

    class Holder:
        pass

    for i in range(5):
        h = Holder()
        h.cache = DraftKvCache(bw, be, 19)
        h.self = h
        h.cache.owner = h
        h.cache.step(ring, 30 + i, noise)
    del h
    bw.close()
    print("child done", flush=True)


def daemon_thread() -> None:
    """A daemon thread still drafting when the main thread returns."""
    be = Backend("cpu", n_threads=1)
    bw = w.to_backend(be, "f32")
    started = threading.Event()

    def draft_forever() -> None:
        cache = DraftKvCache(bw, be, 19)
        started.set()
        while True:
            try:
                cache.step(ring, 60, noise)
            except Exception:  # the backend may be closed under it at exit: fine, not a crash
                pass

    threading.Thread(target=draft_forever, daemon=True).start()
    started.wait()
    print("child done", flush=True)


def sys_exit() -> None:
    """sys.exit() from the middle of the program with everything open."""
    be = Backend("cpu", n_threads=1)
    cache = DraftKvCache(w.to_backend(be, "f32"), be, 19)
    cache.step(ring, 60, noise)
    raise SystemExit(0)
