"""Helpers for the GGUF tests: a tiny target vocabulary file, and a GGUF copier with edits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def write_vocab_gguf(path: Path, n_vocab: int) -> Path:
    """A target GGUF holding only a vocabulary (what a dflash GGUF copies from its target)."""
    from gguf import GGUFWriter

    w = GGUFWriter(path, "llama")
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(n_vocab)])
    w.add_array("tokenizer.ggml.token_type", [1] * n_vocab)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def copy_gguf(
    src: Path,
    dst: Path,
    *,
    set_keys: dict[str, tuple[Any, Any]] | None = None,
    drop_keys: tuple[str, ...] = (),
    add_tensors: dict[str, np.ndarray] | None = None,
    drop_tensors: tuple[str, ...] = (),
    arch: str | None = None,
) -> Path:
    """Copy a GGUF, setting keys (name -> (value, GGUFValueType)), dropping keys / tensors, adding
    tensors (f32, or f16 when the array given is float16)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(src, "r")
    w = GGUFWriter(dst, arch or r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop_keys or name in (set_keys or {}):
            continue
        sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    for name, (value, vtype) in (set_keys or {}).items():
        if name == "general.architecture":
            continue
        sub = None
        if isinstance(vtype, tuple):
            vtype, sub = vtype
        w.add_key_value(name, value, vtype, sub_type=sub)
    for t in r.tensors:
        if t.name not in drop_tensors:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    for name, arr in (add_tensors or {}).items():
        arr = np.asarray(arr)
        w.add_tensor(name, arr if arr.dtype == np.float16 else arr.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
