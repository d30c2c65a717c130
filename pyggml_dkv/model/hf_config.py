"""config.json <-> DraftConfig: the `dflash` package's Qwen3-style drafter config, mapped key by key.

Every key a config holds is either mapped to a DraftConfig field or refused by name (a
CheckpointError): rope types other than default / linear / yarn, partial rotary, attention
biases, non-causal sliding or causal full layers, ...

DFlash-2 (`architectures: ["DFlash2DraftModel"]`, docs/dflash2.md): the four keys
`conv_kernel_size`, `conv_group_size`, `selector_rank`, `selector_top_k`, read like every dflash
key from `dflash_config` first, then the top level (the `dflash` package's `_draft_value`). A
DFlash-2 architecture without all four, or the keys under the DFlash-1 architecture, is refused:
the `dflash` package would build a different model than llama.cpp's converter.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from ..common.checks import is_real
from .config import DFLASH2_FIELDS, ConfigError, DraftConfig
from .errors import CheckpointError
from .safetensors_io import save_dtype

ARCHITECTURE = "DFlashDraftModel"
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"
DFLASH2_ARCHITECTURES = (DFLASH2_ARCHITECTURE,)

# Qwen3Config's defaults (transformers 5.x), used where a key is absent, as DFlashDraftModel would.
_QWEN3_DEFAULTS: dict[str, Any] = {
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "sliding_window": 4096,
    "use_sliding_window": False,
    "hidden_act": "silu",
    "attention_bias": False,
}
_DEFAULT_ROPE_THETA = 10_000.0  # RotaryEmbeddingConfigMixin.default_theta (Qwen3Config keeps it)
_DEFAULT_BLOCK_SIZE = 16  # dflash: int(_draft_value(config, "block_size", 16))

# top-level keys that carry nothing this drafter's math depends on, or that are checked below
_TOP_LEVEL_KEYS = {
    # PreTrainedConfig bookkeeping (transformers 4.x and 5.x)
    "_name_or_path",
    "_attn_implementation",
    "_attn_implementation_autoset",
    "architectures",
    "auto_map",
    "model_type",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "use_bfloat16",
    "chunk_size_feed_forward",
    "id2label",
    "label2id",
    "num_labels",
    "is_encoder_decoder",
    "is_decoder",
    "add_cross_attention",
    "tie_encoder_decoder",
    "cross_attention_hidden_size",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "torchscript",
    "problem_type",
    "finetuning_task",
    "tokenizer_class",
    "prefix",
    "task_specific_params",
    "tf_legacy_loss",
    "pruned_heads",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "use_cache",
    "initializer_range",
    "attention_dropout",
    "tie_word_embeddings",
    "max_position_embeddings",
    "max_window_layers",
    # Qwen3 structure
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "vocab_size",
    "attention_bias",
    "mlp_bias",
    "layer_types",
    "use_sliding_window",
    "sliding_window",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "original_max_position_embeddings",
    "partial_rotary_factor",
    "is_causal",
    # dflash (read from dflash_config first, then here)
    "dflash_config",
    "num_target_layers",
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    "output_multiplier",
    "final_logit_softcapping",
    "input_embedding_scale",
    # DFlash-2 (dflash_config first, then here)
    *DFLASH2_FIELDS,
}
_DFLASH_KEYS = {
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    "num_target_layers",
    "output_multiplier",
    "final_logit_softcapping",
    "input_embedding_scale",
    "causal",
    "attention_mode",
    "projector_type",
    *DFLASH2_FIELDS,
}
_HF_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}
_ROPE_KEYS = {
    "default": {"rope_type", "type", "rope_theta"},
    "linear": {"rope_type", "type", "rope_theta", "factor"},
    "yarn": {
        "rope_type",
        "type",
        "rope_theta",
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    },
}


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """dflash's fallback when a config has no target_layer_ids (`dflash.model.build_target_layer_ids`)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + (i * span) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def _int_value(where: str, value: Any) -> int:
    if not is_real(value):
        raise CheckpointError(f"{where} must be an integer, got {value!r}")
    if isinstance(value, float):
        if not value.is_integer():
            raise CheckpointError(f"{where} must be an integer, got {value!r}")
        value = int(value)
    return value


def _float_value(where: str, value: Any) -> float:
    if not is_real(value) or not math.isfinite(value):
        raise CheckpointError(f"{where} must be a finite number, got {value!r}")
    return float(value)


def _rope_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """RoPE settings of a transformers config in ggml_rope_ext's terms.

    transformers (5.x `convert_rope_params_to_dict` / `standardize_rope_params`, 4.x the same
    with `rope_scaling`): the parameters are `rope_scaling or rope_parameters or {}`;
    `rope_theta` inside them wins over the top-level one (default 10000); the type is
    `rope_type`, else the legacy `type`, else "default".

    Mapping (HF `_compute_*_parameters` -> ggml `rope_yarn`, both NEOX, so theta_i = pos * inv_freq_i):
    - default: inv_freq = theta^(-2i/d)                  -> freq_scale 1, ext_factor 0, attn_factor 1.
    - linear:  inv_freq /= factor                        -> freq_scale 1/factor, ext_factor 0, attn_factor 1.
    - yarn:    inv_freq = interp*(1-e) + extrap*e with interp = extrap/factor and
               e_i = 1 - clamp((i-low)/(high-low), 0, 1), low/high = floor/ceil of
               d*ln(orig/(beta*2pi))/(2 ln theta) for beta_fast/beta_slow clamped to [0, d-1];
               cos and sin are multiplied by attention_factor A
               (default A = 0.1*ln(factor)+1, or mscale/mscale_all_dim's ratio).
               ggml: theta = interp*(1-mix) + extrap*mix, mix = rope_yarn_ramp(low, high, i0)*ext_factor
               with the same corr dims from (n_ctx_orig, beta_fast, beta_slow), and cos/sin are
               multiplied by attn_factor * (1 + 0.1*ln(1/freq_scale)) whenever ext_factor != 0.
               -> freq_scale = 1/factor, ext_factor = 1, n_ctx_orig = original_max_position_embeddings,
                  beta_fast/beta_slow as given (HF: `or 32` / `or 1`),
                  attn_factor = A / (1 + 0.1*ln(factor)), so that ggml's total magnitude equals A.
                  HF's default A = 1 + 0.1*ln(factor) thus gives exactly attn_factor 1.0 (what llama.cpp
                  uses for ordinary YaRN models), and A = 1 (DeepSeek-style mscale == mscale_all_dim)
                  gives 1/(1 + 0.1*ln(1/freq_scale)), llama.cpp's deepseek2 `attn_factor_scaled`.
               `truncate: false` (no floor/ceil) has no ggml equivalent and is refused.
    """
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(scaling, Mapping):
        raise CheckpointError(f"rope parameters must be a JSON object, got {scaling!r}")
    rp = dict(scaling)
    if rp and set(rp) <= set(_HF_LAYER_TYPES):  # per-layer-type rope (transformers 5.x)
        variants = [json.dumps(v, sort_keys=True) for v in rp.values()]
        if len(set(variants)) != 1 or not isinstance(next(iter(rp.values())), Mapping):
            raise CheckpointError(f"per-layer-type rope parameters that differ are not supported: {scaling!r}")
        rp = dict(next(iter(rp.values())))
    rp.setdefault("rope_theta", hf.get("rope_theta", _DEFAULT_ROPE_THETA))
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type not in _ROPE_KEYS:
        raise CheckpointError(f"unsupported rope type {rope_type!r} (supported: default, linear, yarn)")
    unknown = sorted(set(rp) - _ROPE_KEYS[rope_type] - {"partial_rotary_factor"})
    if unknown:
        raise CheckpointError(f"unsupported {rope_type} rope parameter(s) {unknown}")
    for where, prf in (
        ("rope parameters", rp.get("partial_rotary_factor")),
        ("config", hf.get("partial_rotary_factor")),
    ):
        if prf is not None and float(prf) != 1.0:
            raise CheckpointError(
                f"partial_rotary_factor {prf} in the {where} is not supported (rotary over the full head only)"
            )
    theta = _float_value("rope_theta", rp["rope_theta"])
    out: dict[str, Any] = {"rope_theta": theta}
    if rope_type == "linear":
        factor = _float_value("rope linear factor", rp.get("factor"))
        if factor <= 0:
            raise CheckpointError(f"rope linear factor must be > 0, got {factor}")
        out["freq_scale"] = 1.0 / factor
    elif rope_type == "yarn":
        if rp.get("truncate", True) is not True:
            raise CheckpointError(
                "yarn rope with truncate=false is not supported (ggml floors/ceils the correction range)"
            )
        max_pos = hf.get("max_position_embeddings", _QWEN3_DEFAULTS["max_position_embeddings"])
        orig = rp.get("original_max_position_embeddings")
        if orig is None:  # transformers: top-level original_max_position_embeddings, else max_position_embeddings
            orig = hf.get("original_max_position_embeddings", max_pos)
        orig = _int_value("rope original_max_position_embeddings", orig)
        given = rp.get("factor")
        if given is None:
            given = _int_value("max_position_embeddings", max_pos) / orig
        factor = _float_value("rope yarn factor", given)
        if factor <= 0 or orig <= 0:
            raise CheckpointError(
                f"rope yarn factor and original_max_position_embeddings must be > 0, got {factor}, {orig}"
            )

        def get_mscale(scale: float, mscale: float = 1.0) -> float:  # transformers' helper, verbatim
            if scale <= 1:
                return 1.0
            return 0.1 * mscale * math.log(scale) + 1.0

        attention = rp.get("attention_factor")
        mscale, mscale_all_dim = rp.get("mscale"), rp.get("mscale_all_dim")
        if attention is None:
            if mscale and mscale_all_dim:
                attention = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
            else:
                attention = get_mscale(factor)
        attention = _float_value("rope attention_factor", attention)
        ggml_internal = 1.0 + 0.1 * math.log(factor)  # = 1 + 0.1*ln(1/freq_scale)
        if ggml_internal <= 0:
            raise CheckpointError(f"rope yarn factor {factor} is too small for ggml's YaRN magnitude correction")
        out.update(
            freq_scale=1.0 / factor,
            ext_factor=1.0,
            attn_factor=attention / ggml_internal,
            beta_fast=_float_value("rope beta_fast", rp.get("beta_fast") or 32),
            beta_slow=_float_value("rope beta_slow", rp.get("beta_slow") or 1),
            n_ctx_orig=orig,
        )
    return out


def config_from_hf(hf: Mapping[str, Any]) -> DraftConfig:
    """Map a dflash `config.json` (as a dict) to a DraftConfig, refusing what we cannot run."""
    if not isinstance(hf, Mapping):
        raise CheckpointError(f"config.json must hold a JSON object, got {type(hf).__name__}")
    dc = hf.get("dflash_config") or {}
    if not isinstance(dc, Mapping):
        raise CheckpointError(f"dflash_config must be a JSON object, got {dc!r}")

    # --- what kind of model this is
    archs = hf.get("architectures")
    if archs is not None:
        if not isinstance(archs, list) or not archs:
            raise CheckpointError(f"architectures must be a non-empty list, got {archs!r}")
        other = [a for a in archs if a not in (ARCHITECTURE, DFLASH2_ARCHITECTURE)]
        if other:
            raise CheckpointError(
                f"unsupported architecture(s) {other}; expected [{ARCHITECTURE!r}] or [{DFLASH2_ARCHITECTURE!r}]"
            )
        if len(set(archs)) > 1:
            raise CheckpointError(f"architectures {archs} names both DFlash-1 and DFlash-2")
    unknown = sorted(set(dc) - _DFLASH_KEYS)
    if unknown:
        raise CheckpointError(f"unsupported dflash_config key(s) {unknown}")
    unknown = sorted(k for k in hf if k not in _TOP_LEVEL_KEYS)
    if unknown:
        if "quantization_config" in unknown:
            raise CheckpointError("quantized checkpoints (quantization_config) are not supported")
        raise CheckpointError(f"unsupported config.json key(s) {unknown}")

    def value(name: str, default: Any = None) -> Any:
        """dflash's `_draft_value`: dflash_config first, then the top level, then the default."""
        return dc[name] if name in dc else hf.get(name, default)

    def top(name: str) -> Any:
        """A top-level Qwen3Config field: absent -> Qwen3Config's default (an explicit null stays null)."""
        return hf.get(name, _QWEN3_DEFAULTS.get(name))

    # --- features of the architecture we do not implement
    if top("hidden_act") != "silu":
        raise CheckpointError(f"hidden_act {top('hidden_act')!r} is not supported (SwiGLU with silu only)")
    if top("attention_bias"):
        raise CheckpointError("attention_bias=true (q/k/v/o projection biases) is not supported")
    if hf.get("mlp_bias"):
        raise CheckpointError("mlp_bias=true is not supported")
    if dc.get("attention_mode", "gqa") not in ("gqa", "mha"):
        raise CheckpointError(f"dflash_config attention_mode {dc['attention_mode']!r} is not supported (gqa/mha only)")
    if dc.get("projector_type") not in (None, "dflash"):
        raise CheckpointError(f"dflash_config projector_type {dc['projector_type']!r} is not supported")

    # --- shape
    hidden = _int_value("hidden_size", top("hidden_size"))
    n_layer = _int_value("num_hidden_layers", top("num_hidden_layers"))
    n_head = _int_value("num_attention_heads", top("num_attention_heads"))
    n_head_kv = _int_value(
        "num_key_value_heads", hf["num_key_value_heads"] if hf.get("num_key_value_heads") is not None else n_head
    )
    head_dim = hf.get("head_dim", _QWEN3_DEFAULTS["head_dim"])
    head_dim = _int_value("head_dim", head_dim if head_dim is not None else hidden // max(n_head, 1))
    ffn = _int_value("intermediate_size", top("intermediate_size"))

    # --- layer types and sliding window (Qwen3Config.__post_init__, then dflash's attention)
    use_swa = bool(hf.get("use_sliding_window", False))
    window = top("sliding_window") if use_swa else None
    hf_types = hf.get("layer_types")
    if hf_types is None:
        max_window_layers = _int_value("max_window_layers", top("max_window_layers"))
        hf_types = [
            "sliding_attention" if window is not None and i >= max_window_layers else "full_attention"
            for i in range(n_layer)
        ]
    if not isinstance(hf_types, list) or len(hf_types) != n_layer:
        raise CheckpointError(f"layer_types must list {n_layer} layer types, got {hf_types!r}")
    bad = sorted({t for t in hf_types if t not in _HF_LAYER_TYPES}, key=str)
    if bad:
        raise CheckpointError(f"unsupported layer type(s) {bad} (full_attention / sliding_attention only)")
    layer_types = [_HF_LAYER_TYPES[t] for t in hf_types]
    any_sliding = "sliding" in layer_types
    if window is None:
        if any_sliding:
            raise CheckpointError(
                "sliding_attention layers without a sliding window (use_sliding_window false or sliding_window null) "
                "are causal over the whole context in dflash; not supported"
            )
        swa_window = 0
    else:
        swa_window = _int_value("sliding_window", window)
        if swa_window <= 0:
            raise CheckpointError(f"sliding_window must be > 0, got {swa_window}")
    is_causal = hf.get("is_causal")
    if is_causal is not None and (bool(is_causal) or any_sliding):
        raise CheckpointError(
            f"is_causal={is_causal!r} is not supported (dflash would make every layer "
            f"{'causal' if is_causal else 'non-causal'}; we run non-causal full and causal sliding layers)"
        )
    causal = dc.get("causal")
    if causal:
        raise CheckpointError("dflash_config causal=true (causal full-attention layers) is not supported")

    # --- dflash keys
    ids = value("target_layer_ids")
    if ids is None:
        n_target = value("num_target_layers")
        if n_target is None:
            raise CheckpointError("config has neither target_layer_ids nor num_target_layers")
        ids = build_target_layer_ids(_int_value("num_target_layers", n_target), n_layer)
    if not isinstance(ids, list) or not ids:
        raise CheckpointError(f"target_layer_ids must be a non-empty list, got {ids!r}")
    ids = [_int_value("target_layer_ids entry", i) for i in ids]
    mask_token_id = value("mask_token_id")
    if mask_token_id is None:
        raise CheckpointError("config has no mask_token_id (dflash_config.mask_token_id)")
    softcap = value("final_logit_softcapping")
    softcap = None if softcap is None else _float_value("final_logit_softcapping", softcap)
    vocab = hf.get("vocab_size")
    dflash2 = _dflash2_from_hf(archs, value)

    try:
        return DraftConfig(
            hidden=hidden,
            n_layer=n_layer,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            ffn=ffn,
            block_size=_int_value("block_size", value("block_size", _DEFAULT_BLOCK_SIZE)),
            n_target_layers=len(ids),
            rms_eps=_float_value("rms_norm_eps", top("rms_norm_eps")),
            swa_window=swa_window,
            layer_types=layer_types,
            mask_token_id=_int_value("mask_token_id", mask_token_id),
            vocab=None if vocab is None else _int_value("vocab_size", vocab),
            input_embedding_scale=_float_value("input_embedding_scale", value("input_embedding_scale", 1.0)),
            output_multiplier=_float_value("output_multiplier", value("output_multiplier", 1.0)),
            final_logit_softcapping=softcap if softcap is not None and softcap > 0 else None,
            target_layer_ids=ids,
            **_rope_from_hf(hf),
            **dflash2,
        )
    except ConfigError as e:
        raise CheckpointError(str(e)) from e


def _dflash2_from_hf(archs: Any, value: Callable[[str], Any]) -> dict[str, int]:
    """The DFlash-2 fields of DraftConfig; `value(name)` is the `_draft_value` lookup.

    The architecture and the keys must agree: `DFlash2DraftModel` reads all four keys (the
    `dflash` package fails without one), while `DFlashDraftModel` would ignore them and drop the
    DFlash-2 tensors, which llama.cpp's converter would keep. Without `architectures` the keys
    decide."""
    found = {name: value(name) for name in DFLASH2_FIELDS if value(name) is not None}
    is_2 = isinstance(archs, list) and DFLASH2_ARCHITECTURE in archs
    if isinstance(archs, list) and not is_2 and found:
        raise CheckpointError(
            f"DFlash-2 key(s) {sorted(found)} under architecture {ARCHITECTURE!r}: the dflash package "
            f"would build a DFlash-1 drafter and drop the DFlash-2 tensors (use {DFLASH2_ARCHITECTURE!r})"
        )
    if not found and not is_2:
        return {}
    missing = [name for name in DFLASH2_FIELDS if name not in found]
    if missing:
        raise CheckpointError(
            f"DFlash-2 config without {missing} (dflash_config.{missing[0]}): "
            f"{DFLASH2_ARCHITECTURE} needs all of {list(DFLASH2_FIELDS)}"
        )
    out = {name: _int_value(f"dflash_config.{name}", v) for name, v in found.items()}
    bad = [name for name, v in out.items() if v <= 0]
    if bad:
        raise CheckpointError(f"dflash_config.{bad[0]} must be > 0, got {out[bad[0]]}")
    return out


def _rope_to_hf(cfg: DraftConfig) -> tuple[dict[str, Any], int | None]:
    """The inverse of `_rope_from_hf`: (rope_parameters, max_position_embeddings or None)."""
    rp: dict[str, Any] = {"rope_theta": float(cfg.rope_theta)}
    if cfg.ext_factor == 0.0:
        if cfg.attn_factor != 1.0:
            raise CheckpointError(
                f"attn_factor {cfg.attn_factor} without YaRN (ext_factor 0) has no transformers equivalent"
            )
        if cfg.freq_scale == 1.0:
            rp["rope_type"] = "default"
        else:
            rp.update(rope_type="linear", factor=1.0 / cfg.freq_scale)
        return rp, None
    if cfg.ext_factor != 1.0:
        raise CheckpointError(f"ext_factor {cfg.ext_factor} has no transformers equivalent (YaRN is ext_factor 1.0)")
    if cfg.n_ctx_orig <= 0:
        raise CheckpointError("YaRN rope (ext_factor 1) needs n_ctx_orig > 0 to be written as a transformers config")
    factor = 1.0 / cfg.freq_scale
    rp.update(
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=int(cfg.n_ctx_orig),
        beta_fast=float(cfg.beta_fast),
        beta_slow=float(cfg.beta_slow),
    )
    if cfg.attn_factor != 1.0:  # 1.0 is exactly transformers' default attention_factor (see _rope_from_hf)
        rp["attention_factor"] = float(cfg.attn_factor * (1.0 + 0.1 * math.log(factor)))
    return rp, max(int(round(cfg.n_ctx_orig * factor)), 1)


def config_to_hf(cfg: DraftConfig, dtype: str = "float32") -> dict[str, Any]:
    """The config.json dflash's `save_pretrained` writes for this drafter (transformers 5.x layout).

    `num_target_layers` (the target model's depth, only read by dflash when target_layer_ids is
    absent) is not part of DraftConfig: max(target_layer_ids) + 1 is written. A config without
    target_layer_ids gets [0, 1, ..., n_target_layers-1].
    """
    ids = list(cfg.target_layer_ids) or list(range(cfg.n_target_layers))
    rope, max_pos = _rope_to_hf(cfg)
    dflash_config: dict[str, Any] = {
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": ids,
    }
    if cfg.input_embedding_scale != 1.0:
        dflash_config["input_embedding_scale"] = float(cfg.input_embedding_scale)
    if cfg.output_multiplier != 1.0:
        dflash_config["output_multiplier"] = float(cfg.output_multiplier)
    if cfg.final_logit_softcapping is not None:
        dflash_config["final_logit_softcapping"] = float(cfg.final_logit_softcapping)
    if cfg.is_dflash2:  # in dflash_config: llama.cpp's converter reads them nowhere else
        dflash_config.update({name: int(getattr(cfg, name)) for name in DFLASH2_FIELDS})
    hf: dict[str, Any] = {
        "architectures": [DFLASH2_ARCHITECTURE if cfg.is_dflash2 else ARCHITECTURE],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": cfg.block_size,
        "bos_token_id": None,
        "dflash_config": dflash_config,
        "dtype": save_dtype(dtype)[1],
        "eos_token_id": None,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "hidden_size": cfg.hidden,
        "initializer_range": 0.02,
        "intermediate_size": cfg.ffn,
        "layer_types": [{"full": "full_attention", "sliding": "sliding_attention"}[t] for t in cfg.layer_types],
        "max_position_embeddings": max_pos if max_pos is not None else _QWEN3_DEFAULTS["max_position_embeddings"],
        "max_window_layers": _QWEN3_DEFAULTS["max_window_layers"],
        "model_type": "qwen3",
        "num_attention_heads": cfg.n_head,
        "num_hidden_layers": cfg.n_layer,
        "num_key_value_heads": cfg.n_head_kv,
        "num_target_layers": max(ids) + 1,
        "pad_token_id": None,
        "rms_norm_eps": float(cfg.rms_eps),
        "rope_parameters": rope,
        "sliding_window": cfg.swa_window if cfg.swa_window > 0 else None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": cfg.swa_window > 0,
    }
    if cfg.vocab is not None:
        hf["vocab_size"] = cfg.vocab
    return hf
