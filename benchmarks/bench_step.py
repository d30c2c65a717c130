"""Step benchmark: one draft step of the ring cache vs the one-shot graph vs PyTorch dflash.

    python benchmarks/bench_step.py --quick                  # < 2 min on 2 cores: toy + small, windows 64/1024
    python benchmarks/bench_step.py --configs small          # the full small config, every window
    python benchmarks/bench_step.py --configs qwen3-8b --reps 5 --json out.json --plot out.png
    python benchmarks/bench_step.py --configs small --profile  # + per-op time of the cache's step graph

The pieces: step_config (configs, systems, targets), step_probes (machine probes, cost model,
roofline, kernels, per-op profiler), step_systems (the timed systems and the Bench), step_report
(ratios, targets, tables, plot); this file parses the command line and runs them.

Systems, each timed for ONE draft step at a context window of W positions:
  kv_f16     DraftKvCache, f16 weights, f16 K/V cache: cache.step(ring, committed, noise)
  kv_q8      DraftKvCache, q8_0 weights (in ggml's AMX buffer on CPUs with AMX), f16 K/V cache
  kv_q8_attbf16  the same with attention="bf16": attention's two products with bf16 inputs on AMX
             tiles (old patch 0009), else on AVX512-BF16 (0011); PyTorch-bf16 precision; left
             out when ggml lacks the patch
  kv_bf16    DraftKvCache, bf16 weights (products on AVX512-BF16 vdpbf16ps with the rows rounded to bf16,
             old patch 0019, where the CPU has it), f16 K/V cache
  kv_q8_generic  (--generic-q8) kv_q8 with its q8_0 weights in the ordinary buffer: ggml's generic
             q8_0 kernels, the path of a CPU without AMX before old patch 0010 (not in the targets)
  raw        kv_f16's step graph alone: cache.next_graph().compute(backend) (the graph step() runs, sized
             for the step's fold-in rows) after begin_step + inp_embed upload
             (so step()/raw shows the host overhead of step(): checks, ring copy, masks, uploads, download)
  oneshot    OneShotDrafter, f16 weights: recomputes features + context K/V of the whole window
             (its graph for a W-row window is built once, before timing, and reused step to step)
  torch_fp32 the PyTorch reference (dflash DFlashDraftModel) on the CPU in float32, with its DynamicCache
  torch_bf16 the same in bfloat16
Every system sees the same weights, the same features and the same noise block.

What one step is. Per step `n_new` (default q_len/2 + 1: half the block accepted + the bonus token)
new context rows are committed and the q_len noise rows are drafted:
  * kv_*: the caches are built with cap=4096 (the production geometry: attention always spans
    kv_total = align_up(4096 + q_len + 1, 32) rows, masks carry the window). Before each timed step
    the cache is rewound by n_new positions (DraftKvCache.rewind: a partial rewind, host
    bookkeeping only, no device work), so every
    timed step folds in exactly n_new rows through the step graph's fold-in path and attends to
    exactly W context positions, like the steady state of a request whose window is W.
    `--cap-per-window` instead builds a cache with cap=W per window and lets committed grow by
    n_new per step (window = min(committed, cap) = W, the ring wraps; nothing internal is touched,
    but the attention span is then W + q_len, not 4096 + q_len).
  * torch_*: dflash_generate's draft call: the DynamicCache holds W - n_new positions, the model gets
    the n_new new feature rows + the noise block (position_ids from W - n_new), the cache is cropped
    back to W (`_crop_to`, as dflash_generate does). The crop back to W - n_new before the next
    step is a view and is not timed.
  * oneshot: step(ring, committed=W, noise): reads the W window rows and recomputes everything.
Systems run interleaved: each repetition steps every system once, in an order rotated per
repetition, so machine noise (other processes, turbo, caches) hits all alike.

Machine probes: memory bandwidth, the roofline's from reading a 512 MiB buffer once (benchmarks/peak_probe.py,
AVX2 loads; a step reads its weights and K/V, it writes back nothing of that size), and, for reference
and where that probe cannot run, a 512 MiB numpy copy (read+write bytes / s); and the dense matmul rate
(a 2048^3 numpy float32 matmul); each trial the best of 1 thread and `--threads` threads (on a shared
or hyperthreaded machine a second thread may not help); measured before and after the runs, the
medians of all trials are used.
Instruction peaks (benchmarks/peak_probe.py): the measured rate of vpdpbusd (AVX512-VNNI), vfmadd231ps
(f32 FMA) and vdpbf16ps (AVX512-BF16) on registers, on `--threads` threads, best of 3, before and after
the runs (median used). On the CPU backend the roofline of each window uses instead the same probes
taken between its steps (peak_probe.PeakSampler, ~2 ms per instruction plus one read of a 512 MiB
buffer, one sample per repetition in the systems' rotation; the medians): a shared VM's speed moves
within seconds, and steps timed in a slow spell were charged against a fast spell's peak. The
figure with the run's peaks stays in the report as "roofline, run's peaks" (info). Where the products run on those instructions (no AMX: the f16 kernel of
old patch 0004 and f32 attention on FMAs, q8_0 on VNNI (0010), attention="bf16" on vdpbf16ps (0011)) the
roofline's compute time is the sum over product kinds of multiply-adds / that instruction's peak;
elsewhere (a CPU with AMX in use: every system; no AVX-512; no compiler for the probe) it is
flops / the numpy matmul rate.
Roofline per window and weight type: max(bytes / bandwidth, compute time) with
  bytes = every weight once (as stored) + the window's K/V (2 * n_layer * W * n_head_kv*head_dim * 2 B)
          + the new feature rows (n_new * fc_in * 4 B)
  flops = 2 * (layer matrices) * q_len                      noise forward
        + 2 * (fc + per-layer wk, wv) * n_new                fold-in of the new rows
        + 2 * 2 * n_head * head_dim * q_len * (W + q_len) * n_layer   attention
(the step graph really folds in a_step = 2*q_len + 2 padded rows: "flops_graph" in the JSON).

Speed targets are printed with PASS/MISS:
  flat          kv_f16 @4096 / @64 <= 1.8                   (small)
  vs recompute  oneshot / kv_f16 @2048 >= 10                (small)
  vs PyTorch    min(torch_fp32, torch_bf16) / min(kv_*) >= 2 at every window (small); the same with
                f32 attention only (kv_f16, kv_q8) is printed as information
  host overhead kv_f16 step() / the graph compute inside it <= 1.10 at every window (small): the
                median over steps of each step()'s own ratio (same call, same moment of the machine);
                the medians' ratio kv_f16 / raw, timed at other moments, is printed as information
  roofline      the best cache (kv_f16 vs roofline(f16), kv_q8 vs roofline(q8_0), kv_q8_attbf16 vs its own with bf16 attention,
                kv_bf16 vs roofline(bf16)) <= 1.5 x its roofline
                at every window (small, qwen3-8b); each weight type's own ratio is shown too
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

# ---------------------------------------------------------------------------- thread env (before numpy)
from machine import early_option, set_omp_wait_policy  # noqa: E402  (benchmarks/machine.py: standard library only)

_THREADS = int(early_option(sys.argv[1:], "--threads", "2"))
for _var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS"):
    os.environ[_var] = str(_THREADS)
# OpenMP (ggml's and torch's) must read this before their runtimes start. With the default
# (spinning) policy, on a machine where other processes compete for the cores, every ggml node
# cost a scheduler slice: toy steps took ~380 ms instead of ~5 ms. See README.
set_omp_wait_policy(early_option(sys.argv[1:], "--omp-wait-policy", os.environ.get("OMP_WAIT_POLICY", "passive")))

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import step_report  # noqa: E402
from machine import cpu_name  # noqa: E402
from peak_probe import probe_peaks, probe_read_bandwidth  # noqa: E402
from pyggml_dkv.ggml import cpu_features, cuda_graph_stats  # noqa: E402
from step_config import (  # noqa: E402
    CAP,
    CONFIGS,
    DEFAULT_ONESHOT_REPS,
    DEFAULT_REPS,
    OPTIONAL_SYSTEMS,
    SYSTEMS,
    TORCH_SYSTEMS,
    WINDOWS,
    log,
)
from step_probes import probe_bandwidth, probe_matmul  # noqa: E402
from step_report import analyse, plot, print_report, targets  # noqa: E402
from step_systems import Bench  # noqa: E402


# ---------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--configs", default="toy,small", help=f"comma list of {','.join(CONFIGS)} (default toy,small)")
    ap.add_argument("--windows", default=",".join(map(str, WINDOWS)), help="comma list of windows, each <= 4096")
    ap.add_argument(
        "--reps",
        type=int,
        default=0,
        help="timed steps per system per window (default per config: "
        + ", ".join(f"{k} {v}" for k, v in DEFAULT_REPS.items())
        + ")",
    )
    ap.add_argument(
        "--oneshot-reps",
        type=int,
        default=0,
        help="timed one-shot steps per window (default per config: "
        + ", ".join(f"{k} {v}" for k, v in DEFAULT_ONESHOT_REPS.items())
        + "; at most --reps)",
    )
    ap.add_argument(
        "--backend",
        default="cpu",
        help="ggml backend of the cache and one-shot systems: cpu, cuda, cuda:N "
        "(GGML_CUDA_DISABLE_GRAPHS=1 in the environment turns CUDA graphs off for comparison)",
    )
    ap.add_argument("--threads", type=int, default=2, help="ggml, torch and BLAS threads (default 2)")
    ap.add_argument(
        "--omp-wait-policy",
        choices=("passive", "active", "default"),
        default=None,
        help="OMP_WAIT_POLICY for ggml's and torch's OpenMP threads (default: $OMP_WAIT_POLICY if set, "
        "else passive; 'default' leaves it unset). Spinning threads wreck the timings on a "
        "machine shared with other processes",
    )
    ap.add_argument("--n-new", type=int, default=0, help="context rows committed per step (default q_len/2 + 1)")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch reference")
    ap.add_argument(
        "--generic-q8",
        action="store_true",
        help="also time kv_q8_generic: q8_0 weights on ggml's generic kernels (no AMX / VNNI repacking)",
    )
    ap.add_argument("--skip", default="", help=f"comma list of systems to leave out ({','.join(SYSTEMS)})")
    ap.add_argument(
        "--cap-per-window",
        action="store_true",
        help="kv caches built with cap=W per window, committed growing (default: cap 4096 + rewind)",
    )
    ap.add_argument("--profile", action="store_true", help="also time every op of the cache's step graph")
    ap.add_argument("--profile-reps", type=int, default=5, help="per-op profile repetitions (min per node is kept)")
    ap.add_argument(
        "--profile-threads",
        type=int,
        default=0,
        help="threads of the per-op profile (default --threads; 1 is steadier on a shared machine: "
        "every node ends in a thread barrier that a descheduled thread stalls)",
    )
    ap.add_argument(
        "--stat",
        choices=("median", "p10", "min"),
        default="median",
        help="statistic the ratios, roofline checks and targets use (default median; on a machine shared "
        "with other processes p10 or min show the code's own cost better)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run (< 2 min on 2 cores): toy + small, windows 64,1024, 4 reps, torch fp32 only",
    )
    ap.add_argument("--json", help="write every sample and figure to this JSON file")
    ap.add_argument("--plot", help="write a latency-vs-window PNG (needs matplotlib)")
    args = ap.parse_args(argv)
    if args.quick:
        args.configs = "toy,small"
        args.windows = "64,1024"
        args.reps = args.reps or 4
        args.oneshot_reps = args.oneshot_reps or 2
        args.skip = ",".join(filter(None, [args.skip, "torch_bf16"]))
    args.config_list = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in args.config_list:
        if c not in CONFIGS:
            ap.error(f"unknown config {c!r}; choose from {list(CONFIGS)}")
    args.windows = sorted({int(w) for w in str(args.windows).split(",") if w.strip()})
    if not args.windows or min(args.windows) < 1 or max(args.windows) > CAP:
        ap.error(f"windows must be in [1, {CAP}]")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    bad = skip - set(SYSTEMS)
    if bad:
        ap.error(f"unknown system(s) in --skip: {sorted(bad)}")
    args.systems = [
        s
        for s in SYSTEMS
        if s not in skip
        and not (args.no_torch and s in TORCH_SYSTEMS)
        and (s not in OPTIONAL_SYSTEMS or args.generic_q8)
    ]
    if args.systems and not args.no_torch and any(s in TORCH_SYSTEMS for s in args.systems):
        try:
            import _torch_ref  # noqa: F401
        except ImportError as e:
            log(f"PyTorch reference unavailable ({e}): running without it")
            args.systems = [s for s in args.systems if s not in TORCH_SYSTEMS]
    return args


def machine_info(args: argparse.Namespace) -> dict:
    from pyggml_dkv.ggml import version

    info = {
        "cpu": cpu_name(),
        "n_cpus": os.cpu_count(),
        "threads": args.threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "ggml": version(),
    }
    if any(s in TORCH_SYSTEMS for s in args.systems):
        import torch

        torch.set_num_threads(args.threads)
        info["torch"] = torch.__version__
    return info


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    step_report.STAT = args.stat  # the statistic every ratio and table uses
    t_start = time.perf_counter()
    machine = machine_info(args)
    log("probing memory bandwidth and matmul rate ...")
    bw = probe_bandwidth(args.threads)
    rd = probe_read_bandwidth(args.threads)
    mm = probe_matmul(args.threads)
    peaks = [probe_peaks(args.threads)] if args.backend == "cpu" else []
    results = []
    for name in args.config_list:
        results.append(Bench(name, args, args.systems).run())
        gc.collect()
    bw += probe_bandwidth(args.threads)
    if rd is not None:
        rd += probe_read_bandwidth(args.threads) or []
    mm += probe_matmul(args.threads)
    if peaks:
        peaks.append(probe_peaks(args.threads))
        machine["peaks_gmacs"] = {
            k: (float(np.median([p[k] for p in peaks])) if all(p[k] for p in peaks) else None) for k in peaks[0]
        }
        machine["peaks_samples_gmacs"] = peaks  # before and after the run: a VM's speed can move meanwhile
    machine["cpu_features"] = cpu_features()
    # the roofline's bandwidth: the read stream's where it could be probed (a step reads its bytes),
    # else the copy's
    machine.update(
        {
            "bandwidth_gbs": float(np.median(rd if rd else bw)),
            "bandwidth_source": "read" if rd else "copy",
            "copy_bandwidth_gbs": float(np.median(bw)),
            "copy_bandwidth_samples_gbs": bw,
            "read_bandwidth_samples_gbs": rd,
            "matmul_gflops": float(np.median(mm)),
            "matmul_samples_gflops": mm,
        }
    )
    for r in results:
        analyse(r, machine)
        r["targets"] = targets(r)
    machine["total_seconds"] = time.perf_counter() - t_start
    machine["backend"] = args.backend
    machine["cuda_graph_stats"] = cuda_graph_stats()  # what ggml's CUDA backend said about CUDA graphs
    machine["cuda_graphs_disabled"] = bool(os.environ.get("GGML_CUDA_DISABLE_GRAPHS"))
    print_report(results, machine, args)
    applicable = [t for r in results for t in r["targets"] if t["applies"] and t["ok"] is not None]
    print(
        f"\n{sum(t['ok'] for t in applicable)}/{len(applicable)} applicable targets met; "
        f"total run time {machine['total_seconds']:.0f} s"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"machine": machine, "args": {k: v for k, v in vars(args).items()}, "results": results}, indent=1
            )
        )
        log(f"JSON written to {args.json}")
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
