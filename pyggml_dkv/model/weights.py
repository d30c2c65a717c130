"""DraftWeights: the drafter's parameters as host numpy arrays, named as in the checkpoint (docs/design.md, "Checkpoints").

Matrices keep PyTorch's `(out, in)` layout, which is exactly ggml's `[in, out]`: no transpose
anywhere. Everything is float32 on the host; the backend copy picks its own storage type.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .checkpoint import read_checkpoint, write_checkpoint
from .config import DraftConfig
from .errors import CheckpointError, WeightsError
from .gguf_names import GGUFError
from .tensor_names import CONV_PROJECTION, expected_shapes, is_conv_base_kernel, is_norm, is_selector_codebook

if TYPE_CHECKING:  # pragma: no cover
    from ..drafter.backend_weights import BackendWeights
    from ..ggml import Backend
    from .stored import StoredMatrix


def _vocab_matrix(cfg: DraftConfig, arr: np.ndarray | None, name: str) -> np.ndarray | None:
    if arr is None:
        return None
    arr = np.asarray(arr)
    if arr.ndim != 2 or arr.shape[1] != cfg.hidden or arr.dtype.kind != "f":
        raise WeightsError(f"{name} must be a float (vocab, hidden={cfg.hidden}) array, got {arr.dtype} {arr.shape}")
    if cfg.vocab is not None and arr.shape[0] != cfg.vocab:
        raise WeightsError(f"{name} has {arr.shape[0]} rows, the config says vocab={cfg.vocab}")
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    arr.flags.writeable = False
    return arr


def _random_base_kernel(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """A random DFlash-2 base kernel (2, K, H): tap 0 near 1 so a sublayer keeps its input's scale,
    the earlier rows' taps ~0.2 so the convolution visibly mixes rows."""
    kernel = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.2)
    kernel[:, 0, :] = rng.uniform(0.8, 1.2, size=(shape[0], shape[2])).astype(np.float32)
    return kernel


def _random_scale(name: str, shape: tuple[int, ...]) -> float:
    """The standard deviation of a random matrix entry.

    Matrices: 1/sqrt(in), so O(1) inputs give O(1) outputs. A convolution's kernel projection is
    halved: its outputs are added to the base kernel's taps, ~0.5 each, enough to matter without
    dwarfing tap 0. The selector's codebooks: R^(-1/4) each, so sum_r A[p,r] gamma[r] B[c,r] over
    the R ranks (gamma O(1)) is O(1), comparable to the logit gaps between the top candidates.
    """
    if is_selector_codebook(name):
        return float(shape[1]) ** -0.25
    scale = 1.0 / np.sqrt(shape[1])
    return 0.5 * scale if name.endswith(CONV_PROJECTION) else scale


class DraftWeights(Mapping[str, np.ndarray]):
    """Host parameters of one drafter. A read-only mapping `name -> float32 array`."""

    def __init__(
        self,
        cfg: DraftConfig,
        tensors: Mapping[str, np.ndarray],
        *,
        stored: Mapping[str, StoredMatrix] | None = None,
        embed_tokens: np.ndarray | None = None,
        lm_head: np.ndarray | None = None,
    ) -> None:
        """`stored`: matrices as their file stores them (e.g. a GGUF's quantized blocks), by the
        same names, plus "embed_tokens" / "lm_head"; `tensors` then holds their dequantized values.
        `embed_tokens` / `lm_head`: (vocab, hidden) matrices a file ships with the drafter."""
        expected = expected_shapes(cfg)
        missing = sorted(set(expected) - set(tensors))
        if missing:
            raise WeightsError(f"missing tensor(s) for this config: {missing[:6]}{' ...' if len(missing) > 6 else ''}")
        unexpected = sorted(set(tensors) - set(expected))
        if unexpected:
            raise WeightsError(
                f"tensor(s) this drafter cannot run: {unexpected[:6]}{' ...' if len(unexpected) > 6 else ''}"
            )
        self.cfg = cfg
        self._tensors: dict[str, np.ndarray] = {}
        for name, shape in expected.items():
            arr = np.asarray(tensors[name])
            if arr.dtype.kind != "f":
                raise WeightsError(f"{name}: expected a floating-point array, got dtype {arr.dtype}")
            if arr.shape != shape:
                raise WeightsError(f"tensor {name!r} has shape {arr.shape}, config needs {shape}")
            arr = np.ascontiguousarray(arr, dtype=np.float32)
            if not np.isfinite(arr).all():
                raise WeightsError(f"{name}: contains NaN or inf")
            arr.flags.writeable = False
            self._tensors[name] = arr
        self.embed_tokens = _vocab_matrix(cfg, embed_tokens, "embed_tokens")
        self.lm_head = _vocab_matrix(cfg, lm_head, "lm_head")
        self.stored: dict[str, StoredMatrix] = dict(stored or {})
        for name, m in self.stored.items():
            host = {"embed_tokens": self.embed_tokens, "lm_head": self.lm_head}.get(name, self._tensors.get(name))
            if host is None or host.shape != m.shape:
                raise WeightsError(f"stored matrix {name!r} {m.shape} has no host tensor of that shape")

    # Mapping protocol
    def __getitem__(self, name: str) -> np.ndarray:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def layer(self, i: int, suffix: str) -> np.ndarray:
        return self._tensors[f"layers.{i}.{suffix}"]

    @property
    def n_params(self) -> int:
        return sum(a.size for a in self._tensors.values())

    @classmethod
    def random(cls, cfg: DraftConfig, seed: int = 0) -> DraftWeights:
        """Random weights with O(1) activations; norm weights random too so tests exercise them."""
        rng = np.random.default_rng(seed)
        tensors = {}
        for name, shape in expected_shapes(cfg).items():
            if is_norm(name):
                tensors[name] = rng.uniform(0.5, 1.5, size=shape).astype(np.float32)
            elif is_conv_base_kernel(name):
                tensors[name] = _random_base_kernel(rng, shape)
            else:  # drawn in float32 in place: a qwen3-8b-sized drafter has ~1e9 parameters
                tensors[name] = rng.standard_normal(shape, dtype=np.float32)
                tensors[name] *= np.float32(_random_scale(name, shape))
        return cls(cfg, tensors)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> DraftWeights:
        """Load a DFlash drafter: a checkpoint directory (config.json + safetensors), or a
        llama.cpp dflash `.gguf` file (model/gguf_read.py)."""
        if str(path).endswith(".gguf"):
            return load_gguf(path)
        return load_checkpoint(path)

    def save_pretrained(
        self, path: str | Path, dtype: str = "float32", format: str = "dflash", vocab_from: str | Path | None = None
    ) -> Path | None:
        """Write config.json + model.safetensors in the `dflash` package's format, or with
        `format="gguf"` a llama.cpp dflash GGUF (`dtype` f32 / f16 / bf16 / q8_0 / q4_0 / q4_k /
        q5_k / q6_k, or q4_k_m: llama.cpp's Q4_K_M mix; `vocab_from`: the target's GGUF, whose
        tokenizer llama.cpp needs). A GGUF
        goes to `path` if it ends in .gguf, else to `path`/model.gguf; returns that file."""
        if format == "gguf":
            # imported here: writing needs the `gguf` package (and ggml's quantizer for the
            # quantized types), this module neither
            from .gguf_write import save_gguf

            return save_gguf(self, path, dtype=dtype, vocab_from=vocab_from)
        if format != "dflash":
            raise ValueError(f"format must be 'dflash' or 'gguf', got {format!r}")
        save_checkpoint(self, path, dtype=dtype)
        return None

    def to_backend(self, backend: Backend, dtype: str = "auto", repack: bool = True) -> BackendWeights:
        """Upload once to the backend. Matrices in `dtype`, norms stay f32 (see BackendWeights for `repack`)."""
        # imported here, not at the top: the upload lives in the drafter layer, on ggml, and the
        # model layer imports without the compiled ggml extension (the numpy reference needs only
        # configs and weights); tests/test_layering.py lists this import as the model's one upward one
        from ..drafter.backend_weights import BackendWeights

        return BackendWeights(self, backend, dtype, repack)


def load_checkpoint(path: str | Path) -> DraftWeights:
    """Load a DFlash drafter checkpoint directory (config.json + model.safetensors or a sharded index)."""
    cfg, tensors, source = read_checkpoint(path)
    try:  # missing tensors, shapes and values are DraftWeights' own checks
        return DraftWeights(cfg, tensors)
    except WeightsError as e:
        raise CheckpointError(f"{source}: {e}") from e


def save_checkpoint(weights: DraftWeights, path: str | Path, dtype: str = "float32") -> None:
    """Write `weights` as config.json + model.safetensors (dtype float32 / bfloat16 / float16).

    bfloat16 rounds to nearest even; values that overflow the chosen dtype are refused. Existing
    files of the same names are replaced (each atomically).
    """
    if not isinstance(weights, DraftWeights):
        raise CheckpointError(f"save_checkpoint needs DraftWeights, got {type(weights).__name__}")
    write_checkpoint(weights.cfg, weights, path, dtype)


def load_gguf(path: str | Path) -> DraftWeights:
    """Load a llama.cpp dflash GGUF drafter (memory-mapped; quantized matrices kept as stored)."""
    # imported here: the reader needs the `gguf` package, this module does not
    from .gguf_read import read_gguf

    parts = read_gguf(path)
    try:
        return DraftWeights(
            parts.cfg, parts.tensors, stored=parts.stored, embed_tokens=parts.embed_tokens, lm_head=parts.lm_head
        )
    except WeightsError as e:
        raise GGUFError(f"{Path(path).name}: {e}") from e
