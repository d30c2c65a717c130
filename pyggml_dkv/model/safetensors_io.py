"""Safetensors files as float32 numpy arrays, through the `safetensors` package (memory-mapped).

F32, F16 and BF16 are read (widened to float32 exactly) and written; BF16 goes through
common.bf16 (round to nearest even, as torch and ggml do). The package validates the layout;
the one check we add is that the JSON header has no duplicate names (the package would keep
the last silently).
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from ..common.bf16 import bfloat16, from_bf16_bits, to_bf16_bits
from .errors import CheckpointError, CheckpointNotFoundError

READ_DTYPES = ("F32", "F16", "BF16")
# save dtype spellings -> (safetensors tag, config.json "dtype")
SAVE_DTYPES: dict[str, tuple[str, str]] = {
    "float32": ("F32", "float32"),
    "f32": ("F32", "float32"),
    "fp32": ("F32", "float32"),
    "bfloat16": ("BF16", "bfloat16"),
    "bf16": ("BF16", "bfloat16"),
    "float16": ("F16", "float16"),
    "f16": ("F16", "float16"),
    "fp16": ("F16", "float16"),
}


def reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json object_pairs_hook: a JSON object naming one key twice is corrupt, not "last wins"."""
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise CheckpointError(f"duplicate key {key!r} in a JSON object")
        seen[key] = value
    return seen


def _check_no_duplicate_names(path: Path) -> None:
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) == 8:
            (n,) = struct.unpack("<Q", head)
            if n <= path.stat().st_size - 8:
                try:
                    json.loads(f.read(n), object_pairs_hook=reject_duplicate_keys)
                except (UnicodeDecodeError, json.JSONDecodeError):
                    pass  # the package reports corrupt JSON itself
                except CheckpointError as e:
                    raise CheckpointError(f"{path}: safetensors header: {e}") from e


def read_safetensors_header(path: str | Path) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """({name: {"dtype": tag, "shape": [...]}}, metadata) of a valid safetensors file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointNotFoundError(f"safetensors file not found: {path}")
    _check_no_duplicate_names(path)
    try:
        with safe_open(str(path), framework="numpy") as f:
            tensors = {
                name: {"dtype": f.get_slice(name).get_dtype(), "shape": list(f.get_slice(name).get_shape())}
                for name in f.keys()  # noqa: SIM118 (a safe_open handle, not a dict)
            }
            return tensors, dict(f.metadata() or {})
    except SafetensorError as e:
        raise CheckpointError(f"{path}: not a valid safetensors file ({e})") from e


def read_safetensors(path: str | Path, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """Read float tensors as float32 (exact). Any dtype but F32 / F16 / BF16 is refused, naming
    the tensor. `names` limits what is read."""
    path = Path(path)
    header, _ = read_safetensors_header(path)
    wanted = list(header) if names is None else list(names)
    out: dict[str, np.ndarray] = {}
    try:
        with safe_open(str(path), framework="numpy") as f:
            for name in wanted:
                if name not in header:
                    raise CheckpointError(f"{path}: no tensor {name!r}")
                dtype = header[name]["dtype"]
                if dtype not in READ_DTYPES:
                    raise CheckpointError(
                        f"{path}: tensor {name!r} has dtype {dtype}; only F32, F16 and BF16 are supported"
                    )
                out[name] = np.ascontiguousarray(f.get_tensor(name), dtype=np.float32)
    except SafetensorError as e:
        raise CheckpointError(f"{path}: not a valid safetensors file ({e})") from e
    return out


def save_dtype(dtype: npt.DTypeLike) -> tuple[str, str]:
    """(safetensors tag, config.json dtype name) for a dtype spelling or numpy dtype."""
    key: object = dtype
    if not isinstance(dtype, str) and dtype is not None:
        try:
            key = str(np.dtype(dtype))
        except TypeError:
            key = None
    if isinstance(key, str) and key.lower() in SAVE_DTYPES:
        return SAVE_DTYPES[key.lower()]
    raise CheckpointError(f"unsupported checkpoint dtype {dtype!r}; use 'float32', 'bfloat16' or 'float16'")


def _stored(name: str, array: np.ndarray, tag: str) -> np.ndarray:
    """`array` in the storage dtype of `tag`; values that overflow it are refused."""
    arr = np.asarray(array)
    if arr.dtype.kind not in "fiu":
        raise CheckpointError(f"tensor {name!r}: cannot store dtype {arr.dtype}")
    src = np.ascontiguousarray(arr, dtype=np.float32)
    if tag == "F32":
        return src
    if tag == "F16":
        with np.errstate(over="ignore"):
            data = src.astype(np.float16)
        back = data.astype(np.float32)
    else:
        bits = to_bf16_bits(src)
        data, back = bits.view(bfloat16), from_bf16_bits(bits)
    if (np.isinf(back) & ~np.isinf(src)).any():
        raise CheckpointError(f"tensor {name!r}: values overflow {tag}")
    return data


def write_safetensors(
    path: str | Path,
    tensors: Mapping[str, np.ndarray],
    dtype: str = "float32",
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write float tensors in `dtype` (float32 / bfloat16 / float16), atomically, with the
    ``{"format": "pt"}`` metadata transformers requires."""
    tag = save_dtype(dtype)[0]
    data = {name: _stored(name, tensors[name], tag) for name in sorted(tensors)}
    path = Path(path)
    atomic_write(path, lambda tmp: save_file(data, str(tmp), metadata={"format": "pt", **dict(metadata or {})}))


def atomic_write(path: Path, write: Any) -> None:
    """Call write(tmp_path) for a temporary file beside `path`, then move it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
