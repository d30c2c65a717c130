"""q8_0 weights repacked for ggml's AMX kernels (Xeons with AMX): same results, write-only tensors.

Skipped where the CPU (or the kernel) offers no AMX; the checks that AMX is *not* used run everywhere.
"""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import pytest

from pyggml_dkv import DraftConfig, DraftKvCache, DraftWeights, FeatureRing, OneShotDrafter
from pyggml_dkv import reference as R
from pyggml_dkv.common.numeric import relative_error
from pyggml_dkv.drafter.backend_weights import upload_matrix
from pyggml_dkv.ggml import (
    Context,
    Gallocr,
    GGMLError,
    Graph,
    amx_available,
    bf16_matmul_kernel,
    bf16_products_on_fma,
    cpu_extra_buffer_types,
    vnni_available,
)
from pyggml_dkv.ggml.capabilities import dkv_buffer_available, q8_0_wide_on_our_amx
from tests.child import run_in_child
from tests.ggml.helpers import mul_mat_rows

needs_amx = pytest.mark.skipif(
    not amx_available(), reason="this CPU / kernel offers no AMX (or PYGGML_DKV_NO_AMX is set)"
)
needs_amx_bf16 = pytest.mark.skipif(
    bf16_matmul_kernel() != "amx",
    reason="bf16 products run on AMX-BF16 tiles only where the CPU has them (old patch 0029)",
)
needs_q8_0_amx = pytest.mark.skipif(
    not q8_0_wide_on_our_amx(), reason="our q8_0 layout runs no products on AMX tiles here (mm-amx-q8_0)"
)

CFG = DraftConfig(
    hidden=128, n_layer=2, n_head=4, n_head_kv=2, head_dim=32, ffn=256, block_size=8, n_target_layers=2, vocab=96
)


def _weights() -> DraftWeights:
    return DraftWeights.random(CFG, seed=5)


def test_only_q8_0_matrices_on_cpu_are_repacked(cpu):
    w = _weights()
    for dtype in ("f32", "f16", "bf16"):
        with w.to_backend(cpu, dtype) as bw:
            # f16 / bf16 matrices go to our CPU_DKV buffer (ggml's layout, not repacked)
            in_dkv = dtype != "f32" and dkv_buffer_available()
            assert bw.n_repacked == 0 and bw.repack_kinds == () and len(bw.buffers) == 1 + in_dkv
    with w.to_backend(cpu, "q8_0", repack=False) as bw:
        assert bw.n_repacked == 0
        assert not any(t.is_repacked for t in bw.tensors.values())
    with pytest.raises(TypeError, match="repack"):
        w.to_backend(cpu, "q8_0", repack="yes")  # type: ignore[arg-type]


def test_no_amx_environment_switch(cpu, monkeypatch):
    monkeypatch.setenv("PYGGML_DKV_NO_AMX", "1")
    assert not amx_available()
    with _weights().to_backend(cpu, "q8_0") as bw:
        # no AMX buffer; the VNNI kernel (old patch 0010) takes q8_0 where ggml was compiled for it
        assert bw.repack_kind == ("CPU_DKV_REPACK" if vnni_available() else None)
        assert "AMX" not in {b.name for b in bw.buffers}


@needs_amx
def test_q8_0_matrices_go_to_the_repacking_buffers(cpu):
    """All repacked: into our VNNI layout, whose wide products run on AMX tiles (mm-amx-q8_0); in a
    build without that kernel the fold-in's to ggml's AMX buffer too, the others to VNNI where it is
    built (the tests below)."""
    w = _weights()
    with w.to_backend(cpu, "q8_0") as bw:
        matrices = [n for n, a in w.items() if a.ndim == 2]
        assert bw.n_repacked == len(matrices) > 0
        if q8_0_wide_on_our_amx():
            want = {"CPU", "CPU_DKV_REPACK"}
        else:
            want = {"CPU", "AMX"} | ({"CPU_DKV_REPACK"} if vnni_available() else set())
        assert {b.name for b in bw.buffers} == want
        assert all(bw[n].is_repacked for n in matrices)
        assert not any(bw[n].is_repacked for n, a in w.items() if a.ndim == 1)  # norms stay readable
        norm = next(n for n, a in w.items() if a.ndim == 1)
        np.testing.assert_array_equal(bw[norm].numpy(), w[norm])


@needs_amx
def test_repacked_tensors_are_write_whole_only(cpu):
    w = _weights()
    with w.to_backend(cpu, "q8_0") as bw:
        t = bw["fc.weight"]
        with pytest.raises(GGMLError, match="repacked"):
            t.numpy()
        with pytest.raises(GGMLError, match="repacked"):
            t.set_bytes(np.zeros(34, np.uint8))
        with pytest.raises(GGMLError, match="repacked"):
            t.fill(0)
        t.set(w["fc.weight"])  # a whole-tensor write is repacked again: allowed


@needs_amx
def test_graph_reading_a_repacked_tensor_other_than_by_mul_mat_is_refused(cpu):
    table, buf = upload_matrix(cpu, np.ones((64, 64), np.float32), "q8_0", "emb", matmul_only=True)
    assert table.is_repacked
    with buf, Context(n_tensors=8) as ids_ctx, Context(n_tensors=32, graph_size=32) as g:
        rows = ids_ctx.new_tensor("i32", 2)
        graph = Graph(g, 32)
        graph.expand(g.get_rows(table, rows))
        with (
            Gallocr(cpu) as galloc,
            pytest.raises(GGMLError, match="emb.*stored repacked .AMX, CPU_DKV_REPACK or CPU_REPACK buffer."),
        ):
            galloc.alloc_graph(graph)
    # an embedding table (read with get_rows) is never repacked by upload_matrix
    table2, buf2 = upload_matrix(cpu, np.ones((64, 64), np.float32), "q8_0", "emb")
    with buf2:
        assert not table2.is_repacked


@needs_amx
def test_amx_weights_match_generic_q8_0_and_the_reference(cpu):
    """Same quantized weights through the AMX and the generic q8_0 kernels: same drafts."""
    w = _weights()
    rng = np.random.default_rng(9)
    lm_head = (rng.standard_normal((CFG.vocab, CFG.hidden)) * 0.05).astype(np.float32)
    ring = FeatureRing(64, CFG.fc_in)
    ring.append(rng.standard_normal((40, CFG.fc_in)).astype(np.float32))
    noise = rng.standard_normal((CFG.block_size, CFG.hidden)).astype(np.float32)
    outs = {}
    for repack in (True, False):
        with (
            w.to_backend(cpu, "q8_0", repack=repack) as bw,
            DraftKvCache(bw, cpu, 64, cache_type="f32", lm_head=lm_head) as cache,
            OneShotDrafter(bw, cpu, 64, cache_type="f32", lm_head=lm_head) as oneshot,
        ):
            assert (bw.n_repacked > 0) == repack
            assert cache.lm_head.is_repacked == repack
            logits = cache.step(ring, 40, noise)
            outs[repack] = (cache.hidden_states.numpy(), logits, oneshot.step(ring, 40, noise))
    for a, b in zip(outs[True], outs[False]):
        assert 0 < relative_error(a, b) < 1e-2, relative_error(a, b)  # > 0: two different kernels really ran
    feats = ring.read(0, 40)
    assert relative_error(outs[True][0], R.reference_step(w, feats, 40, 64, noise)) < 3e-2
    assert relative_error(outs[True][1], R.reference_step(w, feats, 40, 64, noise, lm_head=lm_head)) < 3e-2


def _q8_0_round_trip(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's q8_0 of each row in 32-value blocks: (f16 scales as f32 [rows, blocks], int8 values)."""
    blocks = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    amax = np.abs(blocks).max(-1)
    d = amax / 127
    inv = np.where(d > 0, 1 / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.round(blocks * inv[..., None]).astype(np.int32)  # ggml: roundf (ties away; none here)
    return d.astype(np.float16).astype(np.float32), q


def amx_q8_0_products(n_threads: int, shapes: list[tuple[int, ...]]) -> list[float]:
    """q8_0 weights in ggml's AMX buffer (96 outputs = 3 blocks of 32 columns, 10 K blocks) times
    activations of each shape ((rows, k) or a batch (..., rows, k)): the relative error of each
    product against the exact q8_0 arithmetic in float64 (int8 dot products per 32-value block,
    times both blocks' f16 scales)."""
    from pyggml_dkv.ggml import Backend, Buffer

    rng = np.random.default_rng(3)
    n_out, k = 96, 320
    w = rng.standard_normal((n_out, k)).astype(np.float32)
    dw, qw = _q8_0_round_trip(w)
    errors = []
    with Backend("cpu", n_threads=n_threads) as backend, Context(n_tensors=1) as ctx:
        wt = ctx.new_tensor("q8_0", k, n_out, name="w")
        with Buffer.alloc_ctx_tensors_from_buft(ctx, cpu_extra_buffer_types()["AMX"], backend):
            wt.set(w)
            assert wt.buffer_name == "AMX"
            for shape in shapes:
                x = rng.standard_normal(shape + (k,)).astype(np.float32)
                dx, qx = _q8_0_round_trip(x.reshape(-1, k))
                want = np.einsum(
                    "rb,ob,rbi,obi->ro",
                    dx.astype(np.float64),
                    dw.astype(np.float64),
                    qx.astype(np.float64),
                    qw.astype(np.float64),
                ).reshape(shape + (n_out,))
                got = mul_mat_rows(backend, wt, x)
                assert got.shape == shape + (n_out,)
                errors.append(relative_error(got, want))
    return errors


@needs_amx
@pytest.mark.parametrize("n_threads", [1, 2])
def test_amx_product_at_every_row_count(n_threads):
    """The AMX q8_0 product for row counts around its 16-row tiles (old patch 0007 computes at
    most 16 rows per pass: 16 noise rows, 34 fold-in rows = 16 + 16 + 2; 0039 prepares each pass's
    rows once per product, a partial last block padded), against the exact arithmetic."""
    shapes = [(rows,) for rows in (1, 2, 5, 9, 15, 16, 17, 31, 32, 33, 34, 40, 64)]
    for shape, err in zip(shapes, amx_q8_0_products(n_threads, shapes)):
        assert err < 1e-6, (shape, err)


def amx_batched_products_child() -> None:
    shapes = [(2, 1), (2, 9), (3, 16), (2, 34), (2, 2, 5)]
    for n_threads in (1, 2):
        errors = amx_q8_0_products(n_threads, shapes)
        print(n_threads, [f"{e:.1e}" for e in errors])
        assert max(errors) < 1e-6


@needs_amx
def test_amx_products_of_batched_rows():
    """Activations as a batch (sequences x rows x k) times one 2-D AMX matrix: ggml broadcasts the
    matrix over the batch. ggml's AMX kernel stepped the matrix by the batch (reading past its end)
    and placed each batch's outputs at 4x their byte offset: garbage, then a corrupted heap
    (old patch 0040). In a child process: that failure aborts."""
    proc = run_in_child("tests.ggml.test_amx:amx_batched_products_child")
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])


def cpu_flags() -> set[str]:
    """The CPU's feature flags as the kernel reports them (empty where /proc/cpuinfo is absent)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def test_extra_buffer_types_are_listed_by_name():
    """What ggml lists is what this CPU can do: its repacking buffer on x86-64 (our build keeps
    GGML_CPU_REPACK on), the AMX buffer exactly where the CPU has AMX-INT8 tiles."""
    found = cpu_extra_buffer_types()
    assert isinstance(found, dict) and all(isinstance(k, str) and k for k in found)
    flags = cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64") or not flags:
        pytest.skip("the expected buffer types are known for x86-64 Linux only")
    assert "CPU_REPACK" in found
    assert ("AMX" in found) == ({"amx_tile", "amx_int8"} <= flags), (
        sorted(found),
        sorted(f for f in flags if "amx" in f),
    )


@needs_amx
def test_amx_survives_another_amx_user_on_the_same_thread():
    """oneDNN (PyTorch bf16 matmuls) releases the AMX tiles on the thread it ran on; ggml's AMX
    matmuls must configure them again for their next product instead of dying with SIGILL (patch
    0008, old 0002), and so must our kernels on tiles: bf16 products and attention on AMX-BF16
    (attention="bf16"), q8_0 products of 64 rows or more on AMX-INT8 (mm-amx-q8_0)."""
    pytest.importorskip("torch")
    proc = run_in_child("tests.ggml.amx_child:amx_next_to_torch")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (proc.returncode, proc.stderr[-2000:])


@needs_amx
@pytest.mark.parametrize("ty, ne", [("f32", (64, 64)), ("q8_0", (64, 48)), ("q8_0", (64, 32, 2)), ("f16", (32, 32))])
def test_amx_buffer_refuses_tensors_its_kernels_cannot_hold(cpu, ty, ne):
    from pyggml_dkv.ggml import Buffer

    with Context(n_tensors=1) as ctx:
        ctx.new_tensor(ty, *ne, name="w")
        with pytest.raises(ValueError, match="AMX buffer"):
            Buffer.alloc_ctx_tensors_from_buft(ctx, cpu_extra_buffer_types()["AMX"], cpu)


def test_cpu_repack_refuses_q8_0_without_the_vnni_kernel(cpu, monkeypatch):
    """ggml has no q8_0 layout in its CPU_REPACK on x86 (ours is in CPU_DKV_REPACK, and absent without
    AVX512-VNNI or in a build without vnni-q8_0): uploading one there would crash it. A clear error
    instead."""
    import pyggml_dkv.ggml.capabilities as C
    from pyggml_dkv.ggml import Buffer

    if "CPU_REPACK" not in cpu_extra_buffer_types():
        pytest.skip("no CPU_REPACK buffer type in this build")
    monkeypatch.setattr(C, "vnni_available", lambda: False)
    with Context(n_tensors=1) as ctx:
        ctx.new_tensor("q8_0", 64, 64, name="w")
        with pytest.raises(ValueError, match="cannot live in the CPU_REPACK buffer on this CPU"):
            Buffer.alloc_ctx_tensors_from_buft(ctx, cpu_extra_buffer_types()["CPU_REPACK"], cpu)


def test_amx_needs_the_fixed_build(monkeypatch):
    """On a CPU with AMX tiles our build uses them; a GGML_SRC build lacks our AMX fix (AMX_KERNEL),
    whose absence means SIGILL on GCC 12: no AMX then."""
    import pyggml_dkv.ggml.capabilities as G

    if "AMX" not in cpu_extra_buffer_types():
        pytest.skip("this CPU (or its kernel) offers no AMX tiles")
    monkeypatch.delenv("PYGGML_DKV_NO_AMX", raising=False)
    assert G.AMX_KERNEL in G.built_capabilities() and G.amx_available()
    monkeypatch.setattr(G, "built_capabilities", lambda: frozenset())
    assert not G.amx_available()


def bf16_operands() -> tuple[np.ndarray, np.ndarray]:
    """48 weight rows (three 16-row groups) x 1024 inputs, and 34 columns (two full groups and a
    narrower one), as the fold-in's widest bucket multiplies them."""
    rng = np.random.default_rng(29)
    return (rng.standard_normal((48, 1024)).astype(np.float32), rng.standard_normal((34, 1024)).astype(np.float32))


def test_bf16_product_kernel_rule(monkeypatch):
    # more than 64 columns, or inputs that are not whole 32-value blocks: ggml's own path
    assert bf16_matmul_kernel((1024, 1024), n_columns=65) == "ggml"
    assert bf16_matmul_kernel((1000, 1024)) == "ggml"
    rule = bf16_matmul_kernel((1024, 1024))
    assert rule in ("amx", "avx512_bf16", "avx512_fma", "ggml")
    if rule == "amx":
        # rows that are not whole 16-row groups: vdpbf16ps or FMAs, by the CPU (tests/ggml/test_bf16_products.py)
        without_tiles = "avx512_fma" if bf16_products_on_fma() else "avx512_bf16"
        assert bf16_matmul_kernel((1024, 1000)) == without_tiles
        monkeypatch.setenv("PYGGML_DKV_NO_AMX", "1")  # ggml reads the same switch
        assert bf16_matmul_kernel((1024, 1024)) == without_tiles


@needs_amx_bf16
def test_bf16_products_run_on_amx_tiles(cpu, tmp_path):
    """The AMX-BF16 kernel really runs (its sums in another order than vdpbf16ps': not bit-equal to
    the PYGGML_DKV_NO_AMX=1 product of a child process), and both are the exact bf16 products
    summed in f32 (within f32 rounding of float64 on the bf16-rounded operands)."""
    import os

    from pyggml_dkv.common.bf16 import from_bf16_bits, to_bf16_bits
    from tests.ggml.helpers import compute

    w, x = bf16_operands()
    amx = compute(cpu, [("bf16", w), ("f32", x)], lambda g, a, b: g.mul_mat(a, b), dkv=(0,))
    proc = run_in_child(
        "tests.ggml.amx_child:bf16_product",
        str(tmp_path / "vdpbf16ps.npy"),
        env={**os.environ, "PYGGML_DKV_NO_AMX": "1", "PYGGML_DKV_BF16_PRODUCTS": "dpbf16"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    vdp = np.load(tmp_path / "vdpbf16ps.npy")
    want = from_bf16_bits(to_bf16_bits(x)).astype(np.float64) @ from_bf16_bits(to_bf16_bits(w)).astype(np.float64).T
    assert relative_error(amx, want) < 2e-6 and relative_error(vdp, want) < 2e-6
    assert not np.array_equal(amx, vdp)


@needs_q8_0_amx
def test_q8_0_one_copy_steps_on_vnni_bulk_appends_on_amx(cpu):
    """q8_0 on an AMX CPU: every matrix (and an lm_head) in CPU_DKV_REPACK, one copy, no second one in
    ggml's AMX buffer; a step's few rows multiply on our VNNI kernel (0010), faster there, and a bulk
    append's and the one-shot graph's context rows (64 or more) on AMX tiles over the same layout
    (mm-amx-q8_0.cpp). The cache's results stay those of q8_0 arithmetic."""
    from pyggml_dkv.drafter.backend_weights import repack_buffer

    assert repack_buffer(cpu, "q8_0", 1024, 1024) == "CPU_DKV_REPACK"
    assert repack_buffer(cpu, "q8_0", 1024, 1024, bulk=False) == "CPU_DKV_REPACK"
    cfg = DraftConfig(
        hidden=128, n_layer=2, n_head=4, n_head_kv=2, head_dim=32, ffn=256, block_size=8, n_target_layers=2
    )
    host = DraftWeights.random(cfg, seed=2)
    rng = np.random.default_rng(2)
    head = rng.standard_normal((512, cfg.hidden)).astype(np.float32) / 8
    with host.to_backend(cpu, "q8_0") as bw:
        matrices = {name for name, t in bw.tensors.items() if t.ne[1] > 1}
        assert {bw.tensors[n].buffer_name for n in matrices} == {"CPU_DKV_REPACK"}
        assert bw.bulk_tensors == {} and bw.bulk is bw and bw.repack_kinds == ("CPU_DKV_REPACK",)
        t, buf = upload_matrix(cpu, head, "q8_0", "lm_head", matmul_only=True)
        try:
            assert t.buffer_name == "CPU_DKV_REPACK"
            ring = FeatureRing(128, cfg.fc_in)
            ring.append(rng.standard_normal((100, cfg.fc_in)).astype(np.float32))
            noise = rng.standard_normal((cfg.block_size, cfg.hidden)).astype(np.float32)
            with DraftKvCache(bw, cpu, 128, lm_head=t) as cache:
                got = cache.step(ring, 100, noise)  # 100 rows: a bulk append (AMX) and a step (VNNI)
            with OneShotDrafter(bw, cpu, 128, lm_head=t) as oneshot:
                got_oneshot = oneshot.step(ring, 100, noise)
            with (
                host.to_backend(cpu, "q8_0", repack=False) as plain,
                DraftKvCache(plain, cpu, 128, lm_head=head) as ref,
            ):
                want = ref.step(ring, 100, noise)  # ggml's generic q8_0 x q8_0 products
            assert np.abs(got - want).max() < 3e-2 * np.abs(want).max()
            assert np.abs(got_oneshot - want).max() < 3e-2 * np.abs(want).max()
        finally:
            buf.close()
            t.ctx.close()


@needs_q8_0_amx
def test_q8_0_wide_products_run_on_amx_tiles_with_the_vnni_bits(tmp_path):
    """Our q8_0 layout's products of 64 rows or more run on AMX tiles (the thread has used tile data
    after the 64-row product, not after the 63-row one), and give the bits of the VNNI kernel (a
    PYGGML_DKV_NO_AMX=1 child): the same exact int32 sums per block, scaled and summed in the same
    order. Both within f32 rounding of the exact q8_0 arithmetic."""
    import json
    import os

    from tests.ggml.amx_child import Q8_0_ROWS, q8_0_operands
    from tests.ggml.test_vnni import _exact

    results = {}
    for name, env in (("amx", {}), ("vnni", {"PYGGML_DKV_NO_AMX": "1"})):
        out = str(tmp_path / f"{name}.npz")
        proc = run_in_child("tests.ggml.amx_child:q8_0_wide_products", out, env={**os.environ, **env})
        assert proc.returncode == 0, proc.stderr[-3000:]
        with open(out + ".json") as f:
            results[name] = (dict(np.load(out)), json.load(f))
    assert results["amx"][1] == [False, False, True]
    assert results["vnni"][1] == [False, False, False]
    w, xs = q8_0_operands()
    for rows, x in zip(Q8_0_ROWS, xs):
        amx, vnni = results["amx"][0][str(rows)], results["vnni"][0][str(rows)]
        np.testing.assert_array_equal(amx, vnni)
        assert relative_error(amx, _exact(w, x)) < 1e-6, rows


def test_amx_placement_rule_on_any_cpu(cpu, monkeypatch):
    """The rule itself, on any machine (AMX and the VNNI layouts simulated as present): q8_0 goes to
    ggml's AMX buffer unless only a step multiplies it (bulk=False) and the VNNI layout takes it, or
    that layout runs its wide products on AMX tiles itself (then never, where it takes the matrix);
    q4_0 never; f16 has no AMX kernel; without AMX nothing goes there."""
    import pyggml_dkv.drafter.backend_weights as BW

    monkeypatch.setattr(BW, "amx_available", lambda: True)
    monkeypatch.setattr(BW, "q8_0_wide_on_our_amx", lambda: False)
    monkeypatch.setattr(BW, "amx_fits", lambda dtype, ne: dtype in ("q8_0", "q4_0"))
    monkeypatch.setattr(BW, "vnni_repack_fits", lambda dtype, ne: dtype in ("q8_0", "q4_0") and ne[1] % 16 == 0)
    assert BW.amx_eligible(cpu, "q8_0", 1024, 1024) and BW.amx_eligible(cpu, "q8_0", 1024, 1024, bulk=True)
    assert not BW.amx_eligible(cpu, "q8_0", 1024, 1024, bulk=False)
    assert BW.amx_eligible(cpu, "q8_0", 1000, 1024, bulk=False)  # rows the VNNI layout cannot group
    assert not BW.amx_eligible(cpu, "q4_0", 1024, 1024) and not BW.amx_eligible(cpu, "f16", 1024, 1024)
    # our VNNI layout runs its wide products on AMX tiles itself: q8_0 goes there for both
    monkeypatch.setattr(BW, "q8_0_wide_on_our_amx", lambda: True)
    assert not BW.amx_eligible(cpu, "q8_0", 1024, 1024) and not BW.amx_eligible(cpu, "q8_0", 1024, 1024, bulk=False)
    assert BW.amx_eligible(cpu, "q8_0", 1000, 1024)
    monkeypatch.setattr(BW, "amx_available", lambda: False)
    assert not BW.amx_eligible(cpu, "q8_0", 1024, 1024)


@needs_amx
def test_q4_0_prefers_our_vnni_kernel_to_ggmls_amx_one(cpu, monkeypatch):
    """q4_0 fits ggml's AMX buffer too, but our VNNI kernel (0022) was the faster one side by side
    (backend_weights.VNNI_OVER_AMX); q8_0 goes to ggml's AMX buffer for bulk appends only where our
    layout has no AMX kernel of its own (mm-amx-q8_0). Without 0022, q4_0 goes back to AMX."""
    import pyggml_dkv.ggml.capabilities as C
    from pyggml_dkv.drafter.backend_weights import repack_buffer

    if not vnni_available():
        pytest.skip("no VNNI kernels in this build")
    assert repack_buffer(cpu, "q4_0", 1024, 1024) == "CPU_DKV_REPACK"
    assert repack_buffer(cpu, "q8_0", 1024, 1024) == ("CPU_DKV_REPACK" if q8_0_wide_on_our_amx() else "AMX")
    kernels = C.built_capabilities() - {C.Q4_0_VNNI_KERNEL}
    monkeypatch.setattr(C, "built_capabilities", lambda: kernels)
    assert repack_buffer(cpu, "q4_0", 1024, 1024) == "AMX"
