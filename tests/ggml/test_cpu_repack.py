"""q4_0 / q4_K weights in ggml's CPU_REPACK buffer: ggml's own interleaved kernels (AVX2, AVX-512
where built for it), the ones llama.cpp runs its q4 drafters on. Without them a published Q4_K
drafter ran at less than half llama.cpp's speed (benchmarks/README.md).

Checked: our placement rule (capabilities.cpu_repack_fits) is ggml's own choice of layout for
every 2-D shape (a tensor placed there without a layout would crash ggml on upload); products on
the repacked layout agree with ggml's ordinary kernels for the row counts of a draft step; a
whole q4_K drafter's steps agree with its unrepacked twin and with the float64 reference.
"""

from __future__ import annotations

import numpy as np
import pytest

from pyggml_dkv import DraftConfig, DraftKvCache, DraftWeights, FeatureRing
from pyggml_dkv import reference as R
from pyggml_dkv.common.numeric import relative_error
from pyggml_dkv.ggml import (GGML_REPACK_TYPES, Buffer, Context, cpu_extra_buffer_types, cpu_repack_fits, dequantize, ffi,
                             ggml_repack_fits, lib, quantize)
from pyggml_dkv.model.backend_weights import BackendWeights, repack_buffer
from tests.ggml.helpers import mul_mat_rows

needs_repack = pytest.mark.skipif(not all(ggml_repack_fits(t, (256, 8)) for t in GGML_REPACK_TYPES),
                                  reason="no CPU_REPACK buffer with ggml's q4 kernels here (they need AVX2)")


@needs_repack
@pytest.mark.parametrize("ty", ["q4_0", "q4_k", "q5_k", "q6_k", "q8_0", "f16"])
def test_placement_rule_is_ggmls_choice(cpu, ty):
    """For every 2-D shape, cpu_repack_fits says yes exactly where ggml picks a layout (its traits
    in tensor->extra after allocation; nothing is uploaded). 3-D: ggml would pick a layout that
    its matrix product then refuses; we never place those."""
    buft = cpu_extra_buffer_types()["CPU_REPACK"]
    for ne in [(256, 8), (256, 16), (512, 40), (256, 12), (256, 4), (256, 1), (256, 8, 2)]:
        with Context(n_tensors=1) as ctx:
            t = ctx.new_tensor(ty, *ne, name="w")
            buf = lib.ggml_backend_alloc_ctx_tensors_from_buft(ctx.handle, buft)  # bypasses our own check
            assert buf != ffi.NULL
            try:
                ggml_picks = t.ptr.extra != ffi.NULL
            finally:
                lib.ggml_backend_buffer_free(buf)
        if len(ne) == 2:
            assert cpu_repack_fits(ty, ne) == ggml_picks, (ty, ne)
        else:
            assert not cpu_repack_fits(ty, ne)


@needs_repack
@pytest.mark.parametrize("ty", sorted(GGML_REPACK_TYPES))
def test_repacked_products_agree_with_ggmls_ordinary_kernel(cpu, ty):
    """Both quantize the rows to 8 bits the same way and sum the same integer products; only the f32
    order of the block sums differs. Row counts of a draft step: 1 .. 34 (fold-in buckets, noise)."""
    rng = np.random.default_rng(3)
    n_out, k = 64, 512
    raw = quantize(ty, rng.standard_normal((n_out, k)).astype(np.float32))
    w = dequantize(ty, raw, n_out * k).reshape(n_out, k)
    for rows in (1, 4, 9, 16, 18, 34):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        out = {}
        for kind in ("CPU_REPACK", None):
            with Context(n_tensors=1) as ctx:
                wt = ctx.new_tensor(ty, k, n_out, name="w")
                buf = (Buffer.alloc_ctx_tensors_from_buft(ctx, cpu_extra_buffer_types()[kind], cpu) if kind
                       else Buffer.alloc_ctx_tensors(ctx, cpu))
                with buf:
                    wt.set_bytes(raw)
                    assert wt.is_repacked == (kind is not None)
                    out[kind] = mul_mat_rows(cpu, wt, x)
        assert relative_error(out["CPU_REPACK"], out[None]) < 1e-5, (ty, rows)
        # and both are the 8-bit-activation product of the very same weights (a sanity bound)
        assert relative_error(out["CPU_REPACK"], x.astype(np.float64) @ w.T.astype(np.float64)) < 3e-2, (ty, rows)


@needs_repack
@pytest.mark.parametrize("ty", ["q4_k", "q5_k"])
def test_refuses_what_no_layout_takes(cpu, ty):
    """A q4_K matrix of 12 rows (not whole 8-row groups), or a type with no x86 layout (q5_K): a
    clear error naming the buffer, never ggml's abort on upload."""
    ne = (256, 12) if ty == "q4_k" else (256, 16)
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
    g = DraftWeights.from_pretrained(w.save_pretrained(tmp_path / "d.gguf", format="gguf", dtype="q4_k",
                                                       vocab_from=write_vocab_gguf(tmp_path / "t.gguf", 128)))
    rng = np.random.default_rng(4)
    cap = 40
    feats = rng.standard_normal((100, cfg.fc_in)).astype(np.float32)
    for repack in (True, False):
        with BackendWeights(g, cpu, "native", repack=repack) as bw:
            n_q4 = sum(t.type == "q4_k" for t in bw.tensors.values())
            assert n_q4 > 0
            assert bw.n_repacked == (n_q4 if repack else 0) and bw.repack_kinds == (("CPU_REPACK",) if repack else ())
            ring = FeatureRing(cap + 3 * cfg.block_size, cfg.fc_in)
            with DraftKvCache(bw, cpu, cap, cache_type="f32") as cache:
                for committed in (9, 25, 41, 60, 77, 100):  # the last ones past the cap: ring wraps
                    ring.write(min(ring.written, committed), feats[min(ring.written, committed):committed])
                    noise = np.random.default_rng(committed).standard_normal((cfg.block_size, cfg.hidden)).astype(np.float32)
                    got = cache.step(ring, committed, noise)
                    want = R.reference_step(g, feats, committed, cap, noise)
                    assert relative_error(got, want) < 5e-2, (repack, committed)
