"""Two builds of pyggml_dkv side by side: the same benchmark run by each checkout's interpreter in
alternating processes, so both see the same machine state; per system and window the median over
all rounds of each side, and new / old.

    python benchmarks/ab_builds.py --old ../main --new . --rounds 4
    python benchmarks/ab_builds.py --old ../main --new . --bench llama_cpp --dtypes f16,q8_0
    python benchmarks/ab_builds.py --old ../main --new . --bench bulk --windows 512,2048 --dtypes q8_0,f16

`--old` / `--new`: checkouts, each with its own `.venv` (its ggml built and installed). The step
benchmark is `bench_step.py --configs small` (the kv systems; no PyTorch); the llama.cpp one is
`bench_llama_cpp.py` (ours and llama.cpp's drafter, which is the same on both sides: its ratio
moving says the machine moved). Each checkout runs its own copy of the script. The step benchmark
runs with OpenMP's default wait policy (as in a llama.cpp host), not bench_step.py's own default
(PASSIVE). The bulk one is `bench_bulk_append.py` (an empty cache brought up to N rows; `--windows`
gives the row counts); a checkout older than that script gets a copy of this one's. `--verbose`
prints each process's median: the first processes of a run are often slower.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from machine import cpu_family_model, cpu_name


def run_side(root: Path, bench: str, args: argparse.Namespace, out: Path) -> None:
    python = root / ".venv/bin/python"
    if bench == "step":
        cmd = [
            str(python),
            "benchmarks/bench_step.py",
            "--configs",
            "small",
            "--windows",
            args.windows,
            "--reps",
            str(args.reps),
            "--no-torch",
            "--skip",
            "raw,oneshot",
            "--threads",
            str(args.threads),
            "--omp-wait-policy",
            "default",
            "--json",
            str(out),
        ]
    elif bench == "bulk":
        script = root / "benchmarks/bench_bulk_append.py"
        if not script.exists():  # an older checkout: the same script, its own build
            shutil.copy(Path(__file__).with_name(script.name), script)
        cmd = [
            str(python),
            "benchmarks/bench_bulk_append.py",
            "--dtypes",
            args.dtypes,
            "--rows",
            args.windows,
            "--reps",
            str(args.reps),
            "--threads",
            str(args.threads),
            "--json",
            str(out),
        ]
    else:
        cmd = [
            str(python),
            "benchmarks/bench_llama_cpp.py",
            "--dtypes",
            args.dtypes,
            "--windows",
            args.windows,
            "--reps",
            str(args.reps),
            "--rounds",
            "1",
            "--threads",
            str(args.threads),
            "--json",
            str(out),
        ]
    subprocess.run(cmd, cwd=root, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def medians(bench: str, path: Path) -> dict[tuple[str, int], float]:
    """(system, window) -> median ms of one run's JSON."""
    data = json.loads(path.read_text())
    out: dict[tuple[str, int], float] = {}
    if bench == "step":
        for result in data["results"]:
            for w in result["windows"]:
                for name, s in w["systems"].items():
                    out[(name, int(w["window"]))] = s["median_ms"]
    elif bench == "bulk":
        for dtype, by_rows in data["median_ms"].items():
            for rows, ms in by_rows.items():
                out[(f"{dtype} bulk append", int(rows))] = ms
    else:
        for dtype, systems in data["runs"].items():
            for name, by_w in systems.items():
                for window, s in by_w.items():
                    if "median_ms" in s:  # not the "ratios" entry
                        out[(f"{dtype} {name}", int(window))] = s["median_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", type=Path, required=True, help="checkout of the reference build")
    ap.add_argument("--new", type=Path, required=True, help="checkout of the build under test")
    ap.add_argument("--bench", choices=("step", "llama_cpp", "bulk"), default="step")
    ap.add_argument("--windows", default="64,1024,4096", help="windows (bulk: rows appended)")
    ap.add_argument("--dtypes", default="f16,q8_0", help="(llama_cpp) GGUF weight types, (bulk) weight types")
    ap.add_argument("--reps", type=int, default=10, help="timed steps per system and window in one process")
    ap.add_argument("--rounds", type=int, default=4, help="processes per side, alternating")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--verbose", action="store_true", help="also print each process's median")
    args = ap.parse_args()
    sides = {"old": args.old.resolve(), "new": args.new.resolve()}
    runs: dict[str, list[dict[tuple[str, int], float]]] = {"old": [], "new": []}
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = ("old", "new") if r % 2 == 0 else ("new", "old")
            for side in order:
                out = Path(tmp) / f"{side}{r}.json"
                try:
                    run_side(sides[side], args.bench, args, out)
                except subprocess.CalledProcessError as e:
                    sys.exit(f"{side} ({sides[side]}) failed:\n{e.stderr[-3000:]}")
                runs[side].append(medians(args.bench, out))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    keys = sorted(set(runs["old"][0]) & set(runs["new"][0]), key=lambda k: (k[0], k[1]))
    table = []
    print(f"\n{args.bench}: new {sides['new']} vs old {sides['old']}")
    cpu = f"{cpu_name()} ({cpu_family_model()})"
    print(
        f"CPU: {cpu}, {args.threads} threads, load average {load_start[0]:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end; median ms over {args.rounds} rounds of per-process medians"
    )
    print(f"{'system':>28} {'W':>6} {'old':>9} {'new':>9} {'new/old':>8}")
    for key in keys:
        old = statistics.median(run[key] for run in runs["old"])
        new = statistics.median(run[key] for run in runs["new"])
        table.append({"system": key[0], "window": key[1], "old_ms": old, "new_ms": new, "ratio": new / old})
        print(f"{key[0]:>28} {key[1]:>6} {old:9.2f} {new:9.2f} {new / old:8.2f}")
        if args.verbose:
            for side in ("old", "new"):
                print(f"{'':>36}{side}: " + " ".join(f"{run[key]:.2f}" for run in runs[side]))
    if args.json:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"cpu": cpu, "args": settings, "rows": table}, indent=1))


if __name__ == "__main__":
    main()
