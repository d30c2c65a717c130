"""ggml tensor types by name, and numpy <-> quantized-row conversion through ggml's own code."""

from __future__ import annotations

import numpy as np

from ..common.checks import is_int
from ._lowlevel import ffi, lib
from .errors import GGMLError

MAX_DIMS = 4

TYPES: dict[str, int] = {
    "f32": lib.GGML_TYPE_F32,
    "f16": lib.GGML_TYPE_F16,
    "bf16": lib.GGML_TYPE_BF16,
    "q8_0": lib.GGML_TYPE_Q8_0,
    "q4_0": lib.GGML_TYPE_Q4_0,
    # the k-quants GGUF drafters ship (Q4_K_M files mix q4_K, q5_K and q6_K)
    "q4_k": lib.GGML_TYPE_Q4_K,
    "q5_k": lib.GGML_TYPE_Q5_K,
    "q6_k": lib.GGML_TYPE_Q6_K,
    "i8": lib.GGML_TYPE_I8,
    "i16": lib.GGML_TYPE_I16,
    "i32": lib.GGML_TYPE_I32,
    "i64": lib.GGML_TYPE_I64,
    "f64": lib.GGML_TYPE_F64,
}

QUANT_TYPES = ("q8_0", "q4_0", "q4_k", "q5_k", "q6_k")
TYPE_NAMES = {v: k for k, v in TYPES.items()}
FLOAT_TYPES = {"f32", "f16", "bf16", "f64", *QUANT_TYPES}
INT_DTYPES: dict[str, type[np.signedinteger]] = {"i8": np.int8, "i16": np.int16, "i32": np.int32, "i64": np.int64}


def ggml_type(name: str | int) -> int:
    """The ggml enum value of a type name like "f16" (or pass an enum value through)."""
    if is_int(name):
        if int(name) not in TYPE_NAMES:
            raise ValueError(f"unsupported ggml type id {name}; supported: {sorted(TYPES)}")
        return int(name)
    if isinstance(name, str) and name.lower() in TYPES:
        return TYPES[name.lower()]
    raise ValueError(f"unknown ggml type {name!r}; supported: {sorted(TYPES)}")


def quantize(type_name: str, x: np.ndarray) -> np.ndarray:
    """Quantize float32 rows (last axis = a row) with ggml_quantize_chunk; returns the raw bytes."""
    t = ggml_type(type_name)
    if lib.ggml_quantize_requires_imatrix(t):
        raise ValueError(f"{type_name} needs an importance matrix; not supported")
    x = np.ascontiguousarray(x, dtype=np.float32)
    n_per_row = x.shape[-1] if x.ndim else 1
    if n_per_row % lib.ggml_blck_size(t):
        raise ValueError(f"{type_name} rows must be a multiple of {lib.ggml_blck_size(t)} values, got {n_per_row}")
    nrows = x.size // n_per_row
    out = np.empty(int(lib.ggml_row_size(t, n_per_row)) * nrows, dtype=np.uint8)
    written = lib.ggml_quantize_chunk(
        t, ffi.from_buffer("float[]", x), ffi.from_buffer(out), 0, nrows, n_per_row, ffi.NULL
    )
    if written != out.nbytes:  # pragma: no cover
        raise GGMLError(f"ggml_quantize_chunk wrote {written} bytes, expected {out.nbytes}")
    return out


def dequantize(type_name: str, raw: np.ndarray, n: int) -> np.ndarray:
    traits = lib.ggml_get_type_traits(ggml_type(type_name))
    out = np.empty(n, dtype=np.float32)
    traits.to_float(ffi.from_buffer(raw), ffi.from_buffer("float[]", out), n)
    return out
