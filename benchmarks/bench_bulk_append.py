"""Bulk append: the time to bring an empty cache up to N committed rows (a prompt's context K/V),
per weight type, on the `small` drafter with random weights.

    python benchmarks/bench_bulk_append.py                          # q8_0 and f16, 2048 rows
    python benchmarks/bench_bulk_append.py --dtypes q8_0 --rows 512,2048 --reps 10 --json out.json

What is timed: `cache.reset()` (host bookkeeping) then `cache.begin_step(ring, N)`, which computes
the K/V of all N rows through temporary graphs of up to 1024 rows (drafter/bulk_append.py: fc,
the per-layer norms, k_proj / v_proj, RoPE, the cache writes). On AMX CPUs a q8_0 drafter's fc,
k_proj and v_proj have a copy in ggml's AMX buffer for exactly these products. The weight types
run interleaved, one append each per repetition, so machine noise hits all alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from machine import cpu_family_model, cpu_name
from pyggml_dkv import Backend, DraftConfig, DraftKvCache, DraftWeights, FeatureRing
from step_config import CAP, CONFIGS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="q8_0,f16", help="comma list of weight types (default q8_0,f16)")
    ap.add_argument("--rows", default="2048", help=f"comma list of committed rows, each <= {CAP} (default 2048)")
    ap.add_argument("--reps", type=int, default=8, help="timed appends per type and row count (default 8)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None, help="write the medians and samples here")
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    row_counts = [int(r) for r in args.rows.split(",")]
    if any(not 0 < r <= CAP for r in row_counts):
        ap.error(f"--rows: each count must be in 1..{CAP}")

    cfg = DraftConfig(**CONFIGS["small"])
    backend = Backend("cpu", n_threads=args.threads)
    host = DraftWeights.random(cfg, 0)
    rng = np.random.default_rng(1)
    ring = FeatureRing(max(row_counts), cfg.fc_in)
    ring.append(rng.standard_normal((max(row_counts), cfg.fc_in), dtype=np.float32))
    caches = {dt: DraftKvCache(host.to_backend(backend, dt), backend, CAP) for dt in dtypes}

    samples: dict[str, dict[int, list[float]]] = {dt: {n: [] for n in row_counts} for dt in dtypes}
    for rep in range(args.reps + 1):  # the first repetition warms up and is not kept
        for n in row_counts:
            for dt in dtypes[rep % len(dtypes) :] + dtypes[: rep % len(dtypes)]:
                cache = caches[dt]
                cache.reset()
                t0 = time.perf_counter()
                cache.begin_step(ring, n)
                elapsed = time.perf_counter() - t0
                if rep:
                    samples[dt][n].append(elapsed * 1e3)
    for cache in caches.values():
        cache.close()

    print(f"CPU: {cpu_name()} ({cpu_family_model()}), {args.threads} threads; bulk append of N rows, median ms")
    print(f"{'type':>6} {'N':>6} {'median':>9} {'min':>9} {'ms/1k rows':>11}")
    medians: dict[str, dict[str, float]] = {}
    for dt in dtypes:
        medians[dt] = {}
        for n in row_counts:
            med = statistics.median(samples[dt][n])
            medians[dt][str(n)] = med
            print(f"{dt:>6} {n:>6} {med:9.2f} {min(samples[dt][n]):9.2f} {med / n * 1e3:11.2f}")
    if args.json:
        args.json.write_text(
            json.dumps({"cpu": cpu_name(), "threads": args.threads, "median_ms": medians, "samples_ms": samples})
        )


if __name__ == "__main__":
    main()
