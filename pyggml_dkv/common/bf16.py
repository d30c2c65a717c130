"""bfloat16 <-> float32 as raw uint16 bit patterns, rounding exactly as ggml does.

ml_dtypes does the rounding (to nearest, ties to even) and the exact widening. The one place
ggml differs is NaN: ml_dtypes makes every NaN the canonical 0x7FC0, ggml keeps the payload's
top bits and sets the quiet bit. We follow ggml, so host-side conversions (feature ring,
checkpoints, Tensor.set) give the same bits ggml's own conversion would.
"""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np

bfloat16 = np.dtype(ml_dtypes.bfloat16)


def to_bf16_bits(x: object) -> np.ndarray:
    """float32 (or anything float-like) -> bf16 bit patterns (uint16), the input's shape."""
    f32 = np.asarray(x, dtype=np.float32)
    with warnings.catch_warnings():  # NaN inputs make numpy warn about the cast; handled below
        warnings.simplefilter("ignore", RuntimeWarning)
        bits = f32.astype(bfloat16, order="C").view(np.uint16)  # C order: ggml copies raw bytes
    nan = np.isnan(f32)
    if nan.any():
        bits = np.where(nan, ((f32.view(np.uint32) >> 16) | 0x40).astype(np.uint16), bits)
    return bits


def from_bf16_bits(bits: object) -> np.ndarray:
    """bf16 bit patterns -> float32 (exact)."""
    return np.asarray(bits, dtype=np.uint16).view(bfloat16).astype(np.float32)
