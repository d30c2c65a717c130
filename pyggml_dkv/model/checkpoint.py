"""DFlash drafter checkpoints: `config.json` + safetensors, in the `dflash` package's format (docs/design.md, "Checkpoints").

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

DFlash-2 checkpoints (``architectures: ["DFlash2DraftModel"]``, the four DFlash-2 keys in
``dflash_config``, docs/dflash2.md) also hold per layer
``layers.N.{attention_conv,mlp_conv}.{base_kernel, kernel_projection.weight}`` and
``candidate_selector.hidden_projection.weight``, ``candidate_selector.{predecessor,successor}_codebook``:
the codebooks without ``.weight``, as published (the ``dflash`` package and llama.cpp's converter
both append it; a file that already has it is accepted). We write them without it.

Anything a checkpoint holds that this package cannot run exactly is refused with a
`CheckpointError` naming it: DFlash-2 tensors without the DFlash-2 config (or the reverse),
attention biases, rope types other than default / linear / yarn, partial rotary, quantization,
non-causal sliding or causal full layers, unknown tensors or config keys,
dtypes other than F32 / F16 / BF16.

Where the pieces live: `hf_config` maps config.json, `safetensors_io` reads and writes the
tensor files (through the `safetensors` package), this module puts a directory together.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from .config import DraftConfig
from .errors import CheckpointError, CheckpointNotFoundError
from .hf_config import config_from_hf, config_to_hf
from .safetensors_io import (
    atomic_write,
    read_safetensors,
    read_safetensors_header,
    reject_duplicate_keys,
    save_dtype,
    write_safetensors,
)
from .tensor_names import SELECTOR_CODEBOOKS, expected_shapes, is_dflash2_tensor

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


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
        idx = json.loads(index.read_text(encoding="utf-8"), object_pairs_hook=reject_duplicate_keys)
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
        header, _ = read_safetensors_header(path)
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
        return {k[len("model.") :]: v for k, v in tensors.items()}
    return tensors


def _codebook_names(tensors: dict[str, np.ndarray], source: str) -> dict[str, np.ndarray]:
    """The selector's codebooks under our names (no `.weight`), whichever spelling the file uses."""
    out = dict(tensors)
    for name in SELECTOR_CODEBOOKS:
        spelled = name + ".weight"
        if spelled in out:
            if name in out:
                raise CheckpointError(f"{source}: both {name!r} and {spelled!r}: the same codebook twice")
            out[name] = out.pop(spelled)
    return out


def _describe_extra(cfg: DraftConfig, names: list[str]) -> str:
    d2 = [n for n in names if is_dflash2_tensor(n)]
    if d2 and not cfg.is_dflash2:
        return (
            f"DFlash-2 tensor(s) {d2[:6]} in a checkpoint whose config.json is DFlash-1 (no "
            'architectures ["DFlash2DraftModel"] / dflash_config conv_kernel_size, conv_group_size, '
            "selector_rank, selector_top_k)"
        )
    bias = [n for n in names if n.endswith(".bias")]
    if bias:
        return f"bias tensor(s) {bias[:6]} are not supported"
    return f"tensor(s) this drafter cannot run: {names[:6]}{' ...' if len(names) > 6 else ''}"


def read_checkpoint(path: str | Path) -> tuple[DraftConfig, dict[str, np.ndarray], str]:
    """(config, float32 tensors, where they came from) of a checkpoint directory; anything in it
    this drafter cannot run is refused by name. DraftWeights checks the rest."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointNotFoundError(f"checkpoint directory not found: {root}")
    cfg_path = root / CONFIG_NAME
    if not cfg_path.is_file():
        raise CheckpointNotFoundError(f"{CONFIG_NAME} not found: {cfg_path}")
    try:
        hf = json.loads(cfg_path.read_text(encoding="utf-8"), object_pairs_hook=reject_duplicate_keys)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON: {e}") from e
    except CheckpointError as e:
        raise CheckpointError(f"{cfg_path}: {e}") from e
    try:
        cfg = config_from_hf(hf)
    except CheckpointError as e:
        raise CheckpointError(f"{cfg_path}: {e}") from e

    tensors, source = _read_tensors(root)
    tensors = _codebook_names(_strip_model_prefix(tensors), source)
    extra = sorted(set(tensors) - set(expected_shapes(cfg)))
    if extra:
        raise CheckpointError(f"{source}: {_describe_extra(cfg, extra)}")
    return cfg, tensors, source


def write_checkpoint(
    cfg: DraftConfig, tensors: Mapping[str, np.ndarray], path: str | Path, dtype: str = "float32"
) -> None:
    """Write config.json + model.safetensors for `cfg` and its `tensors`."""
    dtype_name = save_dtype(dtype)[1]
    hf = config_to_hf(cfg, dtype_name)
    root = Path(path)
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"checkpoint path exists and is not a directory: {root}")
    root.mkdir(parents=True, exist_ok=True)
    write_safetensors(root / WEIGHTS_NAME, dict(tensors.items()), dtype_name)
    text = json.dumps(hf, indent=2, sort_keys=True) + "\n"
    atomic_write(root / CONFIG_NAME, lambda tmp: tmp.write_text(text, encoding="utf-8"))
