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
    # a wide q8_0 product of our layout (AMX-INT8 tiles where mm-amx-q8_0 runs), and ggml's own AMX
    # kernel (q8_0 in ggml's AMX buffer: its tile configuration loaded per product, patch 0008)
    from pyggml_dkv.drafter.backend_weights import upload_matrix
    from tests.ggml.helpers import mul_mat_rows
    from tests.ggml.test_amx import amx_q8_0_products

    rng = np.random.default_rng(5)
    wide_w, buf = upload_matrix(be, rng.standard_normal((64, 320)).astype(np.float32), "q8_0", "w", matmul_only=True)
    wide_x = rng.standard_normal((80, 320)).astype(np.float32)
    wide = mul_mat_rows(be, wide_w, wide_x)
    torch.set_num_threads(1)
    a = torch.randn(256, 512, dtype=torch.bfloat16)
    for _ in range(3):
        (a @ a.T).sum().item()
        for cache, first in zip(caches, firsts):
            assert np.array_equal(first, cache.step(ring, 20, noise))
        (a @ a.T).sum().item()
        assert np.array_equal(wide, mul_mat_rows(be, wide_w, wide_x))
        (a @ a.T).sum().item()
        assert max(amx_q8_0_products(1, [(9,), (70,)])) < 1e-6
    buf.close()
    print("ok")


def bf16_product(out_path: str) -> None:
    """The product test_amx.py's AMX-BF16 test compares across kernels, saved to out_path (.npy)."""
    from pyggml_dkv.ggml import Backend
    from tests.ggml.helpers import compute
    from tests.ggml.test_amx import bf16_operands

    w, x = bf16_operands()
    with Backend("cpu", n_threads=2) as cpu:
        np.save(out_path, compute(cpu, [("bf16", w), ("f32", x)], lambda g, a, b: g.mul_mat(a, b), dkv=(0,)))


Q8_0_ROWS = (63, 64, 100, 1024)  # below AMX_Q8_0_MIN_ROWS (mm-vnni.h), at it, a partial tile, a bulk chunk


def q8_0_operands() -> tuple[np.ndarray, list[np.ndarray]]:
    """80 weight rows (five 16-row groups: a pair and a last one alone per thread) x 1376 inputs (43
    blocks), and activations of each Q8_0_ROWS count."""
    rng = np.random.default_rng(37)
    w = rng.standard_normal((80, 1376)).astype(np.float32)
    xs = [rng.standard_normal((rows, 1376)).astype(np.float32) for rows in Q8_0_ROWS]
    xs[-1][5, 64:96] *= 1e-30  # a block of tiny values (its scale an f16 subnormal or 0)
    return w, xs


def q8_0_wide_products(out_path: str) -> None:
    """test_amx.py's q8_0 products of the VNNI layout at each Q8_0_ROWS count on one thread (the calling
    one), saved to out_path (.npz), and whether the thread had used AMX tile data before the first
    product, after the 63-row one and after the 64-row one (out_path + ".json")."""
    import json

    from pyggml_dkv.drafter.backend_weights import upload_matrix
    from pyggml_dkv.ggml import Backend
    from pyggml_dkv.ggml.capabilities import amx_tile_data_in_use
    from tests.ggml.helpers import mul_mat_rows

    w, xs = q8_0_operands()
    tiles = [amx_tile_data_in_use()]
    outs = {}
    with Backend("cpu", n_threads=1) as cpu:
        wt, buf = upload_matrix(cpu, w, "q8_0", "w", matmul_only=True)
        with buf:
            assert buf.name == "CPU_DKV_REPACK"
            for rows, x in zip(Q8_0_ROWS, xs):
                outs[str(rows)] = mul_mat_rows(cpu, wt, x)
                if rows <= 64:
                    tiles.append(amx_tile_data_in_use())
    np.savez(out_path, **outs)
    with open(out_path + ".json", "w") as f:
        json.dump(tiles, f)
