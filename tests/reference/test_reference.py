"""Tests of the pure-numpy reference drafter (pyggml_dkv.reference)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pyggml_dkv import reference as R
from pyggml_dkv.model.config import DraftConfig
from pyggml_dkv.model.weights import DraftWeights

SMALL = dict(hidden=32, n_layer=2, n_head=4, n_head_kv=2, head_dim=8, ffn=48, block_size=4, n_target_layers=2)
YARN = dict(freq_scale=0.25, ext_factor=1.0, attn_factor=1.0, n_ctx_orig=64, rope_theta=10000.0)


def small_cfg(**changes) -> DraftConfig:
    return DraftConfig.toy(**{**SMALL, **changes})


def inputs(cfg: DraftConfig, n_positions: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n_positions, cfg.fc_in)), rng.standard_normal((cfg.q_len, cfg.hidden))


# ---------------------------------------------------------------------------------- rms_norm


def test_rms_norm_matches_direct_formula():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((3, 5, 7)), rng.uniform(0.5, 1.5, 7)
    got = R.rms_norm(x, w, 1e-6)
    for idx in np.ndindex(3, 5):
        row = x[idx]
        want = row / math.sqrt(sum(v * v for v in row) / 7 + 1e-6) * w
        np.testing.assert_allclose(got[idx], want, rtol=1e-13)


def test_rms_norm_rejects_wrong_weight():
    with pytest.raises(ValueError, match="rms_norm"):
        R.rms_norm(np.ones((2, 4)), np.ones(3), 1e-6)


# ---------------------------------------------------------------------------------- RoPE / YaRN


def test_yarn_corr_dims_hand_checked():
    # 128 * ln(4096 / (2*pi*32)) / (2 ln 1e4) = 20.94 -> 20;  same with beta 1: 45.03 -> 46
    assert R.yarn_corr_dims(small_cfg(head_dim=128, rope_theta=10000.0, n_ctx_orig=4096)) == (20.0, 46.0)
    # ggml clamps low only below (0) and high only above (n_dims - 1): low may exceed high
    assert R.yarn_corr_dims(small_cfg(head_dim=8, rope_theta=10.0, n_ctx_orig=1 << 20)) == (14.0, 7.0)
    # ggml with n_ctx_orig == 0: ln(0) = -inf, MAX(0, -inf) = 0, MIN(n_dims-1, -inf) = -inf
    assert R.yarn_corr_dims(small_cfg(n_ctx_orig=0)) == (0.0, -math.inf)


def test_yarn_ramp():
    np.testing.assert_array_equal(R.yarn_ramp(1.0, 3.0, 5), [1.0, 1.0, 0.5, 0.0, 0.0])
    np.testing.assert_array_equal(R.yarn_ramp(2.0, 2.0, 4), [1.0, 1.0, 1.0, 0.0])  # width clamped to 0.001
    np.testing.assert_array_equal(R.yarn_ramp(0.0, -math.inf, 4), [1.0, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(R.yarn_ramp(14.0, 7.0, 4), [1.0, 1.0, 1.0, 1.0])  # low > high: all extrapolated


def test_rope_plain_neox_pairs():
    cfg = small_cfg(rope_theta=100.0)
    hd, half = cfg.head_dim, cfg.head_dim // 2
    pos = np.array([0, 3, 17])
    for i in range(half):
        x = np.zeros((3, 1, hd))
        x[:, 0, i], x[:, 0, i + half] = 1.0, 2.0
        out = R.rope_neox(x, pos, cfg)
        theta = pos * 100.0 ** (-2 * i / hd)
        np.testing.assert_allclose(out[:, 0, i], np.cos(theta) - 2 * np.sin(theta), atol=1e-14)
        np.testing.assert_allclose(out[:, 0, i + half], np.sin(theta) + 2 * np.cos(theta), atol=1e-14)
        others = np.delete(out[:, 0, :], [i, i + half], axis=1)
        assert not others.any()


def test_rope_yarn_with_n_ctx_orig_zero_like_ggml():
    # corr dims (0, -inf): pair 0 fully extrapolated, every other pair fully interpolated
    cfg = small_cfg(rope_theta=100.0, freq_scale=0.5, ext_factor=1.0, n_ctx_orig=0)
    theta, mscale = R.rope_angles(np.array([5]), cfg)
    inv = 100.0 ** (-2 * np.arange(4) / 8)
    np.testing.assert_allclose(theta[0], 5 * inv * np.array([1.0, 0.5, 0.5, 0.5]), rtol=1e-14)
    assert mscale == pytest.approx(1 + 0.1 * math.log(2.0))


def test_rope_mscale():
    x = np.random.default_rng(0).standard_normal((4, 2, 8))
    pos = np.arange(4)
    norm = np.linalg.norm(x, axis=-1)
    # attn_factor scales even without YaRN; ext_factor == 0 adds nothing
    out = R.rope_neox(x, pos, small_cfg(attn_factor=2.0, freq_scale=0.25))
    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), 2.0 * norm)
    out = R.rope_neox(x, pos, small_cfg(**{**YARN, "attn_factor": 2.0}))
    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), 2.0 * (1 + 0.1 * math.log(4.0)) * norm)


def test_rope_yarn_interpolates_between_extrap_and_interp():
    cfg = small_cfg(**YARN)  # corr dims for head_dim 8, base 1e4, n_ctx_orig 64
    low, high = R.yarn_corr_dims(cfg)
    assert 0 <= low <= high <= 7
    theta, _ = R.rope_angles(np.array([1]), cfg)
    inv = 1e4 ** (-2 * np.arange(4) / 8)
    ratio = theta[0] / inv  # 1 = extrapolation, freq_scale = interpolation
    assert np.all((ratio >= 0.25 - 1e-12) & (ratio <= 1 + 1e-12))
    assert np.all(np.diff(ratio) <= 1e-12)  # high frequencies keep more of the original angle


@pytest.mark.parametrize("rope", [{}, YARN, {**YARN, "n_ctx_orig": 0}, {"attn_factor": 1.5}])
def test_rope_scores_depend_only_on_position_difference(rope):
    cfg = small_cfg(**rope)
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((1, 1, 8)), rng.standard_normal((1, 1, 8))

    def score(pq: int, pk: int) -> float:
        return float(np.sum(R.rope_neox(q, np.array([pq]), cfg) * R.rope_neox(k, np.array([pk]), cfg)))

    for pq, pk in [(7, 2), (2, 7), (40, 40)]:
        base = score(pq, pk)
        for shift in (1, 13, 1000):
            assert score(pq + shift, pk + shift) == pytest.approx(base, rel=1e-9, abs=1e-9)


def test_rope_validation():
    cfg = small_cfg()
    with pytest.raises(ValueError, match="head_dim"):
        R.rope_neox(np.zeros((2, 1, 6)), np.arange(2), cfg)
    with pytest.raises(ValueError, match="entries"):
        R.rope_neox(np.zeros((2, 1, 8)), np.arange(3), cfg)
    with pytest.raises(ValueError, match="integers"):
        R.rope_neox(np.zeros((2, 1, 8)), np.array([0.0, 1.0]), cfg)


# ---------------------------------------------------------------------------------- attention


def naive_attention(q, k, v, visible, group):
    out = np.zeros_like(q)
    for j in range(q.shape[0]):
        for h in range(q.shape[1]):
            keys = [c for c in range(k.shape[0]) if visible[j, c]]
            s = np.array([q[j, h] @ k[c, h // group] for c in keys]) / math.sqrt(q.shape[2])
            p = np.exp(s - s.max())
            p /= p.sum()
            out[j, h] = sum(pi * v[c, h // group] for pi, c in zip(p, keys))
    return out


def test_attention_matches_naive_loop_and_head_repetition():
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((3, 6, 4)), rng.standard_normal((5, 2, 4)), rng.standard_normal((5, 2, 4))
    visible = rng.random((3, 5)) < 0.6
    visible[:, 0] = True
    got = R.attention(q, k, v, visible)
    np.testing.assert_allclose(got, naive_attention(q, k, v, visible, 3), rtol=1e-12)
    # GQA == explicit repetition of each K/V head for its n_head // n_head_kv query heads
    np.testing.assert_allclose(
        got, R.attention(q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1), visible), rtol=1e-12
    )


def test_attention_validation():
    q, k = np.zeros((2, 4, 8)), np.zeros((3, 2, 8))
    with pytest.raises(ValueError, match="see no key"):
        R.attention(q, k, k, np.array([[True, False, False], [False, False, False]]))
    with pytest.raises(ValueError, match="bool"):
        R.attention(q, k, k, np.ones((2, 3)))
    with pytest.raises(ValueError, match="multiple"):
        R.attention(np.zeros((2, 3, 8)), k, k, np.ones((2, 3), bool))


# ---------------------------------------------------------------------------------- visibility

CTX = np.array([3, 4, 5, 6, 7])  # committed = 8, q_len = 3


def test_visibility_full_and_off():
    cfg = small_cfg(layer_types=["full", "sliding"], swa_window=2)
    for swa in R.SWA_MODES:
        assert R.visibility(cfg, "full", CTX, 8, 3, swa).all()
    assert R.visibility(cfg, "sliding", CTX, 8, 3, "off").shape == (3, 8)
    assert R.visibility(cfg, "sliding", CTX, 8, 3, "off").all()


def test_visibility_seed_sliding():
    cfg = small_cfg(layer_types=["full", "sliding"], swa_window=2)
    want = np.array(
        [
            # ctx 3 4 5 6 7 | noise 8 9 10
            [0, 0, 0, 1, 1, 1, 0, 0],
            [0, 0, 0, 1, 1, 1, 1, 0],
            [0, 0, 0, 1, 1, 1, 1, 1],
        ],
        dtype=bool,
    )
    np.testing.assert_array_equal(R.visibility(cfg, "sliding", CTX, 8, 3, "seed"), want)


def test_visibility_per_row_sliding():
    cfg = small_cfg(layer_types=["full", "sliding"], swa_window=2)
    want = np.array(
        [
            # ctx 3 4 5 6 7 | noise 8 9 10
            [0, 0, 0, 0, 1, 1, 0, 0],  # q=8: keys 7, 8
            [0, 0, 0, 0, 0, 1, 1, 0],  # q=9: keys 8, 9
            [0, 0, 0, 0, 0, 0, 1, 1],  # q=10: keys 9, 10
        ],
        dtype=bool,
    )
    np.testing.assert_array_equal(R.visibility(cfg, "sliding", CTX, 8, 3, "per_row"), want)


def dflash_mask(key_len: int, q_len: int, is_causal: bool, sliding_window: int | None) -> np.ndarray:
    """dflash/model.py `_attention_mask`, transcribed to numpy (key positions = cache indices)."""
    query_position = key_len - q_len + np.arange(q_len)[:, None]
    key_position = np.arange(key_len)[None, :]
    visible = np.ones((q_len, key_len), dtype=bool)
    if is_causal:
        visible &= key_position <= query_position
    if sliding_window is not None:
        visible &= query_position - key_position < sliding_window
        if not is_causal:
            visible &= key_position - query_position < sliding_window
    return visible


@pytest.mark.parametrize("window", [1, 2, 3, 5, 9, 40])
def test_visibility_per_row_mirrors_dflash(window):
    cfg = small_cfg(layer_types=["sliding", "sliding"], swa_window=window)
    committed, q_len = 12, 4  # dflash's cache holds positions 0..committed-1
    got = R.visibility(cfg, "sliding", np.arange(committed), committed, q_len, "per_row")
    np.testing.assert_array_equal(got, dflash_mask(committed + q_len, q_len, True, window))


@pytest.mark.parametrize("window", [5, 6, 100])
def test_visibility_seed_window_at_least_ctx_len_sees_all_context(window):
    cfg = small_cfg(layer_types=["sliding", "sliding"], swa_window=window)
    vis = R.visibility(cfg, "sliding", CTX, 8, 3, "seed")
    assert vis[:, : CTX.size].all()
    np.testing.assert_array_equal(vis[:, CTX.size :], np.tril(np.ones((3, 3), bool)))


def test_visibility_validation():
    cfg = small_cfg()
    with pytest.raises(ValueError, match="layer_type"):
        R.visibility(cfg, "full_attention", CTX, 8, 3)
    with pytest.raises(ValueError, match="swa"):
        R.visibility(cfg, "full", CTX, 8, 3, "window")
    with pytest.raises(ValueError, match="committed"):
        R.visibility(cfg, "full", CTX, 0, 3)


# ---------------------------------------------------------------------------------- the forward


def test_fuse_features_and_context_kv_shapes():
    cfg = small_cfg()
    w = DraftWeights.random(cfg, 0)
    feats, _ = inputs(cfg, 5)
    fused = R.fuse_features(w, feats)
    assert fused.shape == (5, cfg.hidden)
    want = R.rms_norm(feats @ w["fc.weight"].T.astype(np.float64), w["hidden_norm.weight"], cfg.rms_eps)
    np.testing.assert_allclose(fused, want, rtol=1e-12)
    k, v = R.context_kv(w, 1, fused, np.arange(5))
    assert k.shape == v.shape == (5, cfg.n_head_kv, cfg.head_dim)
    np.testing.assert_allclose(v.reshape(5, -1), fused @ w["layers.1.self_attn.v_proj.weight"].T.astype(np.float64))
    # position 0 is the identity rotation: K = RMSNorm_per_head(fused @ wk.T) * k_norm
    k0 = (fused[:1] @ w["layers.1.self_attn.k_proj.weight"].T.astype(np.float64)).reshape(1, cfg.n_head_kv, -1)
    np.testing.assert_allclose(k[:1], R.rms_norm(k0, w["layers.1.self_attn.k_norm.weight"], cfg.rms_eps), rtol=1e-12)


MIXED = dict(layer_types=["sliding", "full"], swa_window=3)


@pytest.mark.parametrize("swa", R.SWA_MODES)
@pytest.mark.parametrize("changes", [{}, YARN, MIXED, {**MIXED, **YARN}])
def test_shifting_all_positions_leaves_forward_unchanged(changes, swa):
    cfg = small_cfg(**changes)
    w = DraftWeights.random(cfg, 2)
    feats, noise = inputs(cfg, 6)
    base = R.draft_forward(w, feats, np.arange(6), noise, 6, swa=swa)
    for shift in (1, 37, 5000):
        got = R.draft_forward(w, feats, np.arange(6) + shift, noise, 6 + shift, swa=swa)
        np.testing.assert_allclose(got, base, rtol=1e-9, atol=1e-9)


def test_context_rows_are_a_set():
    cfg = small_cfg(**MIXED)
    w = DraftWeights.random(cfg, 3)
    feats, noise = inputs(cfg, 7)
    perm = np.random.default_rng(0).permutation(7)
    for swa in R.SWA_MODES:
        base = R.draft_forward(w, feats, np.arange(7), noise, 7, swa=swa)
        got = R.draft_forward(w, feats[perm], perm, noise, 7, swa=swa)
        np.testing.assert_allclose(got, base, rtol=1e-12, atol=1e-12)


def test_sliding_only_drafter_is_causal_over_the_noise_block():
    cfg = small_cfg(layer_types=["sliding", "sliding"], swa_window=4)
    w = DraftWeights.random(cfg, 4)
    feats, noise = inputs(cfg, 6)
    bumped = noise.copy()
    bumped[-1] += 1.0
    for swa in ("seed", "per_row"):
        a = R.draft_forward(w, feats, np.arange(6), noise, 6, swa=swa)
        b = R.draft_forward(w, feats, np.arange(6), bumped, 6, swa=swa)
        np.testing.assert_allclose(a[:-1], b[:-1], rtol=1e-12, atol=1e-12)
        assert not np.allclose(a[-1], b[-1])
    # full layers are not causal
    a = R.draft_forward(w, feats, np.arange(6), noise, 6, swa="off")
    b = R.draft_forward(w, feats, np.arange(6), bumped, 6, swa="off")
    assert not np.allclose(a[0], b[0])


def test_swa_off_equals_an_all_full_drafter():
    cfg = small_cfg(**MIXED)
    full = cfg.replace(layer_types=["full", "full"])
    w = DraftWeights.random(cfg, 5)
    w_full = DraftWeights(full, dict(w))
    feats, noise = inputs(cfg, 6)
    np.testing.assert_array_equal(
        R.draft_forward(w, feats, np.arange(6), noise, 6, swa="off"),
        R.draft_forward(w_full, feats, np.arange(6), noise, 6),
    )


def test_seed_window_covering_the_context_with_one_query_is_full_attention():
    cfg = small_cfg(layer_types=["sliding", "sliding"], swa_window=6, block_size=1)
    w = DraftWeights.random(cfg, 6)
    feats, noise = inputs(cfg, 6)
    full = R.draft_forward(w, feats, np.arange(6), noise, 6, swa="off")
    np.testing.assert_allclose(R.draft_forward(w, feats, np.arange(6), noise, 6, swa="seed"), full, rtol=1e-13)
    # a narrower window changes the result
    narrow = DraftWeights(cfg.replace(swa_window=2), dict(w))
    assert not np.allclose(R.draft_forward(narrow, feats, np.arange(6), noise, 6), full)


def test_logits_multiplier_and_softcap():
    cfg = small_cfg(vocab=50, output_multiplier=3.0, final_logit_softcapping=2.0)
    w = DraftWeights.random(cfg, 7)
    feats, noise = inputs(cfg, 5)
    lm_head = np.random.default_rng(8).standard_normal((50, cfg.hidden))
    hidden = R.draft_forward(w, feats, np.arange(5), noise, 5)
    logits = R.draft_forward(w, feats, np.arange(5), noise, 5, lm_head=lm_head)
    assert logits.shape == (cfg.q_len, 50)
    np.testing.assert_allclose(logits, 2.0 * np.tanh(hidden @ lm_head.T * 3.0 / 2.0), rtol=1e-12)
    assert np.abs(logits).max() <= 2.0
    plain = DraftWeights(cfg.replace(output_multiplier=1.0, final_logit_softcapping=None), dict(w))
    np.testing.assert_allclose(
        R.draft_forward(plain, feats, np.arange(5), noise, 5, lm_head=lm_head), hidden @ lm_head.T
    )


def test_hidden_is_rms_normed_by_out_norm():
    cfg = small_cfg()
    w = DraftWeights.random(cfg, 9)
    feats, noise = inputs(cfg, 4)
    out = R.draft_forward(w, feats, np.arange(4), noise, 4)
    assert out.shape == (cfg.q_len, cfg.hidden)
    unit = out / w["norm.weight"].astype(np.float64)
    np.testing.assert_allclose(np.mean(unit * unit, axis=-1), 1.0, rtol=1e-4)


@pytest.mark.parametrize("swa", R.SWA_MODES)
def test_reference_step_window(swa):
    cfg = small_cfg(**MIXED)
    w = DraftWeights.random(cfg, 10)
    all_feats, noise = inputs(cfg, 25)
    # absolute positions == window-rebased positions
    got = R.reference_step(w, all_feats, 20, 8, noise, swa=swa)
    want = R.draft_forward(w, all_feats[12:20], np.arange(8), noise, 8, swa=swa)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
    # cap >= committed: the whole prefix
    np.testing.assert_array_equal(
        R.reference_step(w, all_feats, 5, 8, noise, swa=swa),
        R.draft_forward(w, all_feats[:5], np.arange(5), noise, 5, swa=swa),
    )
    np.testing.assert_array_equal(R.window_positions(20, 8), np.arange(12, 20))
    np.testing.assert_array_equal(R.window_positions(3, 8), np.arange(3))


def test_float32_is_close_to_float64():
    cfg = small_cfg(**MIXED, **YARN)
    w = DraftWeights.random(cfg, 11)
    feats, noise = inputs(cfg, 9)
    a = R.reference_step(w, feats, 9, 6, noise)
    b = R.reference_step(w, feats, 9, 6, noise, dtype=np.float32)
    assert b.dtype == np.float32 and a.dtype == np.float64
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)


def test_draft_forward_validation():
    cfg = small_cfg(vocab=50)
    w = DraftWeights.random(cfg, 12)
    feats, noise = inputs(cfg, 5)
    pos = np.arange(5)
    cases = [
        (dict(committed=0), "committed"),
        (dict(committed=True), "committed"),
        (dict(committed=4), r"ctx_positions must lie in \[0, committed"),
        (dict(ctx_positions=np.array([0, 1, 1, 2, 3])), "distinct"),
        (dict(ctx_positions=np.arange(4)), "entries"),
        (dict(ctx_positions=np.arange(5.0)), "integers"),
        (dict(feats=feats[:, :-1]), "fc_in"),
        (dict(feats=feats[:0]), "ctx_len >= 1"),
        (dict(feats=feats[0]), "2-D"),
        (dict(feats=np.where(pos[:, None] == 2, np.nan, feats)), "NaN"),
        (dict(noise_embed=noise[:, :-1]), "hidden"),
        (dict(noise_embed=noise[:0]), "q_len >= 1"),
        (dict(swa="window"), "swa"),
        (dict(lm_head=np.zeros((49, cfg.hidden))), "lm_head"),
        (dict(lm_head=np.zeros((50, cfg.hidden + 1))), "lm_head"),
        (dict(dtype=np.int32), "dtype"),
    ]
    for change, match in cases:
        kwargs = {**dict(feats=feats, ctx_positions=pos, noise_embed=noise, committed=5), **change}
        with pytest.raises(ValueError, match=match):
            R.draft_forward(w, **kwargs)
    with pytest.raises(ValueError, match="DraftWeights"):
        R.draft_forward(dict(w), feats, pos, noise, 5)  # type: ignore[arg-type]


def test_reference_step_validation():
    cfg = small_cfg()
    w = DraftWeights.random(cfg, 13)
    feats, noise = inputs(cfg, 5)
    with pytest.raises(ValueError, match="fewer than committed"):
        R.reference_step(w, feats, 6, 4, noise)
    with pytest.raises(ValueError, match="cap"):
        R.reference_step(w, feats, 5, 0, noise)
    with pytest.raises(ValueError, match="committed"):
        R.reference_step(w, feats, 0, 4, noise)
    with pytest.raises(ValueError, match="2-D"):
        R.reference_step(w, feats[0], 1, 4, noise)
