"""The Pythonic ggml layer (pyggml_dkv.ggml / ops / numeric) on the CPU backend.

* backends: what is available, what is not and why, bad specs;
* tiny graphs against numpy: every op the drafter uses, at the precision of its types;
* tensor I/O round trips, bf16 rounding bit-exact against ggml's own converter;
* contexts (caller-owned arenas, running out of room), graphs, the graph allocator;
* every documented error path raises a Python exception. ggml answers a violated precondition
  with abort(), which would kill pytest, so those cases run in child processes (a few children
  for all of them): a case that aborts fails as "CRASH" and the rest still run.
"""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import pyggml_dkv
from pyggml_dkv import DraftConfig
from pyggml_dkv._lowlevel import ffi, lib
from pyggml_dkv.ggml import (
    Backend,
    BackendInfo,
    BackendUnavailableError,
    Buffer,
    Context,
    Gallocr,
    GGMLError,
    Graph,
    Tensor,
    available_backends,
    list_devices,
    live_objects,
)
from pyggml_dkv.numeric import bf16_bits_to_fp32, fp32_to_bf16_bits, relative_error
from pyggml_dkv.reference import attention, rope_neox

ROOT = Path(__file__).resolve().parents[1]
NEOX = int(lib.GGML_ROPE_TYPE_NEOX)
RNG_SEED = 1234


@pytest.fixture(scope="module")
def be():
    backend = Backend("cpu", n_threads=2)
    yield backend
    backend.close()


@pytest.fixture
def rng():
    return np.random.default_rng(RNG_SEED)


def compute(backend: Backend, specs: list[tuple[str, np.ndarray]], build, graph_size: int = 128):
    """Upload `specs` (type, numpy array) into fresh tensors, run build(g, *tensors) -> output(s), return numpy."""
    with Context(n_tensors=len(specs)) as ctx, Context(n_tensors=graph_size, graph_size=graph_size) as g:
        tensors = [ctx.new_tensor(ty, *reversed(arr.shape)) for ty, arr in specs]
        with Buffer.alloc_ctx_tensors(ctx, backend):
            for t, (_, arr) in zip(tensors, specs):
                t.set(arr)
            graph = Graph(g, graph_size)
            outs = build(g, *tensors)
            single = isinstance(outs, Tensor)
            outs = [outs] if single else list(outs)
            for o in outs:
                graph.expand(o)
            with Gallocr(backend) as galloc:
                galloc.alloc_graph(graph)
                graph.compute(backend)
                results = [o.numpy() for o in outs]
    return results[0] if single else results


# ============================================================================ backends


def test_available_backends_lists_cpu_and_explains_the_rest():
    infos = pyggml_dkv.available_backends()
    assert all(isinstance(i, BackendInfo) for i in infos)
    by_name = {i.name: i for i in infos}
    assert by_name["cpu"].available and by_name["cpu"].reason is None
    assert by_name["cpu"].description
    for info in infos:
        if not info.available:
            assert isinstance(info.reason, str) and info.reason, info
            assert "unavailable" in repr(info)
    assert any(i.name.startswith("cuda") for i in infos), "CUDA must be listed, available or not"


def test_cuda_unavailable_here():
    cuda = [i for i in available_backends() if i.name.startswith("cuda")]
    if any(i.available for i in cuda):
        pytest.skip("this machine has a usable CUDA device")
    assert len(cuda) == 1 and not cuda[0].available and cuda[0].reason
    before = live_objects().get("backend", 0)
    for spec in ("cuda", "cuda:0", "CUDA:1", " cuda "):
        with pytest.raises(BackendUnavailableError) as err:
            Backend(spec)
        assert isinstance(err.value, GGMLError)
    assert live_objects().get("backend", 0) == before


@pytest.mark.parametrize("spec, exc", [
    ("gpu", ValueError), ("cpu:1", ValueError), ("cpu:0", ValueError), ("cuda:x", ValueError),
    ("cuda:-1", ValueError), ("cuda:0:1", ValueError), ("", ValueError), ("metal", ValueError),
    (3, TypeError), (None, TypeError), (b"cpu", TypeError),
])
def test_bad_backend_specs(spec, exc):
    with pytest.raises(exc):
        Backend(spec)


def test_list_devices_has_the_cpu():
    devices = list_devices()
    cpu = [d for d in devices if d["type"] == lib.GGML_BACKEND_DEVICE_TYPE_CPU]
    assert cpu, devices
    assert cpu[0]["name"] == "CPU" and cpu[0]["description"]
    assert cpu[0]["memory_total"] >= cpu[0]["memory_free"] >= 0
    assert set(devices[0]) == {"name", "description", "type", "registry", "memory_free", "memory_total"}


@pytest.mark.parametrize("bad", [0, -1, 513, 2**40, 1.5, True, "2"])
def test_cpu_thread_count_validated(bad):
    before = live_objects().get("backend", 0)
    with pytest.raises(ValueError):
        Backend("cpu", n_threads=bad)
    assert live_objects().get("backend", 0) == before  # nothing leaked by the failed constructor


def test_cpu_backend_basics():
    with Backend(" CPU ", n_threads=1) as b:
        assert b.spec == "cpu" and b.is_cpu and b.name == "CPU" and b.n_threads == 1
        b.set_n_threads(2)
        assert b.n_threads == 2
        with pytest.raises(ValueError):
            b.set_n_threads(0)
        assert lib.ggml_backend_buft_is_host(b.buffer_type)
        b.synchronize()
        assert "CPU" in repr(b)
    assert b.closed and "closed" in repr(b)
    with pytest.raises(GGMLError):
        b.name
    b.close()  # twice is fine


# ============================================================================ ops vs numpy


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


@pytest.mark.parametrize("m, k, n", [(5, 64, 3), (4, 1024, 16), (70, 96, 34), (33, 48, 64), (9, 32, 1), (6, 64, 65), (7, 40, 8)])
def test_mul_mat_f16_weights_few_columns(rng, m, k, n):
    """f16 weights x up to 64 f32 columns: the narrow AVX-512 kernel (vendor/patches/0004) keeps the
    columns f32, so against the stored f16 weights only f32 rounding remains; wider products
    (n > 64) or rows that are not whole 16-value vectors take ggml's f16 x f16 path (x rounded to f16).
    Every output is computed by one thread: the thread count must not change a bit."""
    w = rng.standard_normal((m, k)).astype(np.float32)
    x = rng.standard_normal((n, k)).astype(np.float32)
    want = x.astype(np.float64) @ w.astype(np.float16).astype(np.float64).T
    narrow = n <= 64 and k % 16 == 0 and bool(lib.ggml_cpu_has_avx512() and lib.ggml_cpu_has_f16c())
    results = []
    for n_threads in (1, 2, 3):
        with Backend("cpu", n_threads=n_threads) as backend:
            results.append(compute(backend, [("f16", w), ("f32", x)], lambda g, a, b: g.mul_mat(a, b)))
    for got in results:
        assert got.shape == (n, m)
        assert relative_error(got, want) < (2e-6 if narrow else 2e-3), relative_error(got, want)
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
    got = compute(be, [("f32", a), ("f32", row), ("f32", mat), ("f32", col)],
                  lambda g, x, r, m, c: (g.add(x, r), g.mul(x, m), g.sub(x, c), g.add(x, x)))
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
        be, [("f32", x)],
        lambda g, a: (g.rms_norm(a, eps), g.silu(a), g.scale(a, -0.375), g.tanh(a), g.softplus(a)))
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(rms, x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(silu, x64 / (1 + np.exp(-x64)), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(scaled, x * np.float32(-0.375))
    np.testing.assert_allclose(tanh, np.tanh(x64), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(softplus, np.logaddexp(0, x64), rtol=1e-5, atol=1e-6)


def _rope(g, a, p, cfg: DraftConfig):
    return g.rope_ext(a, p, cfg.head_dim, NEOX, cfg.n_ctx_orig, cfg.rope_theta, cfg.freq_scale,
                      cfg.ext_factor, cfg.attn_factor, cfg.beta_fast, cfg.beta_slow)


@pytest.mark.parametrize("yarn", [
    {},
    {"rope_theta": 10000.0},
    {"rope_theta": 10000.0, "freq_scale": 0.25, "ext_factor": 1.0, "n_ctx_orig": 64, "attn_factor": 1.0},
    {"rope_theta": 500000.0, "freq_scale": 0.125, "ext_factor": 0.5, "n_ctx_orig": 8192, "attn_factor": 0.9},
], ids=["plain", "theta1e4", "yarn", "yarn-partial"])
def test_rope_neox_against_reference(be, rng, yarn):
    cfg = DraftConfig(hidden=48, n_layer=1, n_head=3, n_head_kv=1, head_dim=16, ffn=32, block_size=4,
                      n_target_layers=1, **yarn)
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
        [("f32", q.transpose(1, 0, 2)[None]), ("f16", k.transpose(1, 0, 2)[None]),
         ("f16", v.transpose(1, 0, 2)[None]), ("f16", mask)],
        lambda g, qt, kt, vt, m: g.flash_attn_ext(qt, kt, vt, m, 1 / math.sqrt(d), prec_f32=prec_f32))
    assert got.shape == (1, n_q, n_head, d)  # ggml [d, n_head, n_q, 1]
    want = attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), visible)
    assert relative_error(got[0], want) < 3e-3, relative_error(got[0], want)


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("n_q", [70, 32, 9])
def test_flash_attn_ext_tiled_kernel(rng, kv_type, n_threads, n_q):
    """8+ query rows per head: ggml's tiled CPU flash-attention kernel as vendor/patches/0003 leaves it
    (on AVX-512: its transposed-score form; elsewhere the row-major one).

    267 keys = four whole 64-key tiles + a partial one (vector and scalar tails): a fully masked
    tile (skipped), a tile every row sees whole (an all-zero mask, not converted), two with mixed
    masks; a query row that sees one key only, and a second K/V head; keys no row sees hold NaN.
    70 query rows = a whole 64-row tile + a partial one; 32 and 9 rows = one partial tile (the
    patched kernel takes >= 8 rows and computes only the valid ones).
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
    # keys no row may see hold NaN (like unused cache rows): they must not reach the output
    k_nan, v_nan = k.copy(), v.copy()
    for rows in (slice(64, 128), slice(130, 131)):
        k_nan[rows], v_nan[rows] = np.nan, np.nan
    with Backend("cpu", n_threads=n_threads) as backend:
        got = compute(
            backend,
            [("f32", q.transpose(1, 0, 2)[None]), (kv_type, k_nan.transpose(1, 0, 2)[None]),
             (kv_type, v_nan.transpose(1, 0, 2)[None]), ("f16", mask)],
            lambda g, qt, kt, vt, m: g.flash_attn_ext(qt, kt, vt, m, 1 / math.sqrt(d), prec_f32=True))
    want = attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), visible)
    assert relative_error(got[0], want) < 2e-6, relative_error(got[0], want)
    np.testing.assert_allclose(got[0, 5], v[266], rtol=1e-6, atol=1e-6)


needs_bf16_attention = pytest.mark.skipif(not pyggml_dkv.bf16_attention_supported(),
                                          reason="ggml built without vendor/patches/0009")


@needs_bf16_attention
@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("d,n_q,n_kv", [(64, 70, 267), (64, 9, 267), (128, 20, 150), (64, 64, 4128)])
def test_flash_attn_ext_bf16_products(rng, cpu_runs_bf16_attention, n_threads, d, n_q, n_kv):
    """prec_bf16 (vendor/patches/0009, 0011): on CPUs with AMX-BF16 or AVX512-BF16 both products take bf16 inputs with
    f32 sums, so the result is within bf16 rounding of the reference (and not the f32 result); the
    masking rules stay exact: keys no row may see hold NaN and must not reach the output, a row
    that sees one key returns that key's value (to bf16 precision)."""
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
    specs = [("f32", q.transpose(1, 0, 2)[None]), ("f16", k_nan.transpose(1, 0, 2)[None]),
             ("f16", v_nan.transpose(1, 0, 2)[None]), ("f16", mask)]
    with Backend("cpu", n_threads=n_threads) as backend:
        fast, exact = (compute(backend, specs, lambda g, qt, kt, vt, m, bf=bf: g.flash_attn_ext(
            qt, kt, vt, m, 1 / math.sqrt(d), prec_f32=not bf, prec_bf16=bf)) for bf in (True, False))
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
def test_flash_attn_ext_bf16_falls_back_to_f32_for_other_head_sizes(be, rng):
    """Head size 80 is no multiple of 32 (the AMX tiles' width in bf16): the f32 kernel runs."""
    d, n_q, n_kv = 80, 16, 100
    q = rng.standard_normal((1, 1, n_q, d)).astype(np.float32)  # ggml [d, n_q, 1 head, 1]
    kv = rng.standard_normal((1, 1, n_kv, d)).astype(np.float16)
    mask = np.zeros((n_q, n_kv), np.float16)
    specs = [("f32", q), ("f16", kv), ("f16", kv), ("f16", mask)]
    fast, exact = (compute(be, specs, lambda g, qt, kt, vt, m, bf=bf: g.flash_attn_ext(
        qt, kt, vt, m, 0.1, prec_f32=not bf, prec_bf16=bf)) for bf in (True, False))
    np.testing.assert_array_equal(fast, exact)


def test_flash_attn_ext_bf16_refusals(monkeypatch):
    import pyggml_dkv.ggml as G

    with Context(n_tensors=8) as g:
        q, k = g.new_tensor("f32", 64, 8), g.new_tensor("f16", 64, 32)
        with pytest.raises(ValueError, match="exclude each other"):
            g.flash_attn_ext(q, k, k, None, 0.125, prec_f32=True, prec_bf16=True)
        monkeypatch.setattr(G, "built_with_patches", lambda: ())
        with pytest.raises(ValueError, match="0009"):
            g.flash_attn_ext(q, k, k, None, 0.125, prec_bf16=True)


def _alibi_slopes(n_head: int, max_bias: float) -> np.ndarray:
    """ggml's ALiBi slope per query head (1 for every head when max_bias is 0)."""
    if max_bias <= 0:
        return np.ones(n_head)
    n_log2 = 2 ** int(math.floor(math.log2(n_head)))
    m0, m1 = 2.0 ** (-max_bias / n_log2), 2.0 ** (-(max_bias / 2) / n_log2)
    return np.array([m0 ** (h + 1) if h < n_log2 else m1 ** (2 * (h - n_log2) + 1) for h in range(n_head)])


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("d,n_q,softcap,max_bias", [(128, 20, 0.0, 0.0), (128, 20, 5.0, 8.0), (64, 64, 2.0, 0.0),
                                                    (80, 12, 0.0, 4.0)])
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
    with Backend("cpu", n_threads=n_threads) as backend:
        got = compute(
            backend,
            [("f32", q.transpose(1, 0, 2)[None]), ("f16", k.transpose(1, 0, 2)[None]),
             ("f16", v.transpose(1, 0, 2)[None]), ("f16", bias)],
            lambda g, qt, kt, vt, m: g.flash_attn_ext(qt, kt, vt, m, scale, max_bias=max_bias,
                                                      logit_softcap=softcap, prec_f32=True))
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    s = np.einsum("qhd,kd->hqk", q64, k64[:, 0]) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    s = s + _alibi_slopes(n_head, max_bias)[:, None, None] * bias.astype(np.float64)[None]
    w = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("hqk,kd->qhd", w / w.sum(-1, keepdims=True), v64[:, 0])
    assert got.shape == (1, n_q, n_head, d)
    assert relative_error(got[0], want) < 1e-5, relative_error(got[0], want)


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
    written, rows = compute(be, [(dest, a), ("f32", src), ("i32", idx), ("i32", gather)],
                            lambda g, t, s, r, gi: (g.set_rows(t, s, r), g.get_rows(t, gi)))
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
    cols, rows = compute(be, [("f32", a), ("f32", b), ("f32", c)],
                         lambda g, x, y, z: (g.concat(x, y, 0), g.concat(x, z, 1)))
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
        be, [("f32", x), ("f16", np.zeros((4, 32), np.float32))],
        lambda g, t, dst: (g.cast(t, "f16"), g.cast(t, "bf16"), g.cast(t, "q8_0"),
                           g.cast(g.cpy(t, dst), "f32"), g.cast(t, "i32")))
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


# ============================================================================ tensors and number formats


def _roundtrip(backend, ty, arr, shape=None):
    with Context(n_tensors=1) as ctx:
        t = ctx.new_tensor(ty, *reversed(shape or arr.shape), name=f"rt_{ty}")
        with Buffer.alloc_ctx_tensors(ctx, backend) as buf:
            assert t.is_allocated and buf.size >= t.nbytes and buf.is_host
            t.set(arr)
            return t.numpy()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_roundtrip_f32_f16_bf16_f64(be, rng):
    x = (rng.standard_normal((3, 5, 8)) * 10.0 ** rng.integers(-6, 6, (3, 5, 8))).astype(np.float32)
    np.testing.assert_array_equal(_roundtrip(be, "f32", x), x)
    np.testing.assert_array_equal(_roundtrip(be, "f16", x), x.astype(np.float16).astype(np.float32))
    got = _roundtrip(be, "bf16", x)
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_array_equal(got.view(np.uint32) >> 16, fp32_to_bf16_bits(x))
    np.testing.assert_array_equal(got.view(np.uint32) & 0xFFFF, 0)
    x64 = rng.standard_normal((2, 3))
    np.testing.assert_array_equal(_roundtrip(be, "f64", x64), x64)
    # float64 and float16 arrays are accepted for f32 tensors (converted)
    np.testing.assert_array_equal(_roundtrip(be, "f32", x64), x64.astype(np.float32))
    h = x64.astype(np.float16)
    np.testing.assert_array_equal(_roundtrip(be, "f32", h), h.astype(np.float32))
    np.testing.assert_array_equal(_roundtrip(be, "bf16", h), bf16_bits_to_fp32(fp32_to_bf16_bits(h.astype(np.float32))))


def test_bf16_rounds_to_nearest_even(be):
    one_ulp = 2.0**-7  # bf16 keeps 7 mantissa bits
    x = np.array([1 + one_ulp / 2,  # tie -> even (1.0)
                  1 + 1.5 * one_ulp,  # tie -> even (1 + 2 ulp)
                  1 + one_ulp / 2 + 2**-20,  # just above the tie -> up
                  1 + one_ulp / 2 - 2**-20,  # just below -> down
                  -(1 + 1.5 * one_ulp), 0.0, np.inf, -0.0], np.float32)
    x[5] = np.array(0x7F7F8000, np.uint32).view(np.float32)  # max bf16 + half an ulp: a tie, to even = inf
    want = np.array([1.0, 1 + 2 * one_ulp, 1 + one_ulp, 1.0, -(1 + 2 * one_ulp), np.inf, np.inf, -0.0], np.float32)
    got = _roundtrip(be, "bf16", x)
    np.testing.assert_array_equal(got, want)
    assert np.signbit(got[-1])


def test_roundtrip_ints(be, rng):
    for ty, dt in (("i8", np.int8), ("i16", np.int16), ("i32", np.int32), ("i64", np.int64)):
        info = np.iinfo(dt)
        x = rng.integers(info.min, info.max, (4, 6), dtype=dt, endpoint=True)
        x[0, :2] = info.min, info.max
        got = _roundtrip(be, ty, x)
        assert got.dtype == dt
        np.testing.assert_array_equal(got, x)
    # any integer dtype whose values fit is accepted
    np.testing.assert_array_equal(_roundtrip(be, "i32", np.arange(6, dtype=np.uint8)), np.arange(6))
    np.testing.assert_array_equal(_roundtrip(be, "i32", np.array([-(2**31), 2**31 - 1], np.int64)),
                                  [-(2**31), 2**31 - 1])


@pytest.mark.parametrize("ty, tol", [("q8_0", 8e-3), ("q4_0", 1.5e-1)])
def test_roundtrip_quantized(be, rng, ty, tol):
    x = rng.standard_normal((3, 64)).astype(np.float32)
    got = _roundtrip(be, ty, x)
    assert got.shape == x.shape and got.dtype == np.float32
    assert relative_error(got, x) < tol
    # per 32-block absmax scaling: every value within half a step (+ the f16 rounding of the scale)
    if ty == "q8_0":
        step = np.abs(x.reshape(-1, 32)).max(1, keepdims=True) / 127
        assert (np.abs(got - x).reshape(-1, 32) <= step * 0.57).all()


def _ggml_bf16(x: np.ndarray) -> np.ndarray:
    """ggml_fp32_to_bf16_row, in chunks of < 32 so a build with AVX512-BF16 stays on the exact scalar path."""
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty(x.size, np.uint16)
    for start in range(0, x.size, 31):
        n = min(31, x.size - start)
        lib.ggml_fp32_to_bf16_row(ffi.from_buffer("float[]", x[start:start + n]),
                                  ffi.cast("ggml_bf16_t *", ffi.from_buffer(out[start:start + n])), n)
    return out


def test_fp32_to_bf16_bits_matches_ggml(rng):
    special = np.array([np.inf, -np.inf, 0.0, -0.0, np.nan, -np.nan, 1e-45, -1e-45, 1e-40, 1.1754942e-38,
                        1.17549435e-38, 3.4028235e38, -3.4028235e38, 3.3961514e38, 1.0, -2.5], np.float32)
    bit_patterns = np.array([
        0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001,  # ties to even (down, up), just below / above a tie
        0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000,  # rounding up into +-inf
        0x7F800001, 0xFF800001, 0x7FC00001, 0x7FBFFFFF, 0xFFFFFFFF,  # signalling / quiet / payload NaNs
        0x00008000, 0x00018000, 0x0000FFFF, 0x807FFFFF, 0x00000001,  # subnormals (ties and round-up)
    ], np.uint32).view(np.float32)
    randoms = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    scaled = (rng.standard_normal(5000) * 10.0 ** rng.integers(-44, 38, 5000)).astype(np.float32)
    x = np.concatenate([special, bit_patterns, randoms, scaled])
    np.testing.assert_array_equal(fp32_to_bf16_bits(x), _ggml_bf16(x))
    # shapes and scalars are kept; NaNs come back quiet
    assert fp32_to_bf16_bits(x[:12].reshape(3, 4)).shape == (3, 4)
    assert fp32_to_bf16_bits(np.float32(1.0)).shape == () and int(fp32_to_bf16_bits(1.0)) == 0x3F80
    nan_bits = fp32_to_bf16_bits(bit_patterns[7:12])
    assert (nan_bits & 0x7FC0 == 0x7FC0).all()


def test_bf16_bits_roundtrip_every_pattern():
    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    values = bf16_bits_to_fp32(bits)
    back = fp32_to_bf16_bits(values)
    nan = np.isnan(values)
    np.testing.assert_array_equal(back[~nan], bits[~nan])
    np.testing.assert_array_equal(back[nan], bits[nan] | 0x40)


def test_relative_error():
    assert relative_error(np.array([1.0, 2.0]), np.array([1.0, 4.0])) == 0.5
    assert relative_error(np.zeros(2), np.zeros(2)) == 0.0
    assert relative_error(np.ones(2), np.zeros(2)) == 1.0
    with pytest.raises(ValueError):
        relative_error(np.zeros(2), np.zeros(3))


def test_tensor_metadata(be):
    with Context(n_tensors=4) as ctx:
        t = ctx.new_tensor("f32", 8, 3, name="x")
        assert (t.ne, t.shape, t.ndim, t.type, t.nbytes, t.nelements) == ((8, 3, 1, 1), (3, 8), 2, "f32", 96, 24)
        assert t.nb == (4, 32, 96, 96) and t.is_contiguous and not t.is_allocated and t.op == "NONE"
        v = ctx.new_tensor(lib.GGML_TYPE_I32, 5)
        assert v.shape == (5,) and v.type == "i32" and v.name == ""
        v.name = "idx"
        assert ctx.get_tensor("idx") == v and hash(ctx.get_tensor("idx")) == hash(v) and v != t
        q = ctx.new_tensor("Q8_0", 64, 2, 1, 1)
        assert q.shape == (1, 1, 2, 64) and q.ndim == 4 and q.nbytes == 2 * 68
        assert [x.name for x in ctx.tensors()] == ["x", "idx", ""]
        assert "x" in repr(t) and ctx.used_mem > 0
        with Buffer.alloc_ctx_tensors(ctx, be) as buf:
            assert t.is_allocated and t.data_address != 0
            t.fill(0)
            np.testing.assert_array_equal(t.numpy(), 0)
            t.set_bytes(np.full(8, 1.5, np.float32), offset=8 * 4)
            np.testing.assert_array_equal(t.numpy()[1], 1.5)
            buf.clear(0)
            np.testing.assert_array_equal(t.numpy(), 0)
            assert buf.name and buf.backend is be
    assert repr(t) == "Tensor(<context closed>)"


# ============================================================================ contexts, arenas, graphs, gallocr


@pytest.mark.parametrize("kind", ["bytearray", "numpy"])
def test_context_with_caller_owned_arena(be, kind):
    size = 16 * 1024
    arena = bytearray(size) if kind == "bytearray" else np.zeros(size, np.uint8)
    addr = int(ffi.cast("uintptr_t", ffi.from_buffer(arena)))
    # metadata-only context: tensor headers live in the arena, their data in a backend buffer
    with Context(size, arena=arena) as ctx:
        assert ctx.mem_size == size and ctx.no_alloc
        x = ctx.new_tensor("f32", 4, 2)
        assert addr <= int(ffi.cast("uintptr_t", x.ptr)) < addr + size
        assert any(arena)  # ggml wrote its object headers into our memory
        with Buffer.alloc_ctx_tensors(ctx, be):
            x.set(np.arange(8, dtype=np.float32).reshape(2, 4))
            np.testing.assert_array_equal(x.numpy().ravel(), np.arange(8))
    # no_alloc=False: the tensor data is in the arena too
    arena2 = np.zeros(size, np.uint8)
    addr2 = int(ffi.cast("uintptr_t", ffi.from_buffer(arena2)))
    with Context(size, arena=arena2, no_alloc=False) as ctx:
        y = ctx.new_tensor("f32", 64)
        assert addr2 <= y.data_address < addr2 + size - 256
        # ... but only backend buffers are readable through this layer
        assert not y.is_allocated


def test_context_sizes():
    ctx = Context(n_tensors=3, graph_size=16)
    assert ctx.mem_size >= 3 * lib.ggml_tensor_overhead() + lib.ggml_graph_overhead_custom(16, False)
    Graph(ctx, 16)
    ctx.close()
    assert Context().mem_size >= 1024


def test_gallocr_recompute_with_new_inputs(be, rng):
    with Context(n_tensors=2) as ctx, Context(n_tensors=32, graph_size=32) as g:
        x = ctx.new_tensor("f32", 16, 4, name="x").set_input()
        w = ctx.new_tensor("f32", 16, 8, name="w")
        with Buffer.alloc_ctx_tensors(ctx, be):
            wv = rng.standard_normal((8, 16)).astype(np.float32)
            w.set(wv)
            graph = Graph(g, 32)
            out = graph.expand(g.silu(g.mul_mat(w, g.scale(x, 0.5))).set_output())
            assert graph.n_nodes == 3 and graph.node(-1) == out and [n.op for n in graph.nodes()] == ["SCALE", "MUL_MAT", "SILU"]
            with Gallocr(be) as galloc:
                galloc.reserve(graph)
                reserved = galloc.buffer_size
                galloc.alloc_graph(graph)
                assert galloc.n_allocs == 1 and galloc.buffer_size == reserved > 0
                results = []
                for step in range(3):
                    xv = rng.standard_normal((4, 16)).astype(np.float32)
                    x.set(xv)
                    graph.compute(be)
                    z = (0.5 * xv.astype(np.float64)) @ wv.T
                    np.testing.assert_allclose(out.numpy(), z / (1 + np.exp(-z)), rtol=1e-5, atol=1e-6)
                    results.append(out.numpy())
                    assert galloc.buffer_size == reserved
                assert not np.array_equal(results[0], results[1])
                galloc.alloc_graph(graph)  # allocating the same graph again changes nothing
                assert galloc.n_allocs == 2 and galloc.buffer_size == reserved
                be.compute(graph)
                np.testing.assert_array_equal(out.numpy(), results[-1])
                with pytest.raises(IndexError):
                    graph.node(3)


def test_gallocr_growth_detaches_older_graphs(be):
    """A bigger graph makes ggml free the allocator's buffer: older graphs must be re-allocated, not read freed memory."""
    with Context(n_tensors=2) as ctx, Context(n_tensors=8, graph_size=8) as g1, Context(n_tensors=8, graph_size=8) as g2:
        a = ctx.new_tensor("f32", 4, 2)
        big = ctx.new_tensor("f32", 4096, 16)
        with Buffer.alloc_ctx_tensors(ctx, be), Gallocr(be) as galloc:
            a.set(np.ones((2, 4), np.float32))
            big.set(np.ones((16, 4096), np.float32))
            graph1 = Graph(g1, 8)
            out1 = graph1.expand(g1.scale(a, 2.0))
            galloc.alloc_graph(graph1)
            graph1.compute(be)
            small = galloc.buffer_size
            graph2 = Graph(g2, 8)
            out2 = graph2.expand(g2.scale(g2.add(big, big), 3.0))
            galloc.alloc_graph(graph2)
            assert galloc.buffer_size > small
            graph2.compute(be)
            np.testing.assert_array_equal(out2.numpy(), 6.0)
            with pytest.raises(GGMLError):
                out1.numpy()
            with pytest.raises(GGMLError):
                graph1.compute(be)
            galloc.alloc_graph(graph1)  # placed again, in the new buffer
            graph1.compute(be)
            np.testing.assert_array_equal(out1.numpy(), 2.0)


def test_close_is_idempotent_and_live_objects_balance(be):
    gc.collect()
    before = live_objects()
    backend = Backend("cpu", n_threads=1)
    ctx = Context(n_tensors=1)
    t = ctx.new_tensor("f32", 4)
    buf = Buffer.alloc_ctx_tensors(ctx, backend)
    g = Context(n_tensors=4, graph_size=4)
    graph = Graph(g, 4)
    graph.expand(g.scale(t, 2.0))
    galloc = Gallocr(backend)
    galloc.alloc_graph(graph)
    now = live_objects()
    for kind, extra in (("backend", 1), ("context", 2), ("buffer", 1), ("gallocr", 1)):
        assert now.get(kind, 0) == before.get(kind, 0) + extra, (kind, now, before)
    for obj in (galloc, g, buf, ctx, backend):
        obj.close()
        assert obj.closed
        obj.close()
    assert {k: v for k, v in live_objects().items() if v} == {k: v for k, v in before.items() if v}
    # the garbage collector frees what was never closed
    with Context(n_tensors=1):
        pass
    Context(n_tensors=1)
    gc.collect()
    assert {k: v for k, v in live_objects().items() if v} == {k: v for k, v in before.items() if v}


# ============================================================================ error paths, in child processes

PRELUDE = r'''
import gc, json, sys
import numpy as np
from pyggml_dkv.ggml import (Backend, BackendUnavailableError, Buffer, Context, Gallocr, GGMLError, Graph,
                             live_objects)
from pyggml_dkv._lowlevel import lib

BE = Backend("cpu", n_threads=1)
NEOX = lib.GGML_ROPE_TYPE_NEOX
META = Context(n_tensors=2048)  # unallocated tensors for graph-building checks
G = Context(n_tensors=2048)


def T(ty, *ne):
    return META.new_tensor(ty, *ne)


def inputs(*specs):
    """A context with one tensor per (type, *ne) spec, all allocated (zeroed) in one Buffer."""
    ctx = Context(n_tensors=len(specs) + 4)
    ts = [ctx.new_tensor(*s) for s in specs]
    buf = Buffer.alloc_ctx_tensors(ctx, BE)
    buf.clear(0)
    return (ctx, buf, *ts)


def graph_ctx(n=64):
    return Context(n_tensors=n, graph_size=n)


def run(g, *outs, galloc=None, size=64):
    graph = Graph(g, size)
    for o in outs:
        graph.expand(o)
    galloc = galloc or Gallocr(BE)
    galloc.alloc_graph(graph)
    graph.compute(BE)
    return graph, galloc


def scaled_graph():
    """An input a = 1 in a Buffer and a computed graph out = 2a: (ctx, buf, a, g, graph, galloc, out)."""
    ctx, buf, a = inputs(("f32", 4, 2))
    a.set(np.ones((2, 4), np.float32))
    g = graph_ctx()
    out = g.scale(a, 2.0)
    graph, galloc = run(g, out)
    assert (out.numpy() == 2).all()
    return ctx, buf, a, g, graph, galloc, out
'''

CHILD = PRELUDE + r'''
cases = json.loads(sys.stdin.read())
for name, code in cases:
    print("START", name, flush=True)
    try:
        exec(code, dict(globals()))
    except BaseException as e:  # noqa: BLE001 - report whatever it was
        msg = " ".join(str(e).split())[:300]
        print("RESULT", name, type(e).__name__, msg, flush=True)
    else:
        print("RESULT", name, "NOERROR", flush=True)
'''


def run_isolated(cases: dict[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
    """Run every case's code in a child process; a case that kills its child is reported as CRASH
    and the remaining cases continue in a fresh child. Returns name -> (exception name, message)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    results: dict[str, tuple[str, str]] = {}
    pending = [(name, textwrap.dedent(code)) for name, (_, code) in cases.items()]
    while pending:
        proc = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(pending), capture_output=True,
                              text=True, timeout=300, env=env, cwd=str(ROOT))
        started = None
        for line in proc.stdout.splitlines():
            if line.startswith("START "):
                started = line.split(" ", 1)[1]
            elif line.startswith("RESULT "):
                _, name, exc, *msg = line.split(" ", 3)
                results[name] = (exc, msg[0] if msg else "")
                started = None
        if proc.returncode != 0 or started is not None:
            victim = started if started is not None else next(n for n, _ in pending if n not in results)
            tail = " | ".join(proc.stderr.strip().splitlines()[-6:])
            results[victim] = (f"CRASH(rc={proc.returncode})", tail)
        pending = [(n, c) for n, c in pending if n not in results]
    return results


# name -> (expected exception type name, code); the last statement is the one that must raise
TENSOR_CASES: dict[str, tuple[str, str]] = {
    "set_wrong_shape": ("ValueError", 'ctx, buf, t = inputs(("f32", 4, 3)); t.set(np.zeros((4, 3), np.float32))'),
    "set_wrong_ndim": ("ValueError", 'ctx, buf, t = inputs(("f32", 4, 3)); t.set(np.zeros(12, np.float32))'),
    "set_scalar": ("ValueError", 'ctx, buf, t = inputs(("f32", 1)); t.set(1.0)'),
    "set_int_into_f32": ("TypeError", 'ctx, buf, t = inputs(("f32", 4)); t.set(np.arange(4))'),
    "set_int_into_bf16": ("TypeError", 'ctx, buf, t = inputs(("bf16", 4)); t.set(np.arange(4))'),
    "set_int_into_q8_0": ("TypeError", 'ctx, buf, t = inputs(("q8_0", 32)); t.set(np.arange(32))'),
    "set_complex_into_f32": ("TypeError", 'ctx, buf, t = inputs(("f32", 2)); t.set(np.ones(2, np.complex64))'),
    "set_float_into_i32": ("TypeError", 'ctx, buf, t = inputs(("i32", 4)); t.set(np.zeros(4, np.float32))'),
    "set_bool_into_i32": ("TypeError", 'ctx, buf, t = inputs(("i32", 2)); t.set(np.array([True, False]))'),
    "set_i8_out_of_range": ("ValueError", 'ctx, buf, t = inputs(("i8", 4)); t.set(np.array([1, 2, 3, 300]))'),
    "set_i32_out_of_range": ("ValueError", 'ctx, buf, t = inputs(("i32", 2)); t.set(np.array([0, 2**40]))'),
    "set_i32_negative_out_of_range": ("ValueError", 'ctx, buf, t = inputs(("i32", 2)); t.set(np.array([0, -2**31 - 1]))'),
    "set_i64_from_huge_uint64": ("ValueError", 'ctx, buf, t = inputs(("i64", 1)); t.set(np.array([2**64 - 1], np.uint64))'),
    "set_unallocated": ("GGMLError", 'ctx = Context(n_tensors=1); t = ctx.new_tensor("f32", 4); t.set(np.zeros(4, np.float32))'),
    "numpy_unallocated": ("GGMLError", 'ctx = Context(n_tensors=1); t = ctx.new_tensor("f32", 4); t.numpy()'),
    "fill_unallocated": ("GGMLError", 'ctx = Context(n_tensors=1); t = ctx.new_tensor("f32", 4); t.fill(0)'),
    "set_bytes_unallocated": ("GGMLError", 'ctx = Context(n_tensors=1); t = ctx.new_tensor("f32", 4); t.set_bytes(np.zeros(4, np.uint8))'),
    "set_noncontiguous_view": ("GGMLError", """
        ctx = Context(n_tensors=2)
        t = ctx.new_tensor("f32", 4, 3)
        v = ctx.permute(t, 1, 0, 2, 3)
        buf = Buffer.alloc_ctx_tensors(ctx, BE)
        assert t.is_allocated and v.is_allocated and not v.is_contiguous and v.shape == (4, 3)
        v.set(np.zeros((4, 3), np.float32))"""),
    "numpy_noncontiguous_view": ("GGMLError", """
        ctx = Context(n_tensors=2)
        t = ctx.new_tensor("f32", 4, 3)
        v = ctx.view(t, (2, 3), (16,), 4)
        buf = Buffer.alloc_ctx_tensors(ctx, BE)
        assert v.is_allocated and not v.is_contiguous
        v.numpy()"""),
    "set_bytes_past_end": ("ValueError", 'ctx, buf, t = inputs(("f32", 4)); t.set_bytes(np.zeros(16, np.uint8), offset=8)'),
    "set_bytes_negative_offset": ("ValueError", 'ctx, buf, t = inputs(("f32", 4)); t.set_bytes(np.zeros(4, np.uint8), offset=-4)'),
    "name_too_long": ("ValueError", 'ctx = Context(n_tensors=1); t = ctx.new_tensor("f32", 4); t.name = "x" * 200'),
    "new_tensor_zero_dim": ("ValueError", 'Context(n_tensors=1).new_tensor("f32", 4, 0)'),
    "new_tensor_negative_dim": ("ValueError", 'Context(n_tensors=1).new_tensor("f32", -4)'),
    "new_tensor_no_dims": ("ValueError", 'Context(n_tensors=1).new_tensor("f32")'),
    "new_tensor_five_dims": ("ValueError", 'Context(n_tensors=1).new_tensor("f32", 1, 1, 1, 1, 1)'),
    "new_tensor_float_dim": ("ValueError", 'Context(n_tensors=1).new_tensor("f32", 4.0)'),
    "new_tensor_bool_dim": ("ValueError", 'Context(n_tensors=1).new_tensor("f32", True)'),
    "new_tensor_huge": ("ValueError", 'Context(n_tensors=1).new_tensor("f32", 2**31, 2**31, 2**10)'),
    "new_tensor_block_size": ("ValueError", 'Context(n_tensors=1).new_tensor("q8_0", 33)'),
    "new_tensor_unknown_type": ("ValueError", 'Context(n_tensors=1).new_tensor("f8", 4)'),
    "new_tensor_bad_type_id": ("ValueError", 'Context(n_tensors=1).new_tensor(999, 4)'),
    "get_tensor_missing": ("KeyError", 'Context(n_tensors=1).get_tensor("nope")'),
    "context_full": ("GGMLError", """
        ctx = Context(n_tensors=2)
        made = []
        try:
            for _ in range(100):
                made.append(ctx.new_tensor("f32", 4))
        finally:
            assert len(made) >= 2, len(made)"""),
    "tiny_context": ("GGMLError", 'Context(mem_size=16).new_tensor("f32", 1)'),
    "tiny_arena_context": ("GGMLError", 'Context(mem_size=256, arena=np.zeros(256, np.uint8)).new_tensor("f32", 1)'),
    "context_full_of_views": ("GGMLError", """
        ctx = Context(n_tensors=2)
        t = ctx.new_tensor("f32", 4)
        for _ in range(100):
            ctx.view(t, (2,))"""),
    "context_full_with_data": ("GGMLError", """
        ctx = Context(mem_size=4096, no_alloc=False)
        ctx.new_tensor("f32", 512)  # 2 KiB of data in the context
        ctx.new_tensor("f32", 512)"""),
    "graph_context_full": ("GGMLError", """
        ctx, buf, a = inputs(("f32", 4))
        g = Context(n_tensors=3)
        x = a
        for _ in range(10):
            x = g.scale(x, 1.0)"""),
    "op_needing_data_in_alloc_context": ("GGMLError", """
        ctx = Context(mem_size=1 << 16, no_alloc=False)
        a = ctx.new_tensor("f32", 1024)
        ctx.add(a, a)"""),
    "mem_size_zero": ("ValueError", "Context(mem_size=0)"),
    "mem_size_float": ("ValueError", "Context(mem_size=1024.0)"),
    "n_tensors_negative": ("ValueError", "Context(n_tensors=-1)"),
    "arena_too_small": ("ValueError", "Context(mem_size=4096, arena=bytearray(1024))"),
    "arena_read_only": ("ValueError", "Context(mem_size=1024, arena=bytes(1024))"),
    "arena_misaligned": ("ValueError", "Context(mem_size=4096, arena=np.zeros(4096 + 64, np.uint8)[1:])"),
    "arena_not_a_buffer": ("TypeError", "Context(mem_size=1024, arena=[0] * 1024)"),
    "graph_without_room": ("GGMLError", "Graph(Context(n_tensors=4), 64)"),
    "graph_bigger_than_room": ("GGMLError", "Graph(Context(n_tensors=4, graph_size=16), 64)"),
    "second_graph_without_room": ("GGMLError", "g = Context(graph_size=16); Graph(g, 16); Graph(g, 16)"),
    "graph_size_zero": ("ValueError", "Graph(graph_ctx(), 0)"),
    "graph_size_float": ("ValueError", "Graph(graph_ctx(), 8.0)"),
    "graph_too_large_for_size": ("GGMLError", """
        ctx, buf, a = inputs(("f32", 4))
        g = graph_ctx(64)
        graph = Graph(g, 8)
        x = a
        for _ in range(20):
            x = g.scale(x, 1.0)
        graph.expand(x)"""),
    "graph_fills_up_across_expands": ("GGMLError", """
        ctx, buf, a = inputs(("f32", 4))
        g = graph_ctx(64)
        graph = Graph(g, 6)
        x = a
        for _ in range(20):
            x = graph.expand(g.scale(x, 1.0))"""),
    "alloc_empty_graph": ("GGMLError", "Gallocr(BE).alloc_graph(Graph(graph_ctx(), 8))"),
    "compute_empty_graph": ("GGMLError", "Graph(graph_ctx(), 8).compute(BE)"),
    "compute_unallocated_graph": ("GGMLError", """
        ctx, buf, a = inputs(("f32", 4))
        g = graph_ctx()
        graph = Graph(g, 8)
        graph.expand(g.scale(a, 2.0))
        graph.compute(BE)"""),
    "compute_with_unallocated_input": ("GGMLError", """
        ctx, buf, a = inputs(("f32", 4))
        other = Context(n_tensors=1)
        b = other.new_tensor("f32", 4)
        g = graph_ctx()
        graph = Graph(g, 8)
        graph.expand(g.add(a, b))
        graph.compute(BE)"""),
}

OP_CASES: dict[str, tuple[str, str]] = {
    # mul_mat
    "mul_mat_k_mismatch": ("ValueError", 'G.mul_mat(T("f32", 8, 4), T("f32", 16, 2))'),
    "mul_mat_batch_mismatch": ("ValueError", 'G.mul_mat(T("f32", 8, 4, 3), T("f32", 8, 2, 4))'),
    "mul_mat_transposed_a": ("ValueError", 'G.mul_mat(G.permute(T("f32", 4, 8), 1, 0, 2, 3), T("f32", 8, 2))'),
    "mul_mat_transposed_b": ("ValueError", 'G.mul_mat(T("f32", 8, 4), G.permute(T("f32", 2, 8), 1, 0, 2, 3))'),
    "mul_mat_int_a": ("ValueError", 'G.mul_mat(T("i32", 8, 4), T("f32", 8, 2))'),
    "mul_mat_f16_b_with_q8_a": ("ValueError", 'G.mul_mat(T("q8_0", 32, 4), T("f16", 32, 2))'),
    "mul_mat_i32_b": ("ValueError", 'G.mul_mat(T("f32", 8, 4), T("i32", 8, 2))'),
    # broadcasting elementwise
    "add_broadcast_mismatch": ("ValueError", 'G.add(T("f32", 8, 3), T("f32", 3))'),
    "add_b_larger_than_a": ("ValueError", 'G.add(T("f32", 8), T("f32", 8, 3))'),
    "mul_broadcast_mismatch": ("ValueError", 'G.mul(T("f32", 8, 4, 2), T("f32", 8, 3))'),
    "sub_broadcast_mismatch": ("ValueError", 'G.sub(T("f32", 8, 4), T("f32", 8, 1, 2))'),
    "add_int_types": ("ValueError", 'G.add(T("i32", 4), T("i32", 4))'),
    "add_f32_plus_f16": ("ValueError", 'G.add(T("f32", 4), T("f16", 4))'),
    "add_transposed_a": ("ValueError", 'G.add(G.permute(T("f32", 4, 8), 1, 0, 2, 3), T("f32", 8))'),
    # unary
    "silu_transposed": ("ValueError", 'G.silu(G.permute(T("f32", 4, 3), 1, 0, 2, 3))'),
    "tanh_transposed": ("ValueError", 'G.tanh(G.permute(T("f32", 4, 3), 1, 0, 2, 3))'),
    "silu_int": ("ValueError", 'G.silu(T("i32", 4))'),
    "softplus_q8": ("ValueError", 'G.softplus(T("q8_0", 32))'),
    "scale_permuted": ("ValueError", 'G.scale(G.permute(T("f32", 4, 3, 2), 0, 2, 1, 3), 2.0)'),
    "scale_f16": ("ValueError", 'G.scale(T("f16", 4), 2.0)'),
    "scale_nan": ("ValueError", 'G.scale(T("f32", 4), float("nan"))'),
    "scale_string": ("ValueError", 'G.scale(T("f32", 4), "2")'),
    "rms_norm_negative_eps": ("ValueError", 'G.rms_norm(T("f32", 4), -1e-6)'),
    "rms_norm_inf_eps": ("ValueError", 'G.rms_norm(T("f32", 4), float("inf"))'),
    "rms_norm_f16": ("ValueError", 'G.rms_norm(T("f16", 4), 1e-6)'),
    "rms_norm_transposed": ("ValueError", 'G.rms_norm(G.permute(T("f32", 4, 3), 1, 0, 2, 3), 1e-6)'),
    "argmax_3d": ("ValueError", 'G.argmax(T("f32", 4, 3, 2))'),
    "argmax_f16": ("ValueError", 'G.argmax(T("f16", 4, 3))'),
    "soft_max_permuted": ("ValueError", 'G.soft_max_ext(G.permute(T("f32", 4, 3, 2), 0, 2, 1, 3), None, 1.0)'),
    "soft_max_max_bias_without_mask": ("ValueError", 'G.soft_max_ext(T("f32", 4, 3), None, 1.0, 0.5)'),
    "soft_max_mask_too_short": ("ValueError", 'G.soft_max_ext(T("f32", 4, 3), T("f16", 4, 2), 1.0)'),
    "soft_max_mask_i32": ("ValueError", 'G.soft_max_ext(T("f32", 4, 3), T("i32", 4, 3), 1.0)'),
    "soft_max_mask_heads": ("ValueError", 'G.soft_max_ext(T("f32", 4, 3, 3), T("f16", 4, 3, 2), 1.0)'),
    # rope
    "rope_pos_f32": ("ValueError", 'G.rope_ext(T("f32", 16, 2, 5), T("f32", 5), 16, NEOX, 0, 10000.0)'),
    "rope_pos_i64": ("ValueError", 'G.rope_ext(T("f32", 16, 2, 5), T("i64", 5), 16, NEOX, 0, 10000.0)'),
    "rope_pos_too_short": ("ValueError", 'G.rope_ext(T("f32", 16, 2, 5), T("i32", 4), 16, NEOX, 0, 10000.0)'),
    "rope_pos_too_long": ("ValueError", 'G.rope_ext(T("f32", 16, 2, 5), T("i32", 6), 16, NEOX, 0, 10000.0)'),
    "rope_pos_matrix": ("ValueError", 'G.rope_ext(T("f32", 16, 2, 5), T("i32", 5, 2), 16, NEOX, 0, 10000.0)'),
    "rope_odd_n_dims": ("ValueError", 'G.rope_ext(T("f32", 16, 2, 5), T("i32", 5), 15, NEOX, 0, 10000.0)'),
    "rope_n_dims_too_big": ("ValueError", 'G.rope_ext(T("f32", 16, 2, 5), T("i32", 5), 32, NEOX, 0, 10000.0)'),
    "rope_mode_1": ("ValueError", 'G.rope_ext(T("f32", 16, 2, 5), T("i32", 5), 16, 1, 0, 10000.0)'),
    "rope_mode_mrope": ("ValueError", 'G.rope_ext(T("f32", 16, 2, 5), T("i32", 5), 16, 8, 0, 10000.0)'),
    "rope_int_input": ("ValueError", 'G.rope_ext(T("i32", 16, 2, 5), T("i32", 5), 16, NEOX, 0, 10000.0)'),
    "rope_nan_base": ("ValueError", 'G.rope_ext(T("f32", 16, 2, 5), T("i32", 5), 16, NEOX, 0, float("nan"))'),
    "rope_freq_factors_short": ("ValueError", 'G.rope_ext(T("f32", 16, 2, 5), T("i32", 5), 16, NEOX, 0, 1e4, freq_factors=T("f32", 4))'),
    # flash attention: q [32, 4 queries, 4 heads, 1], k/v [32, 10 rows, 2 heads, 1]
    "fa_mask_f32": ("ValueError", 'G.flash_attn_ext(T("f32", 32, 4, 4, 1), T("f16", 32, 10, 2, 1), T("f16", 32, 10, 2, 1), T("f32", 10, 4), 0.1)'),
    "fa_mask_wrong_kv_len": ("ValueError", 'G.flash_attn_ext(T("f32", 32, 4, 4, 1), T("f16", 32, 10, 2, 1), T("f16", 32, 10, 2, 1), T("f16", 12, 4), 0.1)'),
    "fa_mask_too_few_rows": ("ValueError", 'G.flash_attn_ext(T("f32", 32, 4, 4, 1), T("f16", 32, 10, 2, 1), T("f16", 32, 10, 2, 1), T("f16", 10, 2), 0.1)'),
    "fa_mask_heads": ("ValueError", 'G.flash_attn_ext(T("f32", 32, 4, 4, 1), T("f16", 32, 10, 2, 1), T("f16", 32, 10, 2, 1), T("f16", 10, 4, 3), 0.1)'),
    "fa_mask_noncontiguous": ("ValueError", 'G.flash_attn_ext(T("f32", 32, 4, 4, 1), T("f16", 32, 10, 2, 1), T("f16", 32, 10, 2, 1), G.permute(T("f16", 4, 10), 1, 0, 2, 3), 0.1)'),
    "fa_head_dim_mismatch": ("ValueError", 'G.flash_attn_ext(T("f32", 32, 4, 4, 1), T("f16", 16, 10, 2, 1), T("f16", 16, 10, 2, 1), None, 0.1)'),
    "fa_heads_not_multiple": ("ValueError", 'G.flash_attn_ext(T("f32", 32, 4, 3, 1), T("f16", 32, 10, 2, 1), T("f16", 32, 10, 2, 1), None, 0.1)'),
    "fa_kv_rows_differ": ("ValueError", 'G.flash_attn_ext(T("f32", 32, 4, 4, 1), T("f16", 32, 10, 2, 1), T("f16", 32, 9, 2, 1), None, 0.1)'),
    "fa_kv_heads_differ": ("ValueError", 'G.flash_attn_ext(T("f32", 32, 4, 4, 1), T("f16", 32, 10, 2, 1), T("f16", 32, 10, 1, 1), None, 0.1)'),
    "fa_ne3_differ": ("ValueError", 'G.flash_attn_ext(T("f32", 32, 4, 4, 2), T("f16", 32, 10, 2, 1), T("f16", 32, 10, 2, 1), None, 0.1)'),
    "fa_max_bias_without_mask": ("ValueError", 'G.flash_attn_ext(T("f32", 32, 4, 4, 1), T("f16", 32, 10, 2, 1), T("f16", 32, 10, 2, 1), None, 0.1, max_bias=1.0)'),
    "fa_scale_inf": ("ValueError", 'G.flash_attn_ext(T("f32", 32, 4, 4, 1), T("f16", 32, 10, 2, 1), T("f16", 32, 10, 2, 1), None, float("inf"))'),
    # rows
    "set_rows_index_f32": ("ValueError", 'G.set_rows(T("f32", 8, 6), T("f32", 8, 2), T("f32", 2))'),
    "set_rows_index_i16": ("ValueError", 'G.set_rows(T("f32", 8, 6), T("f32", 8, 2), T("i16", 2))'),
    "set_rows_source_f16": ("ValueError", 'G.set_rows(T("f32", 8, 6), T("f16", 8, 2), T("i32", 2))'),
    "set_rows_width_mismatch": ("ValueError", 'G.set_rows(T("f32", 8, 6), T("f32", 4, 2), T("i32", 2))'),
    "set_rows_count_mismatch": ("ValueError", 'G.set_rows(T("f32", 8, 6), T("f32", 8, 2), T("i32", 3))'),
    "set_rows_transposed_source": ("ValueError", 'G.set_rows(T("f32", 2, 6), G.permute(T("f32", 2, 2), 1, 0, 2, 3), T("i32", 2))'),
    "get_rows_index_i64": ("ValueError", 'G.get_rows(T("f32", 8, 6), T("i64", 3))'),
    "get_rows_index_f32": ("ValueError", 'G.get_rows(T("f32", 8, 6), T("f32", 3))'),
    "get_rows_batch_mismatch": ("ValueError", 'G.get_rows(T("f32", 8, 6, 2), T("i32", 3))'),
    "get_rows_f64_data": ("ValueError", 'G.get_rows(T("f64", 8, 6), T("i32", 3))'),
    # layout
    "reshape_element_count": ("ValueError", 'G.reshape(T("f32", 8, 3), 5, 5)'),
    "reshape_noncontiguous": ("ValueError", 'G.reshape(G.permute(T("f32", 8, 3), 1, 0, 2, 3), 24, 1)'),
    "reshape_one_dim": ("ValueError", 'G.reshape(T("f32", 8, 3), 24)'),
    "permute_repeated_axis": ("ValueError", 'G.permute(T("f32", 8, 3), 0, 0, 1, 2)'),
    "permute_axis_out_of_range": ("ValueError", 'G.permute(T("f32", 8, 3), 0, 1, 2, 4)'),
    "permute_negative_axis": ("ValueError", 'G.permute(T("f32", 8, 3), -1, 0, 1, 2)'),
    "view_out_of_bounds": ("ValueError", 'G.view(T("f32", 8, 3), (8, 3), offset=4)'),
    "view_too_many_rows": ("ValueError", 'G.view(T("f32", 8, 3), (8, 4))'),
    "view_overlapping_strides": ("ValueError", 'G.view(T("f32", 16), (8, 4), (4,), 0)'),
    "view_of_view_past_base": ("ValueError", 't = T("f32", 16); v = G.view(t, (8,), offset=32); G.view(v, (4, 2), (8,), 4)'),
    "view_negative_offset": ("ValueError", 'G.view(T("f32", 8), (4,), offset=-4)'),
    "view_zero_dim": ("ValueError", 'G.view(T("f32", 8), (0,))'),
    "view_five_dims": ("ValueError", 'G.view(T("f32", 8), (1, 1, 1, 1, 1))'),
    "view_stride_count": ("ValueError", 'G.view(T("f32", 8, 2), (4, 2), (16, 32))'),
    "view_quantized_partial_block": ("ValueError", 'G.view(T("q8_0", 64), (16,))'),
    "concat_type_mismatch": ("ValueError", 'G.concat(T("f32", 4, 3), T("f16", 4, 3), 1)'),
    "concat_bad_dim": ("ValueError", 'G.concat(T("f32", 4, 3), T("f32", 4, 3), 4)'),
    "concat_shape_mismatch": ("ValueError", 'G.concat(T("f32", 4, 3), T("f32", 5, 3), 1)'),
    "cpy_count_mismatch": ("ValueError", 'G.cpy(T("f32", 4, 3), T("f32", 4, 2))'),
    "cpy_i32_to_f16": ("ValueError", 'G.cpy(T("i32", 4), T("f16", 4))'),
    "cast_int_to_f16": ("ValueError", 'G.cast(T("i32", 4, 3), "f16")'),
    "cast_f16_to_i32": ("ValueError", 'G.cast(T("f16", 4, 3), "i32")'),
    "cast_q8_to_f16": ("ValueError", 'G.cast(T("q8_0", 32, 3), "f16")'),
    "cast_partial_block": ("ValueError", 'G.cast(T("f32", 10, 3), "q8_0")'),
    "cast_transposed_to_q8": ("ValueError", 'G.cast(G.permute(T("f32", 32, 32), 1, 0, 2, 3), "q8_0")'),
    "cast_unknown_type": ("ValueError", 'G.cast(T("f32", 4), "f8")'),
    # closed contexts
    "op_on_tensor_of_closed_context": ("GGMLError", 'c = Context(n_tensors=1); t = c.new_tensor("f32", 4); c.close(); G.scale(t, 2.0)'),
    "op_in_closed_context": ("GGMLError", 'g = Context(n_tensors=4); g.close(); g.scale(T("f32", 4), 2.0)'),
}

LIFECYCLE_CASES: dict[str, tuple[str, str]] = {
    "compute_after_buffer_closed": ("GGMLError", """
        ctx, buf, a, g, graph, galloc, out = scaled_graph()
        buf.close()
        graph.compute(BE)"""),
    "compute_after_buffer_closed_and_address_reused": ("GGMLError", """
        ctx, buf, a, g, graph, galloc, out = scaled_graph()
        buf.close()
        others = [inputs(("f32", 4, 2)) for _ in range(4)]  # malloc hands the freed address out again
        graph.compute(BE)"""),
    "read_after_buffer_closed": ("GGMLError", """
        ctx, buf, a = inputs(("f32", 4))
        buf.close()
        others = [inputs(("f32", 4)) for _ in range(4)]
        a.numpy()"""),
    "write_after_buffer_closed": ("GGMLError", """
        ctx, buf, a = inputs(("f32", 4))
        buf.close()
        a.set(np.zeros(4, np.float32))"""),
    "read_view_after_buffer_closed": ("GGMLError", """
        ctx, buf, a = inputs(("f32", 4))
        v = G.view(a, (2,), offset=8)
        buf.close()
        others = [inputs(("f32", 4)) for _ in range(4)]
        v.numpy()"""),
    "buffer_dropped_without_a_reference": ("GGMLError", """
        ctx = Context(n_tensors=1)
        t = ctx.new_tensor("f32", 4)
        Buffer.alloc_ctx_tensors(ctx, BE)  # not kept: garbage-collected at once
        gc.collect()
        t.set(np.zeros(4, np.float32))"""),
    "buffer_again_after_close": ("NOERROR", """
        ctx, buf, a = inputs(("f32", 4))
        buf.close()
        buf2 = Buffer.alloc_ctx_tensors(ctx, BE)
        a.set(np.arange(4, dtype=np.float32))
        assert (a.numpy() == np.arange(4)).all()"""),
    "closed_buffer_properties": ("GGMLError", "ctx, buf, a = inputs(('f32', 4)); buf.close(); buf.close(); buf.size"),
    "compute_after_gallocr_closed": ("GGMLError", """
        ctx, buf, a, g, graph, galloc, out = scaled_graph()
        galloc.close()
        graph.compute(BE)"""),
    "read_output_after_gallocr_closed": ("GGMLError", """
        ctx, buf, a, g, graph, galloc, out = scaled_graph()
        galloc.close()
        others = [scaled_graph() for _ in range(3)]
        out.numpy()"""),
    "gallocr_kept_alive_by_its_graph": ("NOERROR", """
        ctx, buf, a = inputs(("f32", 4))
        a.set(np.ones(4, np.float32))
        g = graph_ctx()
        graph = Graph(g, 8)
        out = graph.expand(g.scale(a, 2.0))
        Gallocr(BE).alloc_graph(graph)  # not kept by the caller: the graph keeps it
        gc.collect()
        others = [scaled_graph() for _ in range(3)]
        graph.compute(BE)
        assert (out.numpy() == 2).all()"""),
    "gallocr_again_after_close": ("NOERROR", """
        ctx, buf, a, g, graph, galloc, out = scaled_graph()
        galloc.close()
        with Gallocr(BE) as galloc2:
            galloc2.alloc_graph(graph)
            graph.compute(BE)
            assert (out.numpy() == 2).all()"""),
    "stale_graph_after_gallocr_growth": ("GGMLError", """
        ctx, buf, a, g, graph, galloc, out = scaled_graph()
        ctx2, buf2, big = inputs(("f32", 4096, 16))
        g2 = graph_ctx()
        run(g2, g2.add(big, big), galloc=galloc)
        others = [scaled_graph() for _ in range(3)]
        graph.compute(BE)"""),
    "stale_output_after_gallocr_growth": ("GGMLError", """
        ctx, buf, a, g, graph, galloc, out = scaled_graph()
        ctx2, buf2, big = inputs(("f32", 4096, 16))
        g2 = graph_ctx()
        run(g2, g2.add(big, big), galloc=galloc)
        out.numpy()"""),
    "growing_a_graph_after_allocation": ("NOERROR", """
        ctx, buf, a, g, graph, galloc, out = scaled_graph()
        ctx2, buf2, big = inputs(("f32", 4096, 16))
        big.set(np.ones((16, 4096), np.float32))
        out2 = graph.expand(g.scale(big, 3.0))  # more nodes after allocation: the buffer must grow
        galloc.alloc_graph(graph)
        graph.compute(BE)
        assert (out.numpy() == 2).all() and (out2.numpy() == 3).all()"""),
    "reserve_growth_detaches": ("GGMLError", """
        ctx, buf, a, g, graph, galloc, out = scaled_graph()
        ctx2, buf2, big = inputs(("f32", 4096, 16))
        g2 = graph_ctx()
        graph2 = Graph(g2, 8)
        graph2.expand(g2.add(big, big))
        galloc.reserve(graph2)
        graph.compute(BE)"""),
    "compute_after_graph_context_closed": ("GGMLError", """
        ctx, buf, a, g, graph, galloc, out = scaled_graph()
        g.close()
        graph.compute(BE)"""),
    "compute_after_input_context_closed": ("GGMLError", """
        ctx, buf, a, g, graph, galloc, out = scaled_graph()
        ctx.close()
        graph.compute(BE)"""),
    "alloc_after_input_context_closed": ("GGMLError", """
        ctx, buf, a = inputs(("f32", 4))
        g = graph_ctx()
        graph = Graph(g, 8)
        graph.expand(g.scale(a, 2.0))
        ctx.close()
        Gallocr(BE).alloc_graph(graph)"""),
    "expand_after_context_closed": ("GGMLError", """
        ctx, buf, a = inputs(("f32", 4))
        g = graph_ctx()
        graph = Graph(g, 8)
        t = g.scale(a, 2.0)
        ctx.close()
        graph.expand(t)"""),
    "tensor_after_context_closed": ("GGMLError", 'c = Context(n_tensors=1); t = c.new_tensor("f32", 4); c.close(); t.ne'),
    "tensor_name_after_context_closed": ("GGMLError", 'c = Context(n_tensors=1); t = c.new_tensor("f32", 4); c.close(); t.name = "x"'),
    "new_tensor_after_context_closed": ("GGMLError", 'c = Context(n_tensors=1); c.close(); c.close(); c.new_tensor("f32", 4)'),
    "graph_in_closed_context": ("GGMLError", "g = graph_ctx(); g.close(); Graph(g, 8)"),
    "compute_on_closed_backend": ("GGMLError", """
        ctx, buf, a, g, graph, galloc, out = scaled_graph()
        other = Backend("cpu")
        other.close()
        graph.compute(other)"""),
    "gallocr_on_closed_backend": ("GGMLError", 'b = Backend("cpu"); b.close(); Gallocr(b)'),
    "buffer_on_closed_backend": ("GGMLError", 'c = Context(n_tensors=1); c.new_tensor("f32", 4); b = Backend("cpu"); b.close(); Buffer.alloc_ctx_tensors(c, b)'),
    "alloc_ctx_tensors_twice": ("GGMLError", "ctx, buf, a = inputs(('f32', 4)); Buffer.alloc_ctx_tensors(ctx, BE)"),
    "alloc_ctx_tensors_of_data_context": ("GGMLError", 'c = Context(mem_size=4096, no_alloc=False); c.new_tensor("f32", 4); Buffer.alloc_ctx_tensors(c, BE)'),
    "buffer_size_zero": ("ValueError", "Buffer.alloc(BE, 0)"),
    "closed_backend_threads": ("GGMLError", 'b = Backend("cpu"); b.close(); b.set_n_threads(2)'),
    "live_objects_balance": ("NOERROR", """
        gc.collect()
        before = {k: v for k, v in live_objects().items() if v}
        for _ in range(3):
            parts = scaled_graph()
            for obj in reversed(parts):
                if hasattr(obj, "close"):
                    obj.close()
        del parts
        gc.collect()
        after = {k: v for k, v in live_objects().items() if v}
        assert after == before, (before, after)"""),
}


@pytest.fixture(scope="module")
def isolated_results():
    cache: dict[str, dict[str, tuple[str, str]]] = {}

    def get(group: str, cases: dict[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
        if group not in cache:
            cache[group] = run_isolated(cases)
        return cache[group]

    return get


def _check(results: dict[str, tuple[str, str]], cases: dict[str, tuple[str, str]], name: str) -> None:
    expected = cases[name][0]
    got, msg = results[name]
    assert not got.startswith("CRASH"), f"{name}: the process died (ggml abort?): {msg}"
    assert got == expected, f"{name}: expected {expected}, got {got}: {msg}"
    if expected != "NOERROR":
        assert msg, f"{name}: {got} without a message"


@pytest.mark.parametrize("name", list(TENSOR_CASES))
def test_tensor_and_context_errors(isolated_results, name):
    _check(isolated_results("tensor", TENSOR_CASES), TENSOR_CASES, name)


@pytest.mark.parametrize("name", list(OP_CASES))
def test_op_precondition_errors(isolated_results, name):
    _check(isolated_results("ops", OP_CASES), OP_CASES, name)


@pytest.mark.parametrize("name", list(LIFECYCLE_CASES))
def test_lifecycle_errors(isolated_results, name):
    _check(isolated_results("lifecycle", LIFECYCLE_CASES), LIFECYCLE_CASES, name)


def test_isolation_harness_reports_a_crash():
    """The child-process harness itself: an abort is reported as CRASH and later cases still run."""
    results = run_isolated({
        "ok": ("NOERROR", "pass"),
        "abort": ("", "import os; os.abort()"),
        "after": ("ValueError", "raise ValueError('still running')"),
    })
    assert results["ok"][0] == "NOERROR"
    assert results["abort"][0].startswith("CRASH")
    assert results["after"] == ("ValueError", "still running")
