"""drafter/masks.py, the masks the cache and the one-shot graph share, against the reference's
independent statement of the same rules (reference.visibility)."""

from __future__ import annotations

import numpy as np
import pytest

from pyggml_dkv import DraftConfig
from pyggml_dkv import reference as R
from pyggml_dkv.drafter.masks import SplitMask, StepMasks


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("swa", ["seed", "per_row"])
@pytest.mark.parametrize("window", [1, 3, 7, 50])
@pytest.mark.parametrize("committed, cap", [(5, 12), (12, 12), (30, 12), (30, 40)])
def test_ring_layout_masks_match_the_reference(swa, window, committed, cap, split):
    q_len, groups = 4, 2
    cfg = DraftConfig(
        hidden=64,
        n_layer=2,
        n_head=4,
        n_head_kv=2,
        head_dim=16,
        ffn=32,
        block_size=q_len,
        n_target_layers=2,
        layer_types=["full", "sliding"],
        swa_window=window,
    )
    n_cols = cap + q_len + 5
    masks = StepMasks(q_len, groups, cap, n_cols, cap, True, True, swa, window, split=split)
    # a ring after positions 0..committed-1 were written, plus a stale slot far in the past
    slot_pos = np.full(cap, -1, dtype=np.int64)
    for p in range(committed):
        slot_pos[p % cap] = p
    lo = committed - min(committed, cap)
    full, sliding = masks.fill(slot_pos, lo, committed)
    if split:  # what the device computes: base + the row fill returned (sliding: only under "seed")
        assert isinstance(masks.full, SplitMask) and full.shape == (1, n_cols)
        assert isinstance(masks.sliding, SplitMask) == (swa == "seed")
        full = masks.full.base + full
        if swa == "seed":
            sliding = masks.sliding.base + sliding
    window_pos = np.arange(lo, committed)
    for layer_type, image in (("full", full), ("sliding", sliding)):
        want = R.visibility(cfg, layer_type, window_pos, committed, q_len, swa=swa)  # (q_len, win + q_len)
        assert image.shape == (groups * q_len, n_cols)
        for g in range(groups):  # every folded copy of a query row carries that row's mask
            rows = image[g * q_len : (g + 1) * q_len]
            ctx_cols = rows[:, window_pos % cap]
            np.testing.assert_array_equal(ctx_cols == 0, want[:, : window_pos.size])
            np.testing.assert_array_equal(rows[:, cap : cap + q_len] == 0, want[:, window_pos.size :])
            others = np.setdiff1d(np.arange(cap), window_pos % cap)
            assert (rows[:, others] == -np.inf).all() and (rows[:, cap + q_len :] == -np.inf).all()
