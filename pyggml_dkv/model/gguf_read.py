"""Read a llama.cpp dflash GGUF drafter into DraftConfig + DraftWeights.

The file is memory-mapped (gguf.GGUFReader). Every metadata key it holds is either mapped to
our config, accepted as information we do not need (general.*, the vocabulary), or refused by
name when it describes something our drafter does not run (DSpark heads, value scales, partial
rotary, M-RoPE, causal attention, ...). Every tensor is mapped by name (gguf_names.py) or
refused by name.

DFlash-2 files (docs/dflash2.md) are read under llama.cpp's own rules
(`llama_model_dflash::load_arch_tensors`): the four `dflash.conv_*` / `dflash.selector_*` keys
all positive, H % conv_group_size == 0, H >= top_k * (top_k + 1), every convolution and selector
tensor present with its shape, base kernels in F32. A file with the keys but not the tensors (or
the tensors but not the keys) is refused too: llama.cpp would run half of DFlash-2.

Matrices keep the file's storage as StoredMatrix (quantized blocks stay quantized on the
backend, see BackendWeights dtype "native"); the host copy is their float32 dequantization by
`gguf.quants.dequantize` (independent of ggml), which the float64 reference computes with.

Target layer ids: GGUF stores the layers whose input is tapped (id + 1), we store id.
"""

import builtins
import logging
import math
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..common.checks import is_int, is_real
from .config import ConfigError, DraftConfig
from .gguf_names import (
    ARCH,
    DEFAULT_BLOCK_SIZE,
    DFLASH2_KEYS,
    TARGET_LAYER_OFFSET,
    GGUFError,
    gguf_name,
    is_dflash2_gguf_tensor,
    key,
    our_name,
    refusal_reason,
)
from .stored import STORED_TYPES, StoredMatrix
from .tensor_names import dflash2_shapes, is_conv_base_kernel

log = logging.getLogger(__name__)

_MISSING = object()

# keys we accept and do not need: why
_INFORMATIONAL = {
    key("context_length"): "the training context (only YaRN's fallback original context)",
    key("rope.scaling.finetuned"): "informational",
    "tokenizer.ggml.mask_token_id": "read as mask_token_id",
}
# keys whose presence means a drafter we cannot run: why
_REFUSED_KEYS = {
    key("sample_from_anchor"): "DSpark anchor sampling",
    key("has_confidence_head"): "the DSpark confidence head",
    key("rope.scaling.yarn_log_multiplier"): "YaRN log-multiplier magnitude scaling",
}


def field_value(field: Any) -> Any:
    """A GGUFReader field as a Python value (str, int, float, bool, or a list of them). A float32
    value comes back as the shortest decimal that rounds to it (1e-06, not 9.99999997e-07)."""
    from gguf import GGUFValueType

    value = field.contents()
    if field.types and field.types[0] == GGUFValueType.FLOAT32:
        value = float(str(np.float32(value)))
    return value


class _Keys:
    """The file's metadata, tracking which keys were consumed so leftovers can be refused."""

    def __init__(self, reader: Any) -> None:
        self.kv = {name: field_value(f) for name, f in reader.fields.items() if not name.startswith("GGUF.")}
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.kv

    def get(self, name: str, default: Any = _MISSING) -> Any:
        if name not in self.kv:
            if default is _MISSING:
                raise GGUFError(f"missing key {name!r}")
            return default
        self.used.add(name)
        return self.kv[name]

    def int(self, name: str, default: Any = _MISSING) -> Any:
        value = self.get(name, default)
        if value is default:
            return value
        if not is_int(value):
            raise GGUFError(f"key {name!r} must be an integer, got {value!r}")
        return value

    def float(self, name: str, default: Any = _MISSING) -> Any:
        value = self.get(name, default)
        if value is default:
            return value
        if not is_real(value) or not math.isfinite(value):
            raise GGUFError(f"key {name!r} must be a finite number, got {value!r}")
        return float(value)

    def uniform_int(self, name: str, n_layer: builtins.int, default: Any = _MISSING) -> Any:  # (int: the method above)
        """An int, or a per-layer array that must hold one value (we run uniform layers)."""
        value = self.get(name, default)
        if isinstance(value, list):
            if len(value) != n_layer or len(set(value)) != 1:
                raise GGUFError(f"key {name!r} varies per layer ({value}); we run uniform layers")
            value = value[0]
        if not is_int(value):
            raise GGUFError(f"key {name!r} must be an integer, got {value!r}")
        return value


def config_from_gguf(keys: _Keys) -> DraftConfig:
    """Map the file's metadata to a DraftConfig; refuse what we cannot run."""
    arch = keys.get("general.architecture")
    if arch != ARCH:
        raise GGUFError(f"general.architecture is {arch!r}, expected {ARCH!r} (a DFlash drafter)")
    for name, why in _REFUSED_KEYS.items():
        if keys.has(name):
            raise GGUFError(f"key {name!r}: {why} is not supported by this drafter")

    hidden = keys.int(key("embedding_length"))
    n_layer = keys.int(key("block_count"))
    n_head = keys.uniform_int(key("attention.head_count"), n_layer)
    n_head_kv = keys.uniform_int(key("attention.head_count_kv"), n_layer, n_head)
    head_dim = keys.int(key("attention.key_length"), hidden // n_head if n_head else 0)
    if keys.int(key("attention.value_length"), head_dim) != head_dim:
        raise GGUFError(f"{key('attention.value_length')} differs from the key length {head_dim}")
    if keys.int(key("rope.dimension_count"), head_dim) != head_dim:
        raise GGUFError(
            f"{key('rope.dimension_count')} = {keys.kv[key('rope.dimension_count')]} < head_dim "
            f"{head_dim}: partial rotary embeddings are not supported"
        )
    sections = keys.get(key("rope.dimension_sections"), [0, 0, 0, 0])
    if any(sections):
        raise GGUFError(f"{key('rope.dimension_sections')} = {sections}: M-RoPE drafters are not supported")
    act = keys.get(key("hidden_act"), "silu")
    if act != "silu":
        raise GGUFError(f"{key('hidden_act')} = {act!r}: only silu FFNs are supported")
    if keys.get(key("attention.causal"), False):
        raise GGUFError(f"{key('attention.causal')} = true: causal drafters are not supported")
    if keys.float(key("attention.value_scale"), 0.0) != 0.0:
        raise GGUFError(f"{key('attention.value_scale')}: attention value scales are not supported")
    attn_scale = keys.float(key("attention.scale"), 0.0)
    if attn_scale != 0.0 and not math.isclose(attn_scale, 1.0 / math.sqrt(head_dim), rel_tol=1e-6):
        raise GGUFError(f"{key('attention.scale')} = {attn_scale}: only 1/sqrt(head_dim) is supported")

    n_ctx_train = keys.int(key("context_length"), 0)
    rope = _rope_from_gguf(keys, n_ctx_train)

    ids = keys.get(key("target_layers"))
    if not isinstance(ids, list) or not ids or any(not is_int(i) or i < TARGET_LAYER_OFFSET for i in ids):
        raise GGUFError(f"{key('target_layers')} must be a non-empty list of layer inputs >= 1, got {ids!r}")

    swa_window = keys.int(key("attention.sliding_window"), 0)
    pattern = keys.get(key("attention.sliding_window_pattern"), None)
    if swa_window > 0:
        if not isinstance(pattern, list) or len(pattern) != n_layer:
            raise GGUFError(
                f"{key('attention.sliding_window')} needs a {n_layer}-entry sliding_window_pattern, got {pattern!r}"
            )
        layer_types = ["sliding" if p else "full" for p in pattern]
        if "sliding" in layer_types:
            log.warning(
                "%s: sliding layers; llama.cpp runs them non-causal over the noise block with a per-row "
                "window: build the drafter with swa='llama' to draft exactly as llama.cpp does (the "
                "default, 'seed', windows like the C++ seed; 'per_row' like the dflash reference)",
                ARCH,
            )
    else:
        if pattern is not None and any(pattern):
            raise GGUFError(f"{key('attention.sliding_window_pattern')} marks sliding layers without a sliding window")
        layer_types = []
        swa_window = 0

    tokens = keys.get("tokenizer.ggml.tokens", None)
    vocab = len(tokens) if isinstance(tokens, list) else None
    vocab_size = keys.int(key("vocab_size"), vocab)
    if vocab is not None and vocab_size != vocab:
        raise GGUFError(f"{key('vocab_size')} = {vocab_size} but the tokenizer has {vocab} tokens")
    mask = keys.int("tokenizer.ggml.mask_token_id", None)
    if mask is None:
        raise GGUFError("missing key 'tokenizer.ggml.mask_token_id' (the drafter's mask token)")
    softcap = keys.float(key("final_logit_softcapping"), 0.0)
    emb_scale = keys.float(key("embedding_scale"), 0.0)
    dflash2 = _dflash2_from_gguf(keys, hidden, vocab_size)
    try:
        return DraftConfig(
            hidden=hidden,
            n_layer=n_layer,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            ffn=keys.uniform_int(key("feed_forward_length"), n_layer),
            block_size=keys.int(key("block_size"), DEFAULT_BLOCK_SIZE),
            n_target_layers=len(ids),
            rms_eps=keys.float(key("attention.layer_norm_rms_epsilon")),
            layer_types=layer_types,
            swa_window=swa_window,
            mask_token_id=mask,
            vocab=vocab_size,
            input_embedding_scale=emb_scale if emb_scale != 0.0 else 1.0,
            output_multiplier=keys.float(key("logit_scale"), 1.0),
            final_logit_softcapping=softcap if softcap > 0 else None,
            target_layer_ids=[i - TARGET_LAYER_OFFSET for i in ids],
            **rope,
            **dflash2,
        )
    except ConfigError as e:
        raise GGUFError(f"the file's hyper-parameters do not make a drafter: {e}") from e


def _dflash2_from_gguf(keys: _Keys, hidden: int, vocab: int | None) -> dict[str, int]:
    """The DFlash-2 fields of DraftConfig from the file's keys, checked as llama.cpp checks them
    (plus what it would only trip over later: top_k beyond the vocabulary). No key, or all four
    0, is DFlash-1 (llama.cpp: no selector, no convolutions)."""
    present = [name for name in DFLASH2_KEYS if keys.has(key(name))]
    if not present:
        return {}
    values = {name: keys.int(key(name), 0) for name in DFLASH2_KEYS}
    if all(v == 0 for v in values.values()):
        return {}
    for name in DFLASH2_KEYS:
        if name not in present:
            raise GGUFError(
                f"missing key {key(name)!r}: a DFlash-2 file needs all of "
                f"{[key(n) for n in DFLASH2_KEYS]} (has {[key(n) for n in present]})"
            )
        if values[name] <= 0:
            raise GGUFError(
                f"key {key(name)!r} = {values[name]} must be > 0 in a DFlash-2 file "
                f"(llama.cpp: 'DFlash2 model is missing conv/selector metadata')"
            )
    group, top_k = values["conv_group_size"], values["selector_top_k"]
    if hidden % group:
        raise GGUFError(
            f"key {key('conv_group_size')!r} = {group} does not divide "
            f"{key('embedding_length')} = {hidden} (llama.cpp refuses the file)"
        )
    if hidden < top_k * (top_k + 1):
        raise GGUFError(
            f"key {key('selector_top_k')!r} = {top_k}: the selector's lattice would not fit in n_embd "
            f"(llama.cpp packs k + k*k = {top_k * (top_k + 1)} values per position into one "
            f"{hidden}-wide hidden row, and refuses the file)"
        )
    if vocab is None:
        raise GGUFError(
            f"a DFlash-2 file needs its vocabulary size ({key('vocab_size')} or tokenizer.ggml.tokens): "
            "the selector's codebooks have one row per token"
        )
    if top_k > vocab:
        raise GGUFError(f"key {key('selector_top_k')!r} = {top_k} exceeds the vocabulary of {vocab} tokens")
    return values


# where the selector's tensors hold the rank, in numpy (out, in) order: (R, H), (V, R), (V, R)
_RANK_AXIS = {"selector_hidden.weight": 0, "selector_predecessor.weight": 1, "selector_successor.weight": 1}


def _ne(shape: tuple[int, ...]) -> str:
    """A numpy (out, in) shape in ggml's `ne` order, as llama.cpp prints it: {in, out}."""
    return "{" + ", ".join(str(n) for n in reversed(shape)) + "}"


def check_dflash2_tensors(cfg: DraftConfig, shapes: dict[str, tuple[int, ...]], types: dict[str, str]) -> None:
    """The file's DFlash-2 tensors against its keys. `shapes`: GGUF name -> numpy shape (the
    reverse of `ne`), `types`: GGUF name -> ggml type name, for every tensor of the file.

    llama.cpp decides DFlash-2 by the tensor selector_hidden.weight and its draft loop by the key
    selector_top_k; a file with only one of the two would load and then run half a drafter, so
    both directions are refused here, naming the tensor or key."""
    found = sorted(n for n in shapes if is_dflash2_gguf_tensor(n))
    if not cfg.is_dflash2:
        if found:
            raise GGUFError(
                f"tensor {found[0]!r} is a DFlash-2 tensor ({len(found)} in the file) but the file has "
                f"none of the keys {[key(n) for n in DFLASH2_KEYS]} (llama.cpp refuses it: "
                "'DFlash2 model is missing conv/selector metadata')"
            )
        return
    want = {gguf_name(ours): shape for ours, shape in dflash2_shapes(cfg).items()}
    missing = [n for n in want if n not in shapes]
    if missing and not found:
        raise GGUFError(
            f"the file has the DFlash-2 keys ({key('selector_top_k')} = {cfg.selector_top_k}, ...) but "
            f"no DFlash-2 tensor: missing {missing[:4]}{' ...' if len(missing) > 4 else ''}"
        )
    if missing:
        raise GGUFError(
            f"missing DFlash-2 tensor {missing[0]!r}{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}"
        )
    rank_key = key("selector_rank")
    for name, shape in want.items():
        got = shapes[name]
        if got == shape:
            continue
        if name in _RANK_AXIS and len(got) == 2:
            rank = got[_RANK_AXIS[name]]
            if rank != cfg.selector_rank:
                raise GGUFError(
                    f"tensor {name!r} has ne {_ne(got)}, expected {_ne(shape)}: its rank {rank} differs from "
                    f"{rank_key} = {cfg.selector_rank} (the selector's tensors must share one rank)"
                )
        raise GGUFError(f"tensor {name!r} has ne {_ne(got)}, expected {_ne(shape)} for this file's keys")
    for ours in dflash2_shapes(cfg):
        name = gguf_name(ours)
        if is_conv_base_kernel(ours) and types[name] != "f32":
            raise GGUFError(
                f"tensor {name!r} is {types[name].upper()}: llama.cpp adds the base kernel to f32 taps "
                "with ggml_add, which needs it in F32 (its converter always writes F32)"
            )


def _rope_from_gguf(keys: _Keys, n_ctx_train: int) -> dict[str, Any]:
    """RoPE in ggml_rope_ext's terms, the way llama.cpp's context sets them up for a dflash model:
    none / linear: freq_scale = 1/factor, no ramp; yarn: ext_factor 1, betas 32 / 1 (the dflash
    loader reads no yarn_* keys), and an attn_factor that cancels ggml's own YaRN magnitude
    (1 + 0.1 ln factor) for factor > 1; times rope.scaling.attn_factor in every case."""
    theta = keys.float(key("rope.freq_base"), 10000.0)  # llama.cpp's default
    kind = keys.get(key("rope.scaling.type"), "linear")
    factor = keys.float(key("rope.scaling.factor"), 0.0)
    if factor == 0.0:
        factor = keys.float(key("rope.scale_linear"), 0.0)
    attn = keys.float(key("rope.scaling.attn_factor"), 1.0)
    orig = keys.int(key("rope.scaling.original_context_length"), n_ctx_train)
    out: dict[str, Any] = dict(rope_theta=theta, attn_factor=attn)
    if kind == "none":
        return out
    if kind not in ("linear", "yarn"):
        raise GGUFError(f"{key('rope.scaling.type')} = {kind!r}: only none / linear / yarn are supported")
    if factor < 0:
        raise GGUFError(f"{key('rope.scaling.factor')} must be >= 0, got {factor}")
    if factor != 0.0:
        out["freq_scale"] = 1.0 / factor
    if kind == "yarn":
        f = factor if factor != 0.0 else 1.0
        if orig <= 0:
            raise GGUFError("yarn rope needs rope.scaling.original_context_length or context_length > 0")
        # llama.cpp's converter copies these from the HF config, its dflash loader ignores them and
        # runs ext 1, betas 32 / 1, magnitude 1 + 0.1 ln(factor) (HF's default attention_factor):
        # accepted when they say the same, refused when the file means something llama.cpp does not run
        hf_magnitude = 1.0 + 0.1 * math.log(f) if f > 1.0 else 1.0
        for name, runs in (
            ("yarn_ext_factor", 1.0),
            ("yarn_beta_fast", 32.0),
            ("yarn_beta_slow", 1.0),
            ("yarn_attn_factor", hf_magnitude),
        ):
            value = keys.float(key(f"rope.scaling.{name}"), runs)
            if not math.isclose(value, runs, rel_tol=1e-6):
                raise GGUFError(
                    f"{key(f'rope.scaling.{name}')} = {value}: llama.cpp's dflash loader ignores it and "
                    f"runs {runs}; this file means a different rope"
                )
        magnitude = 1.0 if f > 1.0 else 1.0 / (1.0 + 0.1 * math.log(f))
        out.update(ext_factor=1.0, beta_fast=32.0, beta_slow=1.0, n_ctx_orig=orig, attn_factor=attn * magnitude)
    return out


def host_array(tensor: Any) -> np.ndarray:
    """A GGUF tensor as float32 in numpy (out, in) order, dequantized by the gguf package."""
    from gguf.quants import dequantize

    arr = dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(arr, dtype=np.float32).reshape(tuple(int(n) for n in reversed(tensor.shape)))


def _stored(tensor: Any, type_name: str, shape: tuple[int, ...]) -> StoredMatrix:
    raw = np.asarray(tensor.data)
    raw = (
        raw.reshape(-1).view(np.uint8)
        if raw.flags.c_contiguous
        else np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    )
    return StoredMatrix(type_name, (int(shape[0]), int(shape[1])), raw)


class GGUFDrafter(NamedTuple):
    """What a dflash GGUF holds, for DraftWeights (model/weights.py load_gguf) to check and keep."""

    cfg: DraftConfig
    tensors: dict[str, np.ndarray]  # float32 host copies (dequantized)
    stored: dict[str, StoredMatrix]  # the matrices as the file stores them
    embed_tokens: np.ndarray | None
    lm_head: np.ndarray | None


def read_gguf(path: str | Path) -> GGUFDrafter:
    """Read a dflash GGUF; see the module docstring."""
    try:
        from gguf import GGUFReader
    except ImportError as e:  # pragma: no cover - a dependency
        raise GGUFError("reading GGUF needs the `gguf` package (pip install gguf)") from e
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"no such GGUF file: {path}")
    try:
        reader = GGUFReader(path, "r")
    except (ValueError, OSError) as e:
        raise GGUFError(f"{path}: not a readable GGUF file ({e})") from e
    keys = _Keys(reader)
    cfg = config_from_gguf(keys)
    for name in keys.kv:
        if name in keys.used or name in _INFORMATIONAL or name.startswith(("general.", "tokenizer.")):
            continue
        raise GGUFError(f"{path.name}: key {name!r} is not something this drafter maps or can ignore")

    check_dflash2_tensors(
        cfg,
        {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors},
        {t.name: t.tensor_type.name.lower() for t in reader.tensors},
    )
    tensors: dict[str, np.ndarray] = {}
    stored: dict[str, StoredMatrix] = {}
    has_v = set()
    for t in reader.tensors:
        ours = our_name(t.name)
        if ours is None:
            raise GGUFError(f"{path.name}: tensor {t.name!r} ({refusal_reason(t.name)}) is not supported")
        type_name = t.tensor_type.name.lower()
        if type_name not in STORED_TYPES:
            raise GGUFError(f"{path.name}: tensor {t.name!r} is {t.tensor_type.name}; supported: {STORED_TYPES}")
        host = host_array(t)
        tensors[ours] = host
        if host.ndim == 2:
            stored[ours] = _stored(t, type_name, host.shape)
        if ours.endswith("v_proj.weight"):
            has_v.add(ours)
    missing_v = [i for i in range(cfg.n_layer) if f"layers.{i}.self_attn.v_proj.weight" not in has_v]
    if missing_v:
        raise GGUFError(f"{path.name}: layer(s) {missing_v} have no attn_v: shared K/V is not supported")
    embed = tensors.pop("embed_tokens", None)
    head = tensors.pop("lm_head", None)
    log.info(
        "read %s: %d tensors, types %s", path.name, len(reader.tensors), sorted({m.type_name for m in stored.values()})
    )
    return GGUFDrafter(cfg, tensors, stored, embed, head)
