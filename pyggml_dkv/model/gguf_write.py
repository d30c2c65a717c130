"""Write a DraftWeights as a llama.cpp dflash GGUF that llama.cpp's loader accepts.

What the loader needs (src/llama-model.cpp, src/models/dflash.cpp): `general.architecture =
dflash`, the usual `dflash.*` hyper-parameters including `attention.layer_norm_rms_epsilon`,
`block_size` and `target_layers` (our ids + 1), the target's `tokenizer.*` keys (copied from
the target's own GGUF, `vocab_from`) with `tokenizer.ggml.mask_token_id`, and the tensors named
in gguf_names.py. `token_embd` / `output` are written when the weights carry them; without
them llama.cpp borrows the target's at run time.

Matrices are stored in `dtype` (quantized by ggml's own quantizer), norm vectors in f32. The
module imports without the compiled ggml, and writes f32 / f16 / bf16 files without it; the
quantized types import ggml's quantizer when they are written (the `gguf` package has none for
the k-quants).
`dtype="q4_k_m"` writes llama.cpp's Q4_K_M mix instead, the form DFlash drafters are published in:
q4_K, with q6_K for the output head and for the V projection and the MLP's down projection of the
layers llama.cpp gives more bits (src/llama-quant.cpp, `use_more_bits`).

DFlash-2 (docs/dflash2.md) adds the four `dflash.conv_*` / `dflash.selector_*` keys and its
tensors, typed as llama.cpp's converter types them: the base kernels (no `.weight` suffix)
always F32, the kernel projections and the selector's hidden projection like every matrix. The
codebooks are `.weight` tensors that the converter writes in its output type (F32 / F16 / BF16 /
Q8_0); for our finer quantized types they are written as q8_0, the converter's one quantized
type (a codebook row is only R values, rarely a whole k-quant block), and as f16 where R is not
a multiple of q8_0's 32 (the converter's own fallback when a tensor does not quantize).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..common.bf16 import to_bf16_bits
from .config import DraftConfig
from .gguf_names import ARCH, DFLASH2_KEYS, TARGET_LAYER_OFFSET, GGUFError, gguf_name, key
from .tensor_names import is_selector_codebook

if TYPE_CHECKING:  # pragma: no cover
    from .weights import DraftWeights

log = logging.getLogger(__name__)

GGUF_DTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "q4_k_m")
# llama.cpp's Q4_K_M: the per-layer matrices that get q6_K instead of q4_K in use_more_bits layers
Q4_K_M_MORE_BITS = ("self_attn.v_proj.weight", "mlp.down_proj.weight")
# the training context written when the config has no YaRN original context (informational)
DEFAULT_CONTEXT_LENGTH = 32768
MASK_KEY = "tokenizer.ggml.mask_token_id"


def gguf_path(path: str | Path) -> Path:
    path = Path(path)
    return path if path.suffix == ".gguf" else path / "model.gguf"


def _target_vocab(vocab_from: str | Path) -> list[tuple[str, Any, Any, Any]]:
    """The target GGUF's tokenizer.* fields as (key, value, type, sub_type), mask id excluded."""
    from gguf import GGUFReader, GGUFValueType

    try:
        reader = GGUFReader(vocab_from, "r")
    except (ValueError, OSError) as e:
        raise GGUFError(f"vocab_from {vocab_from}: not a readable GGUF file ({e})") from e
    out = []
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer.") or name == MASK_KEY:
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == GGUFValueType.ARRAY else None
        out.append((name, field.contents(), vtype, sub))
    if not any(name == "tokenizer.ggml.tokens" for name, *_ in out):
        raise GGUFError(f"vocab_from {vocab_from}: has no tokenizer.ggml.tokens")
    return out


def _rope_keys(cfg: DraftConfig) -> dict[str, tuple[str, Any]]:
    """The inverse of gguf_read._rope_from_gguf; refuses what llama.cpp's dflash loader cannot express."""
    out: dict[str, tuple[str, Any]] = {key("rope.freq_base"): ("f32", cfg.rope_theta)}
    attn = cfg.attn_factor
    if cfg.ext_factor == 0.0:
        if cfg.freq_scale != 1.0:
            out[key("rope.scaling.type")] = ("str", "linear")
            out[key("rope.scaling.factor")] = ("f32", 1.0 / cfg.freq_scale)
    elif cfg.ext_factor == 1.0:
        if (cfg.beta_fast, cfg.beta_slow) != (32.0, 1.0):
            raise GGUFError(f"YaRN betas {cfg.beta_fast}/{cfg.beta_slow}: llama.cpp's dflash loader only runs 32/1")
        if cfg.n_ctx_orig <= 0:
            raise GGUFError("YaRN rope needs n_ctx_orig > 0")
        factor = 1.0 / cfg.freq_scale
        magnitude = 1.0 if factor > 1.0 else 1.0 / (1.0 + 0.1 * math.log(factor))
        attn = cfg.attn_factor / magnitude
        out[key("rope.scaling.type")] = ("str", "yarn")
        out[key("rope.scaling.factor")] = ("f32", factor)
        out[key("rope.scaling.original_context_length")] = ("u32", cfg.n_ctx_orig)
    else:
        raise GGUFError(f"ext_factor {cfg.ext_factor}: llama.cpp runs YaRN with ext_factor 1 only")
    if attn != 1.0:
        out[key("rope.scaling.attn_factor")] = ("f32", attn)
    return out


def _tensor_bytes(name: str, arr: np.ndarray, dtype: str) -> tuple[np.ndarray, Any]:
    """(payload, raw GGML type) for GGUFWriter.add_tensor; anything but a matrix (norm vectors,
    DFlash-2's 3-D base kernels) always f32."""
    from gguf import GGMLQuantizationType as Q

    if arr.ndim != 2 or dtype == "f32":
        return np.ascontiguousarray(arr, dtype=np.float32), None
    if dtype == "f16":
        return np.ascontiguousarray(arr, dtype=np.float16), None
    if dtype == "bf16":
        return to_bf16_bits(arr).view(np.uint8).reshape(arr.shape[0], -1), Q.BF16
    # imported here: the one use of the compiled ggml in the model layer (docs/design.md, "Layers")
    from ..ggml.types import quantize

    try:
        raw = quantize(dtype, arr)
    except ValueError as e:
        raise GGUFError(f"cannot store {name!r} {arr.shape} as {dtype}: {e}") from e
    return raw.reshape(arr.shape[0], -1), Q[dtype.upper()]


def _check_dflash2_writable(cfg: DraftConfig, n_vocab: int) -> None:
    """What llama.cpp's loader would refuse in a DFlash-2 file that DraftConfig allows."""
    k = cfg.selector_top_k
    if cfg.hidden < k * (k + 1):
        raise GGUFError(
            f"{key('selector_top_k')} = {k}: the selector's lattice would not fit in n_embd (llama.cpp packs "
            f"k + k*k = {k * (k + 1)} values per position into one {cfg.hidden}-wide hidden row and "
            "refuses the file)"
        )
    if k > n_vocab:
        raise GGUFError(f"{key('selector_top_k')} = {k} exceeds the target vocabulary of {n_vocab} tokens")


def use_more_bits(layer: int, n_layer: int) -> bool:
    """llama.cpp's rule for the layers of a Q4_K_M file whose V / down projections get q6_K: the
    first and last eighth, and every third one between."""
    return layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2


# the types llama.cpp's converter itself writes (--outtype); a codebook keeps these
CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0")
Q8_0_BLOCK = 32


def codebook_type(dtype: str, rank: int) -> str:
    """The type of a DFlash-2 selector codebook (V, R) in a file of `dtype` (see the module docstring)."""
    wanted = dtype if dtype in CONVERTER_TYPES else "q8_0"
    if wanted == "q8_0" and rank % Q8_0_BLOCK:
        return "f16"
    return wanted


def matrix_type(name: str, dtype: str, n_layer: int) -> str:
    """The type `name` is stored in for a file of `dtype` (the mix's choice for "q4_k_m").
    Selector codebooks go through `codebook_type` instead."""
    if dtype != "q4_k_m":
        return dtype
    if name == "lm_head":
        return "q6_k"
    parts = name.split(".")
    if parts[0] == "layers" and ".".join(parts[2:]) in Q4_K_M_MORE_BITS and use_more_bits(int(parts[1]), n_layer):
        return "q6_k"
    return "q4_k"


def save_gguf(
    weights: DraftWeights, path: str | Path, dtype: str = "f16", vocab_from: str | Path | None = None
) -> Path:
    """Write `weights` as a dflash GGUF at `path` (a .gguf file, or a directory for model.gguf)."""
    from gguf import GGUFValueType, GGUFWriter

    dtype = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}.get(dtype, dtype).lower()
    if dtype not in GGUF_DTYPES:
        raise GGUFError(f"GGUF dtype must be one of {GGUF_DTYPES}, got {dtype!r}")
    if vocab_from is None:
        raise GGUFError("a dflash GGUF carries the target's vocabulary: pass vocab_from=<the target's GGUF>")
    cfg = weights.cfg
    if not cfg.target_layer_ids:
        raise GGUFError("the config has no target_layer_ids (llama.cpp needs dflash.target_layers)")
    vocab = _target_vocab(vocab_from)
    n_vocab = len(dict((k, v) for k, v, *_ in vocab)["tokenizer.ggml.tokens"])
    if cfg.vocab is not None and cfg.vocab != n_vocab:
        raise GGUFError(f"the config's vocab {cfg.vocab} differs from {vocab_from}'s {n_vocab} tokens")
    if not 0 <= cfg.mask_token_id < n_vocab:
        raise GGUFError(f"mask_token_id {cfg.mask_token_id} outside the target's {n_vocab} tokens")
    for name, m in (("embed_tokens", weights.embed_tokens), ("lm_head", weights.lm_head)):
        if m is not None and m.shape[0] != n_vocab:
            raise GGUFError(f"{name} has {m.shape[0]} rows, the target vocabulary {n_vocab}")
    if cfg.is_dflash2:
        _check_dflash2_writable(cfg, n_vocab)

    out = gguf_path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    w = GGUFWriter(tmp, ARCH)
    try:
        w.add_string("general.name", "pyggml_dkv dflash drafter")
        u32: dict[str, int] = {
            key("context_length"): cfg.n_ctx_orig or DEFAULT_CONTEXT_LENGTH,
            key("embedding_length"): cfg.hidden,
            key("block_count"): cfg.n_layer,
            key("feed_forward_length"): cfg.ffn,
            key("attention.head_count"): cfg.n_head,
            key("attention.head_count_kv"): cfg.n_head_kv,
            key("attention.key_length"): cfg.head_dim,
            key("attention.value_length"): cfg.head_dim,
            key("rope.dimension_count"): cfg.head_dim,
            key("block_size"): cfg.block_size,
            key("vocab_size"): n_vocab,
        }
        for k, v in u32.items():
            w.add_uint32(k, int(v))
        w.add_float32(key("attention.layer_norm_rms_epsilon"), float(cfg.rms_eps))
        adders: dict[str, Callable[[str, Any], None]] = {"f32": w.add_float32, "u32": w.add_uint32, "str": w.add_string}
        for k, (kind, v) in _rope_keys(cfg).items():
            adders[kind](k, v)
        w.add_key_value(
            key("target_layers"),
            [i + TARGET_LAYER_OFFSET for i in cfg.target_layer_ids],
            GGUFValueType.ARRAY,
            sub_type=GGUFValueType.INT32,
        )
        if cfg.any_swa:  # as llama.cpp's converter writes them (it runs them its own way, see gguf_read)
            w.add_uint32(key("attention.sliding_window"), cfg.swa_window)
            w.add_key_value(
                key("attention.sliding_window_pattern"),
                [t == "sliding" for t in cfg.layer_types],
                GGUFValueType.ARRAY,
                sub_type=GGUFValueType.BOOL,
            )
        if cfg.output_multiplier != 1.0:
            w.add_float32(key("logit_scale"), float(cfg.output_multiplier))
        if cfg.final_logit_softcapping is not None:
            w.add_float32(key("final_logit_softcapping"), float(cfg.final_logit_softcapping))
        if cfg.input_embedding_scale != 1.0:
            w.add_float32(key("embedding_scale"), float(cfg.input_embedding_scale))
        for name in DFLASH2_KEYS if cfg.is_dflash2 else ():
            w.add_uint32(key(name), int(getattr(cfg, name)))
        for k, v, vtype, sub in vocab:
            w.add_key_value(k, v, vtype, sub_type=sub)
        w.add_uint32(MASK_KEY, int(cfg.mask_token_id))

        arrays = dict(weights.items())
        if weights.embed_tokens is not None:
            arrays["embed_tokens"] = weights.embed_tokens
        if weights.lm_head is not None:
            arrays["lm_head"] = weights.lm_head
        for name, arr in arrays.items():
            if is_selector_codebook(name):
                kind = codebook_type(dtype, arr.shape[1])
            else:
                kind = matrix_type(name, dtype, cfg.n_layer)
            payload, raw_type = _tensor_bytes(name, arr, kind)
            w.add_tensor(gguf_name(name), payload, raw_dtype=raw_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    os.replace(tmp, out)
    log.info("wrote %s (%s, %d tensors)", out, dtype, len(arrays))
    return out
