"""What the ring cache and the one-shot graph take alike: constructor checks and the target's
(vocab, hidden) matrices (lm_head, token embedding), given as arrays or uploaded Tensors."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..common.checks import check_choice, check_int
from ..ggml import Backend, Buffer, GGMLError, Tensor, bf16_attention_supported
from ..ggml.capabilities import BF16_ATTENTION_KERNEL
from .backend_weights import BackendWeights, upload_matrix
from .masks import SWA_MODES

CACHE_TYPES = ("f16", "f32")
ATTENTION_PRECISIONS = ("f32", "bf16")
MAX_CAP = 1 << 22
MAX_LANES = 256


def check_drafter_args(weights: Any, backend: Any, cap: Any, cache_type: str, swa: str, attention: str) -> int:
    """Validate the shared constructor arguments; returns cap as an int."""
    if not isinstance(weights, BackendWeights):
        raise TypeError("weights must be BackendWeights (DraftWeights.to_backend(backend, dtype))")
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be a pyggml_dkv Backend, got {type(backend).__name__}")
    backend._check_open()
    if weights.closed:
        raise GGMLError("the BackendWeights were closed")
    if weights.backend is not backend and not (weights.backend.is_cpu and backend.is_cpu):
        raise ValueError(f"weights live on {weights.backend.spec}, but the drafter was asked to run on {backend.spec}")
    cap = check_int("cap", cap, 1, MAX_CAP)
    check_choice("cache_type", cache_type, CACHE_TYPES)
    check_choice("swa", swa, SWA_MODES)
    check_choice("attention", attention, ATTENTION_PRECISIONS)
    if attention == "bf16" and not bf16_attention_supported():
        raise ValueError(
            f"attention='bf16' needs a ggml build with our bf16 attention kernel ({BF16_ATTENTION_KERNEL!r}; "
            "built_capabilities() lists this build's; a GGML_SRC build has none)"
        )
    return cap


# what an lm_head given as an array may be uploaded as, besides the drafter weights' own type
LM_HEAD_DTYPES = ("f32", "f16", "bf16", "q8_0")


def vocab_matrix(
    matrix: Any, name: str, weights: BackendWeights, backend: Backend, dtype: str | None = None
) -> tuple[Tensor | None, Buffer | None]:
    """A (vocab, hidden) target matrix on the backend: (tensor, the buffer we uploaded it into or None).

    The lm_head is only ever the matrix of a product, so with q8_0 weights it may be repacked for
    AMX / VNNI; the token embedding is read with get_rows and never is. An array is uploaded in
    `dtype`, or the weights' dtype when None (an already uploaded Tensor keeps its own type).
    """
    if dtype is not None:
        check_choice(f"{name}_dtype", dtype, LM_HEAD_DTYPES)
        if matrix is None:
            raise ValueError(f"{name}_dtype={dtype!r} was given without a {name}")
        if isinstance(matrix, Tensor):
            raise ValueError(
                f"{name}_dtype={dtype!r} applies to a {name} given as an array; this {name} is an "
                f"uploaded {matrix.type} Tensor"
            )
    if matrix is None:
        return None, None
    cfg = weights.cfg
    if isinstance(matrix, Tensor):
        if matrix.ne[0] != cfg.hidden or matrix.ne[2:] != (1, 1):
            raise ValueError(f"{name} tensor must be [hidden={cfg.hidden}, vocab], got ne={matrix.ne}")
        return matrix, None
    arr = np.asarray(matrix)
    if arr.ndim != 2 or arr.shape[1] != cfg.hidden:
        raise ValueError(f"{name} must be a (vocab, hidden={cfg.hidden}) array, got shape {arr.shape}")
    if cfg.vocab is not None and arr.shape[0] != cfg.vocab:
        raise ValueError(f"{name} has {arr.shape[0]} rows, the config says vocab={cfg.vocab}")
    return upload_matrix(backend, arr, dtype or weights.dtype, name, matmul_only=name == "lm_head" and weights.repack)


def check_noise_embed(noise_embed: Any, q_len: int, hidden: int) -> np.ndarray:
    """The noise block's embeddings: a finite float (q_len, hidden) array."""
    emb = np.asarray(noise_embed)
    if emb.shape != (q_len, hidden):
        raise ValueError(f"noise_embed must have shape (q_len={q_len}, hidden={hidden}), got {emb.shape}")
    if emb.dtype.kind != "f":
        raise TypeError(f"noise_embed must be floating point, got dtype {emb.dtype}")
    if not np.isfinite(emb).all():
        raise ValueError("noise_embed contains NaN or inf")
    return emb


def check_token_ids(tokens: Any, q_len: int, vocab: int) -> np.ndarray:
    """The noise block's token ids: q_len integers in [0, vocab)."""
    ids = np.asarray(tokens)
    if ids.shape != (q_len,) or ids.dtype.kind not in "iu":
        raise ValueError(f"tokens must be {q_len} integer ids, got {ids.dtype} {ids.shape}")
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"token ids must be in [0, {vocab}), got range [{ids.min()}, {ids.max()}]")
    return np.ascontiguousarray(ids, dtype=np.int32)  # in range: exact as the graph's i32 input
