"""The lossless check over a prompt set: speculative greedy output against plain one-token greedy
decoding, with the top-2 logit gap at every divergence, and how far a position's logits move
between batch shapes (why a divergence at a near-tie is not a bug).

    python examples/llama_cpp_lossless.py --drafter oracle --max-tokens 64
    python examples/llama_cpp_lossless.py --drafter random --json lossless.json
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import numpy as np

from pyggml_dkv.hosts.llama_cpp import (
    GenerationConfig,
    LlamaTarget,
    OracleDrafter,
    SpeculativeGenerator,
    compare_to_plain,
    ggml_drafter,
    plain_greedy,
    random_smollm2_weights,
    smollm2_draft_config,
    smollm2_gguf,
)

PROMPTS = (
    "Write a short poem about the sea.",
    "List three prime numbers and explain why they are prime.",
    "What is the capital of France? Answer in one sentence.",
    "Explain what a hash table is to a child.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Write a haiku about autumn leaves.",
    "Describe the water cycle in three steps.",
    "What are the benefits of regular exercise?",
    "Tell me a joke about computers.",
    "Summarize the plot of Romeo and Juliet.",
    "How do airplanes stay in the air?",
)


def batch_shape_noise(target: LlamaTarget, prompt: np.ndarray, tokens: np.ndarray, block: int) -> float:
    """max |logit(one-token decode) - logit(same position in a `block`-token batch)| over the generation."""
    seq = np.concatenate([prompt, tokens])
    target.clear()
    target.prefill(prompt)
    single = [np.array(target.decode([t], logits="last")[-1]) for t in tokens[:-1]]
    target.clear()
    target.prefill(prompt)
    batched = []
    for lo in range(prompt.size, seq.size - 1, block):
        batched.extend(np.array(target.decode(seq[lo : min(lo + block, seq.size - 1)], logits="all")))
    return float(max(np.abs(a - b).max() for a, b in zip(single, batched))) if single else 0.0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", choices=("oracle", "random"), default="oracle")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--near-tie", type=float, default=0.5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    model = smollm2_gguf()
    cfg = smollm2_draft_config()
    target = LlamaTarget(model, n_ctx=1024, n_batch=64, n_threads=args.threads, capture_layers=cfg.target_layer_ids)
    if args.drafter == "random":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            weights = random_smollm2_weights(seed=0)
        drafter = ggml_drafter(weights, str(model))
    else:
        drafter = OracleDrafter(cfg, target.n_vocab, [], seed=0)
    gen = SpeculativeGenerator(target, drafter)
    rows, noise = [], []
    for text in PROMPTS:
        prompt = target.tokenize(target.chat_prompt(text))
        plain = plain_greedy(target, prompt, args.max_tokens)
        if isinstance(drafter, OracleDrafter):
            drafter.reference = np.concatenate([prompt, plain.tokens])
        res = gen.generate(prompt, GenerationConfig(max_tokens=args.max_tokens))
        cmp = compare_to_plain(res, plain, args.near_tie)
        noise.append(batch_shape_noise(target, prompt, plain.tokens, cfg.block_size))
        rows.append(
            {
                "prompt": text,
                **cmp,
                "tokens": int(res.tokens.size),
                "tokens_per_round": res.stats.tokens_per_round,
                "min_gap_plain": float(plain.gaps.min()) if plain.gaps.size else None,
            }
        )
        gap = (
            ""
            if cmp["first_divergence"] is None
            else f" diverges at {cmp['first_divergence']}: gaps plain {cmp['gap_plain']:.3f} / spec {cmp['gap_spec']:.3f}"
        )
        print(
            f"{'OK ' if cmp['lossless'] else 'BAD'} {'identical' if cmp['identical'] else 'prefix   '} "
            f"{res.tokens.size:3d} tokens, {res.stats.tokens_per_round:.2f} tok/round{gap}  [{text[:40]}]"
        )
    ok = all(r["lossless"] for r in rows)
    print(
        f"lossless over {len(rows)} prompts: {ok}; identical: {sum(r['identical'] for r in rows)}; "
        f"max batch-shape logit noise (1-token vs {cfg.block_size}-token batches): {max(noise):.3f}"
    )
    if args.json:
        args.json.write_text(json.dumps({"lossless": ok, "prompts": rows, "batch_shape_noise": noise}, indent=2))
    if hasattr(drafter, "close"):
        drafter.close()
    target.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
