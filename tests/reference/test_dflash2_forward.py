"""The numpy reference running DFlash-2 drafters (docs/dflash2.md): the convolutions around the
attention and the MLP in `decoder_layer` / `draft_forward`, the selector on a drafter's weights
(`dflash2.selector_lattice`, `dflash2.draft_step_dflash2`), and llama.cpp's sliding-window flavour
`swa="llama"`. Each is checked against a statement written out independently in this file.
"""

from __future__ import annotations

import numpy as np
import pytest

from pyggml_dkv import reference as R
from pyggml_dkv.model.config import DFLASH2_FIELDS, DraftConfig
from pyggml_dkv.model.tensor_names import expected_shapes
from pyggml_dkv.model.weights import DraftWeights
from pyggml_dkv.reference import dflash2 as D2
from tests.reference.test_dflash2_reference import brute_conv

SMALL = dict(
    hidden=32,
    n_layer=2,
    n_head=4,
    n_head_kv=2,
    head_dim=8,
    ffn=48,
    block_size=6,
    n_target_layers=2,
    vocab=50,
    mask_token_id=49,
)
DFLASH2 = dict(conv_kernel_size=3, conv_group_size=4, selector_rank=6, selector_top_k=3)
MIXED = dict(layer_types=["sliding", "full"], swa_window=3)


def d2_cfg(**changes) -> DraftConfig:
    return DraftConfig(**{**SMALL, **DFLASH2, **changes})


def inputs(cfg: DraftConfig, n_positions: int, q_len: int | None = None, seed: int = 1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n_positions, cfg.fc_in)), rng.standard_normal((q_len or cfg.block_size, cfg.hidden))


def with_tensors(w: DraftWeights, **arrays: np.ndarray) -> DraftWeights:
    """`w` with some tensors replaced (names with `/` for `.`)."""
    tensors = dict(w)
    tensors.update({name.replace("/", "."): arr for name, arr in arrays.items()})
    return DraftWeights(w.cfg, tensors)


# ------------------------------------------------------------------------------- the layer, stated by brute force


def brute_layer(
    w: DraftWeights,
    layer: int,
    h: np.ndarray,
    fused: np.ndarray,
    ctx: np.ndarray,
    committed: int,
    swa: str,
    conv=None,
    kv_from_convolved: bool = True,
) -> np.ndarray:
    """docs/dflash2.md section 1, steps 1-11, from the reference's DFlash-1 pieces and a scalar
    convolution: conv(x, sublayer, side, deltas) defaults to brute_conv."""
    cfg = w.cfg
    p = f"layers.{layer}."
    q_len = h.shape[0]
    noise_pos = committed + np.arange(q_len)

    def deltas(normed, sub):
        proj = w[p + f"{sub}.kernel_projection.weight"].astype(np.float64)
        return (normed @ proj.T).reshape(q_len, 2, cfg.conv_kernel_size, cfg.conv_groups)

    def convolve(x, sub, side, d):
        if conv is not None:
            return conv(x, sub, side, d)
        return brute_conv(x, w[p + f"{sub}.base_kernel"].astype(np.float64), d, side, q_len)

    a = R.rms_norm(h, w[p + "input_layernorm.weight"], cfg.rms_eps)  # 1
    d_attn = deltas(a, "attention_conv")  # 2: from the un-convolved input
    a_conv = convolve(a, "attention_conv", 0, d_attn)  # 3
    q = (a_conv @ w[p + "self_attn.q_proj.weight"].T).reshape(q_len, cfg.n_head, cfg.head_dim)  # 4
    q = R.rope_neox(R.rms_norm(q, w[p + "self_attn.q_norm.weight"], cfg.rms_eps), noise_pos, cfg)
    k_ctx, v_ctx = R.context_kv(w, layer, fused, ctx)  # the context rows: never convolved
    k_noise, v_noise = R.project_kv(w, layer, a_conv if kv_from_convolved else a, noise_pos)
    vis = R.visibility(cfg, cfg.layer_types[layer], ctx, committed, q_len, swa)
    y = R.attention(q, np.concatenate([k_ctx, k_noise]), np.concatenate([v_ctx, v_noise]), vis)
    y = y.reshape(q_len, -1) @ w[p + "self_attn.o_proj.weight"].T
    h = h + convolve(y, "attention_conv", 1, d_attn)  # 6, 7
    m = R.rms_norm(h, w[p + "post_attention_layernorm.weight"], cfg.rms_eps)  # 8
    d_mlp = deltas(m, "mlp_conv")  # 9
    m_conv = convolve(m, "mlp_conv", 0, d_mlp)  # 10
    gate, up = m_conv @ w[p + "mlp.gate_proj.weight"].T, m_conv @ w[p + "mlp.up_proj.weight"].T
    u = (R.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return h + convolve(u, "mlp_conv", 1, d_mlp)  # 11


def brute_forward(w, feats, ctx, noise, committed, swa, **kwargs) -> np.ndarray:
    fused = R.fuse_features(w, feats)
    h = noise.astype(np.float64)
    for layer in range(w.cfg.n_layer):
        h = brute_layer(w, layer, h, fused, ctx, committed, swa, **kwargs)
    return R.rms_norm(h, w["norm.weight"], w.cfg.rms_eps)


@pytest.mark.parametrize("swa", ["seed", "per_row", "llama"])
@pytest.mark.parametrize("changes", [{}, MIXED, dict(conv_kernel_size=1), dict(conv_kernel_size=8, conv_group_size=32)])
def test_forward_matches_the_brute_force_statement(changes, swa):
    cfg = d2_cfg(**changes)
    w = DraftWeights.random(cfg, seed=3)
    feats, noise = inputs(cfg, 9)
    ctx = np.arange(2, 11)
    got = R.draft_forward(w, feats, ctx, noise, 11, swa=swa)
    want = brute_forward(w, feats, ctx, noise, 11, swa)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # negative control: K and V of the noise rows from the un-convolved input are another drafter
    other = brute_forward(w, feats, ctx, noise, 11, swa, kv_from_convolved=False)
    assert not np.allclose(other, got, rtol=1e-6, atol=1e-6)


def test_one_tap_without_projection_is_a_per_channel_scale():
    """K = 1 and a zero projection: each side of each convolution multiplies channel c by base[side, 0, c]."""
    cfg = d2_cfg(conv_kernel_size=1)
    w = DraftWeights.random(cfg, seed=4)
    zero = {
        f"layers/{i}/{sub}/kernel_projection/weight": np.zeros((2 * cfg.conv_groups, cfg.hidden), np.float32)
        for i in range(cfg.n_layer)
        for sub in ("attention_conv", "mlp_conv")
    }
    w = with_tensors(w, **zero)
    feats, noise = inputs(cfg, 7)
    fused = R.fuse_features(w, feats)
    h = noise.copy()
    for layer in range(cfg.n_layer):
        h = brute_layer(
            w,
            layer,
            h,
            fused,
            np.arange(7),
            7,
            "seed",
            conv=lambda x, sub, side, d, i=layer: x * w[f"layers.{i}.{sub}.base_kernel"][side, 0],
        )
    want = R.rms_norm(h, w["norm.weight"], cfg.rms_eps)
    np.testing.assert_allclose(R.draft_forward(w, feats, np.arange(7), noise, 7), want, rtol=1e-12, atol=1e-12)


def test_identity_convolutions_give_exactly_the_dflash1_drafter():
    cfg = d2_cfg()
    w = DraftWeights.random(cfg, seed=5)
    ident = np.zeros((2, cfg.conv_kernel_size, cfg.hidden), np.float32)
    ident[:, 0] = 1.0
    arrays = {}
    for i in range(cfg.n_layer):
        for sub in ("attention_conv", "mlp_conv"):
            arrays[f"layers/{i}/{sub}/base_kernel"] = ident
            arrays[f"layers/{i}/{sub}/kernel_projection/weight"] = np.zeros_like(
                w[f"layers.{i}.{sub}.kernel_projection.weight"]
            )
    w2 = with_tensors(w, **arrays)
    one_cfg = cfg.replace(**{k: 0 for k in DFLASH2_FIELDS})
    w1 = DraftWeights(one_cfg, {k: v for k, v in w.items() if k in expected_shapes(one_cfg)})
    feats, noise = inputs(cfg, 8)
    np.testing.assert_array_equal(
        R.draft_forward(w2, feats, np.arange(8), noise, 8), R.draft_forward(w1, feats, np.arange(8), noise, 8)
    )
    # negative control: the random convolutions change the result
    assert not np.allclose(
        R.draft_forward(w, feats, np.arange(8), noise, 8), R.draft_forward(w1, feats, np.arange(8), noise, 8), rtol=1e-3
    )


def test_context_rows_are_not_convolved():
    """The noise block is the convolution's only block: changing the context's features changes the
    output only through attention (context K/V), never through a tap reading a context row. With
    every attention output zeroed by o_proj = 0, the context cannot matter at all."""
    cfg = d2_cfg()
    w = DraftWeights.random(cfg, seed=6)
    w = with_tensors(
        w,
        **{
            f"layers/{i}/self_attn/o_proj/weight": np.zeros((cfg.hidden, cfg.hidden), np.float32)
            for i in range(cfg.n_layer)
        },
    )
    feats, noise = inputs(cfg, 8)
    other = feats + np.random.default_rng(9).standard_normal(feats.shape)
    np.testing.assert_array_equal(
        R.draft_forward(w, feats, np.arange(8), noise, 8), R.draft_forward(w, other, np.arange(8), noise, 8)
    )


OLD_CASES = [dict(), MIXED, dict(freq_scale=0.25, ext_factor=1.0, n_ctx_orig=64)]


@pytest.mark.parametrize("changes", OLD_CASES)
@pytest.mark.parametrize("swa", ["seed", "per_row", "off"])
def test_dflash1_configs_give_exactly_the_old_results(changes, swa):
    """The DFlash-1 layer as it was before DFlash-2 (transcribed here), bit for bit."""
    cfg = DraftConfig(**{**SMALL, **changes})
    w = DraftWeights.random(cfg, seed=7)
    feats, noise = inputs(cfg, 9)
    ctx = np.arange(3, 12)
    fused = R.fuse_features(w, feats)
    h = noise.copy()
    for layer in range(cfg.n_layer):
        h = old_decoder_layer(w, layer, h, fused, ctx, 12, swa)
    want = R.rms_norm(h, w["norm.weight"], cfg.rms_eps)
    np.testing.assert_array_equal(R.draft_forward(w, feats, ctx, noise, 12, swa=swa), want)


def old_decoder_layer(w, layer, h, fused, ctx_positions, committed, swa):
    """pyggml_dkv.reference.decoder_layer before DFlash-2, verbatim but for the helper names."""
    cfg = w.cfg
    q_len = h.shape[0]
    noise_pos = committed + np.arange(q_len, dtype=np.int64)

    def lw(suffix):
        return np.asarray(w[f"layers.{layer}.{suffix}"], dtype=h.dtype)

    hn = R.rms_norm(h, lw("input_layernorm.weight"), cfg.rms_eps)
    q = (hn @ lw("self_attn.q_proj.weight").T).reshape(q_len, cfg.n_head, cfg.head_dim)
    q = R.rope_neox(R.rms_norm(q, lw("self_attn.q_norm.weight"), cfg.rms_eps), noise_pos, cfg)
    k_ctx, v_ctx = R.context_kv(w, layer, fused, ctx_positions)
    k_noise, v_noise = R.project_kv(w, layer, hn, noise_pos)
    k = np.concatenate([k_ctx, k_noise], axis=0)
    v = np.concatenate([v_ctx, v_noise], axis=0)
    visible = R.visibility(cfg, cfg.layer_types[layer], ctx_positions, committed, q_len, swa)
    attn = R.attention(q, k, v, visible).reshape(q_len, cfg.n_head * cfg.head_dim)
    h = h + attn @ lw("self_attn.o_proj.weight").T
    hf = R.rms_norm(h, lw("post_attention_layernorm.weight"), cfg.rms_eps)
    gate = hf @ lw("mlp.gate_proj.weight").T
    up = hf @ lw("mlp.up_proj.weight").T
    return h + (R.silu(gate) * up) @ lw("mlp.down_proj.weight").T


def test_float32_is_close_to_float64():
    cfg = d2_cfg(**MIXED)
    w = DraftWeights.random(cfg, seed=8)
    feats, noise = inputs(cfg, 7)
    a = R.draft_forward(w, feats, np.arange(7), noise, 7, dtype=np.float32, swa="llama")
    b = R.draft_forward(w, feats, np.arange(7), noise, 7, swa="llama")
    assert a.dtype == np.float32
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------- the selector on a drafter


def head_for(cfg: DraftConfig, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((cfg.vocab, cfg.hidden)) / np.sqrt(cfg.hidden)


def test_draft_step_is_forward_then_selector_then_walk():
    cfg = d2_cfg(output_multiplier=0.8, final_logit_softcapping=5.0)
    w = DraftWeights.random(cfg, seed=9)
    head = head_for(cfg)
    all_feats, noise = inputs(cfg, 20)
    lattice, ids = D2.draft_step_dflash2(w, all_feats, 20, 8, noise, 17, head)
    out = R.reference_step(w, all_feats, 20, 8, noise)
    logits = R.lm_logits(out, head, cfg)
    want = D2.selector_scores(
        out,
        logits,
        17,
        w["candidate_selector.hidden_projection.weight"],
        w["candidate_selector.predecessor_codebook"],
        w["candidate_selector.successor_codebook"],
        3,
    )
    np.testing.assert_array_equal(lattice.candidates, want.candidates)
    np.testing.assert_array_equal(lattice.scores, want.scores)
    np.testing.assert_array_equal(ids, D2.greedy_walk(want))
    assert lattice.n_positions == cfg.block_size - 1 and ids.shape == (cfg.block_size - 1,)
    # the codebooks matter: the predecessor of position 1 is the anchor id
    other, _ = D2.draft_step_dflash2(w, all_feats, 20, 8, noise, 18, head)
    assert not np.allclose(other.scores[0], lattice.scores[0])
    np.testing.assert_array_equal(other.scores[1:], lattice.scores[1:])


def test_selector_scores_at_most_block_size_rows():
    cfg = d2_cfg(block_size=4)
    w = DraftWeights.random(cfg, seed=10)
    head = head_for(cfg)
    all_feats, noise = inputs(cfg, 12, q_len=7)
    lattice, ids = D2.draft_step_dflash2(w, all_feats, 12, 12, noise, 3, head)
    assert lattice.n_positions == 3 and ids.shape == (3,)
    shorter, _ = D2.draft_step_dflash2(w, all_feats, 12, 12, noise[:3], 3, head)
    assert shorter.n_positions == 2  # a shorter block: that many rows only


def test_top_k_one_drafts_the_argmax_like_dflash1():
    cfg = d2_cfg(selector_top_k=1)
    w = DraftWeights.random(cfg, seed=11)
    head = head_for(cfg)
    all_feats, noise = inputs(cfg, 10)
    _, ids = D2.draft_step_dflash2(w, all_feats, 10, 10, noise, 0, head)
    logits = R.reference_step(w, all_feats, 10, 10, noise, lm_head=head)
    np.testing.assert_array_equal(ids, logits[1:].argmax(axis=1))


def test_selector_validation():
    cfg = d2_cfg()
    w = DraftWeights.random(cfg, seed=12)
    head = head_for(cfg)
    all_feats, noise = inputs(cfg, 10)
    one = DraftWeights.random(DraftConfig(**SMALL), seed=12)
    with pytest.raises(ValueError, match="DFlash-1 drafter"):
        D2.draft_step_dflash2(one, all_feats, 10, 10, noise, 0, head)
    with pytest.raises(ValueError, match="must be DraftWeights"):
        D2.selector_lattice(dict(w), noise, noise, 0)
    with pytest.raises(ValueError, match="anchor"):
        D2.draft_step_dflash2(w, all_feats, 10, 10, noise, cfg.vocab, head)
    with pytest.raises(ValueError, match="lm_head"):
        D2.draft_step_dflash2(w, all_feats, 10, 10, noise, 0, head[:, :-1])
    with pytest.raises(ValueError, match="logits"):
        D2.selector_lattice(w, noise, np.zeros((cfg.block_size, cfg.vocab + 1)), 0)


# ------------------------------------------------------------------------------- swa="llama"


def brute_llama_visibility(cfg: DraftConfig, layer_type: str, ctx: np.ndarray, committed: int, q_len: int):
    """llama.cpp's mask for one sequence, key by key: non-causal, and a sliding layer drops a key
    at position k for the query at position q exactly when q - k >= n_swa (is_masked_swa)."""
    keys = list(ctx) + [committed + i for i in range(q_len)]
    vis = np.zeros((q_len, len(keys)), dtype=bool)
    for j in range(q_len):
        q = committed + j
        for c, k in enumerate(keys):
            vis[j, c] = layer_type == "full" or not q - k >= cfg.swa_window
    return vis


@pytest.mark.parametrize("window", [1, 2, 3, 5, 9, 40])
@pytest.mark.parametrize("layer_type", ["sliding", "full"])
def test_llama_visibility_by_brute_force(window, layer_type):
    cfg = DraftConfig(**{**SMALL, "layer_types": ["sliding", "full"], "swa_window": window})
    for ctx, committed, q_len in ((np.arange(12), 12, 4), (np.array([3, 9, 4, 10]), 11, 6), (np.arange(5, 8), 8, 1)):
        got = R.visibility(cfg, layer_type, ctx, committed, q_len, "llama")
        np.testing.assert_array_equal(got, brute_llama_visibility(cfg, layer_type, ctx, committed, q_len))


def test_llama_sees_noise_keys_ahead_where_per_row_does_not():
    cfg = DraftConfig(**{**SMALL, "layer_types": ["sliding", "sliding"], "swa_window": 2})
    ctx = np.array([3, 4, 5, 6, 7])
    want = np.array(
        [
            # ctx 3 4 5 6 7 | noise 8 9 10
            [0, 0, 0, 0, 1, 1, 1, 1],  # q=8: 7, and every noise key (none is 2 behind)
            [0, 0, 0, 0, 0, 1, 1, 1],  # q=9: 8 .. 10
            [0, 0, 0, 0, 0, 0, 1, 1],  # q=10: 9, 10
        ],
        dtype=bool,
    )
    np.testing.assert_array_equal(R.visibility(cfg, "sliding", ctx, 8, 3, "llama"), want)
    assert not np.array_equal(R.visibility(cfg, "sliding", ctx, 8, 3, "per_row"), want)


def test_llama_flavour_runs_and_differs_from_per_row_on_sliding_layers():
    cfg = d2_cfg(**MIXED)
    w = DraftWeights.random(cfg, seed=13)
    feats, noise = inputs(cfg, 9)
    llama = R.draft_forward(w, feats, np.arange(9), noise, 9, swa="llama")
    assert not np.allclose(llama, R.draft_forward(w, feats, np.arange(9), noise, 9, swa="per_row"))
    full = DraftWeights(cfg.replace(layer_types=["full", "full"]), dict(w))
    np.testing.assert_array_equal(
        R.draft_forward(full, feats, np.arange(9), noise, 9, swa="llama"),
        R.draft_forward(full, feats, np.arange(9), noise, 9, swa="per_row"),
    )
