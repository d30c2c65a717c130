"""Graph builders for the drafter's math (docs/design.md, "The drafter"), shared by the ring
cache and the one-shot graph: one statement of each layer, and of the noise-block forward.

Every function takes the graph Context `g`, appends ops, and returns the resulting Tensor(s).
Shapes are ggml order: a token's vector is ne0, tokens are ne1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ..ggml import Context, Tensor, lib
from ..model.config import DraftConfig
from . import dflash2_graph as D2
from .backend_weights import BackendWeights, Matrices

ROPE_NEOX = int(lib.GGML_ROPE_TYPE_NEOX)


def graph_size_for(cfg: DraftConfig) -> int:
    """Upper bound on nodes + leafs of a step graph (about 60 per layer, plus head and inputs,
    plus DFlash-2's convolutions and selector)."""
    extra = D2.graph_nodes(cfg.block_size, cfg.n_layer, cfg.conv_kernel_size) if cfg.is_dflash2 else 0
    return 128 * cfg.n_layer + 256 + extra


def norm(g: Context, x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm(x) * weight over ne0."""
    return g.mul(g.rms_norm(x, eps), weight)


def rope(g: Context, x: Tensor, pos: Tensor, cfg: DraftConfig) -> Tensor:
    """NEOX RoPE (with the config's YaRN args) of x [head_dim, heads, tokens] at i32 positions [tokens]."""
    return g.rope_ext(
        x,
        pos,
        cfg.head_dim,
        ROPE_NEOX,
        cfg.n_ctx_orig,
        cfg.rope_theta,
        cfg.freq_scale,
        cfg.ext_factor,
        cfg.attn_factor,
        cfg.beta_fast,
        cfg.beta_slow,
    )


def fuse_features(g: Context, w: Matrices, feat: Tensor) -> Tensor:
    """feat [fc_in, n] -> RMSNorm(fc @ feat) * hidden_norm  [hidden, n]."""
    return norm(g, g.mul_mat(w["fc.weight"], feat), w["hidden_norm.weight"], w.cfg.rms_eps)


def project_heads(g: Context, w: Matrices, layer: int, which: str, x: Tensor, n_heads: int) -> Tensor:
    """`which`_proj @ x reshaped to [head_dim, n_heads, tokens]."""
    y = g.mul_mat(w.layer(layer, f"self_attn.{which}_proj.weight"), x)
    return g.reshape(y, w.cfg.head_dim, n_heads, x.ne[1])


def keys(g: Context, w: Matrices, layer: int, x: Tensor, pos: Tensor) -> Tensor:
    """K of tokens x [hidden, n]: per-head RMSNorm * k_norm, RoPE at pos -> [head_dim*n_head_kv, n] f32."""
    cfg = w.cfg
    k = project_heads(g, w, layer, "k", x, cfg.n_head_kv)
    k = rope(g, norm(g, k, w.layer(layer, "self_attn.k_norm.weight"), cfg.rms_eps), pos, cfg)
    return g.reshape(k, cfg.head_dim * cfg.n_head_kv, x.ne[1])


def values(g: Context, w: Matrices, layer: int, x: Tensor) -> Tensor:
    """V of tokens x [hidden, n] -> [head_dim*n_head_kv, n] f32 (no norm)."""
    return g.mul_mat(w.layer(layer, "self_attn.v_proj.weight"), x)


def queries(g: Context, w: BackendWeights, layer: int, hn: Tensor, pos: Tensor) -> Tensor:
    """Q of the noise block: per-head RMSNorm * q_norm, RoPE -> [head_dim, n_head, q_len]."""
    cfg = w.cfg
    q = project_heads(g, w, layer, "q", hn, cfg.n_head)
    return rope(g, norm(g, q, w.layer(layer, "self_attn.q_norm.weight"), cfg.rms_eps), pos, cfg)


def kv_heads_view(g: Context, cache: Tensor, cfg: DraftConfig, n_rows: int, lanes: int = 1) -> Tensor:
    """A [head_dim*n_head_kv, n_rows * lanes] cache seen as [head_dim, n_rows, n_head_kv, lanes]
    (no copy): each lane's `n_rows` rows are a batch of their own for flash attention."""
    head_bytes = cache.nb[0] * cfg.head_dim
    if lanes == 1:
        return g.view(cache, (cfg.head_dim, n_rows, cfg.n_head_kv), (cache.nb[1], head_bytes), 0)
    return g.view(
        cache, (cfg.head_dim, n_rows, cfg.n_head_kv, lanes), (cache.nb[1], head_bytes, cache.nb[1] * n_rows), 0
    )


def group_size(cfg: DraftConfig) -> int:
    """Query heads per K/V head."""
    return cfg.n_head // cfg.n_head_kv


def fold_gqa(cfg: DraftConfig, backend_is_cpu: bool) -> bool:
    """Fold each K/V head's query heads into extra query rows for flash attention?

    ggml's CPU flash attention runs a tiled GEMM kernel only for >= 64 query rows per head, and
    otherwise a per-row dot-product loop that rereads every key for every query row and head
    (docs/design.md, "GQA folding"). With q_len 16 and 4 query heads per K/V head, folding gives
    64 rows per K/V head: the keys are read once per K/V head and scored with a GEMM.
    """
    return backend_is_cpu and group_size(cfg) > 1


def attend(
    g: Context,
    w: BackendWeights,
    layer: int,
    q: Tensor,
    k_all: Tensor,
    v_all: Tensor,
    mask: Tensor | None,
    fold: bool,
    bf16_products: bool = False,
    lanes: int = 1,
    lane_rows: int = 0,
) -> Tensor:
    """Flash attention of q [head_dim, n_head, q_len * lanes] over [head_dim*n_head_kv, rows] K/V, then o_proj.

    With `lanes` > 1 the query rows are `lanes` blocks of q_len, lane l's block attends only to
    rows [l * lane_rows, (l + 1) * lane_rows) of K/V: the lanes are flash attention's batch
    dimension (ne3), each with its own mask plane, so no lane can see another's keys
    (docs/design.md, "Lanes").

    With `fold`, the query heads sharing a K/V head become rows r = j + q_len*g of that head (g =
    the head's index within its group), and `mask` must have those rows: row j + q_len*g = query
    j's mask. The caller uploads it so (repeating a q_len-row mask
    in-graph with a concat cost more than uploading the folded rows). `bf16_products`: the CPU kernel's products take bf16 inputs
    on AMX tiles (ggml with old patch 0009), else f32 precision throughout.
    """
    cfg = w.cfg
    hd, n_kv, groups = cfg.head_dim, cfg.n_head_kv, group_size(cfg)
    q_len = q.ne[2] // lanes
    rows = lane_rows or k_all.ne[1]
    k = kv_heads_view(g, k_all, cfg, rows, lanes)
    v = kv_heads_view(g, v_all, cfg, rows, lanes)
    scale = 1.0 / math.sqrt(hd)
    prec = dict(prec_f32=not bf16_products, prec_bf16=bf16_products)
    if lanes == 1 and fold:
        # q[d, h = g + groups*kv, j] -> [d, j + q_len*g, kv]
        q4 = g.reshape(q, hd, groups, n_kv, q_len)
        qf = g.reshape(g.cont(g.permute(q4, 0, 2, 3, 1)), hd, q_len * groups, n_kv)
        out = g.flash_attn_ext(qf, k, v, mask, scale, **prec)  # [d, kv, j + q_len*g]
        # -> [d, h = g + groups*kv, j]
        out4 = g.reshape(out, hd, n_kv, q_len, groups)
        out = g.cont(g.permute(out4, 0, 2, 3, 1))
    elif fold:
        # q[d, h = g + groups*kv, j, lane] -> [d, j, h, lane] = [d, j + q_len*g, kv, lane]
        q4 = g.reshape(q, hd, cfg.n_head, q_len, lanes)
        qf = g.reshape(g.cont(g.permute(q4, 0, 2, 1, 3)), hd, q_len * groups, n_kv, lanes)
        out = g.flash_attn_ext(qf, k, v, mask, scale, **prec)  # [d, kv, j + q_len*g, lane]
        # -> [d, j + q_len*g, kv, lane] = [d, j, h, lane] -> [d, h, j, lane]: two moves, as ggml has four dims
        out = g.cont(g.permute(out, 0, 2, 1, 3))
        out = g.cont(g.permute(g.reshape(out, hd, q_len, cfg.n_head, lanes), 0, 2, 1, 3))
    elif lanes == 1:
        out = g.flash_attn_ext(g.permute(q, 0, 2, 1, 3), k, v, mask, scale, **prec)  # [d, n_head, q_len]
    else:
        q4 = g.reshape(q, hd, cfg.n_head, q_len, lanes)
        out = g.flash_attn_ext(g.permute(q4, 0, 2, 1, 3), k, v, mask, scale, **prec)  # [d, n_head, q_len, lane]
    out = g.reshape(out, hd * cfg.n_head, q_len * lanes)
    return g.mul_mat(w.layer(layer, "self_attn.o_proj.weight"), out)


def mlp(g: Context, w: BackendWeights, layer: int, hf: Tensor) -> Tensor:
    """down(silu(gate(hf)) * up(hf)) of the MLP's normed input hf."""
    gate = g.mul_mat(w.layer(layer, "mlp.gate_proj.weight"), hf)
    up = g.mul_mat(w.layer(layer, "mlp.up_proj.weight"), hf)
    return g.mul_mat(w.layer(layer, "mlp.down_proj.weight"), g.mul(g.silu(gate), up))


@dataclass
class Convolutions:
    """DFlash-2's convolutions around a noise block's sublayers (drafter.dflash2_graph): the
    block's lanes, and whether the CPU's custom op computes them."""

    lanes: int
    custom_op: bool

    def around(
        self,
        g: Context,
        w: BackendWeights,
        layer: int,
        sublayer: str,
        normed: Tensor,
        inner: Callable[[Tensor], Tensor],
    ) -> Tensor:
        """conv(inner(conv(normed, side 0)), side 1), both sides' taps from the un-convolved normed input."""
        deltas = D2.conv_deltas(g, w, layer, sublayer, normed)
        x = D2.dynamic_conv(g, w, layer, sublayer, normed, deltas, 0, self.lanes, self.custom_op)
        return D2.dynamic_conv(g, w, layer, sublayer, inner(x), deltas, 1, self.lanes, self.custom_op)


@dataclass
class Head:
    """The drafter's output: hidden states, and logits when an lm_head was given."""

    hidden: Tensor
    logits: Tensor | None


def output_head(g: Context, w: BackendWeights, h: Tensor, lm_head: Tensor | None) -> Head:
    """out = RMSNorm(h) * norm; logits = lm_head @ out * output_multiplier, soft-capped if configured."""
    cfg = w.cfg
    out = norm(g, h, w["norm.weight"], cfg.rms_eps)
    out.name = "hidden_states"
    out.set_output()
    logits = None
    if lm_head is not None:
        logits = g.mul_mat(lm_head, out)
        if cfg.output_multiplier != 1.0:
            logits = g.scale(logits, cfg.output_multiplier)
        if cfg.final_logit_softcapping:
            cap = float(cfg.final_logit_softcapping)
            logits = g.scale(g.tanh(g.scale(logits, 1.0 / cap)), cap)
        logits.name = "logits"
        logits.set_output()
    return Head(out, logits)


def append_rows(
    g: Context, w: Matrices, k_caches: list[Tensor], v_caches: list[Tensor], feat: Tensor, pos: Tensor, rows: Tensor
) -> tuple[list[Tensor], list[Tensor]]:
    """Fold-in append: fuse feat [fc_in, n], write each layer's K/V of those rows into the caches at `rows`.

    Returns the caches as written (set_rows results): reading through them orders every read
    after the write in the graph.
    """
    fused = fuse_features(g, w, feat)
    new_k, new_v = [], []
    for layer, (kc, vc) in enumerate(zip(k_caches, v_caches)):
        new_k.append(g.set_rows(kc, keys(g, w, layer, fused, pos), rows))
        new_v.append(g.set_rows(vc, values(g, w, layer, fused), rows))
    return new_k, new_v


# K/V of the noise block's `hn` rows for `layer`, joined with the context's: (k_all, v_all)
KvOfLayer = Callable[[int, Tensor], tuple[Tensor, Tensor]]


def embed_tokens(g: Context, cfg: DraftConfig, table: Tensor, tokens: Tensor) -> Tensor:
    """The noise block's embeddings looked up in-graph: table [hidden, vocab] at i32 ids [q_len]."""
    h = g.get_rows(table, tokens)
    return g.scale(h, cfg.input_embedding_scale) if cfg.input_embedding_scale != 1.0 else h


def noise_forward(
    g: Context,
    w: BackendWeights,
    h: Tensor,
    pos_q: Tensor,
    kv_of_layer: KvOfLayer,
    masks: dict[bool, Tensor | None],
    layer_swa: list[bool],
    fold: bool,
    bf16_products: bool,
    lm_head: Tensor | None,
    lanes: int = 1,
    lane_rows: int = 0,
    convs: Convolutions | None = None,
) -> Head:
    """The drafter's forward of the noise block h [hidden, q_len * lanes] at positions pos_q.

    With `lanes` > 1, h holds one noise block per lane, one after another; every product runs over
    all of them at once, and attention keeps them apart (`attend`), each lane's K/V being its
    `lane_rows` rows of the cache.

    `kv_of_layer(layer, hn)` projects the block's own K/V and returns them joined with the
    context's (the cache writes them into its ring; the one-shot graph concatenates);
    `masks[sliding]` is that layer type's mask (see drafter.masks). `convs`: a DFlash-2 drafter's
    convolutions around attention and the MLP (None for DFlash-1).
    """
    cfg = w.cfg
    for layer in range(cfg.n_layer):
        mask = masks[layer_swa[layer]]

        def attention(hn: Tensor, layer: int = layer, mask: Tensor | None = mask) -> Tensor:
            q = queries(g, w, layer, hn, pos_q)
            k_all, v_all = kv_of_layer(layer, hn)
            return attend(g, w, layer, q, k_all, v_all, mask, fold, bf16_products, lanes, lane_rows)

        hn = norm(g, h, w.layer(layer, "input_layernorm.weight"), cfg.rms_eps)
        h = g.add(h, convs.around(g, w, layer, D2.ATTENTION_CONV, hn, attention) if convs else attention(hn))
        hf = norm(g, h, w.layer(layer, "post_attention_layernorm.weight"), cfg.rms_eps)

        def feed_forward(x: Tensor, layer: int = layer) -> Tensor:
            return mlp(g, w, layer, x)

        ffn = convs.around(g, w, layer, D2.MLP_CONV, hf, feed_forward) if convs else feed_forward(hf)
        h = g.add(h, ffn)
    return output_head(g, w, h, lm_head)
