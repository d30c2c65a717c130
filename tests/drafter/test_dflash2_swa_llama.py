"""The sliding-window flavour swa="llama" in the cache's masks (drafter/masks.py): llama.cpp's rule
(docs/dflash2.md, section 4: a query at position q sees a key at position k, context or noise,
unless q - k >= swa_window; non-causal otherwise), checked against the numpy reference's
independent statement of it (reference.visibility, swa="llama"): the mask images, a DFlash-1
parity run over commit/rewind trajectories (ring cache vs reference vs one-shot graph, as
tests/drafter/test_parity.py runs per_row), and a DFlash-2 run (hidden states, lattice, greedy ids)
on a sliding layer narrower than the block, where "llama" and "per_row" differ.
"""

from __future__ import annotations

import numpy as np
import pytest

from pyggml_dkv import DraftConfig, DraftKvCache, DraftWeights, FeatureRing
from pyggml_dkv import reference as R
from pyggml_dkv.common.numeric import relative_error
from pyggml_dkv.drafter.masks import SWA_MODES, noise_visible
from pyggml_dkv.drafter.selector_walk import greedy_walk
from pyggml_dkv.reference import dflash2 as R2

from .test_dflash2 import TOL, VOCAB, assert_lattice_close, dflash2_config, near_tie_free_prefix, vocab_tables
from .test_masks import test_ring_layout_masks_match_the_reference as ring_layout_case
from .test_parity import CONFIGS, run_trajectory, trajectory


def test_llama_is_a_flavour_of_the_cache_and_of_the_reference():
    assert "llama" in SWA_MODES and set(SWA_MODES) == set(R.SWA_MODES)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("window", [1, 3, 7, 50])
@pytest.mark.parametrize("committed, cap", [(5, 12), (12, 12), (30, 12), (30, 40)])
def test_ring_layout_masks_match_the_reference(window, committed, cap, split):
    """test_masks' check of the ring-layout images, for swa="llama" (per-row context columns:
    never a SplitMask on the sliding side)."""
    ring_layout_case("llama", window, committed, cap, split)


@pytest.mark.parametrize("window", [1, 2, 3, 5, 9])
def test_noise_keys_ahead_stay_visible(window):
    """Every noise key at or ahead of a row is visible, however far; behind it only those less
    than `window` rows back. (per_row hides every key ahead.)"""
    q_len = 6
    vis = noise_visible(q_len, True, "llama", window)
    j, i = np.meshgrid(np.arange(q_len), np.arange(q_len), indexing="ij")
    np.testing.assert_array_equal(vis, (i >= j) | (j - i < window))
    assert not noise_visible(q_len, True, "per_row", window)[np.triu_indices(q_len, 1)].any()
    assert noise_visible(q_len, False, "llama", window).all()  # full layers: everything


@pytest.mark.parametrize("name", ["gqa1-hd64-q10-mixed-swa<cap", "gqa4-hd128-q10-sliding"])
def test_parity_swa_llama(name, cpu, parity_log):
    """As test_parity.test_parity_swa_flavours: ring cache vs reference vs one-shot graph, f32."""
    spec = CONFIGS[name]
    run_trajectory(
        DraftConfig(**spec["cfg"]),
        spec["cap"],
        "f32",
        "f32",
        "llama",
        False,
        n_steps=30,
        seed=7,
        cpu=cpu,
        parity_log=parity_log,
        case=name,
    )


def test_parity_swa_llama_window_narrower_than_the_block(cpu, parity_log):
    """A window of 4 under a 10-row block (logits too): here the noise keys ahead of a row, and
    those 4 or more rows behind it, are what tells "llama" from "per_row" and "seed"."""
    cfg = DraftConfig(**{**CONFIGS["gqa1-hd64-q10-mixed-swa<cap"]["cfg"], "swa_window": 4})
    run_trajectory(
        cfg,
        50,
        "f32",
        "f32",
        "llama",
        True,
        n_steps=20,
        seed=9,
        cpu=cpu,
        parity_log=parity_log,
        case="gqa1-hd64-q10 swa window 4 < block 10",
    )


@pytest.mark.parametrize("cache_type", ["f32", "f16"])
def test_dflash2_cache_with_swa_llama_matches_reference(cache_type, cpu, parity_log):
    """A DFlash-2 drafter with one sliding layer (window 3 < block 8) under swa="llama": hidden
    states, lattice and greedy ids per step against reference.dflash2.draft_step_dflash2(swa="llama")
    over a trajectory with rewinds; the cache's output is far from what per_row would give."""
    cfg = dflash2_config(layer_types=["sliding", "full"], swa_window=3)
    cap, n_steps, seed = 33, 20, 5
    rng = np.random.default_rng(seed)
    w = DraftWeights.random(cfg, seed=seed)
    embed, head = vocab_tables(cfg, seed)
    tol = TOL[cache_type]
    commits = trajectory(rng, cap, cfg.block_size, n_steps)
    feats = rng.standard_normal((max(commits) + 1, cfg.fc_in)).astype(np.float32)
    ring = FeatureRing(cap + 3 * cfg.block_size, cfg.fc_in)
    worst = {"hidden": 0.0, "lattice": 0.0}
    ids_checked, per_row_gap = 0, 0.0
    with (
        w.to_backend(cpu, "f32") as bw,
        DraftKvCache(bw, cpu, cap, lm_head=head, embed_tokens=embed, cache_type=cache_type, swa="llama") as cache,
    ):
        for c in commits:
            ring.write(min(ring.written, c), feats[min(ring.written, c) : c])
            tokens = np.full(cfg.block_size, cfg.mask_token_id, dtype=np.int32)
            tokens[0] = rng.integers(0, VOCAB)
            ids = cache.step_tokens(ring, c, tokens, output="ids")
            hidden = cache.hidden_states.numpy().reshape(-1, cfg.block_size, cfg.hidden)[0].copy()
            lattice = cache.step_tokens(ring, c, tokens, output="lattice")
            noise = embed[tokens]
            want = R.reference_step(w, feats, c, cap, noise, swa="llama")
            e = relative_error(hidden, want)
            assert e <= tol, f"committed={c}: hidden states differ by {e:.3e}"
            worst["hidden"] = max(worst["hidden"], e)
            per_row_gap = max(
                per_row_gap, relative_error(hidden, R.reference_step(w, feats, c, cap, noise, swa="per_row"))
            )
            want_lattice, want_ids = R2.draft_step_dflash2(w, feats, c, cap, noise, int(tokens[0]), head, swa="llama")
            worst["lattice"] = max(worst["lattice"], assert_lattice_close(lattice, want_lattice, tol))
            np.testing.assert_array_equal(ids[1:], greedy_walk(lattice))
            sure = near_tie_free_prefix(want_lattice, tol)
            np.testing.assert_array_equal(ids[1 : 1 + sure], want_ids[:sure])
            ids_checked += sure
    assert per_row_gap > 0.05, "the window flavours do not differ here: a vacuous test"
    assert ids_checked > n_steps * (cfg.block_size - 1) // 2, "most draft ids were near-ties: a vacuous test"
    for what, error in worst.items():
        parity_log(f"dflash2 cache-vs-reference ({what})", f"w=f32 kv={cache_type}", error, "swa=llama window 3")
