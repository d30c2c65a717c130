"""The child side of tests/ggml/test_amx.py's AMX-next-to-PyTorch test (it needs a process of its own:
oneDNN and ggml share the thread's AMX tile state)."""

from __future__ import annotations

import numpy as np


def amx_next_to_torch() -> None:
    import torch

    from pyggml_dkv import Backend, DraftConfig, DraftKvCache, DraftWeights, FeatureRing, bf16_attention_supported

    cfg = DraftConfig(
        hidden=128, n_layer=2, n_head=4, n_head_kv=2, head_dim=32, ffn=256, block_size=8, n_target_layers=2
    )
    be = Backend("cpu", n_threads=1)  # ggml computes on this (main) thread, like torch
    bw = DraftWeights.random(cfg, seed=1).to_backend(be, "q8_0")
    assert bw.n_repacked > 0
    ring = FeatureRing(64, cfg.fc_in)
    ring.append(np.ones((20, cfg.fc_in), np.float32))
    noise = np.full((8, cfg.hidden), 0.5, np.float32)
    caches = [DraftKvCache(bw, be, 64)]
    # bf16 weights: their products on AMX-BF16 tiles where the CPU has them (old patch 0029)
    caches.append(DraftKvCache(DraftWeights.random(cfg, seed=1).to_backend(be, "bf16"), be, 64))
    if bf16_attention_supported():
        caches.append(DraftKvCache(bw, be, 64, attention="bf16"))
    firsts = [c.step(ring, 20, noise) for c in caches]
    torch.set_num_threads(1)
    a = torch.randn(256, 512, dtype=torch.bfloat16)
    for _ in range(3):
        (a @ a.T).sum().item()
        for cache, first in zip(caches, firsts):
            assert np.array_equal(first, cache.step(ring, 20, noise))
    print("ok")


def bf16_product(out_path: str) -> None:
    """The product test_amx.py's AMX-BF16 test compares across kernels, saved to out_path (.npy)."""
    from pyggml_dkv.ggml import Backend
    from tests.ggml.helpers import compute
    from tests.ggml.test_amx import bf16_operands

    w, x = bf16_operands()
    with Backend("cpu", n_threads=2) as cpu:
        np.save(out_path, compute(cpu, [("bf16", w), ("f32", x)], lambda g, a, b: g.mul_mat(a, b), dkv=(0,)))
