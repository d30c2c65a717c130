"""Pure-numpy number formats shared by the ggml layer and the host-side feature ring."""

from __future__ import annotations

import numpy as np


def fp32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns, rounding to nearest even exactly like ggml (NaN kept quiet)."""
    shape = np.shape(x)  # ascontiguousarray makes a 0-d input 1-d: give the result the input's shape
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits.astype(np.uint64) + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | 64).astype(np.uint16)
    return rounded.reshape(shape)


def bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    """max|a-b| / max|b|: the parity figure every test and benchmark reports."""
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a64.shape != b64.shape:
        raise ValueError(f"shapes differ: {a64.shape} vs {b64.shape}")
    denom = np.abs(b64).max()
    return float(np.abs(a64 - b64).max() / denom) if denom > 0 else float(np.abs(a64).max())
