"""Our AVX512-VNNI products of repacked quantized weights against ggml's own, side by side: the same
weights in our CPU_DKV_REPACK buffer (our kernels: kernels/mm-vnni-*.cpp), in ggml's CPU
buffer (ggml 0.25.3's own path for the type: its vec_dot against q8_0 / q8_K rows, llamafile's
tinyBLAS or its tiled/ K-quant kernel where they take the shape) and, where ggml's CPU_REPACK has a
layout for the type here (q4_0 / q4_K: its AVX2 8x8 interleaves; none for q8_0, q5_K, q6_K on
x86), in ggml's CPU_REPACK.

    python benchmarks/ab_vnni_products.py [--threads 2] [--reps 40] [--types q8_0,q4_0,q6_k,q4_k,q5_k]

Per shape (rows x inputs, columns), one graph per placement holding `count` distinct weight
matrices (so a product streams its weights as a step's do; about 48 MB of f16-sized weights a
graph), each multiplied once per compute. The graphs are computed in turn, --reps times each after
a warm-up; the figure is the median time per product, and the ratio to ours. Not a timed test: run
it on a quiet machine.
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

from pyggml_dkv.common.numeric import relative_error  # noqa: E402
from pyggml_dkv.ggml import Backend, Buffer, Context, Gallocr, Graph  # noqa: E402
from pyggml_dkv.ggml.capabilities import (  # noqa: E402
    DKV_REPACK_BUFFER_TYPE,
    cpu_extra_buffer_types,
    ggml_repack_fits,
    vnni_repack_fits,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_name  # noqa: E402  (benchmarks/machine.py)

# (rows, inputs, columns): the small drafter's q / gate / up (3072 x 1024), down (1024 x 3072),
# o (1024 x 1024) at a draft block's 16 rows and a fold-in's 34, and an lm_head slice at 9
SHAPES = [(3072, 1024, 16), (1024, 3072, 16), (1024, 1024, 16), (3072, 1024, 34), (8192, 1024, 9)]
GRAPH_BYTES = 48 << 20


def cpu_family_model() -> str:
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("cpu family", "model") and key.strip() not in fields:
                fields[key.strip()] = value.strip()
    except OSError:
        return "?"
    return f"family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"


class Products:
    def __init__(self, backend: Backend, wtype: str, rows: int, k: int, columns: int, buffer: str | None) -> None:
        rng = np.random.default_rng(1)
        self.count = max(2, GRAPH_BYTES // (rows * k * 2))
        self.wctx = Context(n_tensors=self.count)
        self.weights = [self.wctx.new_tensor(wtype, k, rows) for _ in range(self.count)]
        self.wbuf = (
            Buffer.alloc_ctx_tensors_from_buft(self.wctx, cpu_extra_buffer_types()[buffer], backend)
            if buffer
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
    ap.add_argument("--types", default="q8_0,q4_0,q6_k,q4_k,q5_k")
    args = ap.parse_args()
    print(
        f"CPU: {cpu_name()} ({cpu_family_model()}), {os.cpu_count()} logical CPUs; {args.threads} thread(s), "
        f"median of {args.reps} computes in turn"
    )
    print(
        f"{'type':5} {'rows x K':>12} {'cols':>4} {'ours us':>9} {'ggml us':>9} {'REPACK us':>9} "
        f"{'ggml/ours':>9} {'REPACK/ours':>11} {'ours G mul-add/s':>17}"
    )
    with Backend("cpu", n_threads=args.threads) as backend:
        for wtype in args.types.split(","):
            for rows, k, columns in SHAPES:
                if not vnni_repack_fits(wtype, (k, rows)):
                    raise SystemExit(f"no VNNI kernel for {wtype} {rows} x {k} in this build / on this CPU")
                places: dict[str, Products] = {
                    "ours": Products(backend, wtype, rows, k, columns, DKV_REPACK_BUFFER_TYPE),
                    "ggml": Products(backend, wtype, rows, k, columns, None),
                }
                if ggml_repack_fits(wtype, (k, rows)):
                    places["repack"] = Products(backend, wtype, rows, k, columns, "CPU_REPACK")
                for _ in range(2):  # warm-up
                    for p in places.values():
                        p.time_one()
                # the same product: the rows quantized to 8 bits alike (q6_K: ggml's q8_K rounds some
                # ties the other way, ~2e-3); otherwise only f32 sum orders differ
                want = places["ggml"].outs[0].numpy()
                for name in ("ours", "repack"):
                    if name in places:
                        err = relative_error(places[name].outs[0].numpy(), want)
                        assert err < (5e-3 if wtype.lower() == "q6_k" else 1e-4), (name, err)
                times: dict[str, list[float]] = {name: [] for name in places}
                for _ in range(args.reps):
                    for name, p in places.items():
                        times[name].append(p.time_one())
                med = {name: statistics.median(t) for name, t in times.items()}
                a = med["ours"]
                rp = med.get("repack")
                print(
                    f"{wtype:5} {rows:>5} x {k:<5} {columns:>4} {a * 1e6:9.1f} {med['ggml'] * 1e6:9.1f} "
                    f"{(f'{rp * 1e6:9.1f}' if rp else '        -')} {med['ggml'] / a:9.2f} "
                    f"{(f'{rp / a:11.2f}' if rp else '          -')} {rows * k * columns / a / 1e9:17.1f}",
                    flush=True,
                )
                for p in places.values():
                    p.close()


if __name__ == "__main__":
    main()
