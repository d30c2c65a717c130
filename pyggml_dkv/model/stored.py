"""StoredMatrix: a weight matrix exactly as a file stores it (e.g. a GGUF's Q4_K bytes).

A quantized GGUF drafter keeps these next to its dequantized float32 host copy, so the backend
multiplies the file's own blocks (ggml's quantized kernels) while the float64 reference computes
with the dequantized values of the very same blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ggml import Backend, Buffer, Tensor, lib
from ..ggml.types import ggml_type
from .backend_weights import matrix_in_own_buffer

# ggml types a StoredMatrix may hold: the float types and the quantized ones we run and test
STORED_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k")


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
        t = ggml_type(self.type_name)
        if self.shape[1] % int(lib.ggml_blck_size(t)):
            raise ValueError(f"{self.type_name} rows must be a multiple of {int(lib.ggml_blck_size(t))} values, got {self.shape[1]}")
        want = int(lib.ggml_row_size(t, self.shape[1])) * self.shape[0]
        if self.raw.dtype != np.uint8 or self.raw.nbytes != want:
            raise ValueError(f"{self.type_name} {self.shape} matrix needs {want} uint8 bytes, got {self.raw.dtype} x {self.raw.size}")

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)


def upload_stored(backend: Backend, matrix: StoredMatrix, name: str, matmul_only: bool = False) -> tuple[Tensor, Buffer]:
    """Upload one stored matrix as-is into its own buffer (e.g. a GGUF drafter's token_embd /
    output, to pass to DraftKvCache as `embed_tokens` / `lm_head`). Close the buffer, then the
    tensor's context, when done.

    `matmul_only`: the matrix is only ever multiplied (an lm_head, never an embedding table read
    with get_rows), so its blocks may go to a repacking buffer (AMX, or the AVX512-VNNI q8_0
    kernel) like BackendWeights' matrices; in an ordinary buffer a q8_0 lm_head runs ggml's
    generic q8_0 product, several times slower on CPUs without AMX.
    """
    if not isinstance(matmul_only, bool):
        raise TypeError(f"matmul_only must be a bool, got {type(matmul_only).__name__}")
    t, buf = matrix_in_own_buffer(backend, matrix.type_name, matrix.shape, name, matmul_only)
    t.set_bytes(np.ascontiguousarray(matrix.raw).reshape(-1))
    return t, buf
