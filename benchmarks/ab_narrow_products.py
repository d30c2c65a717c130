"""Our narrow products against ggml's own, side by side: the same f16 / bf16 weights in our CPU_DKV
buffer (our kernels: kernels/mm-*.cpp) and in ggml's CPU buffer (ggml 0.25.3's own path:
the columns rounded to f16 / bf16, llamafile's GEMM), multiplied by the same f32 columns.

    python benchmarks/ab_narrow_products.py [--threads 2] [--reps 40] [--types f16,bf16]

Per shape (rows x inputs, columns), one graph per placement holding `count` distinct weight
matrices (so a product streams its weights as a step's do; about 48 MB a graph), each multiplied once
per compute. The two graphs are computed alternately, --reps times each after a warm-up; the
figure is the median time per product, and the ratio ours / ggml's. Not a timed test: run it on a
quiet machine.
"""

from __future__ import annotations

import argparse
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
    bf16_matmul_kernel,
    cpu_extra_buffer_types,
)
from pyggml_dkv.ggml.capabilities import DKV_BUFFER_TYPE, dkv_buffer_available, f16_matmul_kernel  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_name  # noqa: E402  (benchmarks/machine.py)

# (rows, inputs, columns): the small drafter's q / gate / up (3072 x 1024), down (1024 x 3072),
# o (1024 x 1024) at a draft block's 16 rows and a fold-in's 34, and an lm_head slice
SHAPES = [(3072, 1024, 16), (1024, 3072, 16), (1024, 1024, 16), (3072, 1024, 34), (8192, 1024, 9)]
GRAPH_BYTES = 48 << 20


class Products:
    def __init__(self, backend: Backend, wtype: str, rows: int, k: int, columns: int, dkv: bool, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.count = max(2, GRAPH_BYTES // (rows * k * 2))
        self.wctx = Context(n_tensors=self.count)
        self.weights = [self.wctx.new_tensor(wtype, k, rows) for _ in range(self.count)]
        self.wbuf = (
            Buffer.alloc_ctx_tensors_from_buft(self.wctx, cpu_extra_buffer_types()[DKV_BUFFER_TYPE], backend)
            if dkv
            else Buffer.alloc_ctx_tensors(self.wctx, backend)
        )
        for w in self.weights:
            w.set(rng.standard_normal((rows, k), dtype=np.float32))
        self.xctx = Context(n_tensors=1)
        self.x = self.xctx.new_tensor("f32", k, columns)
        self.xbuf = Buffer.alloc_ctx_tensors(self.xctx, backend)
        self.x.set(rng.standard_normal((columns, k), dtype=np.float32))
        size = 2 * self.count + 8
        self.gctx = Context(n_tensors=size, graph_size=size)
        self.graph = Graph(self.gctx, size)
        self.outs = [self.graph.expand(self.gctx.mul_mat(w, self.x)) for w in self.weights]
        self.galloc = Gallocr(backend)
        self.galloc.alloc_graph(self.graph)
        self.backend = backend

    def time_one(self) -> float:
        t0 = time.perf_counter()
        self.graph.compute(self.backend)
        return (time.perf_counter() - t0) / self.count

    def close(self) -> None:
        for o in (self.galloc, self.gctx, self.xbuf, self.xctx, self.wbuf, self.wctx):
            o.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--types", default="f16,bf16")
    args = ap.parse_args()
    if not dkv_buffer_available():
        raise SystemExit("this ggml has no CPU_DKV buffer type (GGML_PATCHES=none?): nothing to compare")
    print(
        f"CPU: {cpu_name()}, {os.cpu_count()} logical CPUs; {args.threads} thread(s), median of {args.reps} alternated computes"
    )
    print(
        f"{'type':5} {'rows x K':>12} {'cols':>4} {'kernel':>12} {'ours us':>9} {'ggml us':>9} {'ours/ggml':>9} {'ours G mul-add/s':>17}"
    )
    with Backend("cpu", n_threads=args.threads) as backend:
        for wtype in args.types.split(","):
            for rows, k, columns in SHAPES:
                kernel = (f16_matmul_kernel if wtype == "f16" else bf16_matmul_kernel)((k, rows), n_columns=columns)
                ours = Products(backend, wtype, rows, k, columns, True, seed=1)
                ggml = Products(backend, wtype, rows, k, columns, False, seed=1)
                for p in (ours, ggml, ours, ggml):  # warm-up
                    p.time_one()
                # the same product (ggml's rounds the columns: f16 ~1e-3, bf16 the same bits or ~1e-2 apart)
                np.testing.assert_allclose(ours.outs[0].numpy(), ggml.outs[0].numpy(), rtol=0, atol=0.5)
                t_ours, t_ggml = [], []
                for _ in range(args.reps):
                    t_ours.append(ours.time_one())
                    t_ggml.append(ggml.time_one())
                a, b = statistics.median(t_ours), statistics.median(t_ggml)
                print(
                    f"{wtype:5} {rows:>5} x {k:<5} {columns:>4} {kernel:>12} {a * 1e6:9.1f} {b * 1e6:9.1f} {a / b:9.2f} "
                    f"{rows * k * columns / a / 1e9:17.1f}",
                    flush=True,
                )
                ours.close()
                ggml.close()


if __name__ == "__main__":
    main()
