"""Command line: `python -m pyggml_dkv.training {generate,train,evaluate,export,pack,gpu-run} ...`
(docs/training.md)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def cmd_generate(args: argparse.Namespace) -> int:
    from ..hosts.llama_cpp.drafters import SMOLLM2_LAYER_IDS
    from ..hosts.smollm2 import smollm2_gguf
    from .data import DataRecipe, generate
    from .prompts import HELD_OUT_PROMPTS, training_prompts

    recipe = DataRecipe(
        model=str(args.model or smollm2_gguf()),
        layer_ids=list(args.layers or SMOLLM2_LAYER_IDS),
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        prompt_seed=args.prompt_seed,
        prompt_set="held-out" if args.held_out else "training",
    )
    prompts = list(HELD_OUT_PROMPTS) if args.held_out else training_prompts(args.prompt_seed)
    prompts = prompts[: args.prompts]
    counts = generate(args.out, prompts, recipe, kinds=args.kinds, minutes=args.minutes, n_threads=args.threads)
    logging.getLogger(__name__).info("generated %s", counts)
    return 0


# --dflash2: the DFlash-2 shape tested against llama.cpp's own drafter (tests/hosts/test_native_dflash2.py)
DFLASH2_PRESET = {"conv_kernel_size": 3, "conv_group_size": 32, "selector_rank": 32, "selector_top_k": 4}


def add_dflash2_arguments(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group("DFlash-2 (docs/dflash2.md; all four 0: a DFlash-1 drafter)")
    d.add_argument(
        "--dflash2",
        action="store_true",
        help="a DFlash-2 drafter of the preset shape "
        + ", ".join(f"{k} {v}" for k, v in DFLASH2_PRESET.items())
        + " (the flags below override it)",
    )
    for name in DFLASH2_PRESET:
        d.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=f"DraftConfig.{name}")
    d.add_argument(
        "--selector-weight",
        type=float,
        default=1.0,
        help="objective = block loss + SELECTOR_WEIGHT * selector loss (docs/training.md)",
    )


def dflash2_fields(args: argparse.Namespace, base: dict | None = None) -> dict[str, int]:
    """The DraftConfig DFlash-2 fields the command line asks for over those of `base` (a draft
    dict; --dflash2 starts from the preset instead); empty when it asks for none."""
    given = {name: getattr(args, name) for name in DFLASH2_PRESET if getattr(args, name) is not None}
    if not args.dflash2 and not given:
        return {}
    start = DFLASH2_PRESET if args.dflash2 else {name: (base or {}).get(name, 0) for name in DFLASH2_PRESET}
    return {**start, **given}


def cmd_train(args: argparse.Namespace) -> int:
    from ..hosts.llama_cpp.drafters import SMOLLM2_LAYER_IDS, smollm2_draft_config
    from ..hosts.smollm2 import smollm2_gguf
    from .config import TrainConfig
    from .train import train

    draft = smollm2_draft_config(
        n_layer=args.layers,
        block_size=args.block_size,
        mask_token_id=args.mask_token,
        target_layer_ids=list(SMOLLM2_LAYER_IDS),
        **dflash2_fields(args),
    ).to_dict()
    cfg = TrainConfig(
        data=list(args.data),
        out=args.out,
        model=str(args.model or smollm2_gguf()),
        draft=draft,
        init_layers=list(args.init_layers or []),
        epochs=args.epochs,
        seqs_per_step=args.seqs_per_step,
        anchors_per_seq=args.anchors,
        lr=args.lr,
        gamma=args.gamma,
        selector_weight=args.selector_weight,
        seed=args.seed,
        threads=args.threads,
        eval_data=args.eval_data,
        scale_features=args.scale_features,
        save_every=args.save_every,
        warmup_steps=args.warmup,
    )
    record = train(cfg, max_steps=args.max_steps)
    logging.getLogger(__name__).info("last record: %s", record)
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    import json

    from ..hosts.smollm2 import smollm2_gguf
    from .data import load_corpus
    from .evaluate import offline_acceptance
    from .gpu_run import read_weights
    from .model import load_weights, new_model
    from .train import frozen_from_gguf

    weights = read_weights(args.drafter)
    model = new_model(weights.cfg, 0)
    load_weights(model, weights)
    result = offline_acceptance(
        model, frozen_from_gguf(str(args.model or smollm2_gguf())), load_corpus(args.data), args.sequences
    )
    print(json.dumps(result))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from ..hosts.smollm2 import smollm2_gguf
    from .gpu_run import read_weights

    weights = read_weights(args.drafter)
    out = weights.save_pretrained(args.out, format="gguf", dtype=args.dtype, vocab_from=args.model or smollm2_gguf())
    logging.getLogger(__name__).info("wrote %s", out)
    return 0


def cmd_pack(args: argparse.Namespace) -> int:
    from ..hosts.smollm2 import smollm2_gguf
    from .selfgen import prompt_pack

    out = prompt_pack(str(args.model or smollm2_gguf()), args.out, args.prompt_seed)
    logging.getLogger(__name__).info("wrote %s", out)
    return 0


def cmd_gpu_run(args: argparse.Namespace) -> int:
    import json

    from .config import TrainConfig
    from .gpu_run import run

    if args.draft:
        draft = json.loads(Path(args.draft).read_text())
    else:  # (hosts.smollm2 needs neither our ggml extension nor llama.cpp: GPU machines read it)
        from ..hosts.smollm2 import SMOLLM2_LAYER_IDS, smollm2_draft_config

        draft = smollm2_draft_config(
            n_layer=args.layers[0],
            block_size=args.block_size,
            mask_token_id=args.mask_token,
            target_layer_ids=list(SMOLLM2_LAYER_IDS),
        ).to_dict()
    draft.update(dflash2_fields(args, draft))  # (DraftConfig checks the whole shape when the run builds it)
    recipe = TrainConfig(
        pack=args.pack,
        model=args.model,
        out=args.out,
        draft=draft,
        layers=list(args.layers),
        minutes=args.minutes,
        data_share=args.data_share,
        self_prompts=args.self_prompts,
        template_prompts=args.template_prompts,
        held_out_prompts=args.held_out_prompts,
        prompt_batch=args.prompt_batch,
        answer_batch=args.answer_batch,
        max_new_tokens=args.max_new_tokens,
        seqs_per_step=args.seqs_per_step,
        anchors_per_seq=args.anchors,
        lr=args.lr,
        selector_weight=args.selector_weight,
        warmup_steps=args.warmup,
        save_minutes=args.save_minutes,
        seed=args.seed,
        device=args.device,
        tokens=args.tokens,
        init=args.init,
    )
    record = run(recipe)
    logging.getLogger(__name__).info("last record: %s", record)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pyggml_dkv.training", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="self-distilled data through the llama.cpp host")
    g.add_argument("--out", required=True, help="data directory (resumes when it exists)")
    g.add_argument("--model", default=None, help="target GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    g.add_argument("--layers", type=int, nargs="+", default=None, help="target layer ids to capture")
    g.add_argument("--prompts", type=int, default=None, help="use the first N training prompts")
    g.add_argument(
        "--held-out", action="store_true", help="the held-out prompts (evaluation data), not the training ones"
    )
    g.add_argument("--kinds", nargs="+", default=["greedy", "warm"], choices=["greedy", "warm"])
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--minutes", type=float, default=None, help="stop after this long (resume later)")
    g.add_argument("--threads", type=int, default=2)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--prompt-seed", type=int, default=0)
    g.set_defaults(func=cmd_generate)
    t = sub.add_parser("train", help="train a drafter on generated data (resumes from OUT/state.pt)")
    t.add_argument("--data", required=True, nargs="+", help="data directories, trained on together")
    t.add_argument("--out", required=True)
    t.add_argument("--eval-data", default=None, help="held-out data directory, evaluated at every save")
    t.add_argument("--model", default=None, help="target GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    t.add_argument("--layers", type=int, default=2, help="drafter decoder layers")
    t.add_argument("--block-size", type=int, default=8)
    t.add_argument("--mask-token", type=int, default=16, help="mask token id (SmolLM2: 16, <empty_output>)")
    t.add_argument(
        "--init-layers",
        type=int,
        nargs="+",
        default=None,
        help="initialise drafter layer i from target layer INIT_LAYERS[i] (default: random init)",
    )
    t.add_argument("--epochs", type=float, default=1.0)
    t.add_argument("--seqs-per-step", type=int, default=8)
    t.add_argument("--anchors", type=int, default=48, help="anchors per sequence per step")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=50)
    t.add_argument("--gamma", type=float, default=4.0, help="loss weight exp(-(k-1)/gamma) of block row k")
    t.add_argument(
        "--scale-features",
        action="store_true",
        help="train fc as if each feature column were normalised (measured: no gain; docs/training.md)",
    )
    add_dflash2_arguments(t)
    t.add_argument("--save-every", type=int, default=100)
    t.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (resume later)")
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=cmd_train)
    e = sub.add_parser("evaluate", help="offline replay of greedy speculative decoding on held-out data")
    e.add_argument(
        "--drafter", required=True, help="dflash checkpoint directory, dflash .gguf or gpu-run parts (OUT/drafter-2l)"
    )
    e.add_argument("--data", required=True, nargs="+")
    e.add_argument("--model", default=None)
    e.add_argument("--sequences", type=int, default=None)
    e.set_defaults(func=cmd_evaluate)
    x = sub.add_parser("export", help="write a trained drafter as a llama.cpp dflash GGUF")
    x.add_argument("--drafter", required=True, help="a run's drafter/ directory or gpu-run parts (OUT/drafter-2l)")
    x.add_argument("--out", required=True, help="the .gguf file to write")
    x.add_argument("--dtype", default="q8_0", choices=["f32", "f16", "bf16", "q8_0"])
    x.add_argument("--model", default=None, help="target GGUF whose tokenizer the file carries (default: SmolLM2)")
    x.set_defaults(func=cmd_export)
    k = sub.add_parser("pack", help="tokenize the prompts of a gpu-run with the llama.cpp host (a small .npz)")
    k.add_argument("--out", required=True)
    k.add_argument("--model", default=None, help="target GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    k.add_argument("--prompt-seed", type=int, default=0)
    k.set_defaults(func=cmd_pack)
    r = sub.add_parser("gpu-run", help="self-distilled data on the PyTorch target and training, on one GPU, in MINUTES")
    r.add_argument("--pack", required=True, help="the prompt pack (python -m pyggml_dkv.training pack)")
    r.add_argument("--model", required=True, help="target GGUF")
    r.add_argument("--out", required=True)
    r.add_argument("--layers", type=int, nargs="+", default=[2], help="drafter depths, trained side by side")
    r.add_argument("--block-size", type=int, default=8)
    r.add_argument("--mask-token", type=int, default=16)
    r.add_argument("--draft", default=None, help="a JSON file of DraftConfig fields (default: SmolLM2's drafter shape)")
    r.add_argument("--minutes", type=float, default=8.0, help="wall clock of the whole run")
    r.add_argument("--data-share", type=float, default=0.4, help="at most this share of it for data and features")
    r.add_argument("--self-prompts", type=int, default=16384, help="user requests the target writes itself")
    r.add_argument("--template-prompts", type=int, default=None, help="the first N template prompts (default all)")
    r.add_argument("--held-out-prompts", type=int, default=None)
    r.add_argument("--prompt-batch", type=int, default=2048)
    r.add_argument("--answer-batch", type=int, default=1024)
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--seqs-per-step", type=int, default=32)
    r.add_argument("--anchors", type=int, default=64)
    r.add_argument("--lr", type=float, default=1e-3)
    r.add_argument("--warmup", type=int, default=100)
    add_dflash2_arguments(r)
    r.add_argument("--save-minutes", type=float, default=1.5)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--device", default="cuda")
    r.add_argument("--tokens", default=None, help="train on an earlier run's tokens.npz instead of generating")
    r.add_argument(
        "--init", default=None, help="start the one drafter from weights (OUT/drafter-4l parts or a checkpoint)"
    )
    r.set_defaults(func=cmd_gpu_run)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
