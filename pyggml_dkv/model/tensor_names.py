"""The tensors a DFlash drafter has: names (as in its checkpoints) and numpy `(out, in)` shapes."""

from __future__ import annotations

from .config import DraftConfig

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


# the matrices the context fold-in multiplies: the step's few new rows, and a bulk append's
# hundreds (drafter.layers.append_rows)
FOLD_IN_MATRICES = ("fc.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")


def is_fold_in_matrix(name: str) -> bool:
    return name == FOLD_IN_MATRICES[0] or (name.startswith("layers.") and name.endswith(FOLD_IN_MATRICES[1:]))
