"""Quantized weights in the repacking CPU buffers besides q8_0 (tests/ggml/test_vnni.py): q4_0 / q4_K /
q5_K / q6_K on our AVX512-VNNI kernels (old patches 0020-0022; our CPU_DKV_REPACK buffer) where the
matrix has whole 16-row groups, q4_0 / q4_K on ggml's own interleaved AVX2 kernels (the ones
llama.cpp runs; ggml's CPU_REPACK buffer) on other whole 8-row groups or CPUs without VNNI. Without
them a published Q4_K drafter ran at less than half llama.cpp's speed (benchmarks/README.md).

Checked: our placement rule (capabilities.cpu_repack_buffer / cpu_repack_kernel) is each buffer's
own choice of layout and kernel for every 2-D shape (a tensor placed in ggml's CPU_REPACK without a
layout would crash ggml on upload; ours refuses the allocation); products on the repacked layouts
agree with ggml's ordinary kernels for the row counts of a draft step, and our kernels with their own
arithmetic in float64 (the codes decoded independently of ggml); a whole q4_K drafter's steps agree
with its unrepacked twin and with the float64 reference.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from pyggml_dkv import DraftConfig, DraftKvCache, DraftWeights, FeatureRing
from pyggml_dkv import reference as R
from pyggml_dkv.common.numeric import relative_error
from pyggml_dkv.drafter.backend_weights import BackendWeights, repack_buffer, upload_matrix
from pyggml_dkv.ggml import (
    GGML_REPACK_TYPES,
    Buffer,
    Context,
    cpu_extra_buffer_types,
    cpu_repack_fits,
    cpu_repack_kernel,
    dequantize,
    ffi,
    ggml_repack_fits,
    lib,
    quantize,
)
from pyggml_dkv.ggml.capabilities import DKV_REPACK_BUFFER_TYPE, cpu_repack_buffer, vnni_repack_fits
from tests.ggml.helpers import mul_mat_rows, quantize_q8_0_rows


def product_in(cpu, kind: str | None, ty: str, raw: np.ndarray, shape: tuple[int, int], x: np.ndarray) -> np.ndarray:  # noqa: ANN001
    """x times the (out, in) `ty` matrix of blocks `raw`, uploaded to the `kind` buffer (None: ordinary)."""
    with Context(n_tensors=1) as ctx:
        wt = ctx.new_tensor(ty, shape[1], shape[0], name="w")
        buf = (
            Buffer.alloc_ctx_tensors_from_buft(ctx, cpu_extra_buffer_types()[kind], cpu)
            if kind
            else Buffer.alloc_ctx_tensors(ctx, cpu)
        )
        with buf:
            wt.set_bytes(raw)
            assert wt.is_repacked == (kind is not None)
            return mul_mat_rows(cpu, wt, x)


needs_repack = pytest.mark.skipif(
    not all(ggml_repack_fits(t, (256, 8)) for t in GGML_REPACK_TYPES),
    reason="no CPU_REPACK buffer with ggml's q4 kernels here (they need AVX2)",
)


def layout_picked(buffer: str, ty: str, ne: tuple[int, ...]) -> int | None:
    """The layout the `buffer` repacking buffer type picks for an empty tensor: the pointer it keeps in
    tensor->extra after allocation (nothing is uploaded; our Python check bypassed), 0 where ggml's
    CPU_REPACK picks none, None where ours refuses the allocation (it has no layout for the tensor)."""
    with Context(n_tensors=1) as ctx:
        t = ctx.new_tensor(ty, *ne, name="w")
        buf = lib.ggml_backend_alloc_ctx_tensors_from_buft(ctx.handle, cpu_extra_buffer_types()[buffer])
        if buf == ffi.NULL:
            return None
        try:
            return int(ffi.cast("uintptr_t", t.ptr.extra))
        finally:
            lib.ggml_backend_buffer_free(buf)


@needs_repack
@pytest.mark.parametrize("ty", ["q4_0", "q4_k", "q5_k", "q6_k", "q8_0", "f16"])
def test_placement_rule_is_each_buffers_choice(cpu, ty):
    """For every 2-D shape, ggml_repack_fits says yes exactly where ggml's CPU_REPACK picks a layout,
    vnni_repack_fits exactly where our CPU_DKV_REPACK does (it refuses the rest), and
    cpu_repack_buffer names ours first. 3-D: ggml would pick a layout that its matrix product then
    refuses (ours refuses it); we never place those."""
    for ne in [(256, 8), (256, 16), (512, 40), (256, 12), (256, 4), (256, 1), (256, 8, 2)]:
        ggml_picks = layout_picked("CPU_REPACK", ty, ne)
        assert ggml_picks is not None
        ours = (
            layout_picked(DKV_REPACK_BUFFER_TYPE, ty, ne)
            if DKV_REPACK_BUFFER_TYPE in cpu_extra_buffer_types()
            else None
        )
        assert ours != 0  # ours allocates only with a layout
        if len(ne) == 2:
            assert ggml_repack_fits(ty, ne) == (ggml_picks != 0), (ty, ne)
            assert vnni_repack_fits(ty, ne) == (ours is not None), (ty, ne)
            want = DKV_REPACK_BUFFER_TYPE if ours is not None else "CPU_REPACK" if ggml_picks else None
            assert cpu_repack_buffer(ty, ne) == want and cpu_repack_fits(ty, ne) == (want is not None), (ty, ne)
        else:
            assert not cpu_repack_fits(ty, ne) and ours is None


@needs_repack
@pytest.mark.parametrize("kind", ["CPU_REPACK", DKV_REPACK_BUFFER_TYPE])
@pytest.mark.parametrize("ty", sorted(GGML_REPACK_TYPES))
def test_repacked_products_agree_with_ggmls_ordinary_kernel(cpu, ty, kind):
    """Both quantize the rows to 8 bits the same way and sum the same integer products; only the f32
    order of the block sums differs. Row counts of a draft step: 1 .. 34 (fold-in buckets, noise).
    In ggml's CPU_REPACK (its AVX2 8x8 layouts) and in our CPU_DKV_REPACK (VNNI) where it has the type."""
    if kind == DKV_REPACK_BUFFER_TYPE and not vnni_repack_fits(ty, (512, 64)):
        pytest.skip(f"no VNNI kernel for {ty} here")
    rng = np.random.default_rng(3)
    n_out, k = 64, 512
    raw = quantize(ty, rng.standard_normal((n_out, k)).astype(np.float32))
    w = dequantize(ty, raw, n_out * k).reshape(n_out, k)
    for rows in (1, 4, 9, 16, 18, 34):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        out = {place: product_in(cpu, place, ty, raw, (n_out, k), x) for place in (kind, None)}
        assert relative_error(out[kind], out[None]) < 1e-5, (ty, rows)
        # and both are the 8-bit-activation product of the very same weights (a sanity bound)
        assert relative_error(out[kind], x.astype(np.float64) @ w.T.astype(np.float64)) < 3e-2, (ty, rows)


@needs_repack
@pytest.mark.parametrize("ty", ["q4_k", "q5_k"])
def test_refuses_what_no_layout_takes(cpu, ty):
    """A q4_K matrix of 12 rows (not whole 8-row groups), or a q5_K one of 8 (ggml has no x86 layout
    for q5_K, ours takes 16-row groups): a clear error naming the buffer, never ggml's abort on upload."""
    ne = (256, 12) if ty == "q4_k" else (256, 8)
    assert not cpu_repack_fits(ty, ne)
    with Context(n_tensors=1) as ctx:
        ctx.new_tensor(ty, *ne, name="w")
        with pytest.raises(ValueError, match="cannot live in the CPU_REPACK buffer"):
            Buffer.alloc_ctx_tensors_from_buft(ctx, cpu_extra_buffer_types()["CPU_REPACK"], cpu)
    assert repack_buffer(cpu, ty, ne[1], ne[0]) is None


@needs_repack
def test_q4_k_drafter_steps_on_the_repacked_kernels(cpu, tmp_path):
    """A q4_K GGUF drafter uploaded natively: its matrices go to CPU_REPACK, and its steps over a
    trajectory (ring wraps included) stay within q4_k's tolerance of the float64 reference on the
    dequantized weights (tests/model/test_gguf_quant.py), as the same file's steps on ggml's
    ordinary kernels do. The two need not agree more closely than that: a last-bit difference
    upstream can move an activation across an 8-bit rounding boundary (q8_K), a whole quantum (the
    products themselves agree to 1e-5: test_repacked_products_agree_with_ggmls_ordinary_kernel)."""
    pytest.importorskip("gguf")
    from tests.model.gguf_helpers import write_vocab_gguf

    cfg = DraftConfig.toy(vocab=128, mask_token_id=3, target_layer_ids=[1, 4, 7])
    w = DraftWeights(cfg, dict(DraftWeights.random(cfg, seed=9)))
    g = DraftWeights.from_pretrained(
        w.save_pretrained(
            tmp_path / "d.gguf", format="gguf", dtype="q4_k", vocab_from=write_vocab_gguf(tmp_path / "t.gguf", 128)
        )
    )
    rng = np.random.default_rng(4)
    cap = 40
    feats = rng.standard_normal((100, cfg.fc_in)).astype(np.float32)
    for repack in (True, False):
        with BackendWeights(g, cpu, "native", repack=repack) as bw:
            n_q4 = sum(t.type == "q4_k" for t in bw.tensors.values())
            assert n_q4 > 0
            # every toy matrix has whole 16-row groups: all in one buffer, ours where it has q4_K
            kind = cpu_repack_buffer("q4_k", (256, 16))
            assert bw.n_repacked == (n_q4 if repack else 0) and bw.repack_kinds == ((kind,) if repack else ())
            if repack and vnni_repack_fits("q4_k", (256, 16)):
                assert {cpu_repack_kernel("q4_k", t.ne) for t in bw.tensors.values() if t.type == "q4_k"} == {
                    "q4_K VNNI (vnni-q4_k)"
                }
            ring = FeatureRing(cap + 3 * cfg.block_size, cfg.fc_in)
            with DraftKvCache(bw, cpu, cap, cache_type="f32") as cache:
                for committed in (9, 25, 41, 60, 77, 100):  # the last ones past the cap: ring wraps
                    ring.write(min(ring.written, committed), feats[min(ring.written, committed) : committed])
                    noise = (
                        np.random.default_rng(committed)
                        .standard_normal((cfg.block_size, cfg.hidden))
                        .astype(np.float32)
                    )
                    got = cache.step(ring, committed, noise)
                    want = R.reference_step(g, feats, committed, cap, noise)
                    assert relative_error(got, want) < 5e-2, (repack, committed)


# ------------------------------------------- q6_K, q4_K, q5_K and q4_0 on AVX512-VNNI (0020, 0021, 0022)
VNNI_TYPES = ["q6_k", "q4_k", "q5_k", "q4_0"]


def vnni_type(ty: str):  # noqa: ANN201
    """`ty` as a test parameter, skipped where our CPU_DKV_REPACK has no VNNI kernel for it."""
    return pytest.param(
        ty,
        marks=pytest.mark.skipif(
            not vnni_repack_fits(ty, (256, 16)), reason=f"no VNNI kernel for {ty} here (vnni-{ty}, AVX512-VNNI)"
        ),
    )


def _q6_k_blocks(raw: np.ndarray, n_rows: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q6_K blocks (210 bytes: ql[128], qh[64], int8 scales[16], f16 d) decoded independently of ggml:
    (codes 0..63 [rows, k], scales [rows, k // 16], d [rows, k // 256])."""
    blocks = raw.reshape(n_rows, k // 256, 210)
    ql, qh = blocks[..., :128].astype(np.int32), blocks[..., 128:192].astype(np.int32)
    scales = blocks[..., 192:208].copy().view(np.int8).reshape(n_rows, -1)
    d = blocks[..., 208:210].copy().view(np.float16).reshape(n_rows, -1).astype(np.float32)
    i = np.arange(256)
    half, lane, quarter = i // 128, i % 32, (i % 128) // 32
    low = ql[..., half * 64 + lane + (quarter & 1) * 32]
    low = np.where(quarter < 2, low & 0xF, low >> 4)
    high = (qh[..., half * 32 + lane] >> (2 * quarter)) & 3
    return (low | (high << 4)).reshape(n_rows, k), scales, d


def _kmin_blocks(ty: str, raw: np.ndarray, n_rows: int, k: int) -> tuple[np.ndarray, ...]:
    """q4_K / q5_K blocks (f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, q5_K's qh[32] of fifth
    bits, qs[128] of low nibbles) decoded independently of ggml: (codes [rows, k], scales and mins
    [rows, k // 32], d and dmin [rows, k // 256])."""
    size = {"q4_k": 144, "q5_k": 176}[ty]
    blocks = raw.reshape(n_rows, k // 256, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 4:16].astype(np.int32)
    # sub-blocks 0-3: the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7: a nibble of bytes
    # 8-11 and the top 2 bits of bytes 0-3 (scales) / 4-7 (mins)
    sc = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], axis=-1)
    qs = blocks[..., size - 128 :].astype(np.int32)
    i = np.arange(256)
    sub = i // 32
    byte = qs[..., 32 * (sub // 2) + i % 32]
    codes = np.where(sub % 2 == 0, byte & 0xF, byte >> 4)
    if ty == "q5_k":  # the fifth bit of value i: bit (i // 32) of qh[i % 32]
        codes = codes | (((blocks[..., 16:48].astype(np.int32)[..., i % 32] >> sub) & 1) << 4)
    return codes.reshape(n_rows, k), sc.reshape(n_rows, -1), mn.reshape(n_rows, -1), d, dmin


def _quantize_per_256(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernels' activations: per 256 values, scale max|x| / 127 and values rounded to nearest
    even, in f32 as the kernels compute them: (int64 values [m, k], scales [m, k // 256])."""
    xb = x.reshape(x.shape[0], -1, 256)
    db = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(db > 0, np.float32(1) / np.where(db > 0, db, 1), 0).astype(np.float32)
    return np.rint((xb * inv[..., None]).astype(np.float32)).reshape(x.shape).astype(np.int64), db


def _q6_vnni_exact(raw: np.ndarray, n_rows: int, x: np.ndarray) -> np.ndarray:
    """0020's arithmetic in float64: exact integer sums per 16-value sub-block, scaled by
    f32(d * scale) and the activation scale."""
    m, k = x.shape
    codes, scales, d = _q6_k_blocks(raw, n_rows, k)
    xq, db = _quantize_per_256(x)
    coef = (scales.astype(np.float32) * np.repeat(d, 16, axis=1)).astype(np.float64)  # [rows, k // 16]
    prod = (codes[None, :, :].astype(np.int64) - 32) * xq[:, None, :]  # [m, rows, k]
    s = prod.reshape(m, n_rows, k // 16, 16).sum(-1)  # [m, rows, sub-blocks]
    per_block = (s * coef[None]).reshape(m, n_rows, k // 256, 16).sum(-1)  # [m, rows, blocks]
    return (per_block * db[:, None, :].astype(np.float64)).sum(-1)


def _kmin_vnni_exact(ty: str, raw: np.ndarray, n_rows: int, x: np.ndarray) -> np.ndarray:
    """0021's arithmetic (q4_K, q5_K) in float64: per 256-value block the exact integers isum =
    sum_j sc_j * sum(code * qx) and imin = sum_j mn_j * sum(qx) over the 32-value sub-blocks j, then
    dx * (d * isum - dmin * imin)."""
    m, k = x.shape
    codes, sc, mn, d, dmin = _kmin_blocks(ty, raw, n_rows, k)
    xq, db = _quantize_per_256(x)
    s = (codes[None].astype(np.int64) * xq[:, None, :]).reshape(m, n_rows, k // 32, 32).sum(-1)  # [m, rows, subs]
    xs = xq.reshape(m, k // 32, 32).sum(-1)  # [m, subs]
    isum = (s * sc[None]).reshape(m, n_rows, k // 256, 8).sum(-1)
    imin = (xs[:, None, :] * mn[None]).reshape(m, n_rows, k // 256, 8).sum(-1)
    per_block = d[None].astype(np.float64) * isum - dmin[None].astype(np.float64) * imin
    return (per_block * db[:, None, :].astype(np.float64)).sum(-1)


def _q4_0_blocks(raw: np.ndarray, n_rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """q4_0 blocks (18 bytes: f16 d, qs[16]; value j < 16 the low nibble of qs[j], j >= 16 the high
    one of qs[j - 16]) decoded independently of ggml: (codes 0..15 [rows, k], d [rows, k // 32])."""
    blocks = raw.reshape(n_rows, k // 32, 18)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 2:].astype(np.int32)
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(n_rows, k), d


def _q4_0_vnni_exact(raw: np.ndarray, n_rows: int, x: np.ndarray) -> np.ndarray:
    """0022's arithmetic in float64 (ggml's q4_0 x q8_0): activations as q8_0, per 32-value block
    f16(dw) * f16(dx) * the exact sum((code - 8) * qx)."""
    codes, dw = _q4_0_blocks(raw, n_rows, x.shape[1])
    dx, qx = quantize_q8_0_rows(x)
    cw = codes.reshape(n_rows, -1, 32).astype(np.float64) - 8
    return np.einsum("rb,ob,rbi,obi->ro", dx.astype(np.float64), dw.astype(np.float64), qx.astype(np.float64), cw)


def test_q6_k_codes_decode_to_ggmls_values():
    """The layout's source of truth: our decoding of the q6_K codes gives ggml's dequantized values."""
    rng = np.random.default_rng(8)
    raw = quantize("q6_k", rng.standard_normal((4, 512)).astype(np.float32))
    codes, scales, d = _q6_k_blocks(raw, 4, 512)
    values = np.repeat(d, 256, axis=1) * np.repeat(scales, 16, axis=1).astype(np.float32) * (codes - 32)
    np.testing.assert_array_equal(values.astype(np.float32), dequantize("q6_k", raw, 4 * 512).reshape(4, 512))


def test_q4_0_codes_decode_to_ggmls_values():
    """Likewise for q4_0: d * (code - 8), ggml's values to the bit."""
    rng = np.random.default_rng(8)
    raw = quantize("q4_0", rng.standard_normal((4, 512)).astype(np.float32))
    codes, d = _q4_0_blocks(raw, 4, 512)
    assert codes.min() >= 0 and codes.max() <= 15
    np.testing.assert_array_equal(
        (np.repeat(d, 32, axis=1) * (codes - 8)).astype(np.float32), dequantize("q4_0", raw, 4 * 512).reshape(4, 512)
    )


@pytest.mark.parametrize("ty", ["q4_k", "q5_k"])
def test_q4_k_q5_k_codes_decode_to_ggmls_values(ty):
    """Likewise for q4_K / q5_K: d * scale * code - dmin * min, to the last bit f32 allows (ggml may
    fuse the multiply and subtract)."""
    rng = np.random.default_rng(8)
    raw = quantize(ty, rng.standard_normal((4, 512)).astype(np.float32))
    codes, sc, mn, d, dmin = _kmin_blocks(ty, raw, 4, 512)
    assert codes.min() >= 0 and codes.max() == (15 if ty == "q4_k" else 31) and sc.max() <= 63 and mn.max() <= 63
    values = np.repeat(d, 256, axis=1) * np.repeat(sc, 32, axis=1).astype(np.float64) * codes - np.repeat(
        dmin, 256, axis=1
    ) * np.repeat(mn, 32, axis=1).astype(np.float64)
    np.testing.assert_allclose(
        dequantize(ty, raw, 4 * 512).reshape(4, 512), values, rtol=0, atol=2e-7 * np.abs(values).max()
    )


@pytest.mark.parametrize("ty", [vnni_type(t) for t in VNNI_TYPES])
def test_vnni_product_is_its_exact_arithmetic(ty):
    """Row counts of a draft step (1 .. 34: tiles of 16 (q4_0, q5_K: 0032) or 8, then 8 / 4 / 2 / 1),
    several 16-row groups and 256-value blocks: within f32 rounding of the kernel's own arithmetic in float64, equal to the bit
    for 1, 2 or 3 threads (one thread per output; 3 groups: one thread takes groups 0-1 as a pair,
    old patch 0023, three threads one each), and near ggml's ordinary product of the type. q5_K's codes
    come back from nibbles and a plane of fifth-bit masks (0037): this seed's codes have the fifth
    bit set in 51% of them."""
    from pyggml_dkv.ggml import Backend

    exact = {"q6_k": _q6_vnni_exact, "q4_0": _q4_0_vnni_exact}.get(ty, functools.partial(_kmin_vnni_exact, ty))
    rng = np.random.default_rng(11)
    n_out, k = 48, 768
    raw = quantize(ty, rng.standard_normal((n_out, k)).astype(np.float32))
    for rows in (1, 3, 9, 16, 24, 34):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        x[0, :256] *= 1e-3  # a block far smaller than the others: its own scale
        by_threads = []
        for n_threads in (1, 2, 3):
            with Backend("cpu", n_threads=n_threads) as cpu:
                by_threads.append(product_in(cpu, DKV_REPACK_BUFFER_TYPE, ty, raw, (n_out, k), x))
                ordinary = product_in(cpu, None, ty, raw, (n_out, k), x)
        for got in by_threads[1:]:
            np.testing.assert_array_equal(got, by_threads[0])
        assert relative_error(by_threads[0], exact(raw, n_out, x)) < 1e-6, rows
        # ggml's q8_K rounds some ties the other way (q6_K: 2e-3; q4_K / q5_K / q4_0 measured 2-4e-7)
        assert relative_error(by_threads[0], ordinary) < (2e-3 if ty == "q6_k" else 1e-5), rows


@pytest.mark.parametrize("ty", [vnni_type("q4_k"), vnni_type("q5_k")])
def test_vnni_k_quant_sums_at_their_extremes(ty):
    """Every code, scale and min at its largest (q4_K codes 15, q5_K 31, all 6-bit scales and mins
    63) times activations that quantize to +-127 throughout: the integer sums reach their bounds. q4_K
    scales each 16 inputs' sum (at most 16 * 15 * 127 = 30480, an int16) with one vpdpwssd
    (old patch 0038); a sum over more inputs would wrap there and miss the exact result by far."""
    from pyggml_dkv.ggml import Backend

    n_out, k = 48, 512  # three 16-row groups: a pair tile (0023) and a single-group one
    size = {"q4_k": 144, "q5_k": 176}[ty]
    block = np.full(size, 0xFF, dtype=np.uint8)  # scales, mins (and q5_K's fifth bits), codes: all ones
    block[0:4] = np.array([0.01, 0.005], dtype=np.float16).view(np.uint8)  # d, dmin
    raw = np.tile(block, n_out * k // 256)
    codes, sc, mn, _, _ = _kmin_blocks(ty, raw, n_out, k)
    assert codes.min() == codes.max() == (15 if ty == "q4_k" else 31) and sc.min() == mn.min() == 63
    for n_threads in (1, 2):
        with Backend("cpu", n_threads=n_threads) as cpu:
            for rows in (1, 9, 16):
                for sign in (1.0, -1.0):
                    x = np.full((rows, k), sign, dtype=np.float32)
                    got = product_in(cpu, DKV_REPACK_BUFFER_TYPE, ty, raw, (n_out, k), x)
                    assert relative_error(got, _kmin_vnni_exact(ty, raw, n_out, x)) < 1e-6, (n_threads, rows, sign)


@pytest.mark.parametrize("ty", [vnni_type(t) for t in VNNI_TYPES])
def test_vnni_non_finite_rows_stay_non_finite(cpu, ty):
    """A NaN or inf in an activation row makes that row's outputs NaN, as f32 arithmetic would; the
    other rows are untouched."""
    rng = np.random.default_rng(12)
    raw = quantize(ty, rng.standard_normal((16, 256)).astype(np.float32))
    x = rng.standard_normal((3, 256)).astype(np.float32)
    x[1, 7] = np.inf
    with Context(n_tensors=1) as ctx:
        wt = ctx.new_tensor(ty, 256, 16, name="w")
        with Buffer.alloc_ctx_tensors_from_buft(ctx, cpu_extra_buffer_types()[DKV_REPACK_BUFFER_TYPE], cpu):
            wt.set_bytes(raw)
            got = mul_mat_rows(cpu, wt, x)
    assert np.isnan(got[1]).all() and np.isfinite(got[[0, 2]]).all()


@needs_repack
def test_named_kernel_is_the_one_the_buffers_pick(cpu):
    """cpu_repack_kernel names the layout the buffers choose: ggml's CPU_REPACK and our
    CPU_DKV_REPACK keep one object per layout in each tensor's `extra`, so two shapes share a kernel
    exactly when they go to the same buffer with equal pointers (q4_0: 16-row groups on our VNNI
    kernel where built, other 8-row groups on ggml's AVX2 one)."""
    if DKV_REPACK_BUFFER_TYPE not in cpu_extra_buffer_types():
        pytest.skip("no CPU_DKV_REPACK buffer type in this build")
    picked: dict[tuple[str, tuple[int, int]], tuple[str, int] | None] = {}
    for ty in ("q4_k", "q5_k", "q6_k", "q8_0", "q4_0"):
        for ne in [(256, 16), (512, 32), (256, 24), (256, 40)]:
            ours = layout_picked(DKV_REPACK_BUFFER_TYPE, ty, ne)
            ggmls = layout_picked("CPU_REPACK", ty, ne)
            picked[ty, ne] = (DKV_REPACK_BUFFER_TYPE, ours) if ours else ("CPU_REPACK", ggmls) if ggmls else None
    named = {key: cpu_repack_kernel(*key) for key in picked}
    if vnni_repack_fits("q4_0", (256, 16)):
        assert named["q4_0", (256, 16)] == "q4_0 VNNI (vnni-q4_0)" and named["q4_0", (256, 24)].startswith("ggml's")
    for a in picked:
        for b in picked:
            if picked[a] and picked[b]:
                assert (picked[a] == picked[b]) == (named[a] == named[b]), (a, b)
        assert (picked[a] is not None) == (named[a] is not None), a
        assert (picked[a] or (None,))[0] == cpu_repack_buffer(*a), a


@pytest.mark.parametrize("ty", [vnni_type(t) for t in ["q8_0"] + VNNI_TYPES])
def test_vnni_products_of_batched_rows(cpu, ty):
    """Activations as a 3-D batch (rows x 3 sequences): the kernels flatten them in ggml's row order
    and write each output row where ggml's own kernel would, here checked against each sequence's
    product alone. (Rows with gaps between their values never reach the kernels: ops.mul_mat
    refuses a b without packed rows.)"""
    rng = np.random.default_rng(13)
    n_out, k, rows, seqs = 32, 512, 5, 3
    raw = quantize(ty, rng.standard_normal((n_out, k)).astype(np.float32))
    x = rng.standard_normal((seqs, rows, k)).astype(np.float32)
    batched = product_in(cpu, DKV_REPACK_BUFFER_TYPE, ty, raw, (n_out, k), x)
    alone = np.stack([product_in(cpu, DKV_REPACK_BUFFER_TYPE, ty, raw, (n_out, k), x[s]) for s in range(seqs)])
    assert batched.shape == (seqs, rows, n_out)
    np.testing.assert_array_equal(batched, alone)


@needs_repack
def test_kernel_rule_on_cpus_without_vnni_or_without_our_kernels(monkeypatch):
    """The rule's other branches, on this machine's ggml: without AVX512-VNNI (AVX2 only) our layouts
    are off and q4_0 / q4_K fall back to ggml's, q5_K / q6_K / q8_0 stay in ordinary buffers; a
    build without our q4_0 VNNI kernel (a ggml of one's own) keeps q4_0 on ggml's layout."""
    from pyggml_dkv.ggml import capabilities

    monkeypatch.setattr(capabilities, "vnni_available", lambda: False)
    assert cpu_repack_kernel("q4_k", (256, 16)) == "ggml's q4_K 8x8 (AVX2)"
    assert cpu_repack_kernel("q4_0", (256, 16)) == "ggml's q4_0 8x8 (AVX2)"
    assert [cpu_repack_kernel(t, (256, 16)) for t in ("q5_k", "q6_k", "q8_0")] == [None, None, None]
    monkeypatch.undo()
    without = capabilities.built_capabilities() - {capabilities.Q4_0_VNNI_KERNEL}
    monkeypatch.setattr(capabilities, "built_capabilities", lambda: without)
    assert cpu_repack_kernel("q4_0", (256, 16)) == "ggml's q4_0 8x8 (AVX2)"
    assert cpu_repack_kernel("q4_k", (256, 16)) == (
        "q4_K VNNI (vnni-q4_k)" if capabilities.vnni_repack_fits("q4_k", (256, 16)) else "ggml's q4_K 8x8 (AVX2)"
    )


@needs_repack
@pytest.mark.parametrize("ty", ["q8_0", "q4_0", "q4_k", "q6_k"])
def test_type_names_in_any_case_take_the_same_buffer(cpu, ty):
    """ggml spells its types "q4_k"; our types take any case ("q4_K", as llama.cpp writes them). The
    repacking rules used to compare names as given, so upload_matrix(..., "q4_K", matmul_only=True)
    put the matrix in an ordinary buffer on ggml's generic kernels (~10x slower, silently). Every
    spelling must land where the canonical one does and multiply to the same bits."""
    rng = np.random.default_rng(11)
    w = rng.standard_normal((32, 256)).astype(np.float32)
    x = rng.standard_normal((9, 256)).astype(np.float32)
    spellings = {ty, ty.upper(), ty.replace("_k", "_K")}
    placed = {}
    for name in spellings:
        assert cpu_repack_fits(name, (256, 32)) == cpu_repack_fits(ty, (256, 32))
        assert cpu_repack_kernel(name, (256, 32)) == cpu_repack_kernel(ty, (256, 32))
        assert repack_buffer(cpu, name, 32, 256) == repack_buffer(cpu, ty, 32, 256)
        t, buf = upload_matrix(cpu, w, name, "w", matmul_only=True)
        with buf:
            assert t.type == ty
            placed[name] = (buf.name, mul_mat_rows(cpu, t, x))
    want_buffer, want = placed[ty]
    # the canonical spelling is repacked where this build and CPU have a layout for the type (ggml's
    # q4_0 / q4_K; q8_0 / q6_K only with our VNNI kernels), else all land in the CPU buffer
    assert (want_buffer != "CPU") == cpu_repack_fits(ty, (256, 32)), (ty, want_buffer)
    for name, (buffer, got) in placed.items():
        assert buffer == want_buffer, (name, buffer)
        np.testing.assert_array_equal(got, want)
