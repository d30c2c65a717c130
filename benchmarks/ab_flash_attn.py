"""Our tiled flash attention against ggml's own, side by side: the same Q, K/V and mask with K/V in
our CPU_DKV buffer (our kernel: vendor/kernels/flash-attn-tiled.cpp) and in ggml's CPU buffer
(ggml 0.25.3's: its tiled kernel from 64 query rows per head, its per-row one below).

    python benchmarks/ab_flash_attn.py [--threads 2] [--reps 40]

Shapes of the small drafter's attention (head size 64, 4 K/V heads, f16 K/V in a 4128-row cache,
the keys a step may see: the window, then the 16 noise rows): 64 query rows per K/V head (the
step's 16 rows x 4 query heads, folded) and 16 rows per query head unfolded (16 heads). One graph
per placement holds `count` attention ops over distinct caches (so the K/V stream from memory as a
step's do); the graphs are computed alternately, --reps times each after a warm-up; the figure is
the median time per op. Not a timed test: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_step.py

import numpy as np  # noqa: E402

from pyggml_dkv.ggml import (  # noqa: E402
    Backend,
    Buffer,
    Context,
    Gallocr,
    Graph,
    cpu_extra_buffer_types,
)
from pyggml_dkv.ggml.capabilities import DKV_BUFFER_TYPE, dkv_buffer_available, flash_attn_kernel  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_name  # noqa: E402  (benchmarks/machine.py)

D, KV_HEADS, CACHE, Q_LEN = 64, 4, 4128, 16
# (query rows per head, query heads, visible window)
SHAPES = [(64, KV_HEADS, 64), (64, KV_HEADS, 1024), (64, KV_HEADS, 4096), (16, 4 * KV_HEADS, 1024)]
COUNT = 5  # one per layer of the small drafter


class Attention:
    def __init__(self, backend: Backend, n_q: int, n_head: int, window: int, dkv: bool, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.kvctx = Context(n_tensors=2 * COUNT)
        self.ks = [self.kvctx.new_tensor("f16", D, CACHE, KV_HEADS) for _ in range(COUNT)]
        self.vs = [self.kvctx.new_tensor("f16", D, CACHE, KV_HEADS) for _ in range(COUNT)]
        self.kvbuf = (
            Buffer.alloc_ctx_tensors_from_buft(self.kvctx, cpu_extra_buffer_types()[DKV_BUFFER_TYPE], backend)
            if dkv
            else Buffer.alloc_ctx_tensors(self.kvctx, backend)
        )
        for t in (*self.ks, *self.vs):
            t.set(rng.standard_normal((KV_HEADS, CACHE, D)).astype(np.float16))
        self.ictx = Context(n_tensors=2)
        self.q = self.ictx.new_tensor("f32", D, n_q, n_head)
        self.mask = self.ictx.new_tensor("f16", CACHE, n_q)
        self.ibuf = Buffer.alloc_ctx_tensors(self.ictx, backend)
        self.q.set(rng.standard_normal((n_head, n_q, D)).astype(np.float32))
        visible = np.zeros((n_q, CACHE), bool)
        visible[:, :window] = True  # the window's rows
        visible[:, CACHE - 32 : CACHE - 16] = True  # the noise block's rows
        self.mask.set(np.where(visible, 0, -np.inf).astype(np.float16))
        size = 4 * COUNT + 8
        self.gctx = Context(n_tensors=size, graph_size=size)
        self.graph = Graph(self.gctx, size)
        self.outs = [
            self.graph.expand(self.gctx.flash_attn_ext(self.q, k, v, self.mask, 1 / math.sqrt(D), prec_f32=True))
            for k, v in zip(self.ks, self.vs)
        ]
        self.galloc = Gallocr(backend)
        self.galloc.alloc_graph(self.graph)
        self.backend = backend

    def time_one(self) -> float:
        t0 = time.perf_counter()
        self.graph.compute(self.backend)
        return (time.perf_counter() - t0) / COUNT

    def close(self) -> None:
        for o in (self.galloc, self.gctx, self.ibuf, self.ictx, self.kvbuf, self.kvctx):
            o.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()
    if not dkv_buffer_available():
        raise SystemExit("this ggml has no CPU_DKV buffer type (GGML_PATCHES=none?): nothing to compare")
    print(
        f"CPU: {cpu_name()}, {os.cpu_count()} logical CPUs; {args.threads} thread(s), median of {args.reps} alternated computes"
    )
    print(
        f"{'rows/head':>9} {'heads':>5} {'window':>6} {'ours':>6} {'ours us':>9} {'ggml us':>9} {'ours/ggml':>9} {'max |diff|':>10}"
    )
    with Backend("cpu", n_threads=args.threads) as backend:
        for n_q, n_head, window in SHAPES:
            ours = Attention(backend, n_q, n_head, window, True, seed=1)
            ggml = Attention(backend, n_q, n_head, window, False, seed=1)
            for p in (ours, ggml, ours, ggml):  # warm-up
                p.time_one()
            diff = float(np.abs(ours.outs[0].numpy() - ggml.outs[0].numpy()).max())
            t_ours, t_ggml = [], []
            for _ in range(args.reps):
                t_ours.append(ours.time_one())
                t_ggml.append(ggml.time_one())
            a, b = statistics.median(t_ours), statistics.median(t_ggml)
            print(
                f"{n_q:>9} {n_head:>5} {window:>6} {flash_attn_kernel(n_q):>6} {a * 1e6:9.1f} {b * 1e6:9.1f} {a / b:9.2f} {diff:10.2e}",
                flush=True,
            )
            ours.close()
            ggml.close()


if __name__ == "__main__":
    main()
