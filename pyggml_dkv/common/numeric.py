"""Numerical comparisons shared by tests, benchmarks and the parity checks."""

from __future__ import annotations

import numpy as np


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    """max|a-b| / max|b|: the parity figure every test and benchmark reports."""
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a64.shape != b64.shape:
        raise ValueError(f"shapes differ: {a64.shape} vs {b64.shape}")
    denom = np.abs(b64).max()
    return float(np.abs(a64 - b64).max() / denom) if denom > 0 else float(np.abs(a64).max())
