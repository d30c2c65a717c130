"""BackendWeights: a drafter's parameters uploaded once into one backend buffer."""

from __future__ import annotations

import logging

import numpy as np

from .config import DraftConfig
from .ggml import Backend, Buffer, Context, Tensor, ggml_type, lib
from .weights import DraftWeights, is_norm

log = logging.getLogger(__name__)

WEIGHT_DTYPES = ("f32", "f16", "bf16", "q8_0")


class BackendWeights:
    """Matrices stored as `dtype` (f32, f16, bf16, q8_0), norm vectors always f32.

    `tensors[name]` is the ggml Tensor of checkpoint tensor `name`; `host` the DraftWeights
    they came from. Close it (or use `with`) to free the buffer.
    """

    def __init__(self, weights: DraftWeights, backend: Backend, dtype: str = "f16") -> None:
        if not isinstance(weights, DraftWeights):
            raise TypeError(f"expected DraftWeights, got {type(weights).__name__}")
        if dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight dtype must be one of {WEIGHT_DTYPES}, got {dtype!r}")
        cfg = weights.cfg
        if dtype == "q8_0":
            block = int(lib.ggml_blck_size(ggml_type("q8_0")))
            odd = sorted({n for n, a in weights.items() if a.ndim == 2 and a.shape[1] % block})
            if odd:
                raise ValueError(f"q8_0 needs every matrix's input width to be a multiple of {block}; not: {odd[:4]}")
        self.cfg: DraftConfig = cfg
        self.host = weights
        self.backend = backend
        self.dtype = dtype
        self.ctx = Context(n_tensors=len(weights) + 1)
        self.tensors: dict[str, Tensor] = {}
        for name, arr in weights.items():
            ty = "f32" if is_norm(name) or arr.ndim == 1 else dtype
            # ggml order is the reverse of numpy's: (out, in) -> [in, out]
            self.tensors[name] = self.ctx.new_tensor(ty, *reversed(arr.shape), name=name[-63:])
        self.buffer = Buffer.alloc_ctx_tensors(self.ctx, backend)
        self.buffer.set_usage_weights()
        for name, arr in weights.items():
            self.tensors[name].set(arr)
        log.debug("uploaded %d tensors (%.1f MiB, %s) to %s", len(weights), self.buffer.size / 2**20, dtype, backend.spec)

    @property
    def nbytes(self) -> int:
        return self.buffer.size

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name]

    def layer(self, i: int, suffix: str) -> Tensor:
        return self.tensors[f"layers.{i}.{suffix}"]

    @property
    def closed(self) -> bool:
        return self.buffer.closed

    def close(self) -> None:
        self.buffer.close()
        self.ctx.close()

    def __enter__(self) -> "BackendWeights":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def upload_matrix(backend: Backend, array: np.ndarray, dtype: str, name: str) -> tuple[Tensor, Buffer]:
    """Upload one (out, in) matrix (e.g. an lm_head or token embedding) into its own buffer."""
    arr = np.asarray(array)
    if arr.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D (out, in) array, got shape {arr.shape}")
    if arr.dtype.kind != "f":
        raise TypeError(f"{name}: expected a floating-point array, got dtype {arr.dtype}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name}: contains NaN or inf")
    if dtype == "q8_0" and arr.shape[1] % 32:
        dtype = "f16"
    ctx = Context(n_tensors=1)
    t = ctx.new_tensor(dtype, arr.shape[1], arr.shape[0], name=name)
    buf = Buffer.alloc_ctx_tensors(ctx, backend)
    buf.set_usage_weights()
    t.set(arr)
    return t, buf
