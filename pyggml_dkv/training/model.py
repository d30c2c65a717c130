"""The drafter in PyTorch for training: the `dflash` package's DFlashDraftModel, built from a
DraftConfig, and conversions to and from our DraftWeights (same tensor names, `(out, in)` layout).

Training with the reference model's own class means what we train is, by construction, what the
dflash package and our ggml drafter (tested against it, tests/drafter/test_dflash_torch.py) run.
"""

from __future__ import annotations

import numpy as np
import torch
import transformers
from dflash import model as dflash_model

from ..model.config import DraftConfig
from ..model.tensor_names import expected_shapes
from ..model.weights import DraftWeights


def qwen3_config(cfg: DraftConfig) -> transformers.Qwen3Config:
    """The Qwen3Config (with dflash_config) of a drafter of this shape (full-attention, plain RoPE)."""
    if cfg.any_swa:
        raise ValueError("training covers full-attention drafters only")
    if cfg.freq_scale != 1.0 or cfg.ext_factor != 0.0:
        raise ValueError("training covers plain RoPE only")
    target_ids = list(cfg.target_layer_ids) or list(range(1, 2 * cfg.n_target_layers, 2))
    return transformers.Qwen3Config(
        hidden_size=cfg.hidden, intermediate_size=cfg.ffn, num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head_kv, head_dim=cfg.head_dim,
        vocab_size=max(cfg.vocab or 0, cfg.mask_token_id + 1, 32), rms_norm_eps=cfg.rms_eps,
        rope_theta=cfg.rope_theta, max_position_embeddings=1 << 17, num_target_layers=2 * cfg.n_target_layers + 2,
        attn_implementation="sdpa",
        dflash_config={"block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id, "target_layer_ids": target_ids},
    )


def new_model(cfg: DraftConfig, seed: int) -> torch.nn.Module:
    """A freshly initialised DFlashDraftModel (the transformers init: normal(0, 0.02), norms 1)."""
    torch.manual_seed(seed)
    return dflash_model.DFlashDraftModel(qwen3_config(cfg)).float()


def load_weights(model: torch.nn.Module, weights: DraftWeights) -> None:
    """Copy every tensor of `weights` into the model (strict: same names, same shapes)."""
    state = {name: torch.from_numpy(np.array(arr, dtype=np.float32)) for name, arr in weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if "rotary" not in m]
    if missing or unexpected:
        raise ValueError(f"weights do not match the model: missing {missing}, unexpected {unexpected}")


def to_draft_weights(model: torch.nn.Module, cfg: DraftConfig) -> DraftWeights:
    """The model's effective tensors as DraftWeights (float32 host arrays); a reparametrised
    weight (feature scaling) is written as the model computes with it."""
    tensors = {}
    for name in expected_shapes(cfg):
        module_path, _, attr = name.rpartition(".")
        module = model.get_submodule(module_path) if module_path else model
        tensors[name] = getattr(module, attr).detach().float().cpu().numpy().copy()
    return DraftWeights(cfg, tensors)


class _DivideColumns(torch.nn.Module):
    """weight -> weight / scale per input column (a torch parametrization)."""

    def __init__(self, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("scale", scale)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight / self.scale


def scale_features(model: torch.nn.Module, scale: np.ndarray) -> None:
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


def init_from_target(model: torch.nn.Module, cfg: DraftConfig, gguf, target_layers: list[int]) -> None:
    """Initialise drafter layer i from target decoder layer target_layers[i] (same attention and
    MLP shape required): q/k/v/o, gate/up/down and both norms; q_norm/k_norm stay 1. The final
    norm takes the target's output norm (the frozen lm_head follows it in both models)."""
    names = {
        "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
        "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
        "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up", "mlp.down_proj.weight": "ffn_down",
        "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
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
