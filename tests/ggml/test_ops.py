"""Tiny graphs against numpy: every op the drafter uses, at the precision of its types."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import pyggml_dkv
from pyggml_dkv import DraftConfig
from pyggml_dkv.common.bf16 import from_bf16_bits as bf16_bits_to_fp32
from pyggml_dkv.common.bf16 import to_bf16_bits as fp32_to_bf16_bits
from pyggml_dkv.common.numeric import relative_error
from pyggml_dkv.ggml import (
    Backend,
    Context,
    bf16_matmul_kernel,
)
from pyggml_dkv.ggml.capabilities import f16_matmul_kernel, flash_attn_kernel
from pyggml_dkv.reference import attention, rope_neox
from tests.ggml.helpers import NEOX, as_bf16, compute

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("wtype, tol", [("f32", 1e-6), ("f16", 2e-3), ("bf16", 1e-2), ("q8_0", 2e-2)])
def test_mul_mat_against_numpy(be, rng, wtype, tol):
    w = rng.standard_normal((5, 64)).astype(np.float32)  # PyTorch (out, in) -> ggml [in, out]
    x = rng.standard_normal((3, 64)).astype(np.float32)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    for prec_f32 in (False, True):
        got = compute(be, [(wtype, w), ("f32", x)], lambda g, a, b: g.mul_mat(a, b, prec_f32=prec_f32))
        assert got.shape == (3, 5) and got.dtype == np.float32
        assert relative_error(got, want) < tol, (wtype, relative_error(got, want))
    if wtype == "f16":  # against the weights as stored: only the f16 rounding of x remains
        w16 = w.astype(np.float16).astype(np.float64)
        assert relative_error(got, x.astype(np.float64) @ w16.T) < 1e-3


# the narrow kernels (f16: old patch 0004; bf16: 0019, 0029, 0041; both on AVX2: 0042): whether
# this build and CPU run them for a product (rows m, inputs k, columns n) of weights in the
# CPU_DKV buffer
NARROW_KERNELS = {
    "f16": lambda m, k, n: f16_matmul_kernel((k, m), n_columns=n) != "ggml",
    "bf16": lambda m, k, n: bf16_matmul_kernel((k, m), n_columns=n) != "ggml",
}


@pytest.mark.parametrize("wtype", ["f16", "bf16"])
@pytest.mark.parametrize(
    "m, k, n",
    [
        (5, 64, 3),
        (4, 1024, 16),
        (70, 96, 34),
        (33, 48, 64),
        (33, 64, 64),
        (9, 32, 1),
        (6, 64, 65),
        (7, 40, 8),
        (7, 48, 8),
        (13, 5120, 9),
        # whole 16-row blocks: bf16 on AMX-BF16 tiles where the CPU has them (0029),
        # 1-4 column groups, the last one full or narrower
        (16, 32, 1),
        (48, 1024, 9),
        (32, 64, 16),
        (80, 96, 17),
        (64, 5120, 34),
        (16, 3072, 48),
        (32, 160, 63),
        (16, 64, 64),
        # f16: row groups of 8 blocks with K <= 1024 (0034), whole and partial,
        # a last block of one row; wider K ungrouped
        (205, 1024, 16),
        (100, 1024, 64),
        (261, 512, 9),
        (37, 2048, 16),
    ],
)
def test_mul_mat_half_weights_few_columns(rng, wtype, m, k, n):
    """f16 / bf16 weights x up to 64 f32 columns on the narrow AVX-512 kernels (on CPUs with AVX2 and
    no AVX-512: 0042's, the f16 and FMA ones' arithmetic, checked alike), which run for weights in
    our CPU_DKV buffer (where BackendWeights puts f16 / bf16 matrices on the CPU). The f16 one keeps the
    columns f32, so against the stored f16 weights only f32 rounding remains, and so does the bf16 one
    on FMAs (0041, the rule of tests/ggml/test_bf16_products.py); vdpbf16ps (0019) rounds them to
    bf16 as ggml does (nearest even) and sums exact bf16 products, so against both operands rounded
    only f32 rounding remains. Wider products (n > 64) or rows that are not whole vectors
    take ggml's path (f16: x rounded to f16; bf16: as the kernel). bf16 weights of whole 16-row
    blocks run on AMX-BF16 tiles where the CPU has them (0029): the same arithmetic, sums in
    another order. Every output of a narrow kernel is one thread's: the thread count must not
    change a bit."""
    w = rng.standard_normal((m, k)).astype(np.float32)
    x = rng.standard_normal((n, k)).astype(np.float32)
    w_stored = w.astype(np.float16).astype(np.float64) if wtype == "f16" else as_bf16(w)
    # bf16 on f32 FMAs (0041) keeps the columns f32; its other kernels round them to bf16
    keeps_f32 = wtype == "f16" or bf16_matmul_kernel((k, m), n_columns=n) in ("avx512_fma", "avx2_fma")
    x_used = x.astype(np.float64) if keeps_f32 else as_bf16(x)
    want = x_used @ w_stored.T
    narrow = bool(NARROW_KERNELS[wtype](m, k, n))
    tol = 2e-6 if narrow or wtype == "bf16" else 2e-3
    results = []
    for n_threads in (1, 2, 3):
        with Backend("cpu", n_threads=n_threads) as backend:
            results.append(compute(backend, [(wtype, w), ("f32", x)], lambda g, a, b: g.mul_mat(a, b), dkv=(0,)))
    for got in results:
        assert got.shape == (n, m)
        assert relative_error(got, want) < tol, relative_error(got, want)
        if narrow:
            np.testing.assert_array_equal(got, results[0])


def test_mul_mat_broadcasts_batches(be, rng):
    a = rng.standard_normal((2, 4, 16)).astype(np.float32)  # ggml [16, 4, 2]
    b = rng.standard_normal((6, 3, 16)).astype(np.float32)  # ggml [16, 3, 6]: b batch i reads a batch i // 3
    got = compute(be, [("f32", a), ("f32", b)], lambda g, x, y: g.mul_mat(x, y))
    want = np.stack([b[i] @ a[i // 3].T for i in range(6)])
    assert got.shape == (6, 3, 4)
    assert relative_error(got, want) < 1e-6


def test_mul_mat_f16_by_f16(be, rng):
    w = rng.standard_normal((4, 32)).astype(np.float16)
    x = rng.standard_normal((2, 32)).astype(np.float16)
    got = compute(be, [("f16", w), ("f16", x)], lambda g, a, b: g.mul_mat(a, b))
    assert relative_error(got, x.astype(np.float64) @ w.T.astype(np.float64)) < 1e-3


def test_add_mul_sub_broadcast(be, rng):
    a = rng.standard_normal((3, 4, 8)).astype(np.float32)
    row = rng.standard_normal((1, 1, 8)).astype(np.float32)
    mat = rng.standard_normal((1, 4, 8)).astype(np.float32)
    col = rng.standard_normal((3, 4, 1)).astype(np.float32)
    got = compute(
        be,
        [("f32", a), ("f32", row), ("f32", mat), ("f32", col)],
        lambda g, x, r, m, c: (g.add(x, r), g.mul(x, m), g.sub(x, c), g.add(x, x)),
    )
    np.testing.assert_allclose(got[0], a + row, rtol=1e-6)
    np.testing.assert_allclose(got[1], a * mat, rtol=1e-6)
    np.testing.assert_allclose(got[2], a - col, rtol=1e-6)
    np.testing.assert_allclose(got[3], a + a, rtol=1e-6)
    assert [o.shape for o in got] == [a.shape] * 4


def test_add_f16_with_f32(be, rng):
    a = rng.standard_normal((2, 8)).astype(np.float16)
    b = rng.standard_normal((1, 8)).astype(np.float32)
    got = compute(be, [("f16", a), ("f32", b)], lambda g, x, y: g.add(x, y))
    np.testing.assert_array_equal(got, (a.astype(np.float32) + b).astype(np.float16).astype(np.float32))


def test_unary_ops(be, rng):
    x = np.concatenate([np.linspace(-25, 25, 40), rng.standard_normal(24) * 3]).astype(np.float32).reshape(4, 16)
    eps = 1e-5
    rms, silu, scaled, tanh, softplus = compute(
        be, [("f32", x)], lambda g, a: (g.rms_norm(a, eps), g.silu(a), g.scale(a, -0.375), g.tanh(a), g.softplus(a))
    )
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(rms, x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(silu, x64 / (1 + np.exp(-x64)), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(scaled, x * np.float32(-0.375))
    np.testing.assert_allclose(tanh, np.tanh(x64), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(softplus, np.logaddexp(0, x64), rtol=1e-5, atol=1e-6)


def _rope(g, a, p, cfg: DraftConfig):
    return g.rope_ext(
        a,
        p,
        cfg.head_dim,
        NEOX,
        cfg.n_ctx_orig,
        cfg.rope_theta,
        cfg.freq_scale,
        cfg.ext_factor,
        cfg.attn_factor,
        cfg.beta_fast,
        cfg.beta_slow,
    )


@pytest.mark.parametrize(
    "yarn",
    [
        {},
        {"rope_theta": 10000.0},
        {"rope_theta": 10000.0, "freq_scale": 0.25, "ext_factor": 1.0, "n_ctx_orig": 64, "attn_factor": 1.0},
        {"rope_theta": 500000.0, "freq_scale": 0.125, "ext_factor": 0.5, "n_ctx_orig": 8192, "attn_factor": 0.9},
    ],
    ids=["plain", "theta1e4", "yarn", "yarn-partial"],
)
def test_rope_neox_against_reference(be, rng, yarn):
    cfg = DraftConfig(
        hidden=48, n_layer=1, n_head=3, n_head_kv=1, head_dim=16, ffn=32, block_size=4, n_target_layers=1, **yarn
    )
    x = rng.standard_normal((5, 3, 16)).astype(np.float32)  # (tokens, heads, head_dim) = ggml [16, 3, 5]
    pos = np.array([0, 1, 7, 100, 3000], np.int32)
    got = compute(be, [("f32", x), ("i32", pos)], lambda g, a, p: _rope(g, a, p, cfg))
    want = rope_neox(x.astype(np.float64), pos, cfg)
    assert got.shape == x.shape
    assert relative_error(got, want) < 5e-5, relative_error(got, want)
    np.testing.assert_array_equal(got[0, :, :], x[0] * np.float32(want[0, 0, 0] / x[0, 0, 0]))  # pos 0: scale only
    if yarn.get("ext_factor"):  # the YaRN ramp really changed the result
        plain = rope_neox(x.astype(np.float64), pos, cfg.replace(ext_factor=0.0))
        assert relative_error(plain, want) > 1e-2


@pytest.mark.parametrize("prec_f32", [False, True])
def test_flash_attn_ext_gqa_with_mask(be, rng, prec_f32):
    d, n_q, n_head, n_head_kv, n_kv = 32, 4, 4, 2, 10
    q = rng.standard_normal((n_q, n_head, d)).astype(np.float32)
    k = rng.standard_normal((n_kv, n_head_kv, d)).astype(np.float16)
    v = rng.standard_normal((n_kv, n_head_kv, d)).astype(np.float16)
    visible = rng.random((n_q, n_kv)) < 0.6
    visible[:, 3] = True
    mask = np.full((8, n_kv), -np.inf, np.float16)  # more mask rows than queries is allowed (padding)
    mask[:n_q] = np.where(visible, 0, -np.inf)
    got = compute(
        be,
        # ggml q [d, n_q, n_head, 1], k/v [d, n_kv, n_head_kv, 1], mask [n_kv, >= n_q]
        [
            ("f32", q.transpose(1, 0, 2)[None]),
            ("f16", k.transpose(1, 0, 2)[None]),
            ("f16", v.transpose(1, 0, 2)[None]),
            ("f16", mask),
        ],
        lambda g, qt, kt, vt, m: g.flash_attn_ext(qt, kt, vt, m, 1 / math.sqrt(d), prec_f32=prec_f32),
    )
    assert got.shape == (1, n_q, n_head, d)  # ggml [d, n_head, n_q, 1]
    want = attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), visible)
    assert relative_error(got[0], want) < 3e-3, relative_error(got[0], want)


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("n_q", [70, 32, 9])
def test_flash_attn_ext_tiled_kernel(rng, kv_type, n_threads, n_q):
    """8+ query rows per head over K/V in our CPU_DKV buffer (the drafter's caches): our tiled
    kernel (kernels/flash-attn-tiled.cpp, old patches 0003 / 0006: transposed scores on
    AVX-512); from 64 rows ggml's own tiled kernel gives the same precision where ours is absent.

    267 keys = four whole 64-key tiles + a partial one (vector and scalar tails): a fully masked
    tile (skipped), a tile every row sees whole (an all-zero mask, not converted), two with mixed
    masks; a query row that sees one key only, and a second K/V head; keys no row sees hold NaN.
    70 query rows = a whole 64-row tile + a partial one; 32 and 9 rows = one partial tile (the
    patched kernel takes >= 8 rows and computes only the valid ones). The first tile asks for the
    partial one, 4 tiles on, into L2 (0035): a prefetch must leave every output as it was. The
    products run 6-row blocks, then 4-row and single-row tails (0036): 64-key tiles and the 11-key
    partial one as score rows, 64 / 70 / 32 / 9 queries as output rows.
    """
    d, n_head, n_kv = 64, 2, 267
    q = rng.standard_normal((n_q, n_head, d)).astype(np.float32)
    k = rng.standard_normal((n_kv, n_head, d)).astype(np.float32)
    v = rng.standard_normal((n_kv, n_head, d)).astype(np.float32)
    if kv_type == "f16":  # the reference sees exactly the values ggml stores
        k, v = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
    visible = rng.random((n_q, n_kv)) < 0.7
    visible[:, 0] = True
    visible[:, 64:128] = False  # a whole tile masked for every row: skipped
    visible[:, 192:256] = True  # a tile every row sees: all-zero mask
    visible[5] = False
    visible[5, 266] = True  # only the partial tile's last key
    visible[:, 130] = False  # hidden from every row, in a tile that is computed
    mask = np.where(visible, 0, -np.inf).astype(np.float16)
    if kv_type == "f16" and n_q < 64 and flash_attn_kernel(n_q, kv_type, d) != "tiled":
        pytest.skip("ggml's own kernel below 64 rows sums V in f16 (our fa-tiled kernel is not in this build / CPU)")
    # keys no row may see hold NaN (like unused cache rows): they must not reach the output
    k_nan, v_nan = k.copy(), v.copy()
    for rows in (slice(64, 128), slice(130, 131)):
        k_nan[rows], v_nan[rows] = np.nan, np.nan
    with Backend("cpu", n_threads=n_threads) as backend:
        got = compute(
            backend,
            [
                ("f32", q.transpose(1, 0, 2)[None]),
                (kv_type, k_nan.transpose(1, 0, 2)[None]),
                (kv_type, v_nan.transpose(1, 0, 2)[None]),
                ("f16", mask),
            ],
            lambda g, qt, kt, vt, m: g.flash_attn_ext(qt, kt, vt, m, 1 / math.sqrt(d), prec_f32=True),
            dkv=(1, 2),
        )
    want = attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), visible)
    assert relative_error(got[0], want) < 2e-6, relative_error(got[0], want)
    np.testing.assert_allclose(got[0, 5], v[266], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kv_in", ["cpu", "dkv"])
@pytest.mark.parametrize("kv_type", ["f16", "f32"])
@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("n_q,n_kv", [(64, 267), (70, 267), (9, 267), (1, 600)])
def test_flash_attn_ext_masked_non_finite_keys_stay_out(rng, kv_type, n_threads, n_q, n_kv, kv_in):
    """Keys no query row may see (unused cache rows) hold NaN and inf: whichever CPU kernel runs
    (ggml's tiled one from 64 query rows per head, its per-row one below that, its split-KV one for
    a single row and 512+ keys, or ours over K/V in the CPU_DKV buffer), they must not reach the output. ggml 0.25.3's tiled kernel
    returned NaN for every row here (port plan, P5: masked scores exactly -inf, unseen V rows zero).
    Whole masked tiles, an unseen key inside a computed tile, the partial last tile; a row that
    sees only the last key returns that key's value."""
    d, n_head = 64, 2
    q = rng.standard_normal((n_q, n_head, d)).astype(np.float32)
    k = rng.standard_normal((n_kv, n_head, d)).astype(np.float32)
    v = rng.standard_normal((n_kv, n_head, d)).astype(np.float32)
    if kv_type == "f16":
        k, v = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
    visible = rng.random((n_q, n_kv)) < 0.7
    visible[:, 0] = True
    visible[:, 64:128] = False
    visible[:, 130] = False
    visible[:, 200:210] = False
    if n_q > 1:
        visible[n_q - 1] = False
        visible[n_q - 1, n_kv - 1] = True
    mask = np.where(visible, 0, -np.inf).astype(np.float16)
    k_bad, v_bad = k.copy(), v.copy()
    k_bad[64:128], v_bad[64:128] = np.nan, np.nan
    k_bad[130], v_bad[130] = np.inf, -np.inf
    k_bad[200:210], v_bad[200:210] = np.nan, np.inf
    with Backend("cpu", n_threads=n_threads) as backend:
        got = compute(
            backend,
            [
                ("f32", q.transpose(1, 0, 2)[None]),
                (kv_type, k_bad.transpose(1, 0, 2)[None]),
                (kv_type, v_bad.transpose(1, 0, 2)[None]),
                ("f16", mask),
            ],
            lambda g, qt, kt, vt, m: g.flash_attn_ext(qt, kt, vt, m, 1 / math.sqrt(d), prec_f32=True),
            dkv=(1, 2) if kv_in == "dkv" else (),
        )
    assert np.isfinite(got).all(), f"{np.isnan(got).sum()} NaN, {np.isinf(got).sum()} inf of {got.size}"
    want = attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), visible)
    assert relative_error(got[0], want) < 1e-2, relative_error(got[0], want)  # ggml's per-row kernel sums V in f16
    if n_q > 1:
        np.testing.assert_allclose(got[0, n_q - 1], v[n_kv - 1], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("n_threads", [1, 2, 3])
@pytest.mark.parametrize("prec_bf16", [False, True])
@pytest.mark.parametrize("n_q", [64, 70])
def test_flash_attn_ext_tiled_kernel_mask_per_head(rng, n_threads, prec_bf16, n_q):
    """A mask with a plane per query-head group (mask ne2 = 2, head h reads plane h % 2): the tiled
    kernel scans each (plane, whole query tile, KV tile) once for every thread (old patch 0017)
    and reads those scans for whole tiles (64 rows: every chunk is a head's tile), and scans itself
    where a chunk cuts a tile short (70 rows with 2-3 threads: chunks of 64 rows cross the heads).
    The planes differ where it matters: a tile one plane masks whole and the other sees, a key one
    plane hides, a row seeing a single key in one plane only."""
    if prec_bf16 and not pyggml_dkv.bf16_attention_supported():
        pytest.skip("ggml built without our bf16 attention kernel (fa-bf16)")
    d, n_head, n_head_kv, n_kv = 64, 4, 2, 267
    q = rng.standard_normal((n_q, n_head, d)).astype(np.float32)
    k = rng.standard_normal((n_kv, n_head_kv, d)).astype(np.float16).astype(np.float32)
    v = rng.standard_normal((n_kv, n_head_kv, d)).astype(np.float16).astype(np.float32)
    visible = rng.random((2, n_q, n_kv)) < 0.7
    visible[:, :, 0] = True
    visible[0, :, 64:128] = False  # plane 0: a whole tile skipped; plane 1 sees it
    visible[1, :, 192:256] = True  # plane 1: a tile every row sees (all-zero mask)
    visible[1, :, 130] = False
    visible[0, 5] = False
    visible[0, 5, 266] = True  # plane 0, row 5: the partial tile's last key only
    mask = np.where(visible, 0, -np.inf).astype(np.float16)[None]  # ggml [n_kv, n_q, 2, 1]
    specs = [
        ("f32", q.transpose(1, 0, 2)[None]),
        ("f16", k.transpose(1, 0, 2)[None]),
        ("f16", v.transpose(1, 0, 2)[None]),
        ("f16", mask),
    ]
    with Backend("cpu", n_threads=n_threads) as backend:
        got = compute(
            backend,
            specs,
            lambda g, qt, kt, vt, m: g.flash_attn_ext(
                qt, kt, vt, m, 1 / math.sqrt(d), prec_f32=not prec_bf16, prec_bf16=prec_bf16
            ),
            dkv=(1, 2),
        )
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    want = np.stack(
        [
            attention(q64[:, h : h + 1], k64[:, h // 2 : h // 2 + 1], v64[:, h // 2 : h // 2 + 1], visible[h % 2])[:, 0]
            for h in range(n_head)
        ],
        axis=1,
    )
    assert got.shape == (1, n_q, n_head, d)
    assert relative_error(got[0], want) < (1.5e-2 if prec_bf16 else 2e-6), relative_error(got[0], want)
    np.testing.assert_allclose(got[0, 5, 0], v[266, 0], rtol=1e-2, atol=1e-2)


needs_bf16_attention = pytest.mark.skipif(
    not pyggml_dkv.bf16_attention_supported(), reason="ggml built without our bf16 attention kernel (fa-bf16)"
)


@needs_bf16_attention
@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("d,n_q,n_kv", [(64, 70, 267), (64, 9, 267), (128, 20, 150), (64, 64, 4128)])
def test_flash_attn_ext_bf16_products(rng, cpu_runs_bf16_attention, n_threads, d, n_q, n_kv):
    """prec_bf16 over K/V in our CPU_DKV buffer (the drafter's caches): where the build and CPU have
    our bf16 products (AMX-BF16 tiles or vdpbf16ps: bf16_attention_kernel) both take bf16 inputs with f32 sums,
    so the result is within bf16 rounding of the reference (and not the f32 result); the masking
    rules stay exact: keys no row may see hold NaN and must not reach the output, a row that sees
    one key returns that key's value (to bf16 precision)."""
    n_head = 2
    q = rng.standard_normal((n_q, n_head, d)).astype(np.float32)
    k = rng.standard_normal((n_kv, n_head, d)).astype(np.float16).astype(np.float32)
    v = rng.standard_normal((n_kv, n_head, d)).astype(np.float16).astype(np.float32)
    visible = rng.random((n_q, n_kv)) < 0.7
    visible[:, 0] = True
    visible[:, 64:128] = False  # a whole tile no row sees (skipped)
    visible[:, 130] = False  # hidden from every row in a computed tile
    visible[3] = False
    visible[3, n_kv - 1] = True  # only the last (partial) tile's last key
    mask = np.where(visible, 0, -np.inf).astype(np.float16)
    k_nan, v_nan = k.copy(), v.copy()
    k_nan[64:128], v_nan[64:128] = np.nan, np.nan
    k_nan[130], v_nan[130] = np.nan, np.nan
    specs = [
        ("f32", q.transpose(1, 0, 2)[None]),
        ("f16", k_nan.transpose(1, 0, 2)[None]),
        ("f16", v_nan.transpose(1, 0, 2)[None]),
        ("f16", mask),
    ]
    with Backend("cpu", n_threads=n_threads) as backend:
        fast, exact = (
            compute(
                backend,
                specs,
                lambda g, qt, kt, vt, m, bf=bf: g.flash_attn_ext(
                    qt, kt, vt, m, 1 / math.sqrt(d), prec_f32=not bf, prec_bf16=bf
                ),
                dkv=(1, 2),
            )
            for bf in (True, False)
        )
    want = attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), visible)
    assert np.isfinite(fast).all()
    assert relative_error(exact[0], want) < 2e-6
    err = relative_error(fast[0], want)
    if cpu_runs_bf16_attention:
        assert 1e-4 < err < 1.5e-2, err  # bf16 products really ran, at bf16 precision
    else:  # no AMX-BF16 / AVX512-BF16: the f32 kernel
        np.testing.assert_array_equal(fast, exact)
    np.testing.assert_allclose(fast[0, 3], v[n_kv - 1], rtol=1e-2, atol=1e-2)


@needs_bf16_attention
@pytest.mark.parametrize("in_dkv", [True, False])
def test_flash_attn_ext_bf16_falls_back_to_f32_for_other_head_sizes(be, rng, in_dkv):
    """Head size 80 is no multiple of 32 (bf16 pairs in 32-value steps): our tiled kernel runs in
    f32. K/V outside our buffer: ggml's own kernel takes the precision and computes in f32 (patch
    fa-bf16; unpatched ggml aborts on it, hence Python's refusal without that capability)."""
    d, n_q, n_kv = 80, 16, 100
    q = rng.standard_normal((1, 1, n_q, d)).astype(np.float32)  # ggml [d, n_q, 1 head, 1]
    kv = rng.standard_normal((1, 1, n_kv, d)).astype(np.float16)
    mask = np.zeros((n_q, n_kv), np.float16)
    specs = [("f32", q), ("f16", kv), ("f16", kv), ("f16", mask)]
    fast, exact = (
        compute(
            be,
            specs,
            lambda g, qt, kt, vt, m, bf=bf: g.flash_attn_ext(qt, kt, vt, m, 0.1, prec_f32=not bf, prec_bf16=bf),
            dkv=(1, 2) if in_dkv else (),
        )
        for bf in (True, False)
    )
    np.testing.assert_array_equal(fast, exact)


@needs_bf16_attention
@pytest.mark.parametrize("n_q", [4, 16, 64])
def test_flash_attn_ext_bf16_outside_our_buffer_is_ggml_f32(rng, n_q):
    """prec_bf16 where none of our kernels takes the op (K/V in ggml's own buffer, as the one-shot
    drafter's graph intermediates are; or fewer than 8 query rows): ggml's kernels compute it, bit
    for bit their f32 result, rather than aborting."""
    d, n_kv = 64, 150
    q = rng.standard_normal((1, 2, n_q, d)).astype(np.float32)
    kv = rng.standard_normal((1, 2, n_kv, d)).astype(np.float16)
    mask = np.where(rng.random((n_q, n_kv)) < 0.8, 0, -np.inf).astype(np.float16)
    mask[:, 0] = 0
    specs = [("f32", q), ("f16", kv), ("f16", kv), ("f16", mask)]
    with Backend("cpu", n_threads=2) as backend:
        fast, exact = (
            compute(
                backend,
                specs,
                lambda g, qt, kt, vt, m, bf=bf: g.flash_attn_ext(qt, kt, vt, m, 0.125, prec_f32=not bf, prec_bf16=bf),
                dkv=(1, 2) if n_q < 8 else (),
            )
            for bf in (True, False)
        )
    assert np.isfinite(fast).all()
    np.testing.assert_array_equal(fast, exact)


def test_flash_attn_ext_bf16_refusals(monkeypatch):
    import pyggml_dkv.ggml.capabilities as G

    with Context(n_tensors=8) as g:
        q, k = g.new_tensor("f32", 64, 8), g.new_tensor("f16", 64, 32)
        with pytest.raises(ValueError, match="exclude each other"):
            g.flash_attn_ext(q, k, k, None, 0.125, prec_f32=True, prec_bf16=True)
        monkeypatch.setattr(G, "built_capabilities", lambda: frozenset())
        with pytest.raises(ValueError, match="'fa-bf16'"):
            g.flash_attn_ext(q, k, k, None, 0.125, prec_bf16=True)


def _alibi_slopes(n_head: int, max_bias: float) -> np.ndarray:
    """ggml's ALiBi slope per query head (1 for every head when max_bias is 0)."""
    if max_bias <= 0:
        return np.ones(n_head)
    n_log2 = 2 ** int(math.floor(math.log2(n_head)))
    m0, m1 = 2.0 ** (-max_bias / n_log2), 2.0 ** (-(max_bias / 2) / n_log2)
    return np.array([m0 ** (h + 1) if h < n_log2 else m1 ** (2 * (h - n_log2) + 1) for h in range(n_head)])


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize(
    "d,n_q,softcap,max_bias", [(128, 20, 0.0, 0.0), (128, 20, 5.0, 8.0), (64, 64, 2.0, 0.0), (80, 12, 0.0, 4.0)]
)
def test_flash_attn_ext_tiled_kernel_bias_and_softcap(rng, n_threads, d, n_q, softcap, max_bias):
    """The tiled kernel with what the drafter does not use but ggml offers: finite additive mask
    values (the mask is converted and added, not only tested for -inf), ALiBi slopes per query head
    (3 heads: both slope formulas), logit soft-capping, head sizes 80 and 128, 3 query heads per
    K/V head."""
    n_head, n_head_kv, n_kv = 3, 1, 150
    q = rng.standard_normal((n_q, n_head, d)).astype(np.float32)
    k = rng.standard_normal((n_kv, n_head_kv, d)).astype(np.float16).astype(np.float32)
    v = rng.standard_normal((n_kv, n_head_kv, d)).astype(np.float16).astype(np.float32)
    bias = rng.uniform(-3, 0, (n_q, n_kv)).astype(np.float16)
    bias[rng.random((n_q, n_kv)) < 0.2] = -np.inf
    bias[:, 0] = 0  # every row sees a key
    bias[:, 64:128] = 0  # one tile with an all-zero mask
    scale = 1 / math.sqrt(d)
    if n_q < 64 and flash_attn_kernel(n_q, "f16", d) != "tiled":
        pytest.skip("ggml's own kernel below 64 rows sums V in f16 (our fa-tiled kernel is not in this build / CPU)")
    with Backend("cpu", n_threads=n_threads) as backend:
        got = compute(
            backend,
            [
                ("f32", q.transpose(1, 0, 2)[None]),
                ("f16", k.transpose(1, 0, 2)[None]),
                ("f16", v.transpose(1, 0, 2)[None]),
                ("f16", bias),
            ],
            lambda g, qt, kt, vt, m: g.flash_attn_ext(
                qt, kt, vt, m, scale, max_bias=max_bias, logit_softcap=softcap, prec_f32=True
            ),
            dkv=(1, 2),
        )
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    s = np.einsum("qhd,kd->hqk", q64, k64[:, 0]) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    s = s + _alibi_slopes(n_head, max_bias)[:, None, None] * bias.astype(np.float64)[None]
    w = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("hqk,kd->qhd", w / w.sum(-1, keepdims=True), v64[:, 0])
    assert got.shape == (1, n_q, n_head, d)
    assert relative_error(got[0], want) < 1e-5, relative_error(got[0], want)


@pytest.mark.parametrize("n_threads", [1, 2, 3])
@pytest.mark.parametrize("shape, w_len", [((1024, 16), 1024), ((64, 16, 16), 64), ((70, 5), 70), ((24, 3, 2), 24)])
def test_rms_norm_times_weights_fused_bit_identical(rng, n_threads, shape, w_len):
    """RMS_NORM followed by the MUL of its result by one row of weights (every norm of the drafter)
    runs as one fused op (old patch 0018) when the norm has no other use; its results must
    be those of the two ops bit for bit: the same graph with the norm's result also an output (so
    not fused) gives the reference, and both are the float64 math to f32 rounding. Rows of 1024,
    per-head 64, a 70-value row (a vector tail) and a 24-value one (mostly tail)."""
    x = rng.standard_normal(tuple(reversed(shape))).astype(np.float32) * 3
    w = rng.standard_normal(w_len).astype(np.float32)
    eps = 1e-6

    def build(keep_norm: bool):
        def graph(g, xt, wt):
            normed = g.rms_norm(xt, eps)
            out = g.mul(normed, wt)
            return (out, normed) if keep_norm else out

        return graph

    with Backend("cpu", n_threads=n_threads) as backend:
        fused = compute(backend, [("f32", x), ("f32", w)], build(False))
        unfused, normed = compute(backend, [("f32", x), ("f32", w)], build(True))
    np.testing.assert_array_equal(fused.view(np.uint32), unfused.view(np.uint32))
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + eps) * w
    assert relative_error(fused, want) < 1e-6
    assert relative_error(normed, want / w) < 1e-6


def test_rms_norm_times_weights_not_fused_when_unlike(rng):
    """Pairs the fused op must leave to the two ops: weights of two rows (broadcast per row), and
    the norm's result used twice; both still equal the math."""
    x = rng.standard_normal((4, 32)).astype(np.float32)
    w2 = rng.standard_normal((2, 32)).astype(np.float32)
    x64 = x.astype(np.float64)
    n64 = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6)
    with Backend("cpu", n_threads=2) as backend:
        got = compute(backend, [("f32", x), ("f32", w2)], lambda g, xt, wt: g.mul(g.rms_norm(xt, 1e-6), wt))
        twice = compute(
            backend,
            [("f32", x), ("f32", w2[:1])],
            lambda g, xt, wt: (lambda n: g.add(g.mul(n, wt), n))(g.rms_norm(xt, 1e-6)),
        )
    assert relative_error(got, n64 * np.tile(w2, (2, 1))) < 1e-6
    assert relative_error(twice, n64 * w2[0] + n64) < 1e-6


def test_soft_max_ext_with_mask(be, rng):
    s = rng.standard_normal((3, 6)).astype(np.float32)
    mask = np.where(np.tril(np.ones((3, 6), bool), 3), 0, -np.inf).astype(np.float16)
    got = compute(be, [("f32", s), ("f16", mask)], lambda g, a, m: g.soft_max_ext(a, m, 0.5))
    z = 0.5 * s.astype(np.float64) + mask
    want = np.exp(z - z.max(-1, keepdims=True))
    np.testing.assert_allclose(got, want / want.sum(-1, keepdims=True), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dest", ["f32", "f16"])
def test_set_rows_and_get_rows(be, rng, dest):
    a = rng.standard_normal((6, 8)).astype(np.float32)
    src = rng.standard_normal((2, 8)).astype(np.float32)
    idx = np.array([4, 1], np.int32)
    gather = np.array([5, 0, 5], np.int32)
    written, rows = compute(
        be,
        [(dest, a), ("f32", src), ("i32", idx), ("i32", gather)],
        lambda g, t, s, r, gi: (g.set_rows(t, s, r), g.get_rows(t, gi)),
    )
    cast = (lambda y: y.astype(np.float16).astype(np.float32)) if dest == "f16" else (lambda y: y)
    want = cast(a).copy()
    want[idx] = cast(src)
    np.testing.assert_array_equal(written, want)
    # get_rows reads `t` itself (not set_rows' result), so only rows set_rows leaves alone are compared
    assert rows.shape == (3, 8) and rows.dtype == np.float32
    np.testing.assert_array_equal(rows[[0, 2]], np.stack([want[5], want[5]]))
    np.testing.assert_array_equal(rows[1], want[0])


def test_set_rows_i64_indices(be, rng):
    a = np.zeros((4, 8), np.float32)
    src = rng.standard_normal((1, 8)).astype(np.float32)
    got = compute(be, [("f32", a), ("f32", src), ("i64", np.array([3]))], lambda g, t, s, r: g.set_rows(t, s, r))
    np.testing.assert_array_equal(got[3], src[0])
    np.testing.assert_array_equal(got[:3], 0)


def test_get_rows_dequantizes(be, rng):
    a = rng.standard_normal((4, 32)).astype(np.float32)
    got = compute(be, [("q8_0", a), ("i32", np.array([2, 0], np.int32))], lambda g, t, r: g.get_rows(t, r))
    assert relative_error(got, a[[2, 0]]) < 1e-2


def test_concat(be, rng):
    a = rng.standard_normal((3, 4)).astype(np.float32)
    b = rng.standard_normal((3, 2)).astype(np.float32)
    c = rng.standard_normal((5, 4)).astype(np.float32)
    cols, rows = compute(
        be, [("f32", a), ("f32", b), ("f32", c)], lambda g, x, y, z: (g.concat(x, y, 0), g.concat(x, z, 1))
    )
    np.testing.assert_array_equal(cols, np.concatenate([a, b], axis=1))
    np.testing.assert_array_equal(rows, np.concatenate([a, c], axis=0))


def test_permute_cont_reshape(be, rng):
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)  # ggml [4, 3, 2]
    shapes = {}

    def build(g, t):
        p = g.permute(t, 0, 2, 1, 3)  # ggml [4, 2, 3]
        tr = g.permute(g.reshape(t, 4, 6), 1, 0, 2, 3)  # 2-d transpose
        shapes.update(p=p.shape, tr=tr.shape, p_contig=p.is_contiguous)
        return g.cont(p), g.cont(tr), g.reshape(g.cont(p), 8, 3)

    p, tr, flat = compute(be, [("f32", x)], build)
    assert shapes == {"p": (3, 2, 4), "tr": (4, 6), "p_contig": False}
    np.testing.assert_array_equal(p, x.transpose(1, 0, 2))
    np.testing.assert_array_equal(tr, x.reshape(6, 4).T)
    np.testing.assert_array_equal(flat, x.transpose(1, 0, 2).reshape(3, 8))


def test_views(be, rng):
    x = rng.standard_normal((6, 8)).astype(np.float32)  # ggml [8, 6], nb1 = 32

    def build(g, t):
        nb1 = t.nb[1]
        rows = g.view(t, (8, 3), offset=2 * nb1)  # rows 2..4, contiguous
        cols = g.view(t, (4, 6), (nb1,), offset=8)  # columns 2..5 of every row, strided
        flat = g.view(t, (16,), offset=nb1)  # rows 1..2 as one vector
        heads = g.view(t, (2, 6, 4), (nb1, 8), 0)  # [2, rows, 4 heads] over the same data
        assert rows.is_contiguous and not cols.is_contiguous and heads.shape == (4, 6, 2)
        return g.cont(rows), g.cont(cols), g.cont(flat), g.cont(heads)

    rows, cols, flat, heads = compute(be, [("f32", x)], build)
    np.testing.assert_array_equal(rows, x[2:5])
    np.testing.assert_array_equal(cols, x[:, 2:6])
    np.testing.assert_array_equal(flat, x[1:3].reshape(16))
    np.testing.assert_array_equal(heads, x.reshape(6, 4, 2).transpose(1, 0, 2))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_cast_and_cpy(be, rng):
    x = (rng.standard_normal((4, 32)) * 100).astype(np.float32)
    x[0, :6] = [1 + 2**-8, 1 + 3 * 2**-8, 65519.0, 1e-8, -0.0, 3.0e5]  # ties, f16 overflow, f16 subnormal
    f16, bf16, q8, back, as_i32 = compute(
        be,
        [("f32", x), ("f16", np.zeros((4, 32), np.float32))],
        lambda g, t, dst: (
            g.cast(t, "f16"),
            g.cast(t, "bf16"),
            g.cast(t, "q8_0"),
            g.cast(g.cpy(t, dst), "f32"),
            g.cast(t, "i32"),
        ),
    )
    np.testing.assert_array_equal(f16, x.astype(np.float16).astype(np.float32))  # ggml's f16 == numpy's RNE
    np.testing.assert_array_equal(bf16, bf16_bits_to_fp32(fp32_to_bf16_bits(x)))
    assert relative_error(q8, x) < 1e-2
    np.testing.assert_array_equal(back, x.astype(np.float16).astype(np.float32))
    assert as_i32.dtype == np.int32 and as_i32.shape == x.shape
    np.testing.assert_array_equal(as_i32[1:], x[1:].astype(np.int32))  # truncation toward zero


def test_argmax(be, rng):
    x = rng.standard_normal((5, 17)).astype(np.float32)
    x[2, 16] = 99.0
    got = compute(be, [("f32", x)], lambda g, t: g.argmax(t))
    assert got.dtype == np.int32 and got.shape == (5,)
    np.testing.assert_array_equal(got, x.argmax(-1))


def _ggml_scalar_argmax(row: np.ndarray) -> int:
    """ggml_vec_argmax_f32 value by value: max = MAX(max, x) (a > b ? a : b), idx = i where max == x."""
    best, idx = -np.inf, 0
    for i, v in enumerate(row.tolist()):
        best = best if best > v else v
        if best == v:
            idx = i
    return idx


def _argmax_rows(rng: np.random.Generator, width: int) -> np.ndarray:
    """Rows that tell the last index of the maximum from the first, across the kernel's 16-value
    lanes, its 4 chains and its tail: ties, +-inf, signed zeros, all -inf, NaN in several places."""
    rows = [rng.standard_normal(width).astype(np.float32) for _ in range(3)]
    tie = rng.standard_normal(width).astype(np.float32)
    tie[rng.choice(width, size=min(width, 3), replace=False)] = 7.0  # the maximum three times
    rows.append(tie)
    rows.append(np.full(width, -np.inf, np.float32))
    zeros = np.where(rng.random(width) < 0.5, np.float32(-0.0), np.float32(0.0)).astype(np.float32)
    zeros[: width // 2] = -1.0
    rows.append(zeros)  # the maximum is zero, stored as -0.0 or +0.0
    inf = rng.standard_normal(width).astype(np.float32)
    inf[[0, width - 1]] = np.inf
    rows.append(inf)
    for at in sorted({0, width // 2, width - 1}):
        nan = rng.standard_normal(width).astype(np.float32)
        nan[at] = np.nan
        rows.append(nan)
    return np.stack(rows)


@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_argmax_is_ggmls_last_index_of_the_maximum(n_threads, rng):
    """ggml's argmax returns the last index of a row's maximum (and, with a NaN, whatever its scalar
    loop makes of it). P8 (argmax-rows) computes it 16 values at a time in 4 chains, the rows split over
    the threads: the same index for every row, width and thread count, against ggml's loop emulated
    value by value (rows of 1-200 values, and a vocabulary's 49152)."""
    with Backend("cpu", n_threads=n_threads) as backend:
        for width in (1, 15, 16, 17, 63, 64, 65, 100, 129, 200, 49152):
            x = _argmax_rows(rng, width)
            got = compute(backend, [("f32", x)], lambda g, t: g.argmax(t))
            want = [_ggml_scalar_argmax(row) for row in x]
            np.testing.assert_array_equal(got, want, err_msg=f"width {width}")
