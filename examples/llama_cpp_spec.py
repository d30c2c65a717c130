"""Speculative decoding inside a llama-cpp-python host: llama.cpp runs the target, a DFlash
drafter drafts, the target verifies. Prints the text, the lossless check against plain greedy
decoding of the same prompt in the same run, the acceptance histogram and tokens/s. (The short
version, llama-cpp-python's own Llama with the drafter attached: examples/llama_cpp_quickstart.py.)

    pip install -e ".[llama]"
    python examples/llama_cpp_spec.py                         # SmolLM2-135M target, the shipped trained drafter
    python examples/llama_cpp_spec.py --drafter random        # random drafter weights (nothing accepted)
    python examples/llama_cpp_spec.py --drafter oracle        # the target's own continuation as drafts
    python examples/llama_cpp_spec.py --hybrid --p-min 0.5    # n-gram drafts when the context repeats; cut unsure drafts
    python examples/llama_cpp_spec.py --lm-head-screen        # the target's head kept f32, exact drafts at a q8_0 head's cost
    python examples/llama_cpp_spec.py --drafter CKPT_DIR      # a DFlash checkpoint (dflash format, or a dflash .gguf)
    python examples/llama_cpp_spec.py --json out.json --max-tokens 128 --temperature 0.8

--drafter: a dflash checkpoint directory or a llama.cpp dflash .gguf; `oracle` (plain greedy output of the target, cut at random
lengths: shows the loop at high acceptance); `random` (random weights of the SmolLM2 drafter shape:
drafts are rejected, and the output must still be lossless); default: the drafter trained for
SmolLM2-135M-Instruct that ships with the package (pyggml_dkv/hosts/pretrained/RECIPE.md).
--engine: `ggml` (default) runs pyggml_dkv's Drafter (ring cache) in this process; `remote` runs it
in a child process; `reference` the numpy reference drafter (slow).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from pyggml_dkv import DraftWeights  # noqa: E402
from pyggml_dkv.hosts.llama_cpp import (  # noqa: E402
    GenerationConfig,
    GGUFFile,
    HybridDrafter,
    LlamaTarget,
    OracleDrafter,
    ReferenceDrafter,
    RemoteDrafter,
    SpeculativeGenerator,
    check_fits_gguf,
    compare_to_plain,
    ggml_drafter,
    plain_greedy,
    random_smollm2_weights,
    smollm2_draft_config,
    smollm2_drafter_path,
    smollm2_gguf,
    target_embeddings,
)

NEAR_TIE = 0.5  # top-2 logit gap under which batch-shape rounding may flip the argmax (SmolLM2 Q4_1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="target GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument(
        "--drafter",
        default=None,
        help="dflash checkpoint dir or .gguf, 'oracle', 'random'; default: the shipped SmolLM2 drafter",
    )
    ap.add_argument(
        "--p-min", type=float, default=0.0, help="cut greedy drafts at the first token the drafter gives p < P_MIN"
    )
    ap.add_argument(
        "--hybrid", action="store_true", help="n-gram drafts when the context has a match, DFlash otherwise"
    )
    ap.add_argument(
        "--lm-head-screen",
        action="store_true",
        help="the target's head kept f32, greedy drafts found through a q8_0 screen (exact ids at "
        "about a q8_0 head's cost; sampling and --p-min read the full head; ggml engine)",
    )
    ap.add_argument("--engine", choices=("ggml", "remote", "reference"), default="ggml")
    ap.add_argument("--prompt", default="Write a short story about a robot who learns to paint.")
    ap.add_argument("--raw", action="store_true", help="use the prompt as is, not in the chat template")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=None, help="drafter block size (default: the drafter's)")
    ap.add_argument("--cap", type=int, default=4096, help="drafter context window")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args(argv)


def build_drafter(args: argparse.Namespace, gguf: GGUFFile, reference_tokens: np.ndarray):
    """The drafter and a one-line description."""
    if args.drafter == "oracle":
        cfg = smollm2_draft_config(**({"block_size": args.block_size} if args.block_size else {}))
        return OracleDrafter(cfg, int(gguf.arch_value("vocab_size")), reference_tokens, seed=args.seed), "oracle"
    if args.drafter == "random":
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            weights = random_smollm2_weights(
                seed=args.seed, **({"block_size": args.block_size} if args.block_size else {})
            )
        what = "random weights (SmolLM2 drafter shape)"
    else:
        path = Path(args.drafter) if args.drafter else smollm2_drafter_path()
        weights = DraftWeights.from_pretrained(path)  # a dflash checkpoint directory or a dflash .gguf
        if args.block_size:
            weights = DraftWeights(weights.cfg.replace(block_size=args.block_size), dict(weights))
        what = f"{'GGUF' if path.suffix == '.gguf' else 'checkpoint'} {path}"
    embed, head = target_embeddings(gguf)
    check_fits_gguf(weights.cfg, head.shape[0], gguf)
    engine = args.engine
    if engine == "ggml":
        screen = dict(lm_head_dtype="f32", lm_head_screen="q8_0") if args.lm_head_screen else {}
        drafter = ggml_drafter(weights, str(gguf.path), cap=args.cap, p_min=args.p_min, **screen)
        what += f", pyggml_dkv Drafter{f', p_min {args.p_min}' if args.p_min else ''}"
        what += ", f32 lm_head through a q8_0 screen" if args.lm_head_screen else ""
        if args.hybrid:
            return HybridDrafter(drafter), what + ", hybrid with n-gram drafts"
        return drafter, what
    if engine == "remote":
        drafter = RemoteDrafter(weights, str(gguf.path), cap=args.cap, n_threads=args.threads)
        return drafter, f"{what}, pyggml_dkv Drafter in a child process"
    return ReferenceDrafter(weights, embed, head, cap=args.cap), f"{what}, numpy reference drafter"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (args.hybrid or args.p_min) and (args.engine != "ggml" or args.drafter == "oracle"):
        raise SystemExit("--hybrid and --p-min go with the ggml engine and a DFlash drafter")
    if args.hybrid and args.temperature != 0:
        raise SystemExit("--hybrid drafts for greedy decoding only (--temperature 0)")
    if args.lm_head_screen and (args.engine != "ggml" or args.drafter == "oracle"):
        raise SystemExit("--lm-head-screen goes with the ggml engine and a DFlash drafter")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    model = args.model or smollm2_gguf()
    gguf = GGUFFile(model)

    # plain one-token greedy decoding first (no capture): the baseline and the oracle's source
    with LlamaTarget(model, n_ctx=args.n_ctx, n_threads=args.threads) as plain_target:
        prompt = plain_target.tokenize(args.prompt if args.raw else plain_target.chat_prompt(args.prompt))
        plain = plain_greedy(plain_target, prompt, args.max_tokens)
    drafter, what = build_drafter(args, gguf, np.concatenate([prompt, plain.tokens]))
    print(
        f"target {model.name}, drafter: {what}, block size {drafter.cfg.block_size}, "
        f"layers {list(drafter.cfg.target_layer_ids)}",
        file=sys.stderr,
    )

    target = LlamaTarget(model, n_ctx=args.n_ctx, n_threads=args.threads, capture_layers=drafter.cfg.target_layer_ids)
    gen = SpeculativeGenerator(target, drafter)
    cfg = GenerationConfig(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
    )
    t0 = time.perf_counter()
    for i, _ in enumerate(gen.stream(prompt, cfg), 1):
        rounds = len(gen.stats.rounds) if gen.stats else 0
        print(
            f"\r[{i}/{args.max_tokens} tokens, {rounds} rounds, {i / (time.perf_counter() - t0):.1f} tokens/s]",
            end="",
            file=sys.stderr,
            flush=True,
        )
    print(file=sys.stderr)
    res = gen.last_result
    assert res is not None
    st = res.stats

    print(target.detokenize(res.tokens))
    print("---")
    if args.temperature == 0:
        cmp = compare_to_plain(res, plain, NEAR_TIE)
        if cmp["identical"]:
            verdict = "identical to plain greedy decoding"
        elif cmp["first_divergence"] is None:
            verdict = f"agrees with plain greedy decoding over all {cmp['agree_tokens']} common tokens"
        else:
            verdict = (
                f"agrees with plain greedy for {cmp['agree_tokens']} tokens, then diverges at a "
                f"{'near-tie' if cmp['near_tie'] else 'NON-tie'} (top-2 gap plain {cmp['gap_plain']:.3f}, "
                f"speculative {cmp['gap_spec']:.3f})"
            )
        lossless = bool(cmp["lossless"])
    else:
        cmp, lossless = None, None
        verdict = "n/a at temperature > 0 (rejection sampling: each token distributed as the target's)"
    print(f"lossless: {lossless} ({verdict})")
    print(
        f"finish: {res.finish_reason}; rounds: {len(st.rounds)}, tokens/round: {st.tokens_per_round:.2f}, "
        f"acceptance histogram {st.histogram()}"
    )
    split = st.time_split()
    print(
        "time: "
        + ", ".join(f"{k[:-2]} {1e3 * v:.0f} ms" for k, v in split.items())
        + f"; prefill {1e3 * st.prefill_s:.0f} ms"
    )
    print(
        f"speculative {st.tokens_per_s:.1f} tokens/s vs plain {plain.tokens_per_s:.1f} tokens/s "
        f"({st.tokens_per_s / plain.tokens_per_s:.2f}x)"
    )
    if args.json:
        report = {
            "lossless": lossless,
            "comparison": cmp,
            "n_tokens": int(res.tokens.size),
            "tokens_per_round": st.tokens_per_round,
            "tokens_per_s": st.tokens_per_s,
            "plain_tokens_per_s": plain.tokens_per_s,
            "rounds": len(st.rounds),
            "finish_reason": res.finish_reason,
            "drafter": what,
            "model": str(model),
            "stats": st.to_dict(),
            "capture_route": target.capture.route,
        }
        args.json.write_text(json.dumps(report, indent=2))
    target.close()
    if hasattr(drafter, "close"):
        drafter.close()
    return 0 if lossless is not False else 1


if __name__ == "__main__":
    sys.exit(main())
