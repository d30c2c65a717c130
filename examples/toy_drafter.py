"""Lossless speculative decoding with a DFlash drafter on the ring cache, against a toy target.

    python examples/toy_drafter.py                  # random toy drafter, CPU backend
    python examples/toy_drafter.py --checkpoint DIR # a DFlash checkpoint whose shape fits the toy target
    python examples/toy_drafter.py --json out.json  # machine-readable report

Each round: the Drafter proposes block_size-1 tokens after the last accepted one (one graph
compute), the target verifies them in one forward pass, the longest matching prefix plus the
target's bonus token is accepted, the accepted tokens' features are committed to the drafter and
the target's KV cache is rewound past the rejected ones. The generated text must be identical to
plain greedy decoding of the target (the script exits 1 otherwise). With the random drafter few
drafts are accepted; the point is the machinery, the latency and the lossless check.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# numpy's BLAS threads would fight ggml's for the cores; the toy target's matmuls are small
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from toy_target import ToyTarget, ToyTargetConfig  # noqa: E402

from pyggml_dkv import Backend, DraftConfig, Drafter, DraftWeights, OneShotDrafter  # noqa: E402


@dataclass
class Report:
    tokens: list[int]
    lossless: bool
    rounds: int
    accepted_per_round: list[int] = field(default_factory=list)
    draft_ms: list[float] = field(default_factory=list)
    oneshot_ms: list[float] = field(default_factory=list)
    verify_ms: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> dict:
        acc = np.array(self.accepted_per_round or [0])
        return {
            "new_tokens": len(self.tokens),
            "lossless": self.lossless,
            "rounds": self.rounds,
            "mean_accepted_drafts_per_round": float(acc.mean()),
            "tokens_per_round": len(self.tokens) / max(self.rounds, 1),
            "acceptance_histogram": np.bincount(acc).tolist(),
            "draft_ms_median_cache": float(np.median(self.draft_ms)) if self.draft_ms else None,
            "draft_ms_median_oneshot": float(np.median(self.oneshot_ms)) if self.oneshot_ms else None,
            "verify_ms_median": float(np.median(self.verify_ms)) if self.verify_ms else None,
            "tokens_per_second": len(self.tokens) / self.seconds if self.seconds else None,
        }


def speculative_decode(
    target: ToyTarget,
    drafter,
    prompt: list[int],
    n_new: int,
    oneshot: OneShotDrafter | None = None,
    progress: bool = False,
) -> Report:
    """Greedy speculative decoding; `drafter` needs add_features(rows), propose(last), committed, reset()."""
    target.truncate(0)
    drafter.reset()
    start = time.perf_counter()
    logits, feats = target.forward(prompt)
    drafter.add_features(feats)
    last = int(np.argmax(logits[-1]))  # the bonus token of the prompt pass: accepted, no features yet
    out = [last]
    report = Report(tokens=out, lossless=False, rounds=0)
    while len(out) < n_new:
        t0 = time.perf_counter()
        draft = [int(t) for t in drafter.propose(last)]
        report.draft_ms.append((time.perf_counter() - t0) * 1e3)
        if oneshot is not None:
            t0 = time.perf_counter()
            noise = drafter.noise_embed(last)
            oneshot.step(drafter.ring, drafter.committed, noise)
            report.oneshot_ms.append((time.perf_counter() - t0) * 1e3)
        # verify [last, d1, ..., d_{q-1}] in one target pass: prediction i follows token i
        n_before = target.n_past
        t0 = time.perf_counter()
        logits, feats = target.forward([last, *draft])
        report.verify_ms.append((time.perf_counter() - t0) * 1e3)
        pred = logits.argmax(axis=1)
        k = 0
        while k < len(draft) and draft[k] == int(pred[k]):
            k += 1
        # commit `last` and the k accepted drafts; the target's token after them is the bonus
        target.truncate(n_before + k + 1)
        drafter.add_features(feats[: k + 1])
        accepted = draft[:k] + [int(pred[k])]
        out.extend(accepted)
        last = accepted[-1]
        report.rounds += 1
        report.accepted_per_round.append(k)
        if progress and report.rounds % 10 == 0:
            print(
                f"\r  {min(len(out), n_new)}/{n_new} tokens, {report.rounds} rounds",
                end="",
                file=sys.stderr,
                flush=True,
            )
    if progress:
        print(file=sys.stderr)
    # end-to-end time of speculative decoding itself, without the side-by-side one-shot timing
    report.seconds = time.perf_counter() - start - sum(report.oneshot_ms) / 1e3
    del out[n_new:]
    return report


def drafter_config(tcfg: ToyTargetConfig, block_size: int) -> DraftConfig:
    return DraftConfig(
        hidden=tcfg.hidden,
        n_layer=2,
        n_head=4,
        n_head_kv=2,
        head_dim=64,
        ffn=512,
        block_size=block_size,
        n_target_layers=len(tcfg.captured_layers),
        mask_token_id=tcfg.vocab - 1,
        vocab=tcfg.vocab,
        target_layer_ids=list(tcfg.captured_layers),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cpu", help="cpu, cuda, cuda:N (default cpu)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: all)")
    ap.add_argument("--cap", type=int, default=256, help="drafter window / ring cache capacity")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint", type=Path, default=None, help="DFlash drafter checkpoint directory")
    ap.add_argument("--weight-dtype", default="f16", choices=["f32", "f16", "bf16", "q8_0"])
    ap.add_argument("--no-oneshot", action="store_true", help="skip the one-shot latency comparison")
    ap.add_argument("--json", type=Path, default=None, help="write the report as JSON here")
    args = ap.parse_args(argv)

    tcfg = ToyTargetConfig()
    target = ToyTarget(tcfg, seed=args.seed)
    if args.checkpoint:
        weights = DraftWeights.from_pretrained(args.checkpoint)
        if weights.cfg.hidden != tcfg.hidden or weights.cfg.fc_in != tcfg.fc_in:
            print(
                f"checkpoint hidden={weights.cfg.hidden}, fc_in={weights.cfg.fc_in} does not fit the toy target "
                f"(hidden={tcfg.hidden}, fc_in={tcfg.fc_in})",
                file=sys.stderr,
            )
            return 2
    else:
        weights = DraftWeights.random(drafter_config(tcfg, args.block_size), seed=args.seed)

    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, tcfg.vocab - 1, size=args.prompt_len).tolist()
    backend = Backend(args.backend, n_threads=args.threads) if args.backend == "cpu" else Backend(args.backend)
    with (
        backend,
        Drafter(
            weights,
            embed_tokens=target.embed_tokens,
            lm_head=target.lm_head,
            backend=backend,
            cap=args.cap,
            weight_dtype=args.weight_dtype,
        ) as drafter,
    ):
        oneshot = (
            None if args.no_oneshot else OneShotDrafter(drafter.weights, backend, args.cap, lm_head=target.lm_head)
        )
        print(
            f"pyggml_dkv toy drafter: backend={backend.name}, cap={args.cap}, block={weights.cfg.block_size}, "
            f"weights={args.weight_dtype}, {args.max_new_tokens} new tokens",
            file=sys.stderr,
        )
        report = speculative_decode(
            target, drafter, prompt, args.max_new_tokens, oneshot, progress=args.max_new_tokens >= 100
        )
        if oneshot is not None:
            oneshot.close()
    truth = target.greedy(prompt, args.max_new_tokens)
    report.lossless = report.tokens == truth
    s = report.summary()
    print(f"lossless (identical to greedy decoding): {s['lossless']}")
    print(
        f"rounds: {s['rounds']}, tokens/round: {s['tokens_per_round']:.2f}, "
        f"accepted drafts/round: {s['mean_accepted_drafts_per_round']:.2f}, histogram {s['acceptance_histogram']}"
    )
    line = f"draft latency per step (median): ring cache {s['draft_ms_median_cache']:.2f} ms"
    if s["draft_ms_median_oneshot"] is not None:
        line += f", one-shot recompute {s['draft_ms_median_oneshot']:.2f} ms ({s['draft_ms_median_oneshot'] / s['draft_ms_median_cache']:.1f}x)"
    print(line)
    print(f"target verify (median): {s['verify_ms_median']:.2f} ms; end to end: {s['tokens_per_second']:.0f} tokens/s")
    if args.json:
        args.json.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **s, "tokens": report.tokens}, indent=2)
        )
    if not report.lossless:
        first = next(i for i, (a, b) in enumerate(zip(report.tokens + [-1], truth)) if a != b)
        print(f"MISMATCH with greedy decoding at token {first}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
