"""DFlash drafter checkpoints: `config.json` + safetensors, in the `dflash` package's format (SPEC.md §5).

Layout of a checkpoint directory (what `DFlashDraftModel.save_pretrained` of `dflash` 0.1.0 with
transformers 5.x writes, and what `DFlashDraftModel.from_pretrained` reads):

- ``config.json``: a Qwen3 config (``model_type: "qwen3"``, ``architectures: ["DFlashDraftModel"]``,
  hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
  intermediate_size, rms_norm_eps, vocab_size, rope_parameters / rope_theta + rope_scaling,
  layer_types, use_sliding_window, sliding_window, ...) plus ``num_target_layers`` and a
  ``dflash_config`` dict (``block_size``, ``mask_token_id``, ``target_layer_ids``, optionally
  ``output_multiplier``, ``final_logit_softcapping``, ``input_embedding_scale``). dflash reads every
  drafter key from ``dflash_config`` first and falls back to the top level (``_draft_value``).
- ``model.safetensors`` (or ``model.safetensors.index.json`` + shards) holding exactly
  ``fc.weight``, ``hidden_norm.weight``, ``norm.weight`` and per layer
  ``layers.N.self_attn.{q,k,v,o}_proj.weight``, ``layers.N.self_attn.{q,k}_norm.weight``,
  ``layers.N.mlp.{gate,up,down}_proj.weight``, ``layers.N.{input,post_attention}_layernorm.weight``
  (no ``model.`` prefix; a file whose every name carries one is accepted and stripped).

Anything a checkpoint holds that this package cannot run exactly is refused with a
`CheckpointError` naming it: DFlash-2 tensors/keys (dynamic convolutions, candidate selector),
attention biases, rope types other than default / linear / yarn, partial rotary, quantization,
non-causal sliding or causal full layers, unknown tensors or config keys,
dtypes other than F32 / F16 / BF16.

The safetensors container is parsed and written here directly (8-byte little-endian header
length, JSON header, raw little-endian data): the `safetensors` package's numpy path cannot read
BF16, and BF16 <-> F32 is an exact bit shift (F32 -> BF16 rounds to nearest even, like torch).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .config import ConfigError, DraftConfig
from .weights import DraftWeights, WeightsError, expected_shapes

__all__ = [
    "CONFIG_NAME",
    "INDEX_NAME",
    "SAVE_DTYPES",
    "WEIGHTS_NAME",
    "CheckpointError",
    "CheckpointNotFoundError",
    "bf16_bits_to_f32",
    "config_from_hf",
    "config_to_hf",
    "f32_to_bf16_bits",
    "load_checkpoint",
    "read_safetensors",
    "read_safetensors_header",
    "save_checkpoint",
    "write_safetensors",
]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

ARCHITECTURE = "DFlashDraftModel"
DFLASH2_ARCHITECTURES = ("DFlash2DraftModel",)

MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit


class CheckpointError(ValueError):
    """A checkpoint this package cannot load or write exactly (the message names what and where)."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint directory or one of its files does not exist."""


# ------------------------------------------------------------------------------------------------
# dtypes

# safetensors dtype tag -> (numpy little-endian storage dtype, bytes per element)
_READ_DTYPES: dict[str, tuple[str, int]] = {"F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": ("<u2", 2)}
# every tag of the format, so a refusal can tell "unsupported" from "corrupt"
_KNOWN_DTYPES = {
    "BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2",
    "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64", "C64",
}

# save_checkpoint(dtype=...) spellings -> (safetensors tag, config.json "dtype")
SAVE_DTYPES: dict[str, tuple[str, str]] = {
    "float32": ("F32", "float32"), "f32": ("F32", "float32"), "fp32": ("F32", "float32"),
    "bfloat16": ("BF16", "bfloat16"), "bf16": ("BF16", "bfloat16"),
    "float16": ("F16", "float16"), "f16": ("F16", "float16"), "fp16": ("F16", "float16"),
}


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """BF16 values given as their uint16 bit patterns -> float32 (exact: the high half of an f32)."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        bits = bits.astype("<u2")
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> BF16 bit patterns (uint16), rounding to nearest, ties to even (as torch does).

    NaN stays NaN (quiet); values that round past the BF16 range become +-inf.
    """
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = np.isnan(u.view(np.float32))
    out = rounded.astype(np.uint16)
    if nan.any():
        out[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return out


# ------------------------------------------------------------------------------------------------
# safetensors container


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise CheckpointError(f"duplicate key {key!r} in a JSON object")
        seen[key] = value
    return seen


def read_safetensors_header(path: str | Path) -> tuple[dict[str, dict[str, Any]], dict[str, str], int]:
    """Parse and validate a safetensors header.

    Returns ``(tensors, metadata, data_start)``: ``tensors[name] = {"dtype", "shape", "data_offsets"}``
    with offsets relative to ``data_start``. Every entry is checked against the file: known dtype
    tag, integer shape, ``end - begin == numel * itemsize`` (for the dtypes we read), inside the file,
    no two tensors overlapping.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointNotFoundError(f"safetensors file not found: {path}")
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(f"{path}: corrupt safetensors header length {n} (file is {size} bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON: {e}") from e
    except CheckpointError as e:
        raise CheckpointError(f"{path}: safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: safetensors __metadata__ is not a JSON object")
    data_start = 8 + n
    data_len = size - data_start
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
            raise CheckpointError(f"{where}: malformed header entry {info!r}")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _KNOWN_DTYPES:
            raise CheckpointError(f"{where}: unknown safetensors dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise CheckpointError(f"{where}: malformed shape {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_len
        ):
            raise CheckpointError(f"{where}: data_offsets {offsets!r} outside the {data_len}-byte data section")
        if dtype in _READ_DTYPES:
            want = math.prod(shape) * _READ_DTYPES[dtype][1]
            if offsets[1] - offsets[0] != want:
                raise CheckpointError(
                    f"{where}: {dtype}{shape} needs {want} bytes, data_offsets span {offsets[1] - offsets[0]}"
                )
        spans.append((offsets[0], offsets[1], name))
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointError(f"{path}: tensors {n0!r} and {n1!r} overlap in the data section")
    return header, {str(k): str(v) for k, v in metadata.items()}, data_start


def read_safetensors(path: str | Path, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """Read a safetensors file as float32 numpy arrays (F32 as is, F16 widened, BF16 bit-shifted:
    all exact). Any other dtype is refused, naming the tensor. `names` limits what is read."""
    path = Path(path)
    header, _, data_start = read_safetensors_header(path)
    wanted = list(header) if names is None else list(names)
    out: dict[str, np.ndarray] = {}
    with path.open("rb") as f:
        for name in wanted:
            if name not in header:
                raise CheckpointError(f"{path}: no tensor {name!r}")
            info = header[name]
            dtype = info["dtype"]
            if dtype not in _READ_DTYPES:
                raise CheckpointError(
                    f"{path}: tensor {name!r} has dtype {dtype}; only F32, F16 and BF16 are supported"
                )
            begin, end = info["data_offsets"]
            f.seek(data_start + begin)
            buf = f.read(end - begin)
            if len(buf) != end - begin:
                raise CheckpointError(f"{path}: tensor {name!r} is truncated")
            storage, _ = _READ_DTYPES[dtype]
            arr = np.frombuffer(buf, dtype=storage).reshape(info["shape"])
            if dtype == "BF16":
                arr = bf16_bits_to_f32(arr)
            out[name] = np.ascontiguousarray(arr, dtype=np.float32)
    return out


def write_safetensors(
    path: str | Path,
    tensors: Mapping[str, np.ndarray],
    dtype: str = "float32",
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write float tensors to a safetensors file in `dtype` (float32 / bfloat16 / float16).

    Tensors are laid out in name order, the header padded with spaces to 8 bytes (as the
    `safetensors` package does) and carrying ``{"format": "pt"}`` metadata, which transformers
    requires. Values that do not fit the target dtype (overflow to inf) are refused.
    """
    tag = _save_dtype(dtype)[0]
    path = Path(path)
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **dict(metadata or {})}}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        arr = np.asarray(tensors[name])
        if arr.dtype.kind not in "fiu":
            raise CheckpointError(f"tensor {name!r}: cannot store dtype {arr.dtype}")
        src = np.ascontiguousarray(arr, dtype=np.float32)
        if tag == "F32":
            data = src.astype("<f4")
        elif tag == "F16":
            with np.errstate(over="ignore"):
                data = src.astype("<f2")
        else:
            data = f32_to_bf16_bits(src).astype("<u2")
        if tag != "F32":
            back = data.astype(np.float32) if tag == "F16" else bf16_bits_to_f32(data)
            if (np.isinf(back) & ~np.isinf(src)).any():
                raise CheckpointError(f"tensor {name!r}: values overflow {tag}")
        blob = data.tobytes()
        header[name] = {"dtype": tag, "shape": list(arr.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    _atomic_write(path, [struct.pack("<Q", len(raw)), raw, *blobs])


def _atomic_write(path: Path, chunks: Iterable[bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _save_dtype(dtype: object) -> tuple[str, str]:
    key = dtype
    if not isinstance(dtype, str) and dtype is not None:
        try:
            key = str(np.dtype(dtype))  # type: ignore[call-overload]
        except TypeError:
            key = None
    if isinstance(key, str) and key.lower() in SAVE_DTYPES:
        return SAVE_DTYPES[key.lower()]
    raise CheckpointError(f"unsupported checkpoint dtype {dtype!r}; use 'float32', 'bfloat16' or 'float16'")


# ------------------------------------------------------------------------------------------------
# config.json <-> DraftConfig

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
    "_name_or_path", "_attn_implementation", "_attn_implementation_autoset", "architectures", "auto_map",
    "model_type", "transformers_version", "dtype",
    "torch_dtype", "use_bfloat16", "chunk_size_feed_forward", "id2label", "label2id", "num_labels",
    "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder",
    "cross_attention_hidden_size", "output_attentions", "output_hidden_states", "return_dict",
    "torchscript", "problem_type", "finetuning_task", "tokenizer_class", "prefix",
    "task_specific_params", "tf_legacy_loss", "pruned_heads", "bos_token_id", "eos_token_id",
    "pad_token_id", "sep_token_id", "decoder_start_token_id", "use_cache", "initializer_range",
    "attention_dropout", "tie_word_embeddings", "max_position_embeddings", "max_window_layers",
    # Qwen3 structure
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "vocab_size",
    "attention_bias", "mlp_bias", "layer_types", "use_sliding_window", "sliding_window",
    "rope_theta", "rope_scaling", "rope_parameters", "original_max_position_embeddings",
    "partial_rotary_factor", "is_causal",
    # dflash (read from dflash_config first, then here)
    "dflash_config", "num_target_layers", "block_size", "mask_token_id", "target_layer_ids",
    "output_multiplier", "final_logit_softcapping", "input_embedding_scale",
}
_DFLASH_KEYS = {
    "block_size", "mask_token_id", "target_layer_ids", "num_target_layers", "output_multiplier",
    "final_logit_softcapping", "input_embedding_scale", "causal", "attention_mode", "projector_type",
}
_DFLASH2_KEYS = {"conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"}
_HF_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}
_ROPE_KEYS = {
    "default": {"rope_type", "type", "rope_theta"},
    "linear": {"rope_type", "type", "rope_theta", "factor"},
    "yarn": {
        "rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "attention_factor",
        "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate",
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
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckpointError(f"{where} must be an integer, got {value!r}")
    if isinstance(value, float):
        if not value.is_integer():
            raise CheckpointError(f"{where} must be an integer, got {value!r}")
        value = int(value)
    return value


def _float_value(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
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
    for where, prf in (("rope parameters", rp.get("partial_rotary_factor")), ("config", hf.get("partial_rotary_factor"))):
        if prf is not None and float(prf) != 1.0:
            raise CheckpointError(f"partial_rotary_factor {prf} in the {where} is not supported (rotary over the full head only)")
    theta = _float_value("rope_theta", rp["rope_theta"])
    out: dict[str, Any] = {"rope_theta": theta}
    if rope_type == "linear":
        factor = _float_value("rope linear factor", rp.get("factor"))
        if factor <= 0:
            raise CheckpointError(f"rope linear factor must be > 0, got {factor}")
        out["freq_scale"] = 1.0 / factor
    elif rope_type == "yarn":
        if rp.get("truncate", True) is not True:
            raise CheckpointError("yarn rope with truncate=false is not supported (ggml floors/ceils the correction range)")
        max_pos = hf.get("max_position_embeddings", _QWEN3_DEFAULTS["max_position_embeddings"])
        orig = rp.get("original_max_position_embeddings")
        if orig is None:  # transformers: top-level original_max_position_embeddings, else max_position_embeddings
            orig = hf.get("original_max_position_embeddings", max_pos)
        orig = _int_value("rope original_max_position_embeddings", orig)
        factor = rp.get("factor")
        if factor is None:
            factor = _int_value("max_position_embeddings", max_pos) / orig
        factor = _float_value("rope yarn factor", factor)
        if factor <= 0 or orig <= 0:
            raise CheckpointError(f"rope yarn factor and original_max_position_embeddings must be > 0, got {factor}, {orig}")

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
        dflash2 = [a for a in archs if a in DFLASH2_ARCHITECTURES]
        if dflash2:
            raise CheckpointError(f"architecture {dflash2[0]} (DFlash-2: dynamic convolutions + candidate selector) is not supported")
        other = [a for a in archs if a != ARCHITECTURE]
        if other:
            raise CheckpointError(f"unsupported architecture(s) {other}; expected [{ARCHITECTURE!r}]")
    d2 = sorted((_DFLASH2_KEYS & set(dc)) | (_DFLASH2_KEYS & set(hf)))
    if d2:
        raise CheckpointError(f"DFlash-2 config key(s) {d2} (dynamic convolutions / candidate selector) are not supported")
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
        )
    except ConfigError as e:
        raise CheckpointError(str(e)) from e


def _rope_to_hf(cfg: DraftConfig) -> tuple[dict[str, Any], int | None]:
    """The inverse of `_rope_from_hf`: (rope_parameters, max_position_embeddings or None)."""
    rp: dict[str, Any] = {"rope_theta": float(cfg.rope_theta)}
    if cfg.ext_factor == 0.0:
        if cfg.attn_factor != 1.0:
            raise CheckpointError(f"attn_factor {cfg.attn_factor} without YaRN (ext_factor 0) has no transformers equivalent")
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
    hf: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": cfg.block_size,
        "bos_token_id": None,
        "dflash_config": dflash_config,
        "dtype": _save_dtype(dtype)[1],
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


# ------------------------------------------------------------------------------------------------
# load / save


_SHARD_NAME = re.compile(r"^[^/\\]+\.safetensors$")


def _read_tensors(root: Path) -> tuple[dict[str, np.ndarray], str]:
    """All tensors of a checkpoint directory and a description of where they came from."""
    single, index = root / WEIGHTS_NAME, root / INDEX_NAME
    if single.is_file():  # transformers prefers the single file too
        return read_safetensors(single), str(single)
    if not index.is_file():
        extra = [p.name for p in root.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf")]
        hint = f" (found {extra}; only safetensors checkpoints are supported)" if extra else ""
        raise CheckpointNotFoundError(f"no {WEIGHTS_NAME} or {INDEX_NAME} in {root}{hint}")
    try:
        idx = json.loads(index.read_text(encoding="utf-8"), object_pairs_hook=_reject_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{index}: not valid JSON: {e}") from e
    weight_map = idx.get("weight_map") if isinstance(idx, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: no weight_map")
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not _SHARD_NAME.match(shard) or shard in (".safetensors", "..safetensors"):
            raise CheckpointError(f"{index}: tensor {name!r} maps to a bad shard file name {shard!r}")
        by_shard.setdefault(shard, []).append(name)
    for shard in by_shard:
        if not (root / shard).is_file():
            raise CheckpointNotFoundError(f"shard {root / shard} named by {index} does not exist")
    tensors: dict[str, np.ndarray] = {}
    for shard, names in by_shard.items():
        path = root / shard
        header, _, _ = read_safetensors_header(path)
        missing = sorted(set(names) - set(header))
        if missing:
            raise CheckpointError(f"{path}: tensor(s) {missing[:6]} listed in {INDEX_NAME} are not in this shard")
        stray = sorted(set(header) - set(names))
        if stray:
            raise CheckpointError(f"{path}: tensor(s) {stray[:6]} are not listed for this shard in {INDEX_NAME}")
        tensors.update(read_safetensors(path))
    return tensors, str(index)


def _strip_model_prefix(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    if tensors and all(k.startswith("model.") for k in tensors):
        return {k[len("model."):]: v for k, v in tensors.items()}
    return tensors


def _describe_extra(names: list[str]) -> str:
    d2 = [n for n in names if re.search(r"(attention_conv|mlp_conv|candidate_selector)\.", n)]
    if d2:
        return f"DFlash-2 tensor(s) {d2[:6]} (dynamic convolutions / candidate selector) are not supported"
    bias = [n for n in names if n.endswith(".bias")]
    if bias:
        return f"bias tensor(s) {bias[:6]} are not supported"
    return f"tensor(s) this drafter cannot run: {names[:6]}{' ...' if len(names) > 6 else ''}"


def load_checkpoint(path: str | Path) -> DraftWeights:
    """Load a DFlash drafter checkpoint directory (config.json + model.safetensors or a sharded index)."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointNotFoundError(f"checkpoint directory not found: {root}")
    cfg_path = root / CONFIG_NAME
    if not cfg_path.is_file():
        raise CheckpointNotFoundError(f"{CONFIG_NAME} not found: {cfg_path}")
    try:
        hf = json.loads(cfg_path.read_text(encoding="utf-8"), object_pairs_hook=_reject_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON: {e}") from e
    except CheckpointError as e:
        raise CheckpointError(f"{cfg_path}: {e}") from e
    try:
        cfg = config_from_hf(hf)
    except CheckpointError as e:
        raise CheckpointError(f"{cfg_path}: {e}") from e

    tensors, source = _read_tensors(root)
    tensors = _strip_model_prefix(tensors)
    expected = expected_shapes(cfg)
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise CheckpointError(f"{source}: {_describe_extra(extra)}")
    try:  # missing tensors, shapes and values are DraftWeights' own checks
        return DraftWeights(cfg, tensors)
    except WeightsError as e:
        raise CheckpointError(f"{source}: {e}") from e


def save_checkpoint(weights: DraftWeights, path: str | Path, dtype: str = "float32") -> None:
    """Write `weights` as config.json + model.safetensors (dtype float32 / bfloat16 / float16).

    bfloat16 rounds to nearest even; values that overflow the chosen dtype are refused. Existing
    files of the same names are replaced (each atomically).
    """
    if not isinstance(weights, DraftWeights):
        raise CheckpointError(f"save_checkpoint needs DraftWeights, got {type(weights).__name__}")
    dtype_name = _save_dtype(dtype)[1]
    hf = config_to_hf(weights.cfg, dtype_name)
    root = Path(path)
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"checkpoint path exists and is not a directory: {root}")
    root.mkdir(parents=True, exist_ok=True)
    write_safetensors(root / WEIGHTS_NAME, dict(weights.items()), dtype_name)
    text = json.dumps(hf, indent=2, sort_keys=True) + "\n"
    _atomic_write(root / CONFIG_NAME, [text.encode("utf-8")])
