"""The tensors a DFlash drafter has: names (as in its checkpoints) and numpy `(out, in)` shapes.

A DFlash-2 drafter (docs/dflash2.md) has, besides DFlash-1's tensors, per layer two
convolutions (`attention_conv`, `mlp_conv`: a `(2, K, H)` base kernel and a `(2*K*G, H)`
kernel projection) and one candidate selector (a `(R, H)` hidden projection and two `(V, R)`
codebooks, named without `.weight` as in the published checkpoints).
"""

from __future__ import annotations

from .config import DraftConfig
from .errors import ConfigError

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


# DFlash-2: per-layer convolutions (attention_conv / mlp_conv) and the global candidate selector
CONV_SUBLAYERS = ("attention_conv", "mlp_conv")
CONV_BASE = "base_kernel"
CONV_PROJECTION = "kernel_projection.weight"
SELECTOR_HIDDEN = "candidate_selector.hidden_projection.weight"
SELECTOR_PREDECESSOR = "candidate_selector.predecessor_codebook"
SELECTOR_SUCCESSOR = "candidate_selector.successor_codebook"
SELECTOR_CODEBOOKS = (SELECTOR_PREDECESSOR, SELECTOR_SUCCESSOR)


def dflash2_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """The tensors DFlash-2 adds (empty for a DFlash-1 config), with their numpy shapes."""
    if not cfg.is_dflash2:
        return {}
    h, k, r = cfg.hidden, cfg.conv_kernel_size, cfg.selector_rank
    if cfg.vocab is None:  # DraftConfig refuses this; a config mutated afterwards could still get here
        raise ConfigError("a DFlash-2 config needs vocab (the selector's codebooks have one row per token)")
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(cfg.n_layer):
        for conv in CONV_SUBLAYERS:
            shapes[f"layers.{i}.{conv}.{CONV_BASE}"] = (2, k, h)
            shapes[f"layers.{i}.{conv}.{CONV_PROJECTION}"] = (2 * k * cfg.conv_groups, h)
    shapes[SELECTOR_HIDDEN] = (r, h)
    shapes[SELECTOR_PREDECESSOR] = (cfg.vocab, r)
    shapes[SELECTOR_SUCCESSOR] = (cfg.vocab, r)
    return shapes


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
    shapes.update(dflash2_shapes(cfg))
    return shapes


def is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def is_conv_base_kernel(name: str) -> bool:
    """A DFlash-2 base kernel (2, K, H): added elementwise to the dynamic taps, never a matmul
    operand, so it stays f32 and is not quantized (llama.cpp's converter writes it as F32)."""
    return name.startswith("layers.") and name.endswith(f"_conv.{CONV_BASE}")


def is_selector_codebook(name: str) -> bool:
    """A DFlash-2 selector codebook (V, R): a vocabulary-sized table whose rows are looked up by
    token id (ggml_get_rows in llama.cpp), like an embedding table, not multiplied as a matrix."""
    return name in SELECTOR_CODEBOOKS


def is_dflash2_tensor(name: str) -> bool:
    """One of the tensors DFlash-2 adds to a DFlash-1 drafter."""
    if name == SELECTOR_HIDDEN or is_selector_codebook(name):
        return True
    return name.startswith("layers.") and any(f".{conv}." in name for conv in CONV_SUBLAYERS)


# the matrices the context fold-in multiplies: the step's few new rows, and a bulk append's
# hundreds (drafter.layers.append_rows)
FOLD_IN_MATRICES = ("fc.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")


def is_fold_in_matrix(name: str) -> bool:
    return name == FOLD_IN_MATRICES[0] or (name.startswith("layers.") and name.endswith(FOLD_IN_MATRICES[1:]))
