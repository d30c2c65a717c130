"""The draft step of the shipped SmolLM2 drafter with the target's real head, by how the head is kept.

    python benchmarks/bench_head.py                  # 5 head variants, 3 rounds of 30 steps
    python benchmarks/bench_head.py --json out.json

Drafter: pyggml_dkv/hosts/pretrained (q8_0 weights, 4 layers, hidden 576, block 8); head and token
embedding: the SmolLM2-135M-Instruct GGUF's (49152 x 576, dequantized from Q4_1 to f32, the values
llama.cpp multiplies). One greedy `Drafter.propose` per step at a window of ~300 tokens, all
variants on the same features and tokens, alternating in rounds (ratios side by side in one run).
Variants: the head as q8_0 (the default next to q8_0 weights), f32, f16, and f32 / f16 through
`lm_head_screen="q8_0"` (exact ids of that head, docs/design.md "Exact draft ids from a screened
head"). Reported: median ms per propose, its ratio to the q8_0 head's, and how many draft ids
equal those of the f32 head (the screened f32 variant must be 100%).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_step.py

import numpy as np  # noqa: E402

from machine import cpu_name  # noqa: E402  (benchmarks/machine.py)
from pyggml_dkv import Backend, Drafter, DraftWeights  # noqa: E402
from pyggml_dkv.hosts.llama_cpp.drafters import target_embeddings  # noqa: E402
from pyggml_dkv.hosts.llama_cpp.gguf import GGUFFile  # noqa: E402
from pyggml_dkv.hosts.pretrained import smollm2_drafter_path  # noqa: E402
from pyggml_dkv.hosts.smollm2 import smollm2_gguf  # noqa: E402

VARIANTS = {
    "head_q8_0": {},
    "head_f32": dict(lm_head_dtype="f32"),
    "head_f16": dict(lm_head_dtype="f16"),
    "head_f32_screened": dict(lm_head_dtype="f32", lm_head_screen="q8_0"),
    "head_f16_screened": dict(lm_head_dtype="f16", lm_head_screen="q8_0"),
}
WINDOW = 300


def run(rounds: int, steps: int, threads: int) -> dict:
    weights = DraftWeights.from_pretrained(smollm2_drafter_path())
    embed, head = target_embeddings(GGUFFile(smollm2_gguf()))
    feats = np.random.default_rng(0).standard_normal((WINDOW + 8, weights.cfg.fc_in)).astype(np.float32)
    times: dict[str, list[float]] = {k: [] for k in VARIANTS}
    equal: dict[str, list[float]] = {k: [] for k in VARIANTS}
    with Backend("cpu", n_threads=threads) as backend:
        drafters = {
            k: Drafter(weights, embed_tokens=embed, lm_head=head, backend=backend, cap=512, weight_dtype="q8_0", **v)
            for k, v in VARIANTS.items()
        }
        try:
            for d in drafters.values():
                d.add_features(feats[:WINDOW])
            for r in range(rounds):
                for step in range(steps):
                    window = WINDOW + step % 5  # a few new rows per step, then back (rewind)
                    drafts = {}
                    for name, d in drafters.items():
                        if d.committed > window:
                            d.rewind(window)
                        d.add_features(feats[d.committed : window])
                        t0 = time.perf_counter()
                        drafts[name] = d.propose(7 + 13 * step)
                        if r or step >= 3:  # the first steps warm up
                            times[name].append(time.perf_counter() - t0)
                    for name, ids in drafts.items():
                        equal[name].append(float(np.mean(ids == drafts["head_f32"])))
        finally:
            for d in drafters.values():
                d.close()
    base = float(np.median(times["head_q8_0"]))
    return {
        "cpu": cpu_name(),
        "threads": threads,
        "window": WINDOW,
        "variants": {
            k: {
                "median_ms": 1e3 * float(np.median(t)),
                "over_q8_0_head": float(np.median(t)) / base,
                "ids_equal_to_f32_head": float(np.mean(equal[k])),
                "n": len(t),
            }
            for k, t in times.items()
        },
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30, help="proposes per variant per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res = run(args.rounds, args.steps, args.threads)
    print(
        f"shipped SmolLM2 drafter (q8_0), SmolLM2 head 49152 x 576, window ~{WINDOW}; {res['cpu']}, "
        f"{args.threads} threads; median ms per greedy propose"
    )
    print(f"{'head':>20} {'ms':>7} {'/ q8_0 head':>12} {'ids equal to f32 head':>22}")
    for name, v in res["variants"].items():
        print(f"{name:>20} {v['median_ms']:7.2f} {v['over_q8_0_head']:12.2f} {100 * v['ids_equal_to_f32_head']:21.1f}%")
    if res["variants"]["head_f32_screened"]["ids_equal_to_f32_head"] != 1.0:
        raise SystemExit("the screened f32 head's drafts differ from the f32 head's")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
