"""Lanes: N requests drafted in one step, against N single-lane steps and llama.cpp's N-sequence draft.

    python benchmarks/bench_lanes.py                            # small + SmolLM2 drafters, lanes 1,2,4,8, W 64,1024,4096
    python benchmarks/bench_lanes.py --drafters small --lanes 1,4 --windows 64 --reps 6 --json out.json

One steady-state packed draft step at window W for N requests: every request commits `n_new`
(default 9) new context rows and drafts one noise block of q_len tokens [last, mask, ...], logits
(q_len x vocab per request) included and copied to the host.
  lanes      one DraftKvCache(lanes=N, cap=W): step_tokens with a list of N rings / committed /
             token blocks, output="logits" (one graph compute for all N)
  lanes_ids  the same with output="ids" (in-graph argmax, no logits copied; information)
  singles    N single-lane DraftKvCaches, one step_tokens each, one after another: what N requests
             cost without lanes (the time of all N steps)
  llama_fa / llama_nofa  llama.cpp's own DFlash drafter (libllama 0.3.36 in a child process,
             pyggml_dkv.hosts.llama_cpp.native_dflash_child) with n_seq_max = N: every sequence's
             new rows in one llama_process, then all N noise blocks in ONE decode with logits
             for every row, flash attention on / off
Drafters, each written once as a GGUF both sides load (weights q8_0 unless --dtype):
  small      bench_step.py's `small` shape (hidden 1024, 5 layers, 16/4 heads, block 16) with random
             weights and the SmolLM2 vocabulary (49152 tokens)
  smollm2    the shipped SmolLM2-135M drafter (hosts/pretrained) with SmolLM2's token embedding and
             lm_head in the file (llama.cpp's context then needs no target context)
  random-toy / random-small / random-qwen3-8b (with --no-llama)  bench_step.py's shapes, random weights uploaded in
             --dtype, a random 49152-token head and embedding, no GGUF: our side only, on any
             --backend (e.g. cuda:0)

Goals (docs/design.md, "Lanes"): lanes <= 0.5x llama.cpp's best N-sequence draft at every N and
window; lanes cheaper than singles at every N >= 2 (the ratio is printed). Rounds alternate our
side and llama.cpp's so that the machine's noise hits both; within our side, the lanes step and
the N single steps alternate step by step.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from machine import early_option, set_omp_wait_policy  # noqa: E402  (benchmarks/machine.py: standard library only)

# both sides under OpenMP's default wait policy, as in a llama.cpp host (bench_llama_cpp.py says why)
set_omp_wait_policy(early_option(sys.argv[1:], "--omp-wait-policy", os.environ.get("OMP_WAIT_POLICY", "default")))

import numpy as np  # noqa: E402

from bench_llama_cpp import write_drafter  # noqa: E402
from machine import cpu_name  # noqa: E402
from pyggml_dkv import Backend, DraftKvCache, FeatureRing  # noqa: E402
from pyggml_dkv.drafter.backend_weights import upload_matrix, upload_stored  # noqa: E402
from pyggml_dkv.hosts.llama_cpp.native_dflash import llama_cpp_available, llama_dflash_bench  # noqa: E402
from pyggml_dkv.model.weights import DraftWeights  # noqa: E402
from step_config import CONFIGS  # noqa: E402

log = logging.getLogger("bench_lanes")
GOAL_VS_LLAMA = 0.5
VOCAB = 49152


def stats(samples: list[float]) -> dict:
    a = np.asarray(samples) * 1e3
    return {"median_ms": float(np.median(a)), "p10_ms": float(np.percentile(a, 10)), "n": int(a.size)}


def write_smollm2_drafter(dtype: str, out_dir: Path) -> Path:
    """The shipped SmolLM2 drafter with the target's token embedding and lm_head inside."""
    from pyggml_dkv.hosts.llama_cpp.drafters import target_embeddings
    from pyggml_dkv.hosts.llama_cpp.gguf import GGUFFile
    from pyggml_dkv.hosts.pretrained import smollm2_drafter_path
    from pyggml_dkv.hosts.smollm2 import smollm2_gguf

    shipped = DraftWeights.from_pretrained(smollm2_drafter_path())
    embed, head = target_embeddings(GGUFFile(smollm2_gguf()))
    w = DraftWeights(shipped.cfg, dict(shipped), embed_tokens=embed, lm_head=head)
    return w.save_pretrained(out_dir / f"smollm2.{dtype}.gguf", format="gguf", dtype=dtype, vocab_from=smollm2_gguf())


class Ours:
    """Our side for one drafter: weights, token embedding and head uploaded once; from a GGUF
    (`path`) in its stored types, or random weights of a bench_step shape (`shape`) in `dtype`."""

    def __init__(
        self, path: Path | None, threads: int, backend: str = "cpu", shape: str | None = None, dtype: str = "q8_0"
    ) -> None:
        self.backend = Backend(backend, n_threads=threads) if backend == "cpu" else Backend(backend)
        self._owned = []
        if path is not None:
            self.g = DraftWeights.from_pretrained(path)
            self.bw = self.g.to_backend(self.backend, "native")
            self.emb, self.emb_buf = upload_stored(self.backend, self.g.stored["embed_tokens"], "embed_tokens")
            self.head, self.head_buf = upload_stored(
                self.backend, self.g.stored["lm_head"], "lm_head", matmul_only=True
            )
        else:
            from pyggml_dkv import DraftConfig

            cfg = DraftConfig(**CONFIGS[shape], vocab=VOCAB, mask_token_id=2)
            self.g = DraftWeights.random(cfg, seed=0)
            self.bw = self.g.to_backend(self.backend, dtype)
            rng = np.random.default_rng(0)
            emb = rng.standard_normal((VOCAB, cfg.hidden), dtype=np.float32)
            head = rng.standard_normal((VOCAB, cfg.hidden), dtype=np.float32) / np.float32(32)
            self.emb, self.emb_buf = upload_matrix(self.backend, emb, dtype, "embed_tokens")
            self.head, self.head_buf = upload_matrix(self.backend, head, dtype, "lm_head", matmul_only=self.bw.repack)
        self.q_len = self.g.cfg.block_size
        self.tokens = np.full(self.q_len, self.g.cfg.mask_token_id, dtype=np.int32)
        self.tokens[0] = 11
        self.rng = np.random.default_rng(1)

    def _cache(self, cap: int, lanes: int = 1) -> DraftKvCache:
        # without lanes=1 spelled out, a single-lane run also times a package from before lanes
        # (PYTHONPATH=<old checkout>: the A/B of benchmarks/README.md, "Lanes")
        more = {"lanes": lanes} if lanes > 1 else {}
        return DraftKvCache(self.bw, self.backend, cap, lm_head=self.head, embed_tokens=self.emb, **more)

    def run(self, W: int, n: int, n_new: int, reps: int, warmup: int) -> dict[str, list[float]]:
        """Seconds per packed step of n requests at window W: lanes, lanes_ids, singles."""
        n_pos = W + (reps + warmup + 1) * n_new * 3 + 1  # three systems advance it in turn
        # one ring serves every lane (the features' values do not change a step's cost)
        ring = FeatureRing(n_pos, self.g.cfg.fc_in)
        ring.append(self.rng.standard_normal((n_pos, self.g.cfg.fc_in), dtype=np.float32))
        samples: dict[str, list[float]] = {"lanes": [], "lanes_ids": [], "singles": []}
        with self._cache(W, n) as multi:
            singles = [self._cache(W) for _ in range(n)]
            try:
                multi.step_tokens(
                    [ring] * n, [W] * n, [self.tokens] * n, output="logits"
                ) if n > 1 else multi.step_tokens(ring, W, self.tokens, output="logits")
                for c in singles:
                    c.step_tokens(ring, W, self.tokens, output="logits")
                # every cache advances n_new rows at each of its own steps (the multi-lane cache
                # serves two systems): each step folds in the same rows whatever ran before it
                committed = {"multi": W, "singles": W}
                for k in range(warmup + reps):
                    for name in ("lanes", "lanes_ids", "singles"):
                        which = "singles" if name == "singles" else "multi"
                        committed[which] += n_new
                        pos = committed[which]
                        t0 = time.perf_counter()
                        if name == "singles":
                            for c in singles:
                                c.step_tokens(ring, pos, self.tokens, output="logits")
                        elif n == 1:
                            multi.step_tokens(ring, pos, self.tokens, output="ids" if name == "lanes_ids" else "logits")
                        else:
                            multi.step_tokens(
                                [ring] * n,
                                [pos] * n,
                                [self.tokens] * n,
                                output="ids" if name == "lanes_ids" else "logits",
                            )
                        if k >= warmup:
                            samples[name].append(time.perf_counter() - t0)
            finally:
                for c in singles:
                    c.close()
        return samples

    def idle(self, W: int, n: int, n_new: int, reps: int, warmup: int) -> dict[str, list[float]]:
        """What idle lanes cost: an n-lane cache stepping a few active lanes (the others idle)
        against one single-lane step per active lane, at window W."""
        sets = {
            "lane 0": [0],
            f"lanes 0-{n // 2 - 1}": list(range(n // 2)),
            f"lane {n - 1}": [n - 1],
            f"lanes 0, {n - 1}": [0, n - 1],
        }
        n_pos = W + (reps + warmup + 1) * n_new * len(sets) + 1
        ring = FeatureRing(n_pos, self.g.cfg.fc_in)
        ring.append(self.rng.standard_normal((n_pos, self.g.cfg.fc_in), dtype=np.float32))
        samples: dict[str, list[float]] = {name: [] for name in [*sets, "one single-lane step"]}
        with self._cache(W, n) as multi, self._cache(W) as single:
            multi.step_tokens([ring] * n, [W] * n, [self.tokens] * n, output="logits")
            single.step_tokens(ring, W, self.tokens, output="logits")
            # each lane (and the single cache) advances n_new rows at each of its own steps
            committed = [W] * n
            single_at = W
            for k in range(warmup + reps):
                for name in samples:
                    t0 = time.perf_counter()
                    if name in sets:
                        act = sets[name]
                        for i in act:
                            committed[i] += n_new
                        multi.step_tokens(
                            [ring if i in act else None for i in range(n)],
                            [committed[i] if i in act else None for i in range(n)],
                            [self.tokens if i in act else None for i in range(n)],
                            output="logits",
                        )
                    else:
                        single_at += n_new
                        single.step_tokens(ring, single_at, self.tokens, output="logits")
                    if k >= warmup:
                        samples[name].append(time.perf_counter() - t0)
        return samples

    def close(self) -> None:
        for obj in (self.emb_buf, self.emb.ctx, self.head_buf, self.head.ctx, self.bw, self.backend):
            obj.close()


def report(results: dict, args: argparse.Namespace) -> None:
    print(
        f"\nDFlash draft step for N requests: lanes vs N single-lane steps vs llama.cpp's N-sequence draft "
        f"({args.n_new} new rows + one noise block with logits per request)"
    )
    where = f"backend {args.backend}, " if args.backend != "cpu" else ""
    print(f"CPU: {results['cpu']}, {where}{args.threads} threads; median ms (p10)")
    for drafter, runs in results["runs"].items():
        print(f"\n{drafter} drafter, weights {args.dtype}")
        print(
            f"{'N':>3} {'W':>6} {'lanes':>16} {'lanes_ids':>16} {'singles':>16} {'llama_fa':>16} {'llama_nofa':>16}"
            f" {'lanes/singles':>13} {'lanes/llama':>12}"
        )
        for key, res in runs.items():
            n, W = (int(x) for x in key.split("x"))
            cells = [
                f"{res[s]['median_ms']:7.2f} ({res[s]['p10_ms']:6.2f})" if s in res else f"{'-':>16}"
                for s in ("lanes", "lanes_ids", "singles", "llama_fa", "llama_nofa")
            ]
            r_single = res["lanes"]["median_ms"] / res["singles"]["median_ms"]
            llama = [res[s]["median_ms"] for s in ("llama_fa", "llama_nofa") if s in res]
            r_llama = res["lanes"]["median_ms"] / min(llama) if llama else float("nan")
            res["ratios"] = {"lanes_over_singles": r_single, "lanes_over_best_llama": r_llama}
            flag_s = "" if n == 1 else (" ok" if r_single < 1 else " MISS")
            flag_l = "" if not llama else (" ok" if r_llama <= GOAL_VS_LLAMA else " MISS")
            print(f"{n:>3} {W:>6} " + " ".join(cells) + f" {r_single:>10.2f}{flag_s:<3} {r_llama:>8.2f}{flag_l}")
    print(f"\ngoals: lanes / best llama.cpp <= {GOAL_VS_LLAMA} at every N and window; lanes / singles < 1 for N >= 2")


def report_idle(results: dict, args: argparse.Namespace) -> None:
    print(
        f"\nIdle lanes: a {args.idle}-lane cache stepping some lanes, the others idle, against one single-lane "
        f"step (CPU: {results['cpu']}, {args.threads} threads; median ms, and per active lane / one single step)"
    )
    for drafter, runs in results["runs"].items():
        print(f"\n{drafter} drafter, weights {args.dtype}")
        for W, res in runs.items():
            one = res["one single-lane step"]["median_ms"]
            cells = []
            for name, st in res.items():
                if name == "one single-lane step":
                    continue
                n_active = 2 if "," in name else (int(name.split("-")[1]) + 1 if "-" in name else 1)
                cells.append(f"{name}: {st['median_ms']:.2f} ({st['median_ms'] / n_active / one:.2f})")
            print(f"W {W:>5}: one single-lane step {one:.2f} | " + " | ".join(cells))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafters", default="small,smollm2")
    ap.add_argument("--dtype", default="q8_0", help="the GGUFs' weight type (default q8_0)")
    ap.add_argument("--lanes", default="1,2,4,8")
    ap.add_argument("--windows", default="64,1024,4096")
    ap.add_argument("--reps", type=int, default=8, help="timed steps per system and cell, over all rounds")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of our side and llama.cpp's")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--n-new", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", default="cpu", help="our side's backend: cpu, cuda:0, ... (llama.cpp runs on the CPU)")
    ap.add_argument("--no-llama", action="store_true", help="our side only")
    ap.add_argument(
        "--idle",
        type=int,
        default=0,
        metavar="N",
        help="instead: what idle lanes cost in an N-lane cache (our side only)",
    )
    ap.add_argument("--omp-wait-policy", choices=("default", "active", "passive"), default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.drafters = args.drafters.split(",")
    args.lanes = [int(x) for x in args.lanes.split(",")]
    args.windows = [int(x) for x in args.windows.split(",")]
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args = parse_args(argv)
    use_llama = not args.no_llama and not args.idle
    if use_llama and not llama_cpp_available():
        raise SystemExit("llama-cpp-python is not installed (pip install pyggml_dkv[llama]); or pass --no-llama")
    results: dict = {
        "cpu": cpu_name(),
        "threads": args.threads,
        "n_new": args.n_new,
        "dtype": args.dtype,
        "backend": args.backend,
        "load_avg_start": os.getloadavg(),
        "runs": {},
    }
    per_round = max(1, args.reps // args.rounds)
    writers = {
        "small": lambda d: write_drafter(args.dtype, d),
        "smollm2": lambda d: write_smollm2_drafter(args.dtype, d),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for drafter in args.drafters:
            if drafter in writers:
                path: Path | None = writers[drafter](Path(tmp))
                ours = Ours(path, args.threads, args.backend)
            elif drafter.removeprefix("random-") in CONFIGS and drafter.startswith("random-") and not use_llama:
                path = None
                ours = Ours(None, args.threads, args.backend, shape=drafter.removeprefix("random-"), dtype=args.dtype)
            else:
                raise SystemExit(
                    f"unknown drafter {drafter!r} (small, smollm2; or, with --no-llama, "
                    + ", ".join(f"random-{c}" for c in CONFIGS)
                    + ")"
                )
            samples: dict[str, dict[str, list[float]]] = {}
            try:
                for r in range(args.rounds if not args.idle else 0):
                    for n in args.lanes:
                        for W in args.windows:
                            for name, t in ours.run(W, n, args.n_new, per_round, args.warmup).items():
                                samples.setdefault(f"{n}x{W}", {}).setdefault(name, []).extend(t)
                        if path is not None and use_llama:
                            for name, fa in (("llama_fa", True), ("llama_nofa", False)):
                                times = llama_dflash_bench(
                                    path,
                                    args.windows,
                                    fc_in=ours.g.cfg.fc_in,
                                    q_len=ours.q_len,
                                    n_new=args.n_new,
                                    reps=per_round,
                                    warmup=args.warmup,
                                    flash_attn=fa,
                                    threads=args.threads,
                                    timeout=3600,
                                    n_seq=n,
                                )
                                for W, t in times.items():
                                    samples[f"{n}x{W}"].setdefault(name, []).extend(t)
                        log.info(
                            "%s round %d/%d, %d lanes: %s",
                            drafter,
                            r + 1,
                            args.rounds,
                            n,
                            {
                                k: {s: round(1e3 * float(np.median(t)), 1) for s, t in v.items()}
                                for k, v in samples.items()
                                if k.startswith(f"{n}x")
                            },
                        )
                for _ in range(args.rounds if args.idle else 0):
                    for W in args.windows:
                        for name, t in ours.idle(W, args.idle, args.n_new, per_round, args.warmup).items():
                            samples.setdefault(str(W), {}).setdefault(name, []).extend(t)
            finally:
                ours.close()
            results["runs"][drafter] = {k: {s: stats(t) for s, t in v.items()} for k, v in samples.items()}
    if args.idle:
        report_idle(results, args)
    else:
        report(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
