"""A trained drafter in real greedy speculative decoding, against plain decoding and prompt lookup.

    python benchmarks/bench_drafter.py                       # the shipped SmolLM2 drafter, 40 held-out prompts
    python benchmarks/bench_drafter.py --prompts 10 --max-tokens 64 --json out.json --plot out.png

Every system decodes the same held-out prompts (pyggml_dkv.training.prompts.HELD_OUT_PROMPTS,
never trained on) greedily, with the same threads, in one run; per prompt the systems run one
after another in a rotating order so that the machine's noise is shared. Tokens/s are end to end
(prompt processing included) per prompt, summed over prompts. OpenMP's wait policy is left at its
default: llama.cpp's (unpatched) ggml under OMP_WAIT_POLICY=PASSIVE sleeps at every graph node's
barrier, which made one SmolLM2 token cost 19 ms instead of ~7 on two threads here.

  plain        llama-cpp-python's `Llama.create_completion`, temperature 0
  plain_ll     plain greedy decoding on llama-cpp-python's low-level API (our `plain_greedy` on a
               LlamaTarget without capture): no per-token sampling in Python, the fastest plain
  pld4 / pld10 llama-cpp-python with `LlamaPromptLookupDecoding(num_pred_tokens=4 / 10)`
  dflash       our loop (SpeculativeGenerator on LlamaTarget) with the DFlash drafter (ggml Drafter)
  dflash_pmin  the same, drafts cut at the first token the drafter gives p < --p-min
  ngram        our loop with n-gram drafts only (most recent match of the last 3..2 tokens)
  hybrid       our loop: n-gram drafts when the context has a match, DFlash otherwise

Reported per system: tokens per round (accepted + bonus), the acceptance histogram, tokens/s and
the ratios to plain and to plain_ll. Then the cost model: the measured cost of verifying k tokens and of a draft
step, the tokens/s it predicts from the measured acceptance at each draft length, and what it
predicts for a memory-bound target whose verify cost does not grow with k (a GPU).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

from machine import cpu_name  # noqa: E402  (benchmarks/machine.py: this script's folder is on sys.path)
from pyggml_dkv.hosts.llama_cpp import (  # noqa: E402
    GenerationConfig,
    LlamaTarget,
    SpeculativeGenerator,
    compare_to_plain,
    ggml_drafter,
    plain_greedy,
)
from pyggml_dkv.hosts.llama_cpp.ngram import HybridDrafter, NgramDrafter  # noqa: E402
from pyggml_dkv.hosts.pretrained import smollm2_drafter_path  # noqa: E402
from pyggml_dkv.hosts.smollm2 import smollm2_gguf  # noqa: E402
from pyggml_dkv.model.weights import DraftWeights  # noqa: E402
from pyggml_dkv.training.prompts import HELD_OUT_PROMPTS  # noqa: E402

log = logging.getLogger("bench_drafter")
OURS = ("dflash", "dflash_pmin", "ngram", "hybrid")
LLAMA = ("plain", "plain_ll", "pld4", "pld10")
NEAR_TIE = 0.5


class LlamaSystems:
    """llama-cpp-python's own decoding: plain and prompt lookup (one Llama per system)."""

    def __init__(self, model: Path, threads: int, n_ctx: int) -> None:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        def make(draft):
            return llama_cpp.Llama(
                str(model), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, draft_model=draft, verbose=False
            )

        self.llms = {
            "plain": make(None),
            "pld4": make(LlamaPromptLookupDecoding(num_pred_tokens=4)),
            "pld10": make(LlamaPromptLookupDecoding(num_pred_tokens=10)),
        }
        self.lowlevel = LlamaTarget(model, n_ctx=n_ctx, n_threads=threads)

    def run(self, name: str, prompt: list[int], max_tokens: int) -> dict:
        if name == "plain_ll":
            t0 = time.perf_counter()
            res = plain_greedy(self.lowlevel, prompt, max_tokens)
            return {"tokens": int(res.tokens.size), "seconds": time.perf_counter() - t0}
        llm = self.llms[name]
        llm.reset()
        t0 = time.perf_counter()
        out = llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0, top_k=1)
        seconds = time.perf_counter() - t0
        return {"tokens": int(out["usage"]["completion_tokens"]), "seconds": seconds}


def our_run(gen: SpeculativeGenerator, prompt: np.ndarray, max_tokens: int) -> dict:
    res = gen.generate(prompt, GenerationConfig(max_tokens=max_tokens))
    st = res.stats
    return {
        "tokens": int(res.tokens.size),
        "seconds": st.total_s,
        "rounds": len(st.rounds),
        "emitted": sum(r.n_emitted for r in st.rounds),
        "histogram": st.histogram(),
        "drafted": sum(r.n_draft for r in st.rounds),
        "draft_s": sum(r.draft_s for r in st.rounds),
        "verify_s": sum(r.verify_s for r in st.rounds),
        "result": res,
    }


def verify_costs(target: LlamaTarget, prompt: np.ndarray, ks: list[int], reps: int) -> dict[int, float]:
    """Median seconds to decode k tokens with logits for every row after the prompt (then removed)."""
    target.clear()
    target.prefill(prompt)
    n0 = target.n_past
    out = {}
    for k in ks:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            target.decode(np.full(k, 198), logits="all")
            times.append(time.perf_counter() - t0)
            target.truncate(n0)
        out[k] = float(np.median(times))
    return out


def summarise(name: str, runs: list[dict], plain_tps: float | None, plain_ll_tps: float | None = None) -> dict:
    tokens = sum(r["tokens"] for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    row = {"system": name, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
    if "rounds" in runs[0]:
        rounds = sum(r["rounds"] for r in runs)
        row["rounds"] = rounds
        row["tokens_per_round"] = sum(r["emitted"] for r in runs) / max(1, rounds)
        row["histogram"] = np.sum([r["histogram"] for r in runs], axis=0).tolist()
        row["drafted_per_round"] = sum(r["drafted"] for r in runs) / max(1, rounds)
        row["draft_ms"] = 1e3 * sum(r["draft_s"] for r in runs) / max(1, rounds)
        row["verify_ms"] = 1e3 * sum(r["verify_s"] for r in runs) / max(1, rounds)
    if plain_tps:
        row["vs_plain"] = row["tokens_per_s"] / plain_tps
    if plain_ll_tps:
        row["vs_plain_ll"] = row["tokens_per_s"] / plain_ll_tps
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", default=None, help="dflash checkpoint dir or .gguf (default: the shipped one)")
    ap.add_argument("--prompts", type=int, default=len(HELD_OUT_PROMPTS))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--p-min", type=float, default=0.5)
    ap.add_argument("--systems", default=",".join(LLAMA + OURS))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    systems = args.systems.split(",")
    model = smollm2_gguf()
    drafter_path = Path(args.drafter) if args.drafter else smollm2_drafter_path()
    weights = DraftWeights.from_pretrained(drafter_path)
    cfg = weights.cfg
    target = LlamaTarget(model, n_ctx=2048, n_threads=args.threads, capture_layers=cfg.target_layer_ids)
    drafters = {
        "dflash": ggml_drafter(weights, str(model)),
        "dflash_pmin": ggml_drafter(weights, str(model), p_min=args.p_min),
    }
    drafters["ngram"] = NgramDrafter(cfg, drafters["dflash"].vocab)
    drafters["hybrid"] = HybridDrafter(ggml_drafter(weights, str(model)))
    gens = {name: SpeculativeGenerator(target, d) for name, d in drafters.items()}
    llama = LlamaSystems(model, args.threads, 2048) if any(s in LLAMA for s in systems) else None
    prompts = [target.tokenize(target.chat_prompt(p)) for p in HELD_OUT_PROMPTS[: args.prompts]]
    print(
        f"CPU: {cpu_name()}, {args.threads} threads; drafter {drafter_path} (block {cfg.block_size}, "
        f"{cfg.n_layer} layers); {len(prompts)} held-out prompts x {args.max_tokens} tokens",
        flush=True,
    )

    runs: dict[str, list[dict]] = {s: [] for s in systems}
    lossless = {"checked": 0, "identical": 0, "near_tie_divergence": 0, "violations": 0}
    for i, prompt in enumerate(prompts):
        order = systems[i % len(systems) :] + systems[: i % len(systems)]
        for name in order:
            if name in LLAMA:
                runs[name].append(llama.run(name, prompt.tolist(), args.max_tokens))
            else:
                runs[name].append(our_run(gens[name], prompt, args.max_tokens))
        if "dflash" in systems:  # lossless check of our loop against our plain greedy decoding
            plain = plain_greedy(target, prompt, args.max_tokens)
            cmp = compare_to_plain(runs["dflash"][-1]["result"], plain, NEAR_TIE)
            lossless["checked"] += 1
            lossless["identical"] += bool(cmp["identical"] or cmp["first_divergence"] is None)
            lossless["near_tie_divergence"] += bool(cmp["first_divergence"] is not None and cmp["near_tie"])
            lossless["violations"] += not cmp["lossless"]
        log.info("prompt %d/%d done", i + 1, len(prompts))
    plain_tps = summarise("plain", runs["plain"], None)["tokens_per_s"] if "plain" in systems else None
    ll_tps = summarise("plain_ll", runs["plain_ll"], None)["tokens_per_s"] if "plain_ll" in systems else None
    table = [summarise(name, runs[name], plain_tps, ll_tps) for name in systems]
    for r in runs.values():
        for x in r:
            x.pop("result", None)

    print(
        "\n| system | tokens/round | histogram (accepted 0..) | drafted/round | draft ms | verify ms | tokens/s | vs plain | vs plain_ll |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in table:
        print(
            f"| {row['system']} | {row.get('tokens_per_round', float('nan')):.2f} | {row.get('histogram', '')} | "
            f"{row.get('drafted_per_round', float('nan')):.1f} | {row.get('draft_ms', float('nan')):.1f} | "
            f"{row.get('verify_ms', float('nan')):.1f} | {row['tokens_per_s']:.1f} | {row.get('vs_plain', float('nan')):.2f} | "
            f"{row.get('vs_plain_ll', float('nan')):.2f} |"
        )
    print(f"lossless (dflash vs plain greedy): {lossless}")
    if "hybrid" in systems:
        print(f"hybrid rounds: {drafters['hybrid'].rounds}")

    # the cost model: verify cost per k, draft cost, and the speed each draft length would give
    ks = [1, 2, 4, 8, 16]
    costs = verify_costs(target, prompts[0], ks, reps=15)
    dflash_row = next((r for r in table if r["system"] == "dflash"), None)
    model_out = {"verify_ms": {k: 1e3 * v for k, v in costs.items()}}
    print("\nverify cost (ms) for k tokens: " + ", ".join(f"k={k}: {1e3 * v:.1f}" for k, v in costs.items()))
    if dflash_row:
        hist = np.array(dflash_row["histogram"], dtype=np.float64)
        p_acc = hist / hist.sum()  # distribution of accepted drafts with the full draft
        draft_ms = dflash_row["draft_ms"]
        t1 = 1e3 * costs[1]
        print(f"draft step {draft_ms:.1f} ms; plain decoding {t1:.1f} ms/token")
        print(
            "| drafts verified | expected tokens/round | CPU ms/token (measured costs) | vs plain | memory-bound target vs plain |"
        )
        print("|---|---|---|---|---|")
        rows = []
        for d in range(1, cfg.block_size):
            # accepting a of the full draft means min(a, d) of a draft cut to d
            acc = np.arange(hist.size)
            expect = float((np.minimum(acc, d) * p_acc).sum()) + 1.0
            verify = float(np.interp(d + 1, ks, [1e3 * costs[k] for k in ks]))
            cpu = (draft_ms + verify) / expect
            # memory-bound target: verifying d + 1 tokens costs what decoding one does (t1); the draft
            # step keeps its measured cost relative to t1
            mem = (draft_ms + t1) / expect
            rows.append(
                {
                    "d": d,
                    "tokens_per_round": expect,
                    "cpu_ms_per_token": cpu,
                    "cpu_vs_plain": t1 / cpu,
                    "memory_bound_vs_plain": t1 / mem,
                }
            )
            print(f"| {d} | {expect:.2f} | {cpu:.1f} | {t1 / cpu:.2f} | {t1 / mem:.2f} |")
        model_out.update(draft_ms=draft_ms, plain_ms=t1, by_draft_length=rows)
    report = {
        "cpu": cpu_name(),
        "threads": args.threads,
        "drafter": str(drafter_path),
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "table": table,
        "lossless": lossless,
        "cost_model": model_out,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(report, args.plot)
    return 0 if lossless["violations"] == 0 else 1


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    rows = report["table"]
    a.bar([r["system"] for r in rows], [r["tokens_per_s"] for r in rows], color="tab:blue")
    a.set_ylabel("tokens/s (end to end)")
    a.set_title(
        f"SmolLM2-135M greedy, {report['prompts']} held-out prompts\n{report['cpu']}, {report['threads']} threads",
        fontsize=9,
    )
    a.tick_params(axis="x", rotation=30)
    d = next((r for r in rows if r["system"] == "dflash"), None)
    if d:
        h = np.array(d["histogram"], dtype=np.float64)
        b.bar(np.arange(h.size) + 1, h / h.sum(), color="tab:green")
        b.set_xlabel("tokens per round (accepted + 1)")
        b.set_ylabel("fraction of rounds")
        b.set_title(f"DFlash drafter: {d['tokens_per_round']:.2f} tokens/round", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
