"""DraftConfig: the shape and hyper-parameters of a DFlash drafter (docs/design.md, "The drafter", "Checkpoints")."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ..common.checks import is_int
from .errors import ConfigError

LAYER_TYPES = ("full", "sliding")


@dataclass
class DraftConfig:
    hidden: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    ffn: int
    block_size: int
    n_target_layers: int
    rms_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    # YaRN, in ggml_rope_ext's terms (freq_scale = 1/factor; ext_factor 0 disables the ramp)
    freq_scale: float = 1.0
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_ctx_orig: int = 0
    swa_window: int = 0
    layer_types: list[str] = field(default_factory=list)  # empty = every layer "full"
    mask_token_id: int = 0
    vocab: int | None = None
    # logits = lm_head(out) * output_multiplier, then cap*tanh(logits/cap) when softcap is set
    # the host scales the target's token embeddings by this before the drafter sees them
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    target_layer_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not is_int(self.n_layer) or self.n_layer <= 0:
            raise ConfigError(f"DraftConfig.n_layer must be a positive int, got {self.n_layer!r}")
        if not isinstance(self.layer_types, (list, tuple)):
            raise ConfigError(f"layer_types must be a list of {LAYER_TYPES}, got {self.layer_types!r}")
        if not self.layer_types:
            self.layer_types = ["full"] * self.n_layer
        else:
            self.layer_types = list(self.layer_types)
        self.validate()

    @property
    def fc_in(self) -> int:
        """Width of one context row: the concatenated hidden states of the captured target layers."""
        return self.n_target_layers * self.hidden

    @property
    def q_len(self) -> int:
        return self.block_size

    @property
    def any_full(self) -> bool:
        return "full" in self.layer_types

    @property
    def any_swa(self) -> bool:
        return "sliding" in self.layer_types

    def validate(self) -> None:
        def positive_int(name: str) -> None:
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ConfigError(f"DraftConfig.{name} must be a positive int, got {value!r}")

        for name in ("hidden", "n_layer", "n_head", "n_head_kv", "head_dim", "ffn", "block_size", "n_target_layers"):
            positive_int(name)
        if self.n_head % self.n_head_kv:
            raise ConfigError(f"n_head ({self.n_head}) must be a multiple of n_head_kv ({self.n_head_kv}) for GQA")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if len(self.layer_types) != self.n_layer:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for n_layer={self.n_layer}")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ConfigError(f"unknown layer type(s) {bad}; expected one of {LAYER_TYPES}")
        for name in ("rms_eps", "rope_theta", "freq_scale", "attn_factor"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"DraftConfig.{name} must be a finite positive number, got {value!r}")
        for name in ("ext_factor", "beta_fast", "beta_slow", "output_multiplier", "input_embedding_scale"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"DraftConfig.{name} must be a finite number, got {value!r}")
        if self.final_logit_softcapping is not None and not (
                isinstance(self.final_logit_softcapping, (int, float)) and math.isfinite(self.final_logit_softcapping)
                and self.final_logit_softcapping > 0):
            raise ConfigError(f"final_logit_softcapping must be > 0 or None, got {self.final_logit_softcapping!r}")
        if not isinstance(self.swa_window, int) or self.swa_window < 0:
            raise ConfigError(f"swa_window must be an int >= 0, got {self.swa_window!r}")
        if self.any_swa and self.swa_window == 0:
            raise ConfigError("sliding layers need swa_window > 0")
        if not isinstance(self.n_ctx_orig, int) or self.n_ctx_orig < 0:
            raise ConfigError(f"n_ctx_orig must be an int >= 0, got {self.n_ctx_orig!r}")
        if not is_int(self.mask_token_id):
            raise ConfigError(f"mask_token_id must be an int, got {self.mask_token_id!r}")
        if not isinstance(self.target_layer_ids, (list, tuple)):
            raise ConfigError(f"target_layer_ids must be a list of ints, got {self.target_layer_ids!r}")
        if self.vocab is not None:
            positive_int("vocab")
            if not 0 <= self.mask_token_id < self.vocab:
                raise ConfigError(f"mask_token_id {self.mask_token_id} outside vocab of {self.vocab}")
        if self.mask_token_id < 0:
            raise ConfigError(f"mask_token_id must be >= 0, got {self.mask_token_id}")
        if self.target_layer_ids and len(self.target_layer_ids) != self.n_target_layers:
            raise ConfigError(
                f"target_layer_ids has {len(self.target_layer_ids)} entries, n_target_layers={self.n_target_layers}"
            )

    def replace(self, **changes: Any) -> "DraftConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def toy(cls, **changes: Any) -> "DraftConfig":
        """The benchmark's `toy` shape: tiny, fast, for examples and tests."""
        base = dict(hidden=256, n_layer=2, n_head=4, n_head_kv=2, head_dim=64, ffn=512,
                    block_size=16, n_target_layers=3)
        base.update(changes)
        return cls(**base)  # type: ignore[arg-type]
