"""Our tiled flash attention against ggml's own, side by side: the same Q, K/V and mask with K/V in
our CPU_DKV buffer (our kernel: kernels/flash-attn-tiled.cpp) and in ggml's CPU buffer
(ggml 0.25.3's: its tiled kernel from 64 query rows per head, its per-row one below), and, where the
build and CPU have them (`bf16_attention_kernel()`), our kernel's bf16 products (attention="bf16":
kernels/flash-attn-bf16.cpp) on the same K/V.

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
from pyggml_dkv.ggml.capabilities import (  # noqa: E402
    DKV_BUFFER_TYPE,
    bf16_attention_kernel,
    dkv_buffer_available,
    flash_attn_kernel,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_name  # noqa: E402  (benchmarks/machine.py)

D, KV_HEADS, CACHE, Q_LEN = 64, 4, 4128, 16
# (query rows per head, query heads, visible window)
SHAPES = [(64, KV_HEADS, 64), (64, KV_HEADS, 1024), (64, KV_HEADS, 4096), (16, 4 * KV_HEADS, 1024)]
COUNT = 5  # one per layer of the small drafter


class Attention:
    def __init__(
        self, backend: Backend, n_q: int, n_head: int, window: int, dkv: bool, seed: int, bf16: bool = False
    ) -> None:
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
            self.graph.expand(
                self.gctx.flash_attn_ext(self.q, k, v, self.mask, 1 / math.sqrt(D), prec_f32=not bf16, prec_bf16=bf16)
            )
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
    bf16 = bf16_attention_kernel() != "f32"
    print(
        f"CPU: {cpu_name()}, {os.cpu_count()} logical CPUs; {args.threads} thread(s), median of {args.reps} alternated computes"
    )
    print(
        f"{'rows/head':>9} {'heads':>5} {'window':>6} {'ours':>6} {'ours us':>9} {'ggml us':>9} {'ours/ggml':>9} {'max |diff|':>10}"
        + (f" {'bf16 us':>9} {'bf16/ours':>9} {'bf16/ggml':>9}" if bf16 else "")
    )
    with Backend("cpu", n_threads=args.threads) as backend:
        for n_q, n_head, window in SHAPES:
            systems = [
                Attention(backend, n_q, n_head, window, True, seed=1),
                Attention(backend, n_q, n_head, window, False, seed=1),
            ]
            if bf16:
                systems.append(Attention(backend, n_q, n_head, window, True, seed=1, bf16=True))
            for _ in range(2):  # warm-up
                for p in systems:
                    p.time_one()
            diff = float(np.abs(systems[0].outs[0].numpy() - systems[1].outs[0].numpy()).max())
            times: list[list[float]] = [[] for _ in systems]
            for _ in range(args.reps):
                for p, t in zip(systems, times):
                    t.append(p.time_one())
            med = [statistics.median(t) for t in times]
            line = f"{n_q:>9} {n_head:>5} {window:>6} {flash_attn_kernel(n_q):>6} {med[0] * 1e6:9.1f} {med[1] * 1e6:9.1f} {med[0] / med[1]:9.2f} {diff:10.2e}"
            if bf16:
                line += f" {med[2] * 1e6:9.1f} {med[2] / med[0]:9.2f} {med[2] / med[1]:9.2f}"
            print(line, flush=True)
            for p in systems:
                p.close()


if __name__ == "__main__":
    main()
