"""q8_0 weights repacked for the AVX512-VNNI kernel (old patch 0010).

The kernel tests run where ggml carries the kernel and was compiled for AVX512-VNNI (AMD Zen 4/5,
Intel Ice Lake / Cascade Lake and later); on a Xeon with AMX both in this process (products of 64
rows or more on AMX tiles over the same layout, mm-amx-q8_0) and in a child with
PYGGML_DKV_NO_AMX=1 (the last test). The default-weight-type rule and the buffer checks run
everywhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pyggml_dkv import DraftConfig, DraftKvCache, DraftWeights, FeatureRing
from pyggml_dkv import reference as R
from pyggml_dkv.common.numeric import relative_error
from pyggml_dkv.drafter.backend_weights import BackendWeights, default_weight_dtype, repack_buffer, upload_matrix
from pyggml_dkv.ggml import (
    Backend,
    Buffer,
    Context,
    Gallocr,
    GGMLError,
    Graph,
    amx_available,
    cpu_extra_buffer_types,
    cpu_features,
    cpu_repack_fits,
    vnni_available,
)
from pyggml_dkv.ggml._lowlevel import ffi, lib
from pyggml_dkv.ggml.capabilities import q8_0_wide_on_our_amx
from tests.ggml.helpers import mul_mat_rows, quantize_q8_0_rows

# on a CPU with AMX a build without our AMX q8_0 kernel puts some q8_0 matrices (the fold-in's) in
# ggml's AMX buffer and the rules these tests check differ: there they run only in a
# PYGGML_DKV_NO_AMX=1 child (the last test). With that kernel they run here too, their products of
# 64 rows or more on AMX tiles (mm-amx-q8_0), and again in the child on VNNI alone.
needs_vnni = pytest.mark.skipif(
    not vnni_available() or (amx_available() and not q8_0_wide_on_our_amx()),
    reason="no VNNI q8_0 kernel here (vnni-q8_0 / AVX512-VNNI), or an AMX CPU whose q8_0 goes to ggml's "
    "AMX buffer (where a PYGGML_DKV_NO_AMX=1 child runs these)",
)

CFG = DraftConfig(
    hidden=128, n_layer=2, n_head=4, n_head_kv=2, head_dim=32, ffn=256, block_size=8, n_target_layers=2, vocab=96
)


def _exact(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The exact q8_0 x q8_0 arithmetic in float64: int8 dot products per block times both scales."""
    dw, qw = quantize_q8_0_rows(w)
    dx, qx = quantize_q8_0_rows(x)
    return np.einsum(
        "rb,ob,rbi,obi->ro", dx.astype(np.float64), dw.astype(np.float64), qx.astype(np.float64), qw.astype(np.float64)
    )


@needs_vnni
@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_vnni_product_at_every_row_count(n_threads):
    """Row counts around the kernel's tiles (16, 8, 4, 2, 1 rows per pass: 16 noise rows, 34 fold-in
    rows = 16 + 16 + 2) and a group count that does not split evenly over the threads, against the
    exact q8_0 arithmetic. The only difference allowed is f32 rounding of the per-block sums."""
    rng = np.random.default_rng(7)
    # 5 groups of 16 output rows; 1, 11 or 43 K blocks: the threads split the blocks of the rows to
    # quantize (old patch 0025), or the rows where there are fewer blocks than threads
    for n_out, k in ((80, 32), (80, 352), (80, 1376)):
        w = rng.standard_normal((n_out, k)).astype(np.float32)
        w[3, :32] = 0  # an all-zero block (scale 0)
        with Backend("cpu", n_threads=n_threads) as backend:
            wt, wbuf = upload_matrix(backend, w, "q8_0", "w", matmul_only=True)
            assert wt.is_repacked and wbuf.name == "CPU_DKV_REPACK"
            for rows in (1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 34, 40, 64, 100):
                x = rng.standard_normal((rows, k)).astype(np.float32) * rng.uniform(0.1, 10, (rows, 1)).astype(
                    np.float32
                )
                x[0, 32:64] = 0  # an all-zero activation block
                x[-1, 64:96] *= 1e-2  # a block of small values: its own scale, far below its neighbours'
                got = mul_mat_rows(backend, wt, x)
                assert got.shape == (rows, n_out)
                assert relative_error(got, _exact(w, x)) < 1e-6, (k, rows, relative_error(got, _exact(w, x)))
            wbuf.close()


@needs_vnni
def test_vnni_product_does_not_depend_on_the_thread_count():
    """Each thread takes its 16-row weight groups two at a time (old patch 0023: one broadcast activation
    word feeds both groups' vpdpbusd) and a last odd group alone; with 1, 2, 3 or 5 threads the same
    groups fall into pairs or stay alone, and every output must be the same to the bit. The threads
    also split each activation row's 32-value blocks to quantize them (old patch 0025): 11 or 43 blocks over
    1, 2, 3 or 5 threads, with a block of tiny values (its scale an f16 subnormal or 0)."""
    rng = np.random.default_rng(9)
    # 5 groups: 1 thread pairs 0-1 and 2-3, 5 threads none; 11 blocks, and 43
    for n_out, k in ((80, 352), (80, 1376)):
        w = rng.standard_normal((n_out, k)).astype(np.float32)
        for rows in (1, 5, 9, 16, 34, 64, 100):  # 64, 100: on AMX tiles where the kernel runs
            x = rng.standard_normal((rows, k)).astype(np.float32)
            x[0, 32:64] *= 1e-30  # a block of tiny values (its scale rounds to an f16 subnormal or 0)
            outs = []
            for n_threads in (1, 2, 3, 5):
                with Backend("cpu", n_threads=n_threads) as backend:
                    wt, wbuf = upload_matrix(backend, w, "q8_0", "w", matmul_only=True)
                    outs.append(mul_mat_rows(backend, wt, x))
                    wbuf.close()
            for got in outs[1:]:
                np.testing.assert_array_equal(got, outs[0])


@needs_vnni
def test_vnni_matches_generic_q8_0_bit_for_bit_on_integer_data():
    """Values that quantize exactly (small integers, scale 1/127 * amax) make every f32 sum exact, so
    the VNNI kernel and ggml's generic q8_0 path must agree to the bit, including the extreme weight
    values -127 / +127 (the kernel stores weights + 128 as unsigned bytes)."""
    rng = np.random.default_rng(11)
    n_out, k = 32, 768  # 24 blocks, quantized 12 by each thread (old patch 0025)
    w = rng.integers(-127, 128, (n_out, k)).astype(np.float32)
    w[:, ::32] = 127  # every block's amax is 127: scale exactly 1
    w[5, 1::32] = -127
    x = rng.integers(-127, 128, (19, k)).astype(np.float32)
    x[:, ::32] = -127
    with Backend("cpu", n_threads=2) as backend:
        wt, wbuf = upload_matrix(backend, w, "q8_0", "w", matmul_only=True)
        plain, pbuf = upload_matrix(backend, w, "q8_0", "w", matmul_only=False)
        assert wt.is_repacked and not plain.is_repacked
        got, ref = mul_mat_rows(backend, wt, x), mul_mat_rows(backend, plain, x)
        np.testing.assert_array_equal(got, ref)
        np.testing.assert_array_equal(got, x.astype(np.float64) @ w.T.astype(np.float64))
        wbuf.close()
        pbuf.close()


@needs_vnni
def test_vnni_weights_step_like_generic_q8_0_and_the_reference(cpu):
    """A whole cache step with VNNI-repacked weights against the same weights on ggml's generic q8_0
    path and the float reference."""
    w = DraftWeights.random(CFG, seed=5)
    rng = np.random.default_rng(0)
    feats = rng.standard_normal((40, CFG.fc_in)).astype(np.float32)
    noise = rng.standard_normal((CFG.block_size, CFG.hidden)).astype(np.float32)
    outs = {}
    for repack in (True, False):
        with BackendWeights(w, cpu, "q8_0", repack=repack) as bw:
            assert (bw.n_repacked > 0) == repack and bw.repack_kind == ("CPU_DKV_REPACK" if repack else None)
            with DraftKvCache(bw, cpu, cap=64) as cache:
                ring = FeatureRing(64, CFG.fc_in)
                ring.append(feats)
                outs[repack] = cache.step(ring, 40, noise)
    assert 0 < relative_error(outs[True], outs[False]) < 1e-2  # > 0: two different kernels really ran
    assert relative_error(outs[True], R.reference_step(w, feats, 40, 64, noise)) < 3e-2


@needs_vnni
@pytest.mark.parametrize(
    "ty, ne", [("q8_0", (64, 40)), ("q8_0", (32, 24)), ("q8_0", (64, 32, 2)), ("f16", (32, 32)), ("q4_0", (64, 12))]
)
def test_repacking_buffers_refuse_tensors_the_kernels_cannot_hold(cpu, ty, ne):
    """Anything else would crash ggml's CPU_REPACK on upload (no layout) or compute on a layout nobody
    tested; our CPU_DKV_REPACK refuses the allocation itself (init_tensor fails: NULL, not a crash)."""
    assert not cpu_repack_fits(ty, ne)
    for name in ("CPU_DKV_REPACK", "CPU_REPACK"):
        with Context(n_tensors=1) as ctx:
            ctx.new_tensor(ty, *ne, name="w")
            with pytest.raises(ValueError, match=f"cannot live in the {name} buffer"):
                Buffer.alloc_ctx_tensors_from_buft(ctx, cpu_extra_buffer_types()[name], cpu)
    with Context(n_tensors=1) as ctx:
        ctx.new_tensor(ty, *ne, name="w")
        buft = cpu_extra_buffer_types()["CPU_DKV_REPACK"]
        assert lib.ggml_backend_alloc_ctx_tensors_from_buft(ctx.handle, buft) == ffi.NULL  # bypasses our check


@needs_vnni
def test_vnni_repacked_tensor_is_write_whole_and_mul_mat_only(cpu):
    table, buf = upload_matrix(cpu, np.ones((64, 64), np.float32), "q8_0", "emb", matmul_only=True)
    assert table.is_repacked
    with pytest.raises(GGMLError, match="repacked"):
        table.numpy()
    with pytest.raises(GGMLError, match="repacked"):
        table.fill(0)
    with buf, Context(n_tensors=8) as ids_ctx, Context(n_tensors=32, graph_size=32) as g:
        rows = ids_ctx.new_tensor("i32", 2)
        graph = Graph(g, 32)
        graph.expand(g.get_rows(table, rows))
        with (
            Gallocr(cpu) as galloc,
            pytest.raises(GGMLError, match="emb.*repacked .AMX, CPU_DKV_REPACK or CPU_REPACK buffer."),
        ):
            galloc.alloc_graph(graph)


def test_default_weight_type_follows_the_cpu(cpu):
    """q8_0 where ggml has a fast int8 kernel for it (AMX, or VNNI with old patch 0010), f16 elsewhere;
    an explicit dtype always wins."""
    want = "q8_0" if (amx_available() or vnni_available()) else "f16"
    assert default_weight_dtype(cpu) == want
    w = DraftWeights.random(CFG, seed=2)
    with BackendWeights(w, cpu) as bw:
        assert bw.dtype == want
    with BackendWeights(w, cpu, "f16") as bw:
        assert bw.dtype == "f16" and bw.n_repacked == 0
    with pytest.raises(ValueError, match="weight dtype"):
        BackendWeights(w, cpu, "int4")


def test_no_amx_switch_leaves_q8_0_on_vnni_where_it_can(cpu, monkeypatch):
    """PYGGML_DKV_NO_AMX=1 on an AMX Xeon must give the path of CPUs without AMX: VNNI if compiled."""
    import pyggml_dkv.ggml as G
    import pyggml_dkv.ggml.capabilities as C

    monkeypatch.setenv("PYGGML_DKV_NO_AMX", "1")
    assert not amx_available()
    want = "CPU_DKV_REPACK" if vnni_available() else None
    assert repack_buffer(cpu, "q8_0", 64, 64) == want
    assert G.bf16_attention_kernel() != "amx"  # ggml reads the same switch (old patch 0011)
    assert repack_buffer(cpu, "f16", 64, 64) is None
    monkeypatch.setattr(C, "built_capabilities", lambda: frozenset())  # where vnni_available() looks it up
    assert not G.vnni_available() and repack_buffer(cpu, "q8_0", 64, 64) is None


def test_cpu_features_are_reported():
    feats = cpu_features()
    assert set(feats) >= {"avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_usable"}
    assert all(isinstance(v, bool) for v in feats.values())
    if feats["avx512_vnni"]:
        assert feats["avx512"]


@needs_vnni
def test_vnni_non_finite_activations_give_nan_rows(cpu):
    """A NaN or inf among a row's values makes that row's outputs NaN (as f32 arithmetic would; a
    vector max would silently drop the NaN and return finite garbage); other rows are unaffected."""
    rng = np.random.default_rng(4)
    for k in (96, 1024 + 96):  # 3 / 35 blocks, split over the two threads to quantize (old patch 0025)
        w = rng.standard_normal((32, k)).astype(np.float32)
        x = rng.standard_normal((6, k)).astype(np.float32)
        x[0, 5], x[2, 70], x[3, 40] = np.nan, np.inf, -np.inf
        x[5, k - 10] = np.nan  # in the last block
        wt, buf = upload_matrix(cpu, w, "q8_0", "w", matmul_only=True)
        with buf:
            got = mul_mat_rows(cpu, wt, x)
        assert np.isnan(got[[0, 2, 3, 5]]).all(), k
        ok = [1, 4]
        assert relative_error(got[ok], _exact(w, x[ok])) < 1e-6, k


@pytest.mark.skipif(
    not amx_available() or not lib.ggml_cpu_has_avx512_vnni(),
    reason="runs where AMX takes q8_0 and the CPU has AVX512-VNNI (the tests above run themselves elsewhere)",
)
def test_vnni_tests_on_an_amx_cpu_with_amx_switched_off():
    """On a Xeon with AMX the VNNI tests above skip (AMX takes q8_0), yet the kernel serves
    PYGGML_DKV_NO_AMX=1 there (which ggml reads once per process): run them in a child that sets it,
    and check that none of them skipped."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            str(Path(__file__)),
            "-k",
            "not amx_switched_off",
        ],
        cwd=root,
        env={**os.environ, "PYGGML_DKV_NO_AMX": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "skipped" not in proc.stdout and " passed" in proc.stdout, proc.stdout[-2000:]
