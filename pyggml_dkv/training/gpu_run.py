"""One self-contained training run on a GPU: self-distilled data from the PyTorch target, then
several drafters trained side by side on it until a wall-clock deadline.

    python -m pyggml_dkv.training gpu-run --pack prompts.npz --model SmolLM2.gguf --out OUT --minutes 8

Phases (each logged to OUT/log.jsonl):
1. data: the target writes `self_prompts` user requests and answers them greedily; the template
   prompts are answered greedily and "warm"; the held-out prompts greedily (evaluation only).
   With `tokens` (an earlier run's tokens.npz) the training sequences are read instead;
2. features: a teacher-forced pass over every sequence gives the features of the drafter's target
   layers and the target's argmax (the `greedy` flags), kept on the GPU in bfloat16;
3. training: each drafter shape in `layers` gets its own AdamW, the same batches, warm-up and a
   cosine decay over the training time (by the clock: lr_at);
   every `save_minutes` the weights are written (float16 .npz parts small enough to copy back
   from a rented machine) with the held-out replay of each.

With `init` (an earlier run's weight parts, OUT/drafter-4l, or a dflash checkpoint) the one drafter
of `layers` starts from those weights: with `tokens` too, a run continues an earlier one on its data.

The drafters it writes are measured again on the host's own features before they are used
(`python -m pyggml_dkv.training evaluate`): that is the number that counts.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..model.config import DraftConfig
from ..model.weights import DraftWeights
from .batched import DeviceCorpus, batch_acceptance, batch_loss, choose_anchors
from .config import TrainConfig
from .model import load_weights, new_model, to_draft_weights
from .selfgen import continue_prompts, self_prompts, unpack
from .torch_target import TorchLlama, features_and_argmax
from .train import adamw, cosine_decay

if TYPE_CHECKING:  # pragma: no cover
    from dflash.model import DFlashDraftModel  # (no type information: Any to mypy)

log = logging.getLogger(__name__)


def save_parts(weights: DraftWeights, out_dir: Path, name: str, max_bytes: int = 15 << 20) -> list[Path]:
    """The weights as float16 `NAME.partK.npz` files of at most ~max_bytes each (the config, as
    JSON, rides in part 0): small enough to copy back from a rented machine."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob(f"{name}.part*.npz"):
        old.unlink()
    parts: list[dict[str, Any]] = [{"__config__": np.array(json.dumps(weights.cfg.to_dict()))}]
    size = 0
    for key, arr in weights.items():
        a = np.asarray(arr, np.float16)
        if len(parts[-1]) > 1 and size + a.nbytes > max_bytes:
            parts.append({})
            size = 0
        parts[-1][key] = a
        size += a.nbytes
    paths = []
    for i, part in enumerate(parts):
        p = out_dir / f"{name}.part{i}.npz"
        np.savez(p, **part)
        paths.append(p)
    return paths


def read_weights(spec: str | Path) -> DraftWeights:
    """A gpu-run's weight parts (OUT/drafter-4l: the prefix of OUT/drafter-4l.part0.npz ...), or a
    dflash checkpoint directory or .gguf (DraftWeights.from_pretrained)."""
    path = Path(spec)
    if path.with_name(path.name + ".part0.npz").is_file():
        return load_parts(path.parent, path.name)
    return DraftWeights.from_pretrained(spec)


def load_parts(out_dir: str | Path, name: str) -> DraftWeights:
    """save_parts' files back as DraftWeights (float32)."""
    paths = sorted(Path(out_dir).glob(f"{name}.part*.npz"), key=lambda p: int(p.name.rsplit("part", 1)[1][:-4]))
    if not paths:
        raise FileNotFoundError(f"no {name}.part*.npz in {out_dir}")
    tensors, cfg = {}, None
    for p in paths:
        with np.load(p) as z:
            for k in z.files:
                if k == "__config__":
                    cfg = DraftConfig(**json.loads(str(z[k])))
                else:
                    tensors[k] = z[k].astype(np.float32)
    if cfg is None:
        raise ValueError(f"{paths[0]} holds no __config__")
    return DraftWeights(cfg, tensors)


class RunLog:
    """log.jsonl: one JSON record per line, flushed at once (a run cut short keeps its log)."""

    def __init__(self, path: Path) -> None:
        self.f = open(path, "a")  # noqa: SIM115 (the log's for its life: close())

    def write(self, **record: object) -> None:
        log.info("%s", record)
        self.f.write(json.dumps(record) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def generate_sequences(
    target: TorchLlama, r: TrainConfig, pack: dict, eog: set[int], deadline: float, runlog: RunLog, t0: float
) -> tuple[list[np.ndarray], list[int]]:
    """Phase 1's training sequences: the templates greedy and warm, then requests the target
    writes itself, answered greedily until the data deadline."""
    templates = unpack(pack["train_flat"], pack["train_len"])[: r.template_prompts]
    seqs, plens = continue_prompts(target, templates, eog, batch=r.answer_batch, max_new=r.max_new_tokens)
    warm, warm_plen = continue_prompts(
        target,
        templates,
        eog,
        batch=r.answer_batch,
        max_new=r.max_new_tokens,
        warm_tokens=r.warm_tokens,
        seed=r.seed + 1,
    )
    seqs, plens = seqs + warm, plens + warm_plen
    runlog.write(phase="templates", sequences=len(seqs), seconds=round(time.monotonic() - t0, 1))
    # what is left of the data time: a third for writing prompts, half for answering them, the
    # rest in reserve for the features pass
    now = time.monotonic()
    prompts = self_prompts(
        target, pack, r.self_prompts, batch=r.prompt_batch, seed=r.seed + 2, deadline=now + 0.3 * (deadline - now)
    )
    gen_deadline = now + 0.8 * (deadline - now)
    runlog.write(phase="self_prompts", prompts=len(prompts), seconds=round(time.monotonic() - t0, 1))
    answers, answer_plen = continue_prompts(
        target, prompts, eog, batch=r.answer_batch, max_new=r.max_new_tokens, deadline=gen_deadline
    )
    seqs, plens = seqs + answers, plens + answer_plen
    runlog.write(
        phase="answers",
        sequences=len(seqs),
        tokens=int(sum(s.size for s in seqs)),
        new_tokens=int(sum(s.size - p for s, p in zip(seqs, plens))),
        seconds=round(time.monotonic() - t0, 1),
    )
    return seqs, plens


def build_data(
    target: TorchLlama, r: TrainConfig, deadline: float, runlog: RunLog
) -> tuple[DeviceCorpus, DeviceCorpus, list[np.ndarray], list[int]]:
    """Phases 1-2: (training corpus, held-out corpus, training sequences, their prompt lengths)."""
    assert r.pack is not None  # a GPU run's (TrainConfig.route)
    pack = dict(np.load(r.pack))
    eog = set(int(t) for t in pack["eog"])
    layers = tuple(DraftConfig(**r.draft).target_layer_ids)
    t0 = time.monotonic()
    held, held_plen = continue_prompts(
        target,
        unpack(pack["held_flat"], pack["held_len"])[: r.held_out_prompts],
        eog,
        batch=r.answer_batch,
        max_new=r.max_new_tokens,
    )
    runlog.write(phase="held_out", sequences=len(held), seconds=round(time.monotonic() - t0, 1))
    if r.tokens is not None:
        with np.load(r.tokens) as z:
            seqs = unpack(z["tokens"], z["lengths"])
            plens = [int(p) for p in z["prompt_lengths"]]
        runlog.write(phase="tokens", sequences=len(seqs), source=r.tokens)
    else:
        seqs, plens = generate_sequences(target, r, pack, eog, deadline, runlog, t0)

    def corpus(sequences: list[np.ndarray], prompt_lengths: list[int], chunk: int = 64) -> tuple[DeviceCorpus, float]:
        c = DeviceCorpus.allocate(
            sequences, prompt_lengths, DraftConfig(**r.draft).fc_in, torch.bfloat16, target.device
        )
        agree = []
        for lo in range(0, len(sequences), chunk):
            part = sequences[lo : lo + chunk]
            feats, argmax = features_and_argmax(target, part, layers, torch.bfloat16)
            for i, (s, f, a) in enumerate(zip(part, feats, argmax), start=lo):
                g = np.zeros(s.size, bool)
                g[1:] = s[1:] == a[:-1]  # token t is the target's argmax after tokens [0, t)
                c.fill(i, f, g)
                agree.append(g[prompt_lengths[i] :].mean() if s.size > prompt_lengths[i] else 1.0)
        return c, float(np.mean(agree))

    (train_corpus, agree), (held_corpus, _) = corpus(seqs, plens), corpus(held, held_plen)
    runlog.write(
        phase="features",
        sequences=train_corpus.n_sequences,
        generated_argmax_agreement=agree,
        seconds=round(time.monotonic() - t0, 1),
    )
    return train_corpus, held_corpus, seqs, plens


def drafter_config(draft: dict, n_layer: int) -> DraftConfig:
    """`draft` at depth n_layer (every layer of the kind of its first)."""
    fields = {**draft, "n_layer": n_layer}
    if fields.get("layer_types"):
        fields["layer_types"] = [fields["layer_types"][0]] * n_layer
    return DraftConfig(**fields)


def lr_at(step: int, progress: float, r: TrainConfig) -> float:
    """Linear warm-up over the first steps, times a cosine decay to min_lr_ratio over the training
    time (`progress`: the share of it spent). A run is cut by the clock, and a step's time is
    hard to foresee on a GPU (the first steps of each new shape are slow: a schedule sized from
    steps 10-30 of one run stopped at 40% of its time), so the decay follows the clock."""
    warm = min(1.0, (step + 1) / r.warmup_steps)
    return r.lr * warm * cosine_decay(max(0.0, progress), r.min_lr_ratio)


def run(r: TrainConfig) -> dict:
    """The whole run (module docstring) of a GPU-route TrainConfig (`pack`); returns the last save's record."""
    if r.route != "gpu":
        raise ValueError(
            "gpu_run.run makes its data from a prompt pack (TrainConfig.pack); a run on the "
            "host's data is train.train's"
        )
    out = Path(r.out)
    out.mkdir(parents=True, exist_ok=True)
    runlog = RunLog(out / "log.jsonl")
    try:
        return _run(r, out, runlog)
    finally:
        runlog.close()


def _run(r: TrainConfig, out: Path, runlog: RunLog) -> dict:
    start = time.monotonic()
    end = start + 60 * r.minutes
    runlog.write(phase="recipe", recipe=r.recipe())
    dev = torch.device(r.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # the target in true float32
    target = TorchLlama.from_gguf(r.model, dev)
    runlog.write(phase="load", seconds=round(time.monotonic() - start, 1), device=str(dev))
    corpus, held, seqs, plens = build_data(target, r, start + 60 * r.minutes * r.data_share, runlog)
    token_type = np.uint16 if target.shape.vocab <= 1 << 16 else np.int32
    np.savez_compressed(
        out / "tokens.npz",
        tokens=np.concatenate(seqs).astype(token_type),
        lengths=np.array([s.size for s in seqs]),
        prompt_lengths=np.array(plens),
    )
    embed = target.w["token_embd"]
    lm_head = target.w["output"].to(torch.bfloat16)
    del target.w  # the target's weights are done with: room for training
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    torch.backends.cuda.matmul.allow_tf32 = True
    models, opts, cfgs = [], [], []
    for n_layer in r.layers:
        cfg = drafter_config(r.draft, n_layer)
        if cfg.is_dflash2 and lm_head.shape[0] != cfg.vocab:
            raise ValueError(
                f"the target's vocabulary {lm_head.shape[0]} is not the DFlash-2 drafter's vocab {cfg.vocab}"
            )
        m = new_model(cfg, r.seed)
        if r.init is not None:
            start_from = read_weights(r.init)
            if start_from.cfg != cfg:
                raise ValueError(f"init {r.init}: its shape {start_from.cfg} is not the run's {cfg}")
            load_weights(m, start_from)
            runlog.write(phase="init", source=r.init)
        m = m.to(dev)
        opts.append(adamw(m, r.lr, r.weight_decay))
        models.append(m)
        cfgs.append(cfg)
    rng = np.random.default_rng(r.seed)
    order = np.array([], np.int64)
    step = 0
    t_train = time.monotonic()
    t_stop = end - 60 * 0.4  # the rest is for the last save and its held-out replay
    runlog.write(phase="schedule", training_seconds=round(t_stop - t_train, 1))
    next_save = t_train + 60 * r.save_minutes
    stats = [_new_stats() for _ in models]
    record: dict = {}
    while True:
        now = time.monotonic()
        if now > t_stop:
            break
        if order.size < r.seqs_per_step:
            order = np.concatenate([order, rng.permutation(corpus.n_sequences)])
        rows, order = order[: r.seqs_per_step], order[r.seqs_per_step :]
        anchors, real = choose_anchors(corpus, rows, r.anchors_per_seq, rng)
        lr = lr_at(step, (now - t_train) / max(1e-9, t_stop - t_train), r)
        for m, opt, st in zip(models, opts, stats):
            for g in opt.param_groups:
                g["lr"] = lr
            opt.zero_grad(set_to_none=True)
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss, s = batch_loss(m, embed, lm_head, corpus, rows, anchors, real, r.gamma, r.selector_weight)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), r.grad_clip)
            opt.step()
            st["loss"] += s["block_loss"]
            st["selector_loss"] += s.get("selector_loss", 0.0)
            st["n"] += 1
            st["correct"] += s["correct"]
            st["valid"] += s["valid"]
        step += 1
        if step % 100 == 0:
            record = {
                "step": step,
                "lr": lr,
                "seconds": round(time.monotonic() - start, 1),
                "loss": [round(st["loss"] / st["n"], 4) for st in stats],
                "acc1": [round(st["correct"] / max(1, st["valid"]), 4) for st in stats],
            }
            if cfgs[0].is_dflash2:
                record["selector_loss"] = [round(st["selector_loss"] / st["n"], 4) for st in stats]
            runlog.write(**record)
            stats = [_new_stats() for _ in models]
        if time.monotonic() > next_save:
            record = save_all(models, cfgs, held, embed, lm_head, out, step, start, runlog)
            next_save = time.monotonic() + 60 * r.save_minutes
    if record.get("phase") == "save" and record.get("step") == step:
        return record
    return save_all(models, cfgs, held, embed, lm_head, out, step, start, runlog)


def _new_stats() -> dict[str, float]:
    """One drafter's sums over a log interval: block and selector loss per step, first-row hits."""
    return {"loss": 0.0, "selector_loss": 0.0, "n": 0, "correct": 0, "valid": 0}


def save_all(
    models: list[DFlashDraftModel],
    cfgs: list[DraftConfig],
    held: DeviceCorpus,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    out: Path,
    step: int,
    start: float,
    runlog: RunLog,
) -> dict:
    """Write every drafter's weights (save_parts) and log its held-out replay."""
    evals = []
    for m, cfg in zip(models, cfgs):
        save_parts(to_draft_weights(m, cfg), out, f"drafter-{cfg.n_layer}l")
        evals.append(batch_acceptance(m, embed, lm_head, held))
    record = {
        "phase": "save",
        "step": step,
        "seconds": round(time.monotonic() - start, 1),
        "held_out": {f"{c.n_layer}l": e for c, e in zip(cfgs, evals)},
    }
    runlog.write(**record)
    return record
