"""Each weight type's matrix product at a draft step's shapes, one thread against all: which kernel
runs, how fast, what a product costs beyond its rows, and whether its speed is the memory's.

    python benchmarks/bench_products.py                          # every type, 9 and 16 columns
    python benchmarks/bench_products.py --types bf16,q8_0 --json out.json

Per weight type (placed as a step's weights are: `upload_matrix(..., matmul_only=True)`, so q8_0 goes
to our VNNI kernel or AMX tiles by the package's rule) and per column count (a step multiplies 16
noise rows and up to 34 fold-in rows):
  hot       one K x R matrix multiplied again and again in one graph (its weights stay in cache), R =
            256 / 1024 / 3072 output rows, K = 1024, on one thread and on --threads: microseconds a
            product; the cost per product that does not depend on its rows (fixed: the line through
            R = 256 and 1024, both in L2, at 0 rows: quantizing or laying out the columns, barriers,
            shared cache lines); and the thread speedup. A fixed cost on many threads well above the
            one thread's is flagged: one that threads add (old patch 0043 was found this way:
            ~45 us a product of cache lines both threads wrote)
  streamed  distinct 3072 x 1024 matrices, --stream-mb of them (a step's weights are 60-230 MB), each
            multiplied once per graph, on --threads: against `hot` at 3072 rows, how much of the
            product's time is waiting on memory (1.0: none; the kernel runs at its instructions' rate)
G multiply-adds / s count rows x K x columns. Not a timed test: read the ratios on a quiet machine
(each figure is the median of --reps graph computes; hot and streamed, one thread and many, are
measured alternately in rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_step.py

import numpy as np  # noqa: E402

from pyggml_dkv.drafter.backend_weights import matrix_in_own_buffer, repack_buffer  # noqa: E402
from pyggml_dkv.ggml import Backend, Buffer, Context, Gallocr, Graph, cpu_features, cpu_repack_kernel, quantize  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_name  # noqa: E402  (benchmarks/machine.py)
from step_probes import kernels_used  # noqa: E402

TYPES = ("f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k")
K = 1024
ROWS = (256, 1024, 3072)


def kernel_name(backend: Backend, type_name: str, rows: int, k: int) -> str:
    """The kernel a step's product of this matrix runs on here, in words."""
    if type_name in ("f16", "bf16"):
        return kernels_used(type_name, None, "f32", (k, rows))["matmul"]
    kind = repack_buffer(backend, type_name, rows, k, bulk=False)
    if kind == "AMX":
        return f"{type_name} on ggml's AMX int8 tiles (old patches 0002, 0007)"
    if kind in ("CPU_DKV_REPACK", "CPU_REPACK"):
        return str(cpu_repack_kernel(type_name, (k, rows)))
    return f"ggml's generic {type_name} product"


class Products:
    """Graphs of `count` products of each weight in `weights` by one f32 input of `columns` rows."""

    def __init__(self, backend: Backend, weights: list, columns: int, count: int, seed: int = 0) -> None:
        self.ctx = Context(n_tensors=1)
        self.x = self.ctx.new_tensor("f32", K, columns)
        self.buf = Buffer.alloc_ctx_tensors(self.ctx, backend)
        self.x.set(np.random.default_rng(seed).standard_normal((columns, K), dtype=np.float32))
        size = 2 * count * len(weights) + 8
        self.graph_ctx = Context(n_tensors=size, graph_size=size)
        self.graph = Graph(self.graph_ctx, size)
        for _ in range(count):
            for w in weights:
                self.graph.expand(self.graph_ctx.mul_mat(w, self.x))
        self.galloc = Gallocr(backend)
        self.galloc.alloc_graph(self.graph)
        self.n_products = count * len(weights)

    def time_us(self, backend: Backend, reps: int) -> list[float]:
        """Microseconds a product, per graph compute (the first, warming, dropped)."""
        out = []
        for _ in range(reps + 1):
            t = time.perf_counter()
            self.graph.compute(backend)
            out.append(1e6 * (time.perf_counter() - t) / self.n_products)
        return out[1:]

    def close(self) -> None:
        for obj in (self.galloc, self.graph_ctx, self.buf, self.ctx):
            obj.close()


class Matrix:
    """A (rows, K) matrix of the stored bytes `raw`, placed as a step's weights are; close() closes
    its buffer, then its context."""

    def __init__(self, backend: Backend, type_name: str, raw: np.ndarray, rows: int, name: str) -> None:
        self.tensor, self.buf = matrix_in_own_buffer(backend, type_name, (rows, K), name, matmul_only=True)
        self.tensor.set_bytes(raw)

    def close(self) -> None:
        self.buf.close()
        self.tensor.ctx.close()


def line_fit(rows: tuple[int, int], us: tuple[float, float]) -> tuple[float, float]:
    """The line us = fixed + per_row * rows through two products: (fixed us, us per 1000 rows).
    Negative fixed: none measurable (the larger product's rows cost more each, e.g. out of L2)."""
    per_row = (us[1] - us[0]) / (rows[1] - rows[0])
    return us[0] - per_row * rows[0], 1e3 * per_row


def bench_type(backends: dict[int, Backend], type_name: str, columns: int, args: argparse.Namespace) -> dict:
    many = max(backends)
    rng = np.random.default_rng(1)
    raw = {r: quantize(type_name, rng.standard_normal((r, K), dtype=np.float32)) for r in ROWS}
    bytes_per_weight = raw[ROWS[-1]].nbytes / (ROWS[-1] * K)
    owned = []
    try:
        hot = {}
        for r in ROWS:
            m = Matrix(backends[many], type_name, raw[r], r, f"w{r}")
            owned.append(m)
            # about --work-mweights million weights a graph compute: its time dwarfs the graph's own
            count = max(4, int(args.work_mweights * 1e6 / (r * K)))
            hot[r] = Products(backends[many], [m.tensor], columns, count)
            owned.append(hot[r])
        n_stream = max(2, int(args.stream_mb * 2**20 / raw[ROWS[-1]].nbytes))
        stream_w = []
        for i in range(n_stream):
            m = Matrix(backends[many], type_name, raw[ROWS[-1]], ROWS[-1], f"s{i}")
            owned.append(m)
            stream_w.append(m.tensor)
        streamed = Products(backends[many], stream_w, columns, 1)
        owned.append(streamed)
        samples: dict[str, list[float]] = {}
        for _ in range(args.rounds):  # alternate everything, so the machine's moods fall on all of it
            for n, be in backends.items():
                for r in ROWS:
                    samples.setdefault(f"hot_{r}_t{n}", []).extend(hot[r].time_us(be, args.reps))
            samples.setdefault(f"streamed_t{many}", []).extend(streamed.time_us(backends[many], args.reps))
    finally:
        for obj in reversed(owned):
            obj.close()
    med = {k: float(np.median(v)) for k, v in samples.items()}
    out: dict = {
        "type": type_name,
        "columns": columns,
        "kernel": kernel_name(backends[many], type_name, ROWS[-1], K),
        "bytes_per_weight": bytes_per_weight,
        "stream_matrices": n_stream,
        "stream_mb": n_stream * raw[ROWS[-1]].nbytes / 2**20,
        "median_us": med,
        "threads": {},
    }
    for n in backends:
        us = [med[f"hot_{r}_t{n}"] for r in ROWS]
        fixed, per_1000 = line_fit((ROWS[0], ROWS[1]), (us[0], us[1]))
        out["threads"][n] = {
            "hot_us": dict(zip(ROWS, us)),
            "fixed_us": fixed,
            "us_per_1000_rows": per_1000,
            "gmacs_hot": {r: r * K * columns / u / 1e3 for r, u in zip(ROWS, us)},
        }
    if many > 1:
        out["speedup"] = {r: med[f"hot_{r}_t1"] / med[f"hot_{r}_t{many}"] for r in ROWS}
    out["streamed_us"] = med[f"streamed_t{many}"]
    out["streamed_over_hot"] = med[f"streamed_t{many}"] / med[f"hot_{ROWS[-1]}_t{many}"]
    out["gmacs_streamed"] = ROWS[-1] * K * columns / med[f"streamed_t{many}"] / 1e3
    out["gbs_streamed"] = ROWS[-1] * K * bytes_per_weight / med[f"streamed_t{many}"] / 1e3
    return out


def report(results: list[dict], threads: int) -> None:
    print(
        f"\nproducts of K = {K} inputs, one thread and {threads}; medians, us a product; fixed: the line through "
        f"R = {ROWS[0]} and {ROWS[1]} at 0 rows; G mac/s: R = {ROWS[-1]} hot on {threads} threads"
    )
    head = (
        f"{'type':>5} {'cols':>4} | "
        + " ".join(f"{'R=' + str(r) + ' 1t/' + str(threads) + 't':>17}" for r in ROWS)
        + f" | {'fixed 1t/' + str(threads) + 't':>14} | {'G mac/s':>7} | {'streamed/hot':>12} {'GB/s':>5} | kernel"
    )
    print(head)
    print("-" * len(head))
    for res in results:
        t1, tn = res["threads"][1], res["threads"][threads]
        cells = " ".join(f"{t1['hot_us'][r]:>8.1f}/{tn['hot_us'][r]:<8.1f}" for r in ROWS)
        flag = ""
        # a fixed cost that threads add (not noise, which slows every size alike and leaves the line's
        # intercept): before 0043 bf16 on AMX tiles read 57 us on two threads against -3 on one
        if threads > 1 and tn["fixed_us"] - t1["fixed_us"] > 0.5 * t1["hot_us"][ROWS[0]]:
            flag = f"  <- a cost per product that {threads} threads add"
        print(
            f"{res['type']:>5} {res['columns']:>4} | {cells} | {t1['fixed_us']:>6.1f}/{tn['fixed_us']:<7.1f} | "
            f"{tn['gmacs_hot'][ROWS[-1]]:>7.0f} | {res['streamed_over_hot']:>12.2f} {res['gbs_streamed']:>5.1f} | "
            f"{res['kernel']}{flag}"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default=",".join(TYPES), help=f"comma list of weight types (default {','.join(TYPES)})")
    ap.add_argument("--columns", default="9,16", help="comma list of column counts (rows a step multiplies)")
    ap.add_argument("--threads", type=int, default=2, help="the many-thread count, compared with one (default 2)")
    ap.add_argument("--reps", type=int, default=10, help="graph computes per measurement and round")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of every measurement")
    ap.add_argument("--stream-mb", type=float, default=128, help="bytes of distinct matrices streamed (default 128)")
    ap.add_argument(
        "--work-mweights", type=float, default=12, help="million weights multiplied per hot graph compute (default 12)"
    )
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    args.type_list = [t.strip().lower() for t in args.types.split(",") if t.strip()]
    bad = [t for t in args.type_list if t not in TYPES]
    if bad:
        ap.error(f"unknown weight types {bad}; choose from {', '.join(TYPES)}")
    try:
        args.column_list = [int(c) for c in args.columns.split(",") if c.strip()]
    except ValueError:
        ap.error(f"--columns must be a comma list of integers, got {args.columns!r}")
    if not args.column_list or any(c < 1 for c in args.column_list):
        ap.error("--columns must be positive")
    if args.threads < 1 or args.reps < 1 or args.rounds < 1 or args.stream_mb <= 0 or args.work_mweights <= 0:
        ap.error("--threads, --reps, --rounds, --stream-mb and --work-mweights must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    counts = sorted({1, args.threads})
    backends = {n: Backend("cpu", n_threads=n) for n in counts}
    try:
        print(
            f"CPU: {cpu_name()}, features {', '.join(k for k, v in cpu_features().items() if v)}; "
            f"load average {os.getloadavg()[0]:.1f} at the start"
        )
        results = []
        for type_name in args.type_list:
            for columns in args.column_list:
                results.append(bench_type(backends, type_name, columns, args))
                print(f"{type_name} x {columns} columns done", flush=True)
        report(results, max(counts))
        if args.json:
            Path(args.json).write_text(
                json.dumps(
                    {
                        "machine": {"cpu": cpu_name(), "features": cpu_features(), "threads": max(counts)},
                        "args": {k: v for k, v in vars(args).items()},
                        "results": results,
                    },
                    indent=1,
                )
            )
            print(f"JSON written to {args.json}")
    finally:
        for be in backends.values():
            be.close()


if __name__ == "__main__":
    main()
