"""A minimal GGUF reader: metadata, tensor directory, and numpy dequantization of a few types.

The host needs a few of the target's tensors on the numpy side (token embeddings and lm_head for
the drafter, norm and layer weights for the feature-definition test). llama.cpp keeps its tensors
private, so we read the file itself (memory-mapped; nothing is copied until asked for).

Supported tensor types: F32, F16, BF16, Q8_0, Q4_0, Q4_1 (enough for SmolLM2-135M-Instruct Q4_1);
anything else raises a clear error naming the type.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...common.bf16 import from_bf16_bits

GGUF_MAGIC = b"GGUF"

# gguf value types
_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
            10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9

# ggml tensor types we can dequantize: id -> (name, block size, bytes per block)
TENSOR_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2),
                2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34)}


class GGUFError(ValueError):
    """The file is not a GGUF we can read, or asks for something we do not support."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: (rows, ..., row length); ggml's ne reversed
    type_id: int
    offset: int  # absolute byte offset in the file

    @property
    def type_name(self) -> str:
        return TENSOR_TYPES.get(self.type_id, (f"type {self.type_id}",))[0]


class _Cursor:
    def __init__(self, data: memoryview) -> None:
        self.data, self.pos = data, 0

    def scalar(self, fmt: str) -> Any:
        value = np.frombuffer(self.data, dtype=fmt, count=1, offset=self.pos)[0]
        self.pos += np.dtype(fmt).itemsize
        return value.item()

    def string(self) -> str:
        n = self.scalar("<u8")
        raw = bytes(self.data[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            v = self.scalar(_SCALARS[vtype])
            return bool(v) if vtype == 7 else v
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.scalar("<u4"), self.scalar("<u8")
            if etype in _SCALARS:  # numeric arrays in one go (token scores, types: 49k entries)
                arr = np.frombuffer(self.data, dtype=_SCALARS[etype], count=n, offset=self.pos)
                self.pos += n * np.dtype(_SCALARS[etype]).itemsize
                return arr
            return [self.value(etype) for _ in range(n)]
        raise GGUFError(f"unknown GGUF value type {vtype} at byte {self.pos}")


class GGUFFile:
    """Metadata (`meta`) and tensors (`tensors`, `array(name)`) of one GGUF file, memory-mapped."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"no such GGUF file: {self.path}")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        data = memoryview(self._map)
        if bytes(data[:4]) != GGUF_MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file (magic {bytes(data[:4])!r})")
        cur = _Cursor(data)
        cur.pos = 4
        self.version = cur.scalar("<u4")
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {self.version} is not supported")
        n_tensors, n_kv = cur.scalar("<u8"), cur.scalar("<u8")
        self.meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.meta[key] = cur.value(cur.scalar("<u4"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<u4")
            ne = [cur.scalar("<u8") for _ in range(n_dims)]
            infos.append((name, tuple(reversed(ne)), cur.scalar("<u4"), cur.scalar("<u8")))
        align = int(self.meta.get("general.alignment", 32))
        start = (cur.pos + align - 1) // align * align
        self.tensors = {n: TensorInfo(n, s, t, start + o) for n, s, t, o in infos}

    @property
    def architecture(self) -> str:
        return str(self.meta.get("general.architecture", ""))

    def arch_value(self, key: str, default: Any = None) -> Any:
        """`{architecture}.{key}` from the metadata, e.g. arch_value('block_count')."""
        return self.meta.get(f"{self.architecture}.{key}", default)

    def array(self, name: str, rows: slice | None = None) -> np.ndarray:
        """Tensor `name` dequantized to float32, numpy order (rows of ne0 values)."""
        info = self.tensors.get(name)
        if info is None:
            raise GGUFError(f"{self.path.name} has no tensor {name!r}")
        if info.type_id not in TENSOR_TYPES:
            raise GGUFError(f"tensor {name!r} has ggml type {info.type_id}, which this reader cannot dequantize "
                            f"(supported: {sorted(v[0] for v in TENSOR_TYPES.values())})")
        _, block, block_bytes = TENSOR_TYPES[info.type_id]
        row_len = info.shape[-1]
        n_rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
        if row_len % block:
            raise GGUFError(f"tensor {name!r}: row length {row_len} is not a multiple of {block}")
        row_bytes = row_len // block * block_bytes
        lo, hi = (0, n_rows) if rows is None else rows.indices(n_rows)[:2]
        raw = self._map[info.offset + lo * row_bytes: info.offset + hi * row_bytes]
        out = _dequantize(info.type_id, np.asarray(raw), (hi - lo) * row_len)
        return out.reshape((hi - lo, row_len) if len(info.shape) > 1 else (row_len,))


def _dequantize(type_id: int, raw: np.ndarray, n: int) -> np.ndarray:
    if type_id == 0:
        return raw.view("<f4").astype(np.float32)
    if type_id == 1:
        return raw.view("<f2").astype(np.float32)
    if type_id == 30:
        return from_bf16_bits(raw.view("<u2")).astype(np.float32)
    blocks = raw.reshape(n // 32, -1)
    d = blocks[:, 0:2].copy().view("<f2").astype(np.float32)  # (n_blocks, 1)
    if type_id == 8:  # Q8_0: d, 32 x int8
        return (blocks[:, 2:].view(np.int8).astype(np.float32) * d).reshape(-1)
    if type_id == 2:  # Q4_0: d, 16 bytes of nibbles, values (q - 8) * d
        qs = blocks[:, 2:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32) - 8.0
        return (q * d).reshape(-1)
    if type_id == 3:  # Q4_1: d, m, 16 bytes of nibbles, values q * d + m
        m = blocks[:, 2:4].copy().view("<f2").astype(np.float32)
        qs = blocks[:, 4:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
        return (q * d + m).reshape(-1)
    raise GGUFError(f"ggml type {type_id} is not supported")
