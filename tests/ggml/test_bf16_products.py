"""bf16 weights times a draft block's few f32 columns, by kernel (old patch 0019, 0029, 0041).

Where AMX-BF16 tiles cannot take a product, its arithmetic depends on the CPU: vdpbf16ps (0019:
columns rounded to bf16, exact bf16 products, f32 sums) on AMD's cores, where it runs at twice the
FMA's multiply-adds; f32 FMAs elsewhere (0041: exact bf16 weights x the f32 columns, f32 sums),
PYGGML_DKV_BF16_PRODUCTS=fma / dpbf16 forcing one. Each choice runs in a child process (ggml reads
the switches once); its outputs must be the arithmetic of the kernel Python reports
(`bf16_matmul_kernel`), and bit-identical for any thread count.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from pyggml_dkv.common.numeric import relative_error
from pyggml_dkv.ggml import (
    Backend,
    bf16_matmul_kernel,
    bf16_products_on_fma,
    built_capabilities,
    capabilities,
    cpu_features,
)
from tests.child import run_in_child
from tests.ggml.bf16_child import SHAPES, operands
from tests.ggml.helpers import as_bf16

FMA_KERNEL = capabilities.BF16_MATMUL_FMA_KERNEL


def expected(kernel: str, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """float64 of the operands the kernel multiplies: the stored bf16 weights, and the columns as f32
    (FMAs) or rounded to bf16 (vdpbf16ps, AMX tiles, ggml's own path)."""
    cols = x.astype(np.float64) if kernel in ("avx512_fma", "avx2_fma") else as_bf16(x)
    return cols @ as_bf16(w).T


def run_products(tmp_path, **env: str) -> tuple[dict, dict]:
    out = str(tmp_path / ("products_" + "_".join(f"{k}-{v}" for k, v in sorted(env.items())) + ".npz"))
    proc = run_in_child("tests.ggml.bf16_child:bf16_products", out, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out + ".json") as f:
        kernels = json.load(f)
    return dict(np.load(out)), kernels


@pytest.mark.parametrize("choice", ["", "fma", "dpbf16"])
def test_each_kernel_is_its_arithmetic(tmp_path, monkeypatch, choice):
    """Without AMX (PYGGML_DKV_NO_AMX=1), under the CPU's rule and each forced choice: every product is
    within f32 rounding of its kernel's arithmetic in float64, and more than that away from the other
    kernel's (so the kernel Python names is the one that ran); 1-3 threads give the same bits."""
    monkeypatch.setenv("PYGGML_DKV_BF16_PRODUCTS", choice)  # this process's rule as the child's
    results, kernels = run_products(tmp_path, PYGGML_DKV_NO_AMX="1", PYGGML_DKV_BF16_PRODUCTS=choice)
    for m, k, n in SHAPES:
        name = f"{m}x{k}x{n}"
        kernel = kernels[name]
        assert kernel in ("avx512_fma", "avx512_bf16", "avx2_fma", "ggml"), kernel
        if FMA_KERNEL in built_capabilities() and cpu_features()["avx512"]:
            want_kernel = "avx512_bf16" if choice == "dpbf16" and cpu_features()["avx512_bf16"] else "avx512_fma"
            if choice == "":
                want_kernel = "avx512_fma" if bf16_products_on_fma() else "avx512_bf16"
            assert kernel == want_kernel, (name, kernel, want_kernel)
        w, x = operands(m, k, n)
        got = results[f"{name}/1"]
        assert got.shape == (n, m)
        err = relative_error(got, expected(kernel, w, x))
        other = "avx512_bf16" if kernel in ("avx512_fma", "avx2_fma") else "avx512_fma"
        assert err < 2e-6, (name, kernel, err)
        assert relative_error(got, expected(other, w, x)) > 1e-4, (name, kernel)
        if kernel != "ggml":  # every output one thread's
            for n_threads in (2, 3):
                np.testing.assert_array_equal(results[f"{name}/{n_threads}"], got)


def test_the_kernel_rule(monkeypatch):
    """The rule Python mirrors from old patch 0041: AMD keeps vdpbf16ps, every other CPU (and every CPU
    without AVX512-BF16) takes the FMAs; the switch forces either; a bad value is refused by name."""
    if FMA_KERNEL not in built_capabilities() or not cpu_features()["avx512"]:
        pytest.skip(f"this build has no FMA kernel for bf16 weights ({FMA_KERNEL}, AVX-512)")
    monkeypatch.setenv("PYGGML_DKV_NO_AMX", "1")
    has_dpbf16 = cpu_features()["avx512_bf16"]
    for vendor, on_fma in (("AuthenticAMD", not has_dpbf16), ("GenuineIntel", True), ("", True)):
        monkeypatch.setattr(capabilities, "cpu_flags", lambda v=vendor: frozenset({v, "avx512f"}))
        monkeypatch.delenv("PYGGML_DKV_BF16_PRODUCTS", raising=False)
        assert bf16_products_on_fma() is on_fma, vendor
        assert bf16_matmul_kernel((1024, 1024)) == ("avx512_fma" if on_fma else "avx512_bf16")
        monkeypatch.setenv("PYGGML_DKV_BF16_PRODUCTS", "fma")
        assert bf16_matmul_kernel((1024, 1024)) == "avx512_fma"
        monkeypatch.setenv("PYGGML_DKV_BF16_PRODUCTS", "dpbf16")
        assert bf16_matmul_kernel((1024, 1024)) == ("avx512_bf16" if has_dpbf16 else "avx512_fma")
    # inputs not whole 32-value blocks, more than 64 columns: ggml's own path whatever the choice
    assert bf16_matmul_kernel((1000, 1024)) == "ggml"
    assert bf16_matmul_kernel((1024, 1024), n_columns=65) == "ggml"


@pytest.mark.parametrize("value", ["FMA", "vdpbf16ps", "1", " fma"])
def test_a_misspelt_switch_is_refused(monkeypatch, value):
    monkeypatch.setenv("PYGGML_DKV_BF16_PRODUCTS", value)
    with pytest.raises(ValueError, match="PYGGML_DKV_BF16_PRODUCTS"):
        bf16_products_on_fma()
    with pytest.raises(ValueError, match="PYGGML_DKV_BF16_PRODUCTS"):
        Backend("cpu")


def test_the_avx2_rule(monkeypatch):
    """Where ggml was built for AVX2 without AVX-512 (old patch 0042's kernel; the AVX2-only build test
    runs its arithmetic), a bf16 product of whole 16-input blocks and up to 64 columns takes it, the
    rest ggml's own path. Here the build answer is simulated: it is the CPU's (and the CPU_DKV
    buffer type the weights live in, which an unpatched build lacks)."""
    monkeypatch.setattr(capabilities, "half_matmul_avx2", lambda: True)
    monkeypatch.setattr(capabilities, "dkv_buffer_available", lambda: True)
    assert bf16_matmul_kernel((1024, 1000)) == "avx2_fma"
    assert bf16_matmul_kernel((48, 7), n_columns=64) == "avx2_fma"
    assert bf16_matmul_kernel((40, 7)) == "ggml"
    assert bf16_matmul_kernel((1024, 1024), n_columns=65) == "ggml"
    assert bf16_matmul_kernel((1024, 1024, 2)) == "ggml"
    if not cpu_features()["avx512"]:
        return
    monkeypatch.undo()
    assert capabilities.half_matmul_avx2() is False  # an AVX-512 build keeps 0004 / 0019 / 0029 / 0041
