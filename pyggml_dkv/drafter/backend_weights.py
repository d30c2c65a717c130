"""BackendWeights: a drafter's parameters uploaded once into backend buffers, and single matrices
(an lm_head, a token embedding, a file's stored blocks) uploaded into buffers of their own.

The upload side of the model layer: `pyggml_dkv.model` says what the weights are and imports
without the compiled ggml; this module puts them on a ggml backend (`DraftWeights.to_backend`
imports it when called).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..ggml import Backend, Buffer, Context, Tensor
from ..ggml._lowlevel import lib
from ..ggml.capabilities import (
    DKV_BUFFER_TYPE,
    NARROW_WEIGHT_TYPES,
    REPACKING_BUFFER_TYPES,
    amx_available,
    amx_fits,
    cpu_extra_buffer_types,
    cpu_repack_buffer,
    dkv_buffer_available,
    q8_0_wide_on_our_amx,
    vnni_available,
    vnni_repack_fits,
)
from ..ggml.types import TYPE_NAMES, ggml_type
from ..model.config import DraftConfig
from ..model.stored import StoredMatrix
from ..model.tensor_names import is_fold_in_matrix, is_norm, is_selector_codebook

if TYPE_CHECKING:  # pragma: no cover
    from ..model.weights import DraftWeights

log = logging.getLogger(__name__)

WEIGHT_DTYPES = ("f32", "f16", "bf16", "q8_0", "native")
# "native": each matrix as its file stores it (DraftWeights.stored, e.g. a GGUF's q4_K blocks,
# uploaded byte for byte); matrices without a stored form, and arrays uploaded later against
# these weights (an lm_head given as an array), go in NATIVE_FALLBACK
NATIVE_FALLBACK = "f16"


def default_weight_dtype(backend: Backend) -> str:
    """The weight type `dtype="auto"` picks for `backend`.

    The rule: q8_0 on a CPU backend whose ggml has a fast int8 product for it (AMX tiles and our
    AVX512-VNNI kernel, old patch 0010, on Xeons with AMX: amx_eligible; that kernel alone on
    AMD Zen 4/5 and Intel CPUs with VNNI but no AMX): half the bytes of f16 and int8 products
    (faster steps than f16 on both, see benchmarks/README.md). f16 everywhere else: GPUs, and x86
    CPUs with only AVX2, where ggml's generic q8_0 path was barely faster than ggml's f16 one for
    drafts far further from f32 weights, and where f16 products now run an 8-wide kernel that keeps
    the activations f32 (old patch 0042, ~2x ggml's f16 path).
    """
    if backend.is_cpu and (amx_available() or vnni_available()):
        return "q8_0"
    return "f16"


# Types ggml's AMX buffer takes for which our VNNI kernel is the faster one: q4_0 (old patch 0022) took
# 0.53-0.95 of the time of ggml's AMX q4_0 kernel (which has no 16-row pass like 0007's for q8_0) at
# 9-34 columns, measured interleaved in one process on an Emerald Rapids (2 threads; the small
# drafter's shapes and a 49152-row head).
VNNI_OVER_AMX = ("q4_0",)
# ... and those for which it is the faster one only at a step's few columns: q8_0. A whole step's
# products (the small drafter's 36 matrices at 16 / 9 columns and a 49152-row head, interleaved in
# one process on Emerald Rapids, 2 threads) took 0.86-0.92 of their time on AMX tiles, but a bulk
# append of 2048 prompt rows (1024-row products) 1.48x (1.5-1.6x on the model-167 Xeon). Where our
# VNNI layout runs its own wide products on AMX tiles (capabilities.q8_0_wide_on_our_amx: this
# build on AMX Xeons), every q8_0 matrix goes to that layout alone. Otherwise a step multiplies
# every q8_0 matrix on VNNI (`bulk=False`), and the matrices a bulk append multiplies too (the
# fold-in's: fc, k_proj, v_proj) get a second copy in ggml's AMX buffer for it (BackendWeights.bulk).
VNNI_OVER_AMX_NARROW = ("q8_0",)


def amx_eligible(backend: Backend, dtype: str, out_features: int, in_features: int, bulk: bool = True) -> bool:
    """Does an (out, in) `dtype` matrix on `backend` go to ggml's AMX kernels (q8_0, and q4_0 where our
    VNNI layout does not take it, on AMX Xeons)? `bulk`: the matrix is also multiplied by many rows at
    once (a prompt's bulk append); False for one only a step's few rows ever meet (q8_0 then goes to
    VNNI where its layout takes the matrix, as it does either way where that layout runs its wide
    products on AMX tiles itself: capabilities.q8_0_wide_on_our_amx)."""
    ne = (in_features, out_features)
    wide_on_vnni_layout = not bulk or q8_0_wide_on_our_amx()
    vnni_first = VNNI_OVER_AMX + (VNNI_OVER_AMX_NARROW if wide_on_vnni_layout else ())
    if dtype.lower() in vnni_first and vnni_repack_fits(dtype, ne):
        return False
    return backend.is_cpu and amx_fits(dtype, ne) and amx_available()


def repack_buffer(backend: Backend, dtype: str, out_features: int, in_features: int, bulk: bool = True) -> str | None:
    """The repacking buffer type an (out, in) `dtype` matrix that is only ever multiplied goes to:
    "AMX" (ggml's AMX kernels), else "CPU_DKV_REPACK" (our AVX512-VNNI kernels for q8_0 / q4_0 /
    q4_K / q5_K / q6_K, old patches 0010, 0020-0022), else "CPU_REPACK" (ggml's own AVX2 ones for
    other q4_0 / q4_K shapes: capabilities.cpu_repack_buffer / cpu_repack_kernel), else None (an
    ordinary buffer). `bulk`: as amx_eligible."""
    if amx_eligible(backend, dtype, out_features, in_features, bulk):
        return "AMX"
    if backend.is_cpu:
        return cpu_repack_buffer(dtype, (in_features, out_features))
    return None


def weight_buffer(
    backend: Backend, dtype: str, out_features: int, in_features: int, bulk: bool = True, repack: bool = True
) -> str | None:
    """The extra CPU buffer type an (out, in) `dtype` matrix goes to: with `repack`, the repacking one
    of a matrix that is only ever multiplied (repack_buffer); else, for f16 / bf16 on the CPU backend,
    "CPU_DKV", whose products by a step's few f32 columns run our narrow kernels (old patches 0004,
    0019, 0041, 0042; ggml rounds the columns to f16 / bf16). CPU_DKV keeps ggml's layout, so any op
    may read its tensors (get_rows, Tensor.numpy, the screened argmax). None: an ordinary buffer."""
    kind = repack_buffer(backend, dtype, out_features, in_features, bulk) if repack else None
    if kind is None and backend.is_cpu and dtype.lower() in NARROW_WEIGHT_TYPES and dkv_buffer_available():
        return DKV_BUFFER_TYPE
    return kind


class BackendWeights:
    """Matrices stored as `dtype` (f32, f16, bf16, q8_0, or "native": as the file stored them),
    norm vectors always f32.

    `tensors[name]` is the ggml Tensor of checkpoint tensor `name`; `host` the DraftWeights
    they came from. Close it (or use `with`) to free the buffers.

    `dtype="auto"` (default) picks by the backend and CPU: `default_weight_dtype`.

    With `repack` (default) and q8_0 weights on a CPU with AVX512-VNNI, the matrices go to our
    CPU_DKV_REPACK buffer, laid out for our VNNI kernel (old patch 0010) as they are uploaded; on
    AMX Xeons the same layout's products of 64 rows or more run on AMX tiles (a prompt's bulk
    append). A build without that AMX kernel gives the fold-in's matrices a second copy in ggml's
    AMX buffer for those (`bulk`). Both are much faster than ggml's generic q8_0 path
    (benchmarks/README.md). With `dtype="native"`, a
    file's q4_0 / q4_K / q5_K / q6_K matrices go there too, for our VNNI kernels of those types
    (old patches 0020-0022), or for ggml's interleaved AVX2 kernels (q4_0 / q4_K shapes ours do not
    take, CPUs without VNNI) as llama.cpp runs them (`capabilities.cpu_repack_kernel` says which).
    Those tensors cannot be read back (`Tensor.numpy()` raises); `host` still has the values.
    f16 / bf16 matrices on the CPU go to our CPU_DKV buffer (weight_buffer), repack or not: laid out
    as ggml lays them out, multiplied by our narrow kernels.
    """

    def __init__(self, weights: DraftWeights, backend: Backend, dtype: str = "auto", repack: bool = True) -> None:
        # what is needed of DraftWeights (checked by duck type: DraftWeights.to_backend imports this module)
        if not isinstance(weights, Mapping) or not isinstance(getattr(weights, "cfg", None), DraftConfig):
            raise TypeError(f"expected DraftWeights, got {type(weights).__name__}")
        if dtype == "auto":
            dtype = default_weight_dtype(backend)
        if dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight dtype must be 'auto' or one of {WEIGHT_DTYPES}, got {dtype!r}")
        if not isinstance(repack, bool):
            raise TypeError(f"repack must be a bool, got {type(repack).__name__}")
        cfg = weights.cfg
        if dtype == "q8_0":
            block = int(lib.ggml_blck_size(ggml_type("q8_0")))
            odd = sorted(
                {n for n, a in weights.items() if a.ndim == 2 and a.shape[1] % block and not is_selector_codebook(n)}
            )
            if odd:
                raise ValueError(f"q8_0 needs every matrix's input width to be a multiple of {block}; not: {odd[:4]}")
        self.cfg: DraftConfig = cfg
        self.host = weights
        self.backend = backend
        self.dtype = dtype
        self.repack = repack
        # every weight matrix is only ever the matrix of a mul_mat, so all that fit may be repacked,
        # each into the repacking buffer its type and shape go to for a step's few rows (a file may mix
        # types: q4_K matrices in CPU_DKV_REPACK beside q8_0 ones in AMX); the others stay in the ordinary
        # buffer. The fold-in's matrices, which a bulk append multiplies by hundreds of rows, get a
        # second copy where the kernel for those differs (q8_0 on AMX CPUs without our AMX q8_0
        # kernel: amx_eligible)
        types = {n: self._matrix_type(weights, n, dtype) for n, a in weights.items() if a.ndim == 2 and not is_norm(n)}
        # tables the graph reads rows of (DFlash-2's codebooks) are never repacked (get_rows reads plain rows)
        types.update({n: self._table_type(weights, n, dtype) for n in weights if is_selector_codebook(n)})

        def buffer_kind(name: str, bulk: bool) -> str | None:
            out_features, in_features = weights[name].shape
            return weight_buffer(backend, types[name], out_features, in_features, bulk=bulk, repack=repack)

        step_kinds = {n: buffer_kind(n, bulk=False) for n in types if not is_selector_codebook(n)}
        bulk_found = {n: buffer_kind(n, bulk=True) for n in types if is_fold_in_matrix(n)}
        bulk_kinds = {n: k for n, k in bulk_found.items() if k is not None and k != step_kinds[n]}
        kinds = {n: k for n, k in step_kinds.items() if k is not None}
        placed = [*kinds.values(), *bulk_kinds.values()]
        self.ctx = Context(n_tensors=len(weights) - len(kinds) + 1)
        # the extra buffer types' tensors: the repacking ones (REPACKING_BUFFER_TYPES), then CPU_DKV
        self.extra_ctxs: dict[str, Context] = {
            k: Context(n_tensors=placed.count(k) + 1) for k in (*REPACKING_BUFFER_TYPES, DKV_BUFFER_TYPE) if k in placed
        }
        self.tensors: dict[str, Tensor] = {}
        for name, arr in weights.items():
            ty = types.get(name, "f32")
            ctx = self.extra_ctxs[kinds[name]] if name in kinds else self.ctx
            # ggml order is the reverse of numpy's: (out, in) -> [in, out]
            self.tensors[name] = ctx.new_tensor(ty, *reversed(arr.shape), name=name[-63:])
        # the bulk appends' copies (where none is needed, a bulk append reads `tensors`)
        self.bulk_tensors: dict[str, Tensor] = {
            name: self.extra_ctxs[kind].new_tensor(types[name], *reversed(weights[name].shape), name=name[-63:])
            for name, kind in bulk_kinds.items()
        }
        self.buffers: list[Buffer] = []
        if len(kinds) < len(weights):
            self.buffers.append(Buffer.alloc_ctx_tensors(self.ctx, backend))
        for kind, ctx in self.extra_ctxs.items():
            self.buffers.append(Buffer.alloc_ctx_tensors_from_buft(ctx, cpu_extra_buffer_types()[kind], backend))
        for buf in self.buffers:
            buf.set_usage_weights()
        for name, arr in weights.items():
            stored = weights.stored.get(name)
            for t in (self.tensors[name], self.bulk_tensors.get(name)):
                if t is None:
                    continue
                if stored is not None and stored.type_name == types.get(name):
                    t.set_bytes(stored.raw)  # the file's own blocks, byte for byte
                else:
                    t.set(arr)
        self.n_repacked = sum(k in REPACKING_BUFFER_TYPES for k in kinds.values())
        log.debug(
            "uploaded %d tensors (%.1f MiB, %s, %d repacked for %s) to %s",
            len(weights),
            self.nbytes / 2**20,
            dtype,
            self.n_repacked,
            "/".join(self.repack_kinds) or "-",
            backend.spec,
        )

    @staticmethod
    def _matrix_type(weights: DraftWeights, name: str, dtype: str) -> str:
        if dtype != "native":
            return dtype
        stored = weights.stored.get(name)
        return stored.type_name if stored is not None else NATIVE_FALLBACK

    @staticmethod
    def _table_type(weights: DraftWeights, name: str, dtype: str) -> str:
        """A lookup table's type: the weights' float type; f16 beside quantized matrices (rows of a
        table are read, not multiplied: no int8 product to gain, and a row's scale is one more error)."""
        if dtype == "native":
            stored = weights.stored.get(name)
            return (
                stored.type_name
                if stored is not None and stored.type_name in ("f32", "f16", "bf16")
                else NATIVE_FALLBACK
            )
        return dtype if dtype in ("f32", "f16", "bf16") else "f16"

    @property
    def repack_kinds(self) -> tuple[str, ...]:
        """The repacking buffers the matrices went to ("AMX" first)."""
        return tuple(k for k in self.extra_ctxs if k in REPACKING_BUFFER_TYPES)

    @property
    def repack_kind(self) -> str | None:
        """The first of them, for reports ("AMX" wherever any matrix runs on AMX tiles)."""
        return next(iter(self.repack_kinds), None)

    @property
    def nbytes(self) -> int:
        return sum(b.size for b in self.buffers)

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name]

    def layer(self, i: int, suffix: str) -> Tensor:
        return self.tensors[f"layers.{i}.{suffix}"]

    @property
    def bulk(self) -> BackendWeights | BulkWeights:
        """The weights as products of hundreds of rows read them (a bulk append's, the one-shot
        graph's context rows): the bulk copies where there are any (q8_0 on AMX CPUs: the fold-in's
        matrices on AMX tiles), else these same tensors."""
        return BulkWeights(self) if self.bulk_tensors else self

    @property
    def closed(self) -> bool:
        return self.ctx.closed

    def close(self) -> None:
        for buf in self.buffers:
            buf.close()
        self.ctx.close()
        for ctx in self.extra_ctxs.values():
            ctx.close()

    def __enter__(self) -> BackendWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Matrices(Protocol):
    """What graph builders read of uploaded weights: the config and the tensors by name."""

    cfg: DraftConfig

    def __getitem__(self, name: str) -> Tensor: ...

    def layer(self, i: int, suffix: str) -> Tensor: ...


class BulkWeights:
    """BackendWeights seen by products of many rows: its bulk copies in place of the step's tensors."""

    def __init__(self, weights: BackendWeights) -> None:
        self.cfg = weights.cfg
        self._weights = weights

    def __getitem__(self, name: str) -> Tensor:
        copy = self._weights.bulk_tensors.get(name)
        return copy if copy is not None else self._weights.tensors[name]

    def layer(self, i: int, suffix: str) -> Tensor:
        return self[f"layers.{i}.{suffix}"]


def upload_matrix(
    backend: Backend, array: np.ndarray, dtype: str, name: str, matmul_only: bool = False
) -> tuple[Tensor, Buffer]:
    """Upload one (out, in) matrix (e.g. an lm_head or token embedding) into its own buffer.

    `matmul_only`: the matrix is only ever multiplied (an lm_head, not an embedding table read
    with get_rows), so it may be repacked (AMX, CPU_DKV_REPACK, CPU_REPACK) like BackendWeights' matrices; as a
    step's few rows multiply it (repack_buffer's `bulk=False`: q8_0 goes to VNNI on AMX CPUs too).
    """
    arr = np.asarray(array)
    if arr.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D (out, in) array, got shape {arr.shape}")
    if arr.dtype.kind != "f":
        raise TypeError(f"{name}: expected a floating-point array, got dtype {arr.dtype}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name}: contains NaN or inf")
    if dtype == "native":
        dtype = NATIVE_FALLBACK
    # ggml's own spelling: the repacking rules compare names ("Q8_0" / "q4_K" would silently take
    # an ordinary buffer and ggml's generic kernels, ~10x slower)
    dtype = TYPE_NAMES[ggml_type(dtype)]
    if dtype == "q8_0" and arr.shape[1] % 32:
        dtype = "f16"
    t, buf = matrix_in_own_buffer(backend, dtype, arr.shape, name, matmul_only)
    t.set(arr)
    return t, buf


def matrix_in_own_buffer(
    backend: Backend, dtype: str, shape: tuple[int, int], name: str, matmul_only: bool
) -> tuple[Tensor, Buffer]:
    """An empty (out, in) `dtype` matrix in a weights buffer of its own: a repacking one (AMX,
    VNNI; see repack_buffer, for a matrix a step's few rows multiply) when it is `matmul_only`
    and fits, our CPU_DKV one for f16 / bf16 on the CPU (weight_buffer), an ordinary one otherwise."""
    ctx = Context(n_tensors=1)
    t = ctx.new_tensor(dtype, shape[1], shape[0], name=name[-63:])
    kind = weight_buffer(backend, dtype, *shape, bulk=False, repack=matmul_only)  # a step's head
    if kind is not None:
        buf = Buffer.alloc_ctx_tensors_from_buft(ctx, cpu_extra_buffer_types()[kind], backend)
    else:
        buf = Buffer.alloc_ctx_tensors(ctx, backend)
    buf.set_usage_weights()
    return t, buf


def upload_stored(
    backend: Backend, matrix: StoredMatrix, name: str, matmul_only: bool = False
) -> tuple[Tensor, Buffer]:
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
