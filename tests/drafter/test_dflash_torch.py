"""Parity with the PyTorch reference model: the `dflash` package's DFlashDraftModel (SPEC.md §5).

A small random DFlashDraftModel is built with dflash + transformers on the CPU in float32, saved
with its own `save_pretrained`, loaded with `DraftWeights.from_pretrained`, and its forward pass is
compared with `pyggml_dkv.reference.draft_forward` (float64). The other direction too: a
checkpoint written by `save_pretrained` here is loaded by `DFlashDraftModel.from_pretrained`.

How dflash is driven (dflash 0.1.0, `dflash/model.py`):
    hidden = model(position_ids=pos, noise_embedding=noise, target_hidden=feats,
                   past_key_values=None, use_cache=False)
- `target_hidden` is the RAW concatenation of the captured target layers' hidden states,
  (1, ctx_len, n_target_layers*hidden): `fc` and `hidden_norm` are applied inside forward.
- `noise_embedding` (1, q_len, hidden): the target's token embeddings of the block (row 0 = the
  last accepted token, the rest the mask token), scaled by `input_embedding_scale` by the caller.
- `position_ids` (1, ctx_len + q_len): the context positions followed by the noise positions,
  i.e. arange(committed - ctx_len, committed + q_len); queries take the last q_len of them.
- the result is the final-normed hidden states (1, q_len, hidden), before the lm_head; dflash's
  generate loop keeps rows 1.. and calls `model.compute_logits(hidden, target.lm_head)`
  (times output_multiplier, then soft-capped).
- with a cache (`DynamicCache`, as dflash_generate uses it) only the new context rows are passed
  and `position_ids` starts at the first of them; after each call the cache is cropped back to
  `committed`, so it holds the context K/V of every position 0..committed-1 (unbounded).
Full layers attend to everything (no mask, non-causal); sliding layers are causal and window every
query row separately (`q_pos - k_pos < sliding_window`): reference swa="per_row".
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", exc_type=ImportError)
transformers = pytest.importorskip("transformers", exc_type=ImportError)
dflash_model = pytest.importorskip("dflash.model", exc_type=ImportError)

from pyggml_dkv import reference as R  # noqa: E402
from pyggml_dkv.common.numeric import relative_error  # noqa: E402
from pyggml_dkv.model.config import DraftConfig  # noqa: E402
from pyggml_dkv.model.weights import DraftWeights, load_checkpoint  # noqa: E402
from tests.torch_threads import torch_threads  # noqa: E402

pytestmark = pytest.mark.slow  # the PyTorch reference model: the slow tier

TOL = 1e-4  # max|a-b| / max|b|, dflash in float32 vs the float64 reference

HIDDEN, N_LAYER, N_HEAD, N_HEAD_KV, HEAD_DIM, FFN = 128, 2, 4, 2, 32, 256
BLOCK, TARGET_IDS, VOCAB, MASK_ID = 8, [1, 3, 5], 500, 499


@pytest.fixture(autouse=True, scope="module")
def _few_threads():
    with torch_threads(torch, 2):
        yield


def qwen3_config(
    *,
    layer_types=None,
    sliding_window=None,
    rope_theta=10000.0,
    rope_scaling=None,
    max_position_embeddings=32768,
    dflash_extra=None,
):
    """A Qwen3Config as dflash checkpoints carry it (rope given the transformers-4.x way, which 5.x converts)."""
    kwargs = dict(
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=N_LAYER,
        num_attention_heads=N_HEAD,
        num_key_value_heads=N_HEAD_KV,
        head_dim=HEAD_DIM,
        vocab_size=VOCAB,
        rms_norm_eps=1e-6,
        max_position_embeddings=max_position_embeddings,
        num_target_layers=8,
        rope_theta=rope_theta,
        dflash_config={
            "block_size": BLOCK,
            "mask_token_id": MASK_ID,
            "target_layer_ids": TARGET_IDS,
            **(dflash_extra or {}),
        },
    )
    if rope_scaling is not None:
        kwargs["rope_scaling"] = rope_scaling
    if layer_types is not None:
        kwargs["layer_types"] = layer_types
    if sliding_window is not None:
        kwargs.update(use_sliding_window=True, sliding_window=sliding_window)
    return transformers.Qwen3Config(**kwargs)


def random_dflash(config, seed: int = 0):
    """A DFlashDraftModel with O(1)-activation random weights (norm weights random too)."""
    torch.manual_seed(seed)
    model = dflash_model.DFlashDraftModel(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
    return model


def dflash_forward(model, feats: np.ndarray, noise: np.ndarray, committed: int, cache=None) -> np.ndarray:
    """dflash's pre-lm_head draft hidden states (q_len, hidden) for context rows ending at `committed`."""
    ctx_len, q_len = feats.shape[0], noise.shape[0]
    pos = torch.arange(committed - ctx_len, committed + q_len, dtype=torch.long)[None]
    with torch.no_grad():
        out = model(
            position_ids=pos,
            noise_embedding=torch.from_numpy(noise.astype(np.float32))[None],
            target_hidden=torch.from_numpy(feats.astype(np.float32))[None],
            past_key_values=cache,
            use_cache=cache is not None,
        )
    return out[0].double().numpy()


def inputs(committed: int, ctx_len: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    feats = rng.standard_normal((ctx_len, len(TARGET_IDS) * HIDDEN)).astype(np.float32)
    noise = rng.standard_normal((BLOCK, HIDDEN)).astype(np.float32)
    return feats, noise


def compare(model, w: DraftWeights, committed: int, ctx_len: int, parity_log, case: str, seed: int = 1) -> float:
    feats, noise = inputs(committed, ctx_len, seed)
    got = dflash_forward(model, feats, noise, committed)
    want = R.draft_forward(w, feats, np.arange(committed - ctx_len, committed), noise, committed, swa="per_row")
    err = relative_error(got, want)
    parity_log("dflash torch vs reference", "f32 vs f64", err, case)
    assert err <= TOL, f"{case}: max|a-b|/max|b| = {err:.3e}"
    return err


CASES = {
    "full": dict(),
    "sliding5+full": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5),
    "sliding12x2": dict(layer_types=["sliding_attention", "sliding_attention"], sliding_window=12),
    "theta1e6": dict(rope_theta=1_000_000.0),
    "linear2": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "yarn4": dict(
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
        max_position_embeddings=16384,
    ),
    "yarn4-attn0.8-beta": dict(
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 2048,
            "attention_factor": 0.8,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
        },
        max_position_embeddings=8192,
    ),
    "yarn8-mscale": dict(
        rope_scaling={
            "type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 1024,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        },
        max_position_embeddings=8192,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dflash_checkpoint_forward_matches_reference(tmp_path, parity_log, case):
    model = random_dflash(qwen3_config(**CASES[case]))
    model.save_pretrained(tmp_path)
    w = DraftWeights.from_pretrained(tmp_path)
    # the loaded weights are dflash's, bit for bit
    state = model.state_dict()
    assert set(w) == set(state)
    for name, arr in w.items():
        np.testing.assert_array_equal(arr, state[name].numpy(), err_msg=name)
    # a context window that does not start at 0 and is longer than the sliding windows; YaRN's
    # ramp (beta_fast/beta_slow corrections) lies inside head_dim/2 for these original contexts
    compare(model, w, committed=300, ctx_len=24, parity_log=parity_log, case=f"{case} c=300 ctx=24")
    compare(model, w, committed=3, ctx_len=3, parity_log=parity_log, case=f"{case} c=3 ctx=3", seed=2)


def test_config_mapping_of_a_dflash_checkpoint(tmp_path):
    model = random_dflash(
        qwen3_config(
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=5,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "attention_factor": 0.8,
                "beta_fast": 16.0,
                "beta_slow": 2.0,
            },
            max_position_embeddings=256,
            dflash_extra={"output_multiplier": 0.5, "final_logit_softcapping": 30.0, "input_embedding_scale": 2.0},
        )
    )
    model.save_pretrained(tmp_path)
    cfg = load_checkpoint(tmp_path).cfg
    assert (cfg.hidden, cfg.n_layer, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.ffn) == (
        HIDDEN,
        N_LAYER,
        N_HEAD,
        N_HEAD_KV,
        HEAD_DIM,
        FFN,
    )
    assert (cfg.block_size, cfg.n_target_layers, cfg.target_layer_ids) == (BLOCK, 3, TARGET_IDS)
    assert (cfg.mask_token_id, cfg.vocab, cfg.rms_eps) == (MASK_ID, VOCAB, 1e-6)
    assert cfg.layer_types == ["sliding", "full"] and cfg.swa_window == 5
    assert cfg.freq_scale == 0.25 and cfg.ext_factor == 1.0 and cfg.n_ctx_orig == 64
    assert (cfg.beta_fast, cfg.beta_slow) == (16.0, 2.0)
    assert cfg.attn_factor == pytest.approx(0.8 / (1 + 0.1 * math.log(4.0)), rel=1e-15)
    assert (cfg.output_multiplier, cfg.final_logit_softcapping, cfg.input_embedding_scale) == (0.5, 30.0, 2.0)


def test_logits_match_compute_logits(tmp_path, parity_log):
    """output_multiplier and final_logit_softcapping, as dflash's compute_logits applies them."""
    model = random_dflash(qwen3_config(dflash_extra={"output_multiplier": 0.7, "final_logit_softcapping": 3.0}))
    model.save_pretrained(tmp_path)
    w = DraftWeights.from_pretrained(tmp_path)
    rng = np.random.default_rng(5)
    lm_head = (rng.standard_normal((VOCAB, HIDDEN)) / math.sqrt(HIDDEN) * 8).astype(np.float32)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.from_numpy(lm_head))
    committed, ctx_len = 50, 20
    feats, noise = inputs(committed, ctx_len)
    hidden = dflash_forward(model, feats, noise, committed)
    with torch.no_grad():
        got = model.compute_logits(torch.from_numpy(hidden).float()[None], head)[0].double().numpy()
    assert np.abs(got).max() > 2.0  # the soft cap (3.0) is exercised
    want = R.draft_forward(
        w, feats, np.arange(committed - ctx_len, committed), noise, committed, swa="per_row", lm_head=lm_head
    )
    err = relative_error(got, want)
    parity_log("dflash torch vs reference", "logits f32 vs f64", err, "softcap 3, multiplier 0.7")
    assert err <= TOL


@pytest.mark.parametrize("case", ["full", "sliding5+full"])
def test_dflash_cached_steps_match_reference(tmp_path, parity_log, case):
    """dflash_generate's way: a DynamicCache fed only the new context rows, cropped to `committed`
    after every step; the reference recomputes the whole (unbounded) context each step."""
    if not (hasattr(dflash_model, "_make_cache") and hasattr(dflash_model, "_crop_to")):
        pytest.skip("this dflash version has no _make_cache/_crop_to (dflash_generate's cache helpers)")
    config = qwen3_config(**CASES[case])
    model = random_dflash(config)
    model.save_pretrained(tmp_path)
    w = DraftWeights.from_pretrained(tmp_path)
    cache = dflash_model._make_cache(model.config)
    rng = np.random.default_rng(7)
    all_feats = rng.standard_normal((64, len(TARGET_IDS) * HIDDEN)).astype(np.float32)
    committed = 0
    for step, n_new in enumerate([17, 3, 1, 8, 5]):
        start, committed = committed, committed + n_new
        noise = rng.standard_normal((BLOCK, HIDDEN)).astype(np.float32)
        got = dflash_forward(model, all_feats[start:committed], noise, committed, cache=cache)
        dflash_model._crop_to(cache, committed)
        want = R.draft_forward(w, all_feats[:committed], np.arange(committed), noise, committed, swa="per_row")
        err = relative_error(got, want)
        parity_log("dflash torch vs reference", "cached f32 vs f64", err, f"{case} step {step} c={committed}")
        assert err <= TOL, f"step {step}: {err:.3e}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dflash_loads_our_checkpoint(tmp_path, parity_log, dtype):
    """save_pretrained here -> DFlashDraftModel.from_pretrained: same weights, same forward."""
    cfg = DraftConfig(
        hidden=HIDDEN,
        n_layer=N_LAYER,
        n_head=N_HEAD,
        n_head_kv=N_HEAD_KV,
        head_dim=HEAD_DIM,
        ffn=FFN,
        block_size=BLOCK,
        n_target_layers=3,
        target_layer_ids=TARGET_IDS,
        mask_token_id=MASK_ID,
        vocab=VOCAB,
        rope_theta=1e6,
        layer_types=["full", "sliding"],
        swa_window=6,
        freq_scale=0.5,
        ext_factor=1.0,
        n_ctx_orig=128,
        attn_factor=0.9,
    )
    w = DraftWeights.random(cfg, seed=3)
    w.save_pretrained(tmp_path, dtype=dtype)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == dtype
    w = DraftWeights.from_pretrained(tmp_path)  # bf16-rounded values when saved as bf16
    model = dflash_model.DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
    state = model.state_dict()
    assert set(state) == set(w)
    for name, arr in w.items():
        np.testing.assert_array_equal(state[name].numpy(), arr, err_msg=name)
    compare(model, w, committed=400, ctx_len=30, parity_log=parity_log, case=f"ours->dflash {dtype}")


@pytest.mark.parametrize("case", ["full", "sliding5+full", "yarn4"])
def test_ring_cache_matches_dflash_cached_generation(tmp_path, cpu, parity_log, case):
    """Our DraftKvCache (f32 weights + cache, swa="per_row") on a dflash checkpoint vs dflash's own
    cached generation, step by step, while the window stays within cap (dflash's cache is unbounded)."""
    from pyggml_dkv import DraftKvCache, FeatureRing

    if not (hasattr(dflash_model, "_make_cache") and hasattr(dflash_model, "_crop_to")):
        pytest.skip("this dflash version has no _make_cache/_crop_to (dflash_generate's cache helpers)")
    model = random_dflash(qwen3_config(**CASES[case]))
    model.save_pretrained(tmp_path)
    w = DraftWeights.from_pretrained(tmp_path)
    cache_t = dflash_model._make_cache(model.config)
    rng = np.random.default_rng(11)
    all_feats = rng.standard_normal((120, len(TARGET_IDS) * HIDDEN)).astype(np.float32)
    ring = FeatureRing(128, w.cfg.fc_in)
    committed = 0
    with w.to_backend(cpu, "f32") as bw, DraftKvCache(bw, cpu, 100, cache_type="f32", swa="per_row") as cache:
        for step, n_new in enumerate([17, 3, 1, 8, 5, 30, 2, 20]):
            start, committed = committed, committed + n_new
            ring.append(all_feats[start:committed])
            noise = rng.standard_normal((BLOCK, HIDDEN)).astype(np.float32)
            want = dflash_forward(model, all_feats[start:committed], noise, committed, cache=cache_t)
            dflash_model._crop_to(cache_t, committed)
            got = cache.step(ring, committed, noise)
            err = relative_error(got, want)
            parity_log("ring cache vs dflash torch", "f32 vs f32", err, f"{case} step {step} c={committed}")
            assert err <= TOL, f"step {step}: {err:.3e}"
