"""The drafter in PyTorch for training: the `dflash` package's DFlashDraftModel (DFlash2DraftModel
for a DFlash-2 config), built from a DraftConfig, and conversions to and from our DraftWeights
(same tensor names, `(out, in)` layout; the selector's codebooks, nn.Embedding in the model, are
named without `.weight` in DraftWeights as in the published checkpoints).

Training with the reference model's own class means what we train is, by construction, what the
dflash package and our ggml drafter (tested against it, tests/drafter/test_dflash_torch.py,
tests/reference/test_dflash2_upstream.py) run.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import transformers
from dflash import model as dflash_model

from ..model.config import DFLASH2_FIELDS, DraftConfig
from ..model.tensor_names import expected_shapes, is_selector_codebook
from ..model.weights import DraftWeights


def qwen3_config(cfg: DraftConfig) -> transformers.Qwen3Config:
    """The Qwen3Config (with dflash_config) of a drafter of this shape (full-attention, plain RoPE)."""
    if cfg.any_swa:
        raise ValueError("training covers full-attention drafters only")
    if cfg.freq_scale != 1.0 or cfg.ext_factor != 0.0:
        raise ValueError("training covers plain RoPE only")
    target_ids = list(cfg.target_layer_ids) or list(range(1, 2 * cfg.n_target_layers, 2))
    dflash_config: dict[str, Any] = {
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": target_ids,
        # read by the model's compute_logits (objective.draft_logits): the logits the drafter runs with
        "output_multiplier": cfg.output_multiplier,
        "final_logit_softcapping": cfg.final_logit_softcapping,
    }
    if cfg.is_dflash2:  # DFlash2DraftModel reads these (its codebooks take vocab_size rows: exactly cfg.vocab)
        dflash_config.update({name: getattr(cfg, name) for name in DFLASH2_FIELDS})
    # what Qwen3Config's signature does not name goes through PretrainedConfig's **kwargs (dflash reads it)
    extra: dict[str, Any] = dict(
        rope_theta=cfg.rope_theta,
        num_target_layers=2 * cfg.n_target_layers + 2,
        attn_implementation="sdpa",
        dflash_config=dflash_config,
    )
    return transformers.Qwen3Config(
        hidden_size=cfg.hidden,
        intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_head_kv,
        head_dim=cfg.head_dim,
        vocab_size=int(cfg.vocab or 0) if cfg.is_dflash2 else max(cfg.vocab or 0, cfg.mask_token_id + 1, 32),
        rms_norm_eps=cfg.rms_eps,
        max_position_embeddings=1 << 17,
        **extra,
    )


def new_model(cfg: DraftConfig, seed: int) -> dflash_model.DFlashDraftModel:
    """A freshly initialised DFlashDraftModel, or DFlash2DraftModel for a DFlash-2 config (the
    transformers init: normal(0, 0.02), norms 1; the convolutions' base kernels as `init_dflash2`)."""
    torch.manual_seed(seed)
    if not cfg.is_dflash2:
        return dflash_model.DFlashDraftModel(qwen3_config(cfg)).float()
    model = dflash_model.DFlash2DraftModel(qwen3_config(cfg)).float()
    init_dflash2(model)
    return model


def init_dflash2(model: dflash_model.DFlash2DraftModel) -> None:
    """Base kernels start as the identity (tap 0 = 1, the other taps 0): with the kernel
    projections' small normal(0, 0.02) init, every convolution starts close to a pass-through and
    the drafter close to a DFlash-1 drafter. (The upstream class leaves its base kernels
    uninitialised, torch.empty, and transformers' init does not touch them.) The selector keeps
    the transformers init: codebooks and gate ~ normal(0, 0.02), so its pair term starts near 0 and
    the walk near the per-position argmax."""
    with torch.no_grad():
        for layer in model.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.zero_()
                conv.base_kernel[:, 0] = 1.0


def torch_name(name: str) -> str:
    """The model's state-dict name of a DraftWeights tensor (the codebooks are nn.Embedding)."""
    return name + ".weight" if is_selector_codebook(name) else name


def load_weights(model: dflash_model.DFlashDraftModel, weights: DraftWeights) -> None:
    """Copy every tensor of `weights` into the model (strict: same names, same shapes)."""
    state = {torch_name(name): torch.from_numpy(np.array(arr, dtype=np.float32)) for name, arr in weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if "rotary" not in m]
    if missing or unexpected:
        raise ValueError(f"weights do not match the model: missing {missing}, unexpected {unexpected}")


def to_draft_weights(model: dflash_model.DFlashDraftModel, cfg: DraftConfig) -> DraftWeights:
    """The model's effective tensors as DraftWeights (float32 host arrays); a reparametrised
    weight (feature scaling) is written as the model computes with it."""
    tensors = {}
    for name in expected_shapes(cfg):
        module_path, _, attr = torch_name(name).rpartition(".")
        module = model.get_submodule(module_path) if module_path else model
        tensors[name] = getattr(module, attr).detach().float().cpu().numpy().copy()
    return DraftWeights(cfg, tensors)


class _DivideColumns(torch.nn.Module):
    """weight -> weight / scale per input column (a torch parametrization)."""

    scale: torch.Tensor  # a buffer

    def __init__(self, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("scale", scale)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight / self.scale


def scale_features(model: dflash_model.DFlashDraftModel, scale: np.ndarray) -> None:
    """Train fc as if its input features were divided by `scale` (per feature column).

    The target's features span orders of magnitude between channels (a few channels of the upper
    layers are hundreds of times the median): with Adam, every weight moves by about the learning
    rate, so the output moves by lr x the channel's scale and the small channels barely learn.
    fc.weight is reparametrised as W / scale: the model still reads raw features (inference is
    unchanged, the saved fc is the effective W / scale) while the optimiser works on W, as if the
    features were normalised."""
    from torch.nn.utils import parametrize

    s = torch.from_numpy(np.ascontiguousarray(scale, np.float32))
    if s.shape != (model.fc.weight.shape[1],):
        raise ValueError(f"feature scale must have {model.fc.weight.shape[1]} values, got {tuple(s.shape)}")
    with torch.no_grad():
        model.fc.weight.mul_(s)  # same effective weight as before
    parametrize.register_parametrization(model.fc, "weight", _DivideColumns(s))


def feature_scale(features: np.ndarray, rows: int = 20000, seed: int = 0, floor: float = 1e-3) -> np.ndarray:
    """Per-column RMS of the features over a fixed random sample of rows."""
    idx = np.sort(np.random.default_rng(seed).choice(features.shape[0], min(rows, features.shape[0]), replace=False))
    sample = np.asarray(features[idx], dtype=np.float64)
    return np.maximum(np.sqrt((sample * sample).mean(axis=0)), floor).astype(np.float32)


def unpermute_llama_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter permutes LLaMA's q/k rows for its interleaved RoPE; undo it (back to
    the halves layout of Hugging Face / NEOX RoPE, which the drafter uses)."""
    out, inp = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def init_from_target(model: dflash_model.DFlashDraftModel, cfg: DraftConfig, gguf, target_layers: list[int]) -> None:
    """Initialise drafter layer i from target decoder layer target_layers[i] (same attention and
    MLP shape required): q/k/v/o, gate/up/down and both norms; q_norm/k_norm stay 1. The final
    norm takes the target's output norm (the frozen lm_head follows it in both models)."""
    names = {
        "self_attn.q_proj.weight": "attn_q",
        "self_attn.k_proj.weight": "attn_k",
        "self_attn.v_proj.weight": "attn_v",
        "self_attn.o_proj.weight": "attn_output",
        "mlp.gate_proj.weight": "ffn_gate",
        "mlp.up_proj.weight": "ffn_up",
        "mlp.down_proj.weight": "ffn_down",
        "input_layernorm.weight": "attn_norm",
        "post_attention_layernorm.weight": "ffn_norm",
    }
    state = model.state_dict()
    if len(target_layers) != cfg.n_layer:
        raise ValueError(f"need one target layer per drafter layer ({cfg.n_layer}), got {target_layers}")
    for i, t in enumerate(target_layers):
        for ours, theirs in names.items():
            arr = gguf.array(f"blk.{t}.{theirs}.weight")
            if theirs == "attn_q":
                arr = unpermute_llama_qk(arr, cfg.n_head)
            elif theirs == "attn_k":
                arr = unpermute_llama_qk(arr, cfg.n_head_kv)
            key = f"layers.{i}.{ours}"
            if tuple(state[key].shape) != arr.shape:
                raise ValueError(f"{key}: drafter shape {tuple(state[key].shape)}, target blk.{t} {arr.shape}")
            state[key].copy_(torch.tensor(np.asarray(arr, dtype=np.float32)))
    state["norm.weight"].copy_(torch.tensor(np.asarray(gguf.array("output_norm.weight"), np.float32)))
