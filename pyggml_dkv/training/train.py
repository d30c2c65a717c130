"""The training loop on the host's data: AdamW with warm-up and cosine decay, resumable
checkpoints, held-out evaluation.

    run = TrainConfig(data=["data/smollm2"], out="runs/a", model="SmolLM2.gguf", epochs=2)
    train(run)            # resumes from runs/a/state.pt when it exists

The output directory holds `train.json` (the recipe), `state.pt` (model, optimizer, step: the
resume point), `log.jsonl` (one line per log interval and per evaluation), and `drafter/` (the
latest weights as a dflash checkpoint directory, readable by DraftWeights.from_pretrained).
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..model.config import DraftConfig
from .config import TrainConfig
from .data import load_corpus
from .evaluate import offline_acceptance
from .model import feature_scale, init_from_target, new_model, scale_features, to_draft_weights
from .objective import Frozen, anchor_range, sequence_loss

log = logging.getLogger(__name__)


def cosine_decay(t: float, min_ratio: float) -> float:
    """1 at t = 0 down to min_ratio at t >= 1, along half a cosine."""
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * cosine_decay(t, cfg.min_lr_ratio)


def adamw(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW (0.9, 0.95), weight decay on matrices only (not on norms)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )


def new_accumulator() -> dict[str, float]:
    """Sums over one log interval: losses per step (n steps), first-row hits per valid label."""
    return {"loss": 0.0, "selector_loss": 0.0, "n": 0, "correct": 0, "valid": 0, "selector_correct": 0}


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def frozen_from_gguf(path: str) -> Frozen:
    from ..hosts.llama_cpp.drafters import target_embeddings
    from ..hosts.llama_cpp.gguf import GGUFFile

    embed, head = target_embeddings(GGUFFile(path))
    return Frozen.from_arrays(embed, head)


def train(cfg: TrainConfig, *, max_steps: int | None = None) -> dict:
    """Train (or resume) per `cfg`, a run on the host's data (`cfg.data`); `max_steps` stops early
    (tests). Returns the last log record."""
    if cfg.route != "host":
        raise ValueError(
            "train() trains on the host's data (TrainConfig.data); a run from a prompt pack is gpu_run.run's"
        )
    torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    recipe = out / "train.json"
    if recipe.exists() and json.loads(recipe.read_text()) != cfg.recipe():
        raise ValueError(f"{out} holds a run with another recipe (train.json); use a new --out")
    recipe.write_text(json.dumps(cfg.recipe(), indent=2))
    dcfg = cfg.draft_config()
    corpus = load_corpus(cfg.data)
    held_out = load_corpus(cfg.eval_data) if cfg.eval_data else None
    frozen = frozen_from_gguf(cfg.model)
    if frozen.embed.shape[1] != dcfg.hidden:
        raise ValueError(f"the target's hidden size {frozen.embed.shape[1]} is not the drafter's {dcfg.hidden}")
    if corpus.features.shape[1] != dcfg.fc_in:
        raise ValueError(f"the data's features are {corpus.features.shape[1]} wide, the drafter takes {dcfg.fc_in}")
    if dcfg.is_dflash2 and frozen.lm_head.shape[0] != dcfg.vocab:
        raise ValueError(
            f"the target's vocabulary {frozen.lm_head.shape[0]} is not the DFlash-2 drafter's vocab {dcfg.vocab}"
        )
    model = new_model(dcfg, cfg.seed)
    if cfg.init_layers:
        from ..hosts.llama_cpp.gguf import GGUFFile

        init_from_target(model, dcfg, GGUFFile(cfg.model), cfg.init_layers)
    if cfg.scale_features:
        scale_features(model, feature_scale(corpus.features, seed=cfg.seed))
    opt = adamw(model, cfg.lr, cfg.weight_decay)
    per_epoch = corpus.n_sequences // cfg.seqs_per_step
    total = max(1, int(per_epoch * cfg.epochs))
    step = 0
    state_file = out / "state.pt"
    if state_file.exists():
        state = torch.load(state_file, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = int(state["step"])
        log.info("resumed %s at step %d of %d", out, step, total)
    log.info(
        "%d sequences (%d tokens), %d steps of %d sequences x %d anchors",
        corpus.n_sequences,
        corpus.tokens.size,
        total,
        cfg.seqs_per_step,
        cfg.anchors_per_seq,
    )
    with open(out / "log.jsonl", "a") as logf:
        acc = new_accumulator()
        t0 = time.monotonic()
        record: dict[str, Any] = {}
        stop = total if max_steps is None else min(total, step + max_steps)
        model.train()
        while step < stop:
            epoch, within = divmod(step, per_epoch)
            order = epoch_order(corpus.n_sequences, cfg.seed, epoch)
            batch = order[within * cfg.seqs_per_step : (within + 1) * cfg.seqs_per_step]
            for g in opt.param_groups:
                g["lr"] = lr_at(step, total, cfg)
            opt.zero_grad(set_to_none=True)
            weights, losses, selector_losses = [], [], []
            for i in batch:
                tokens, feats, greedy, plen = corpus.sequence(int(i))
                anchors = anchor_range(tokens.size, plen)
                if anchors.size == 0:
                    continue
                if anchors.size > cfg.anchors_per_seq:  # drawn per (step, sequence): resuming replays them
                    rng = np.random.default_rng([cfg.seed, step, int(i)])
                    anchors = np.sort(rng.choice(anchors, cfg.anchors_per_seq, replace=False))
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
                    loss, st = sequence_loss(
                        model, frozen, tokens, feats, greedy, anchors, cfg.gamma, cfg.selector_weight
                    )
                if st["weight"] == 0:
                    continue
                (loss * st["weight"]).backward()
                weights.append(st["weight"])
                losses.append(st["block_loss"] * st["weight"])
                selector_losses.append(st.get("selector_loss", 0.0) * st["weight"])
                acc["correct"] += int(st["correct"][0])
                acc["valid"] += int(st["valid"][0])
                if "selector_correct" in st:
                    acc["selector_correct"] += int(st["selector_correct"][0])
            if weights:
                scale = 1.0 / sum(weights)
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(scale)
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                opt.step()
                acc["loss"] += sum(losses) * scale
                acc["selector_loss"] += sum(selector_losses) * scale
                acc["n"] += 1
            step += 1
            if step % cfg.log_every == 0 or step == stop:
                record = {
                    "step": step,
                    "of": total,
                    "epoch": round(step / per_epoch, 3),
                    "lr": lr_at(step - 1, total, cfg),
                    "loss": acc["loss"] / max(1, acc["n"]),
                    "acc1": acc["correct"] / max(1, acc["valid"]),
                    "seconds": round(time.monotonic() - t0, 1),
                }
                if dcfg.is_dflash2:
                    record["selector_loss"] = acc["selector_loss"] / max(1, acc["n"])
                    record["selector_acc1"] = acc["selector_correct"] / max(1, acc["valid"])
                log.info(
                    "step %d/%d loss %.4f acc@1 %.3f%s lr %.2e (%.0f s)",
                    step,
                    total,
                    record["loss"],
                    record["acc1"],
                    (
                        f" selector loss {record['selector_loss']:.4f} acc@1 {record['selector_acc1']:.3f}"
                        if dcfg.is_dflash2
                        else ""
                    ),
                    record["lr"],
                    record["seconds"],
                )
                logf.write(json.dumps(record) + "\n")
                logf.flush()
                acc = new_accumulator()
            if step % cfg.save_every == 0 or step == stop:
                save(model, opt, step, out, dcfg)
                if held_out is not None:
                    model.eval()
                    ev = offline_acceptance(model, frozen, held_out, cfg.eval_sequences)
                    model.train()
                    ev_record = {"step": step, "eval": ev}
                    log.info(
                        "step %d held-out: %.3f tokens/round (every anchor %.3f)",
                        step,
                        ev["tokens_per_round"],
                        ev["every_anchor_mean"],
                    )
                    logf.write(json.dumps(ev_record) + "\n")
                    logf.flush()
                    record = {**record, "eval": ev}
    return record


def save(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, out: Path, dcfg: DraftConfig) -> None:
    tmp = out / "state.pt.tmp"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, tmp)
    tmp.rename(out / "state.pt")
    to_draft_weights(model, dcfg).save_pretrained(out / "drafter")
