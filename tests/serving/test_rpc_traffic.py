"""Bytes per draft step over RPC (counted by a relay): a step sends its new features and little
else: the masks as one context row (split masks, drafter.masks), the noise block's changed row."""

from __future__ import annotations

import numpy as np
import pytest

from pyggml_dkv import Backend, DraftConfig, DraftKvCache, DraftWeights, FeatureRing
from pyggml_dkv.serving.traffic import CountingRelay

SMALL = DraftConfig(
    hidden=1024, n_layer=5, n_head=16, n_head_kv=4, head_dim=64, ffn=3072, block_size=16, n_target_layers=5
)
CAP = 4096  # production geometry: the masks span 4096 + q_len + 1 key columns whatever the window


@pytest.mark.parametrize("window", [64, pytest.param(2048, marks=pytest.mark.slow)])
@pytest.mark.parametrize("inputs", ["embed", "tokens"])
@pytest.mark.parametrize("n_new", [2, 4])
def test_small_step_sends_only_its_inputs_and_mask_changes(shared_server, window, inputs, n_new):
    cfg = SMALL
    w = DraftWeights.random(cfg, seed=0)
    feats = np.random.default_rng(1).standard_normal((window + 8 * n_new, cfg.fc_in)).astype(np.float32)
    noise = np.zeros((cfg.block_size, cfg.hidden), np.float32)
    embed = (
        np.random.default_rng(2).standard_normal((100, cfg.hidden)).astype(np.float32) if inputs == "tokens" else None
    )
    ids = np.arange(cfg.block_size, dtype=np.int32)
    with (
        CountingRelay(shared_server.port) as relay,
        Backend(f"rpc:127.0.0.1:{relay.port}") as be,
        w.to_backend(be, "f16") as bw,
        DraftKvCache(bw, be, CAP, embed_tokens=embed) as cache,
    ):
        ring = FeatureRing(CAP, cfg.fc_in)
        committed = window - 4 * n_new
        ring.append(feats[:committed])
        sent = []
        for _ in range(5):
            ring.append(feats[committed : committed + n_new])
            committed += n_new
            mark = relay.snapshot()
            if embed is None:  # the bonus token's embedding changes, the mask token's rows repeat
                noise[0] = np.random.default_rng(committed).standard_normal(cfg.hidden)
                cache.step(ring, committed, noise)
            else:
                cache.step_tokens(ring, committed, ids, output="hidden")
            sent.append(relay.since(mark)[0])
        whole_mask = cache.mask_full.nbytes
    steady = int(np.median(sent[1:]))
    payload = n_new * cfg.fc_in * 4 + (cfg.hidden * 4 if embed is None else 0)  # features, the changed noise row
    overhead = steady - payload  # masks, positions, message headers, the graph recompute command
    assert overhead < 4 * 1024 < whole_mask // 100, (steady, payload)  # measured ~2.5 KiB
    # the goal (a steady step: a round accepting 1-3 drafts); the features are 20 KiB per
    # new position (f32, as captured), so at 9 new positions a step sends ~186 KiB
    assert steady <= 100_000
