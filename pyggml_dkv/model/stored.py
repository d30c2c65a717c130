"""StoredMatrix: a weight matrix exactly as a file stores it (e.g. a GGUF's Q4_K bytes).

A quantized GGUF drafter keeps these next to its dequantized float32 host copy, so the backend
multiplies the file's own blocks (ggml's quantized kernels) while the float64 reference computes
with the dequantized values of the very same blocks. Uploading one as-is:
`pyggml_dkv.drafter.backend_weights.upload_stored`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# ggml types a StoredMatrix may hold: the float types and the quantized ones we run and test
STORED_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k")
# type -> (values per block, bytes per block): ggml's ggml_blck_size / ggml_type_size, stated here
# so that this module (and the GGUF reader) imports without the compiled ggml
# (tests/model/test_gguf_quant.py checks them against ggml)
BLOCKS: dict[str, tuple[int, int]] = {
    "f32": (1, 4),
    "f16": (1, 2),
    "bf16": (1, 2),
    "q8_0": (32, 34),
    "q4_0": (32, 18),
    "q4_k": (256, 144),
    "q5_k": (256, 176),
    "q6_k": (256, 210),
}


def row_bytes(type_name: str, n: int) -> int:
    """Bytes of a row of `n` values in `type_name` (ggml_row_size); `n` a multiple of its block."""
    block, size = BLOCKS[type_name]
    return size * (n // block)


@dataclass(frozen=True)
class StoredMatrix:
    """`raw`: the row-major bytes of an (out, in) matrix in ggml type `type_name`."""

    type_name: str
    shape: tuple[int, int]
    raw: np.ndarray

    def __post_init__(self) -> None:
        if self.type_name not in STORED_TYPES:
            raise ValueError(f"stored matrix type must be one of {STORED_TYPES}, got {self.type_name!r}")
        if len(self.shape) != 2 or min(self.shape) <= 0:
            raise ValueError(f"stored matrix shape must be (out, in) > 0, got {self.shape}")
        block = BLOCKS[self.type_name][0]
        if self.shape[1] % block:
            raise ValueError(f"{self.type_name} rows must be a multiple of {block} values, got {self.shape[1]}")
        want = row_bytes(self.type_name, self.shape[1]) * self.shape[0]
        if self.raw.dtype != np.uint8 or self.raw.nbytes != want:
            raise ValueError(
                f"{self.type_name} {self.shape} matrix needs {want} uint8 bytes, got {self.raw.dtype} x {self.raw.size}"
            )

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)
