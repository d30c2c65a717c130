"""Names shared by the dflash GGUF reader and writer: keys, tensor names, the error class.

llama.cpp's DFlash drafters are GGUF files with `general.architecture = dflash`, written by its
converter (class DFlashModel in conversion/qwen.py) and read by src/models/dflash.cpp. The
`gguf` package on PyPI does not know that architecture yet, so every key is spelled out here.
"""

from __future__ import annotations

import re

from ..common.errors import PyggmlDkvError

ARCH = "dflash"
# GGUF stores the target layers whose *input* it taps (id + 1); our config the layers whose
# output it captures (id): the two differ by exactly one
TARGET_LAYER_OFFSET = 1
# llama.cpp's default when a file has no dflash.block_size (common/speculative.cpp)
DEFAULT_BLOCK_SIZE = 16


class GGUFError(PyggmlDkvError, ValueError):
    """A GGUF file this package cannot read or write as a DFlash drafter (the message names why)."""


def key(suffix: str) -> str:
    """`dflash.<suffix>`, e.g. key("block_size")."""
    return f"{ARCH}.{suffix}"


# the DFlash-2 keys (u32), in the order of DraftConfig's fields of the same names
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")

# global tensors: GGUF name -> our name
GLOBAL_TENSORS = {
    "fc.weight": "fc.weight",
    "enc.output_norm.weight": "hidden_norm.weight",
    "output_norm.weight": "norm.weight",
    "token_embd.weight": "embed_tokens",
    "output.weight": "lm_head",
    # DFlash-2's candidate selector (the checkpoint's codebooks have no `.weight`, the GGUF's do)
    "selector_hidden.weight": "candidate_selector.hidden_projection.weight",
    "selector_predecessor.weight": "candidate_selector.predecessor_codebook",
    "selector_successor.weight": "candidate_selector.successor_codebook",
}
# per-layer tensors: GGUF blk.N.<suffix> -> our layers.N.<suffix>; no Q/K permutation (NeoX rope)
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # DFlash-2's convolutions; the base kernels have no `.weight` suffix in llama.cpp's files
    "attn_conv_base": "attention_conv.base_kernel",
    "attn_conv_proj.weight": "attention_conv.kernel_projection.weight",
    "ffn_conv_base": "mlp_conv.base_kernel",
    "ffn_conv_proj.weight": "mlp_conv.kernel_projection.weight",
}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def our_name(gguf_name: str) -> str | None:
    """Our name for a GGUF tensor name, or None if we have no such tensor."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    m = _BLK.match(gguf_name)
    if m and m.group(2) in LAYER_TENSORS:
        return f"layers.{int(m.group(1))}.{LAYER_TENSORS[m.group(2)]}"
    return None


def gguf_name(name: str) -> str:
    """The GGUF tensor name of one of our names (inverse of our_name)."""
    for g, ours in GLOBAL_TENSORS.items():
        if ours == name:
            return g
    m = _LAYER.match(name)
    if m:
        for g, ours in LAYER_TENSORS.items():
            if ours == m.group(2):
                return f"blk.{int(m.group(1))}.{g}"
    raise GGUFError(f"no GGUF name for tensor {name!r}")


# tensors llama.cpp's dflash loader knows but our drafter cannot run: GGUF name pattern -> why
REFUSED_TENSORS = (
    (r"^markov_w|^conf_proj", "DSpark Markov / confidence head"),
    (r"^d2t$", "a reduced draft vocabulary (d2t map)"),
    (r"\.scale$|^blk\.\d+\.layer_output_scale", "per-tensor or per-layer output scales"),
    (r"^blk\.\d+\.(attn|ffn)_post_norm", "post-attention / post-FFN norms"),
    (r"rope_freqs", "learned rope frequency factors"),
    (r"^blk\.\d+\.attn_sinks", "attention sinks"),
    (
        r"^hc_|^blk\.\d+\.hc_|attn_q_a|attn_q_b|attn_kv|attn_out_[ab]|_exps|_shexp|ffn_gate_inp|exp_probs",
        "the DeepSeek-V4 DSpark backbone (hyper-connections, MLA, MoE)",
    ),
)


def is_dflash2_gguf_tensor(gguf_tensor: str) -> bool:
    """A tensor only DFlash-2 files have (the convolutions and the selector)."""
    return bool(re.match(r"^selector_|^blk\.\d+\.(attn|ffn)_conv_", gguf_tensor))


def refusal_reason(gguf_tensor: str) -> str:
    for pattern, why in REFUSED_TENSORS:
        if re.search(pattern, gguf_tensor):
            return why
    return "a tensor llama.cpp's DFlash drafter does not define"
