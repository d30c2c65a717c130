"""DraftWeights: the drafter's parameters as host numpy arrays, named as in the checkpoint (SPEC.md §5).

Matrices keep PyTorch's `(out, in)` layout, which is exactly ggml's `[in, out]`: no transpose
anywhere. Everything is float32 on the host; the backend copy picks its own storage type.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .config import DraftConfig

if TYPE_CHECKING:  # pragma: no cover
    from .backend_weights import BackendWeights
    from .ggml import Backend

# per-layer tensor name suffixes, in checkpoint order
LAYER_MATRICES = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
LAYER_NORMS = (
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)


class WeightsError(ValueError):
    """Weights that do not fit their DraftConfig (missing, unexpected, wrong shape, not finite)."""


def expected_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a drafter of this config has, with its numpy `(out, in)` shape."""
    h, hd = cfg.hidden, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, cfg.fc_in),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(cfg.n_layer):
        p = f"layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (cfg.n_head * hd, h)
        shapes[p + "self_attn.k_proj.weight"] = (cfg.n_head_kv * hd, h)
        shapes[p + "self_attn.v_proj.weight"] = (cfg.n_head_kv * hd, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.n_head * hd)
        shapes[p + "self_attn.q_norm.weight"] = (hd,)
        shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "mlp.gate_proj.weight"] = (cfg.ffn, h)
        shapes[p + "mlp.up_proj.weight"] = (cfg.ffn, h)
        shapes[p + "mlp.down_proj.weight"] = (h, cfg.ffn)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    return shapes


def is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


class DraftWeights(Mapping[str, np.ndarray]):
    """Host parameters of one drafter. A read-only mapping `name -> float32 array`."""

    def __init__(self, cfg: DraftConfig, tensors: Mapping[str, np.ndarray]) -> None:
        expected = expected_shapes(cfg)
        missing = sorted(set(expected) - set(tensors))
        if missing:
            raise WeightsError(f"missing tensor(s) for this config: {missing[:6]}{' ...' if len(missing) > 6 else ''}")
        unexpected = sorted(set(tensors) - set(expected))
        if unexpected:
            raise WeightsError(f"tensor(s) this drafter cannot run: {unexpected[:6]}{' ...' if len(unexpected) > 6 else ''}")
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
    def random(cls, cfg: DraftConfig, seed: int = 0) -> "DraftWeights":
        """Random weights with O(1) activations; norm weights random too so tests exercise them."""
        rng = np.random.default_rng(seed)
        tensors = {}
        for name, shape in expected_shapes(cfg).items():
            if is_norm(name):
                tensors[name] = rng.uniform(0.5, 1.5, size=shape).astype(np.float32)
            else:  # drawn in float32 in place: a qwen3-8b-sized drafter has ~1e9 parameters
                tensors[name] = rng.standard_normal(shape, dtype=np.float32)
                tensors[name] *= np.float32(1.0 / np.sqrt(shape[1]))
        return cls(cfg, tensors)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "DraftWeights":
        """Load a DFlash drafter checkpoint directory (config.json + safetensors)."""
        from .checkpoint import load_checkpoint

        return load_checkpoint(path)

    def save_pretrained(self, path: str | Path, dtype: str = "float32") -> None:
        """Write config.json + model.safetensors in the `dflash` package's format."""
        from .checkpoint import save_checkpoint

        save_checkpoint(self, path, dtype=dtype)

    def to_backend(self, backend: "Backend", dtype: str = "auto", repack: bool = True) -> "BackendWeights":
        """Upload once to the backend. Matrices in `dtype`, norms stay f32 (see BackendWeights for `repack`)."""
        from .backend_weights import BackendWeights

        return BackendWeights(self, backend, dtype, repack)
