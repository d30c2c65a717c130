"""DraftConfig: the shape and hyper-parameters of a DFlash drafter (docs/design.md, "The drafter", "Checkpoints")."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ..common.checks import is_int
from .errors import ConfigError

LAYER_TYPES = ("full", "sliding")
# the DFlash-2 hyper-parameters, in llama.cpp's key order (dflash.<name>)
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


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
    # DFlash-2 (docs/dflash2.md): all four 0 = DFlash-1, all positive = DFlash-2. The grouped
    # dynamic convolution has conv_kernel_size taps and conv_group_size channels per group (as
    # llama.cpp's dflash.conv_group_size: not the number of groups); the candidate selector scores
    # selector_top_k candidates per position with rank-selector_rank codebooks.
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

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

    @property
    def is_dflash2(self) -> bool:
        """A DFlash-2 drafter: convolutions around every sublayer and a candidate selector."""
        return self.conv_kernel_size > 0

    @property
    def conv_groups(self) -> int:
        """G, the number of channel groups of the convolution (0 for DFlash-1)."""
        return self.hidden // self.conv_group_size if self.is_dflash2 else 0

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
            isinstance(self.final_logit_softcapping, (int, float))
            and math.isfinite(self.final_logit_softcapping)
            and self.final_logit_softcapping > 0
        ):
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
        self._validate_dflash2()

    def _validate_dflash2(self) -> None:
        """All four DFlash-2 fields 0 (DFlash-1) or all positive and consistent with the shape."""
        for name in DFLASH2_FIELDS:
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise ConfigError(f"DraftConfig.{name} must be an int >= 0, got {value!r}")
        set_ = [name for name in DFLASH2_FIELDS if getattr(self, name) > 0]
        if not set_:
            return
        unset = [name for name in DFLASH2_FIELDS if getattr(self, name) == 0]
        if unset:
            raise ConfigError(
                f"DraftConfig.{unset[0]} is 0 while {set_} are set: a DFlash-2 drafter needs all of "
                f"{list(DFLASH2_FIELDS)} positive (all 0 for DFlash-1)"
            )
        if self.hidden % self.conv_group_size:
            raise ConfigError(
                f"DraftConfig.conv_group_size {self.conv_group_size} does not divide hidden {self.hidden}"
            )
        if self.vocab is None:
            raise ConfigError(
                "DraftConfig.vocab must be set for DFlash-2 (the selector's codebooks have one row per token)"
            )
        if self.selector_top_k > self.vocab:
            raise ConfigError(f"DraftConfig.selector_top_k {self.selector_top_k} exceeds vocab {self.vocab}")
        if self.block_size < 2:
            raise ConfigError(
                f"DraftConfig.block_size must be >= 2 for DFlash-2 (its selector drafts block rows 1..), "
                f"got {self.block_size}"
            )

    def replace(self, **changes: Any) -> DraftConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def toy(cls, **changes: Any) -> DraftConfig:
        """The benchmark's `toy` shape: tiny, fast, for examples and tests."""
        base: dict[str, Any] = dict(
            hidden=256, n_layer=2, n_head=4, n_head_kv=2, head_dim=64, ffn=512, block_size=16, n_target_layers=3
        )
        base.update(changes)
        return cls(**base)
