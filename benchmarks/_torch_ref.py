"""The PyTorch DFlash reference (`dflash` package, DFlashDraftModel) driven the way dflash_generate drives it.

Used by bench_step.py. The model is built from our DraftWeights (same tensors, same names: the
PyTorch `(out, in)` Linear layout is the checkpoint's), without a random init pass and, in float32,
without copying the weights (the parameters share the host arrays' memory).

One draft step of dflash_generate (dflash/model.py), mirrored by `TorchDrafter.step`:
    draft_hidden = model(target_hidden=<features of the tokens produced last round>,
                         noise_embedding=<embeddings of the block>,
                         position_ids=arange(start - n_new, start + q_len),
                         past_key_values=cache, use_cache=True)
    _crop_to(cache, start)
The cache (a DynamicCache) holds the context K/V of every committed position; each call appends
the n_new fresh context rows and the q_len noise rows (torch.cat: the cache is copied), then the
crop drops the noise rows again. Slicing draft_hidden and the lm_head are left out on both sides
(the ggml graphs are timed without an lm_head too).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from dflash import model as dflash_model
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from pyggml_dkv.model.weights import DraftWeights
from pyggml_dkv.training.model import qwen3_config  # the same config the trainer builds

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_model(weights: DraftWeights, dtype: str) -> torch.nn.Module:
    """A DFlashDraftModel holding `weights` in fp32 (sharing the host arrays) or bf16 (a copy)."""
    config = qwen3_config(weights.cfg)
    with torch.device("meta"):
        model = dflash_model.DFlashDraftModel(config)
    tdt = TORCH_DTYPES[dtype]
    state = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the host arrays are read-only; inference never writes them
        for name, arr in weights.items():
            t = torch.from_numpy(arr)
            state[name] = t if tdt == torch.float32 else t.to(tdt)
    missing, unexpected = model.load_state_dict(state, strict=True, assign=True)
    assert not missing and not unexpected, (missing, unexpected)
    # rotary buffers are not in the checkpoint: make them for real (they were created on meta)
    model.rotary_emb = Qwen3RotaryEmbedding(config)
    return model.eval()


class TorchDrafter:
    """dflash's cached draft step for one model, with its DynamicCache kept at a given window."""

    def __init__(self, model: torch.nn.Module, dtype: str, feats: np.ndarray) -> None:
        self.model = model
        self.dtype = TORCH_DTYPES[dtype]
        f = torch.from_numpy(feats)[None]  # (1, n_positions, fc_in), shares memory in fp32
        self.feats = f if self.dtype == torch.float32 else f.to(self.dtype)
        self.cache = None
        self.length = 0  # committed positions whose K/V the cache holds

    def reset(self) -> None:
        self.cache = dflash_model._make_cache(self.model.config)
        self.length = 0

    @torch.inference_mode()
    def _forward(self, start: int, end: int, noise: torch.Tensor) -> torch.Tensor:
        """Context rows [start, end) enter the cache; the noise block sits at positions end.. ."""
        q_len = noise.shape[1]
        pos = torch.arange(start, end + q_len, dtype=torch.long)[None]
        out = self.model(
            target_hidden=self.feats[:, start:end],
            noise_embedding=noise,
            position_ids=pos,
            past_key_values=self.cache,
            use_cache=True,
        )
        dflash_model._crop_to(self.cache, end)
        self.length = end
        return out

    def noise(self, noise: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(noise, dtype=np.float32))[None].to(self.dtype)

    def warm_to(self, length: int, noise: torch.Tensor, chunk: int = 1024) -> None:
        """Fill the cache with positions [0, length) (extending it, or cropping it back)."""
        if self.cache is None:
            self.reset()
        if length < self.length:
            dflash_model._crop_to(self.cache, length)
            self.length = length
        while self.length < length:
            self._forward(self.length, min(self.length + chunk, length), noise)

    def rewind(self, length: int) -> None:
        """Crop the cache back to `length` positions (a view: no copy, no compute)."""
        dflash_model._crop_to(self.cache, length)
        self.length = length

    def step(self, committed: int, n_new: int, noise: torch.Tensor) -> torch.Tensor:
        """One dflash_generate draft step: the cache holds committed - n_new positions on entry."""
        assert self.length == committed - n_new, (self.length, committed, n_new)
        return self._forward(committed - n_new, committed, noise)
