"""The host side of a screened argmax (ops_screen): a matrix's q8_0 screen and its error bounds.

The screen is the q8_0 quantization of the exact matrix, made once here so that the bounds
describe exactly the bytes that are uploaded: upload `raw` (Tensor.set_bytes) as the screen, not
the matrix a second time (ggml's quantizers may round a tie differently).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .types import dequantize, quantize

SCREEN_TYPE = "q8_0"
Q8_0_MAX = 127 * 65504.0  # a larger value in a block makes its f16 scale inf


@dataclass(frozen=True)
class Screen:
    raw: np.ndarray  # the q8_0 bytes of the matrix, row after row
    bounds: np.ndarray  # (V + 1, 2) f32: |exact_t - screen_t|, |screen_t| per row, then their maxima


def _rounded_up(values: np.ndarray) -> np.ndarray:
    """float64 -> float32 never below the value (the bound must stay a bound)."""
    out = values.astype(np.float32)
    low = out.astype(np.float64) < values
    out[low] = np.nextafter(out[low], np.float32(np.inf))
    return out


def screen_bounds(exact: np.ndarray, rows_per_chunk: int = 4096) -> Screen:
    """The q8_0 screen of an exact (V, H) matrix and the per-row norms the screened argmax's bound
    uses. `exact` must hold the values the op's exact products read (e.g. an f16 head read back
    as float32); wider values are rounded to float32 first."""
    m = np.asarray(exact)
    if m.ndim != 2 or m.dtype.kind != "f":
        raise ValueError(f"screen_bounds needs a floating-point (rows, columns) matrix, got {m.dtype} {m.shape}")
    v, h = m.shape
    if v == 0 or h == 0 or h % 32:
        raise ValueError(f"screen_bounds needs rows of a multiple of 32 values (q8_0 blocks), got shape {m.shape}")
    raws, norms = [], np.empty((v + 1, 2), dtype=np.float64)
    for lo in range(0, v, rows_per_chunk):  # in chunks: a 150k x 4k head would need 5 GB of float64 at once
        part = np.ascontiguousarray(m[lo : lo + rows_per_chunk], dtype=np.float32)
        if not np.isfinite(part).all():
            raise ValueError(f"the matrix to screen has NaN or inf values (rows {lo}..{lo + part.shape[0] - 1})")
        if np.abs(part).max() > Q8_0_MAX:  # the block scale (amax / 127, stored as f16) would overflow
            raise ValueError(
                f"the matrix to screen has values beyond q8_0's range (|value| > {Q8_0_MAX:.4g}) in rows "
                f"{lo}..{lo + part.shape[0] - 1}: it cannot be screened"
            )
        raw = quantize(SCREEN_TYPE, part)
        deq = dequantize(SCREEN_TYPE, raw, part.size).reshape(part.shape).astype(np.float64)
        norms[lo : lo + part.shape[0], 0] = np.linalg.norm(part.astype(np.float64) - deq, axis=1)
        norms[lo : lo + part.shape[0], 1] = np.linalg.norm(deq, axis=1)
        raws.append(raw)
    norms[v] = norms[:v].max(axis=0)
    # float64 norms of <= 2^31 terms are within ~1e-12 relative: widen by that, then round up
    return Screen(np.concatenate(raws), _rounded_up(norms * (1 + 1e-10)))
