"""TrainConfig: one training run's recipe, for both routes (docs/training.md).

    TrainConfig(data=["data/smollm2"], out="runs/a", model="SmolLM2.gguf", epochs=2)         # train.train
    TrainConfig(pack="prompts.npz", out="runs/g", model="SmolLM2.gguf", layers=[2, 4])      # gpu_run.run

A run on the host's data (`data`: directories `python -m pyggml_dkv.training generate` wrote) goes
by epochs on the CPU and resumes from OUT/state.pt; a GPU run (`pack`: a prompt pack) makes its own
data with the PyTorch target and trains the drafters of `layers` side by side until `minutes` have
passed. The drafter (`draft`), the objective and the optimizer are the same fields for both; each
route's own fields are refused on the other, and three defaults differ by route (ROUTE_DEFAULTS).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..model.config import DraftConfig

HOST, GPU = "host", "gpu"
ROUTE_NAMES = {HOST: "a run on the host's data (`data`)", GPU: "a GPU run (`pack`)"}
BY_ROUTE = -1  # the default of the fields of ROUTE_DEFAULTS: replaced by the run's route's value
# fields whose default depends on the route: the GPU's bigger batches
ROUTE_DEFAULTS: dict[str, dict[str, int]] = {
    HOST: {"seqs_per_step": 8, "anchors_per_seq": 48, "warmup_steps": 50},
    GPU: {"seqs_per_step": 32, "anchors_per_seq": 64, "warmup_steps": 100},
}


@dataclass(kw_only=True)
class TrainConfig:
    # both routes: the target, the drafter, the objective and the optimizer
    model: str  # the target GGUF: frozen embedding and lm_head (host route: optional layer init)
    out: str  # the run's directory
    draft: dict = field(default_factory=dict)  # DraftConfig fields (GPU: n_layer comes from `layers`)
    seqs_per_step: int = BY_ROUTE  # host 8, GPU 32 (ROUTE_DEFAULTS)
    anchors_per_seq: int = BY_ROUTE  # host 48, GPU 64
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = BY_ROUTE  # host 50, GPU 100
    weight_decay: float = 0.01
    gamma: float = 4.0
    selector_weight: float = 1.0  # DFlash-2: objective = block loss + selector_weight * selector loss
    grad_clip: float = 1.0
    seed: int = 0

    # the host route (train.train)
    data: list[str] = field(default_factory=list)  # data directories (pyggml_dkv.training.data), trained on together
    init_layers: list[int] = field(default_factory=list)  # target layers to copy in (empty: random init)
    epochs: float = 1.0
    scale_features: bool = False  # train fc on per-column normalised features (model.scale_features)
    bf16: bool = True  # autocast the drafter's products to bf16 (float32 weights, optimizer and loss)
    threads: int = 2
    log_every: int = 20
    save_every: int = 100
    eval_data: str | None = None  # held-out data directory, evaluated at every save
    eval_sequences: int = 40

    # the GPU route (gpu_run.run)
    pack: str | None = None  # selfgen.prompt_pack output
    layers: list[int] = field(default_factory=lambda: [2])  # drafter depths, trained side by side
    minutes: float = 8.0  # wall clock for the whole run, load to last save
    data_share: float = 0.4  # at most this share of the time goes to phases 1-2
    self_prompts: int = 16384
    template_prompts: int | None = None  # the first N template prompts (None: all)
    held_out_prompts: int | None = None
    prompt_batch: int = 2048
    answer_batch: int = 1024
    max_new_tokens: int = 256
    warm_tokens: int = 4
    save_minutes: float = 1.5
    device: str = "cuda"
    tokens: str | None = None  # an earlier run's tokens.npz: train on those sequences, skip generating
    init: str | None = None  # weights to start the (single) drafter from: parts prefix or checkpoint

    def __post_init__(self) -> None:
        if bool(self.data) == (self.pack is not None):
            raise ValueError(
                "give `data` (a run on the host's data: train.train) or `pack` (a GPU run: gpu_run.run), exactly one"
            )
        other = GPU if self.route == HOST else HOST
        for f in dataclasses.fields(self):
            if f.name in ROUTE_FIELDS[other] and getattr(self, f.name) != _default(f):
                raise ValueError(f"{f.name} is a setting of {ROUTE_NAMES[other]}; this is {ROUTE_NAMES[self.route]}")
        for name, value in ROUTE_DEFAULTS[self.route].items():
            if getattr(self, name) == BY_ROUTE:
                setattr(self, name, value)
        for name in ("seqs_per_step", "anchors_per_seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.selector_weight >= 0:
            raise ValueError(f"selector_weight must be >= 0, got {self.selector_weight}")
        if self.selector_weight != 1.0 and not self.is_dflash2:
            raise ValueError("selector_weight is a setting of a DFlash-2 drafter (draft with conv_kernel_size > 0)")
        if self.route == GPU:
            self._check_gpu_run()

    def _check_gpu_run(self) -> None:
        if not self.layers or len(set(self.layers)) != len(self.layers) or min(self.layers) < 1:
            raise ValueError(f"layers must be distinct drafter depths >= 1, got {self.layers}")
        if not self.minutes > 0:
            raise ValueError(f"minutes must be > 0, got {self.minutes}")
        if not 0 < self.data_share < 1:
            raise ValueError(f"data_share must lie in (0, 1), got {self.data_share}")
        for name in ("self_prompts", "prompt_batch", "answer_batch", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("pack", "model", "tokens"):
            if getattr(self, name) is not None and not Path(getattr(self, name)).is_file():
                raise FileNotFoundError(f"{name}: no such file {getattr(self, name)}")
        if self.init is not None:
            if len(self.layers) != 1:
                raise ValueError(f"init starts one drafter: give one depth in layers, got {self.layers}")
            init = Path(self.init)
            if not (init.exists() or init.with_name(init.name + ".part0.npz").is_file()):
                raise FileNotFoundError(f"init: no weights at {self.init}")
        if self.device.startswith("cuda"):
            import torch  # (a GPU run needs it anyway; the config itself does not)

            if not torch.cuda.is_available():
                raise ValueError(
                    f"device {self.device!r}: PyTorch sees no CUDA device here (--device cpu runs on the CPU)"
                )

    @property
    def route(self) -> str:
        """ "host" (trained on `data`: train.train) or "gpu" (a GPU run from `pack`: gpu_run.run)."""
        return GPU if self.pack is not None else HOST

    @property
    def is_dflash2(self) -> bool:
        """The drafter is a DFlash-2 one (DraftConfig.is_dflash2, read off the `draft` fields)."""
        return int(self.draft.get("conv_kernel_size") or 0) > 0

    def draft_config(self) -> DraftConfig:
        return DraftConfig(**self.draft)

    def recipe(self) -> dict[str, Any]:
        """The fields this run's route reads, as plain values: what a run records (a host run's
        train.json, which a resumed run must match; a GPU run's log.jsonl). selector_weight is
        left out for a DFlash-1 drafter, which has no selector (and runs recorded before the
        field existed resume)."""
        other = ROUTE_FIELDS[HOST if self.route == GPU else GPU]
        if not self.is_dflash2:
            other = other | {"selector_weight"}
        return {name: value for name, value in dataclasses.asdict(self).items() if name not in other}


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


ROUTE_FIELDS: dict[str, frozenset[str]] = {
    HOST: frozenset(
        (
            "data",
            "init_layers",
            "epochs",
            "scale_features",
            "bf16",
            "threads",
            "log_every",
            "save_every",
            "eval_data",
            "eval_sequences",
        )
    ),
    GPU: frozenset(
        (
            "pack",
            "layers",
            "minutes",
            "data_share",
            "self_prompts",
            "template_prompts",
            "held_out_prompts",
            "prompt_batch",
            "answer_batch",
            "max_new_tokens",
            "warm_tokens",
            "save_minutes",
            "device",
            "tokens",
            "init",
        )
    ),
}
