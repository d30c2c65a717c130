"""The child side of tests/ggml/test_bf16_products.py: ggml reads PYGGML_DKV_BF16_PRODUCTS and
PYGGML_DKV_NO_AMX once per process, so each kernel choice needs a process of its own."""

from __future__ import annotations

import json

import numpy as np

# (rows, inputs, columns): 4-row blocks whole and partial, 1-6 column tiles, one to many 32-input
# blocks, row groups of 8 blocks (K <= 1024) and wider K, the most columns the kernels take
SHAPES = [
    (5, 64, 3),
    (4, 1024, 16),
    (70, 96, 34),
    (9, 32, 1),
    (13, 5120, 9),
    (205, 1024, 16),
    (100, 1024, 64),
    (37, 2048, 6),
    (48, 1024, 9),
    (64, 160, 17),
]


def operands(m: int, k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(m * 7919 + k * 31 + n)
    return rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((n, k)).astype(np.float32)


def bf16_products(out_path: str) -> None:
    """Every SHAPES product on 1, 2 and 3 threads, and the kernel Python says each runs on, saved to
    out_path (.npz, and the kernel names in out_path + '.json')."""
    from pyggml_dkv.ggml import Backend, bf16_matmul_kernel
    from tests.ggml.helpers import compute

    results: dict[str, np.ndarray] = {}
    kernels: dict[str, str] = {}
    for m, k, n in SHAPES:
        w, x = operands(m, k, n)
        name = f"{m}x{k}x{n}"
        kernels[name] = bf16_matmul_kernel((k, m), n_columns=n)
        for n_threads in (1, 2, 3):
            with Backend("cpu", n_threads=n_threads) as cpu:
                results[f"{name}/{n_threads}"] = compute(
                    cpu, [("bf16", w), ("f32", x)], lambda g, a, b: g.mul_mat(a, b), dkv=(0,)
                )  # where BackendWeights puts them
    np.savez(out_path, **results)
    with open(out_path + ".json", "w") as f:
        json.dump(kernels, f)
