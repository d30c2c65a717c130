"""Quantized GGUF drafters stay quantized on the backend, and match the float64 reference
computed with the dequantized values of the very same blocks.

The GGUF's blocks are uploaded byte for byte (BackendWeights dtype "native"). ggml multiplies a
quantized matrix by first quantizing the activations to 8 bits (q8_0 / q8_K blocks, its
`vec_dot_type`), so even with exactly the reference's weights the step carries an 8-bit
activation rounding in every product: up to 0.4% of a block's largest value per element.
The tolerances below are ~2x the worst error measured over the trajectory (printed in the
test summary); f16 / bf16 weights round the activations to f16 / bf16.
"""

from __future__ import annotations

import numpy as np
import pytest

from pyggml_dkv import DraftKvCache, FeatureRing
from pyggml_dkv import reference as R
from pyggml_dkv.common.numeric import relative_error
from pyggml_dkv.drafter.backend_weights import repack_buffer, upload_stored
from pyggml_dkv.model.config import DraftConfig
from pyggml_dkv.model.gguf_write import matrix_type
from pyggml_dkv.model.weights import DraftWeights

pytest.importorskip("gguf")
from tests.model.gguf_helpers import write_vocab_gguf  # noqa: E402

N_VOCAB = 128
# worst max|a-b|/max|b| measured on this trajectory (AMD EPYC Zen 5, 1 thread), hidden / logits,
# -> tolerance ~2x that. The error follows the activations' format, not the weights' bits:
# f16 1.4e-4 / 1.1e-4 (activations in f16); bf16 3.4e-3 / 4.2e-3 (bf16: 8-bit mantissa);
# q8_0 1.4e-2 / 1.4e-2 and q4_0 1.3e-2 / 1.5e-2 (activations in q8_0: int8 per 32 values);
# q4_k 2.3e-2 / 2.0e-2, q5_k 2.1e-2 / 2.3e-2, q6_k 2.3e-2 / 2.4e-2 (2.1e-2 / 2.0e-2 on the VNNI
# kernel of old patch 0020, which also quantizes per 256) (q8_K: int8 per 256 values,
# so one outlier coarsens more values). The weights themselves are exact (the reference
# computes with the dequantized blocks), which is why q6_k is no closer than q4_k.
TOL = {
    "f16": 3e-4,
    "bf16": 1e-2,
    "q8_0": 3e-2,
    "q4_0": 3e-2,
    "q6_k": 5e-2,
    "q5_k": 5e-2,
    "q4_k": 5e-2,
    "q4_k_m": 5e-2,  # llama.cpp's mix of q4_k and q6_k (the head's q6_k on its VNNI kernel where there is one)
}
COMMITS = (3, 17, 40, 41, 90, 75, 160, 161, 300)


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory):
    return write_vocab_gguf(tmp_path_factory.mktemp("vocab") / "target.gguf", N_VOCAB)


# the fast tier (-m "not slow") runs q8_0 and q4_k, the full suite every type
@pytest.mark.parametrize(
    "dtype", [t if t in ("q8_0", "q4_k") else pytest.param(t, marks=pytest.mark.slow) for t in TOL]
)
def test_native_quantized_step_matches_reference(dtype, tmp_path, vocab_file, cpu, parity_log):
    cfg = DraftConfig.toy(vocab=N_VOCAB, mask_token_id=3, target_layer_ids=[1, 4, 7])
    rng = np.random.default_rng(5)
    w = DraftWeights(
        cfg,
        dict(DraftWeights.random(cfg, seed=5)),
        lm_head=rng.standard_normal((N_VOCAB, cfg.hidden), dtype=np.float32) / np.float32(16),
    )
    g = DraftWeights.from_pretrained(
        w.save_pretrained(tmp_path / "d.gguf", format="gguf", dtype=dtype, vocab_from=vocab_file)
    )
    cap = 70
    feats = rng.standard_normal((max(COMMITS) + 1, cfg.fc_in)).astype(np.float32)
    ring = FeatureRing(cap + 3 * cfg.block_size, cfg.fc_in)
    worst = {"hidden": 0.0, "logits": 0.0}
    with g.to_backend(cpu, "native", repack=False) as plain:  # readable: not repacked for AMX / VNNI
        for name, t in plain.tensors.items():
            assert t.type == (matrix_type(name, dtype, cfg.n_layer) if g[name].ndim == 2 else "f32"), name
            if g[name].ndim == 2:  # ggml's dequantization of the uploaded blocks == gguf's (the host copy)
                np.testing.assert_array_equal(t.numpy(), g[name], err_msg=name)
    with g.to_backend(cpu, "native") as bw:  # q8_0 may go to a repacking buffer: the step must agree all the same
        # the lm_head is only multiplied: it may be repacked too (its q8_0 blocks on the VNNI / AMX kernels)
        head, head_buf = upload_stored(cpu, g.stored["lm_head"], "lm_head", matmul_only=True)
        try:
            with (
                DraftKvCache(bw, cpu, cap, cache_type="f32") as hid,
                DraftKvCache(bw, cpu, cap, lm_head=head, cache_type="f32") as lgt,
            ):
                for committed in COMMITS:
                    ring.write(min(ring.written, committed), feats[min(ring.written, committed) : committed])
                    noise = rng.standard_normal((cfg.block_size, cfg.hidden)).astype(np.float32)
                    for what, cache, lm in (("hidden", hid, None), ("logits", lgt, g.lm_head)):
                        got = cache.step(ring, committed, noise)
                        want = R.reference_step(g, feats, committed, cap, noise, lm_head=lm)
                        e = relative_error(got, want)
                        worst[what] = max(worst[what], e)
                        assert e <= TOL[dtype], f"{dtype} {what} committed={committed}: {e:.3e} > {TOL[dtype]}"
        finally:
            head_buf.close()
            head.ctx.close()
    for what, e in worst.items():
        parity_log(f"gguf-native-vs-reference ({what})", f"w={dtype} kv=f32", e, "toy 256/2L, cap 70")


def test_upload_stored_repacks_only_matmul_matrices(tmp_path, vocab_file, cpu):
    """An lm_head uploaded with matmul_only goes where BackendWeights puts q8_0 matrices (AMX /
    CPU_DKV_REPACK where the CPU has the kernel; without, an ordinary buffer, like every matrix
    uploaded without matmul_only), and the logits agree with the ordinary buffer's (ggml's generic
    q8_0 product) to rounding."""
    cfg = DraftConfig.toy(vocab=N_VOCAB, mask_token_id=3, target_layer_ids=[1, 4, 7])
    rng = np.random.default_rng(6)
    w = DraftWeights(
        cfg,
        dict(DraftWeights.random(cfg, seed=6)),
        lm_head=rng.standard_normal((N_VOCAB, cfg.hidden), dtype=np.float32) / np.float32(16),
    )
    g = DraftWeights.from_pretrained(
        w.save_pretrained(tmp_path / "d.gguf", format="gguf", dtype="q8_0", vocab_from=vocab_file)
    )
    feats = rng.standard_normal((40, cfg.fc_in)).astype(np.float32)
    ring = FeatureRing(64, cfg.fc_in)
    ring.append(feats)
    noise = rng.standard_normal((cfg.block_size, cfg.hidden)).astype(np.float32)
    with g.to_backend(cpu, "native") as bw:
        logits = {}
        for matmul_only in (False, True):
            head, head_buf = upload_stored(cpu, g.stored["lm_head"], "lm_head", matmul_only=matmul_only)
            try:
                want = repack_buffer(cpu, "q8_0", *g.stored["lm_head"].shape, bulk=False) if matmul_only else None
                assert head_buf.name == (want or "CPU"), head_buf.name
                with DraftKvCache(bw, cpu, 32, lm_head=head, cache_type="f32") as cache:
                    logits[matmul_only] = cache.step(ring, 40, noise)
            finally:
                for obj in (head_buf, head.ctx):
                    obj.close()
    scale = float(np.abs(logits[False]).max())
    np.testing.assert_allclose(logits[True], logits[False], rtol=0, atol=2e-5 * scale)
    with pytest.raises(TypeError, match="matmul_only"):
        upload_stored(cpu, g.stored["lm_head"], "lm_head", matmul_only=1)


def test_the_stored_types_block_sizes_are_ggmls():
    """model/stored.py states ggml's block sizes itself (it imports without ggml): they must be ggml's."""
    from pyggml_dkv.ggml import lib
    from pyggml_dkv.ggml.types import ggml_type
    from pyggml_dkv.model.stored import BLOCKS, STORED_TYPES, StoredMatrix, row_bytes

    assert set(BLOCKS) == set(STORED_TYPES)
    for name, (block, size) in BLOCKS.items():
        t = ggml_type(name)
        assert (block, size) == (int(lib.ggml_blck_size(t)), int(lib.ggml_type_size(t))), name
        assert row_bytes(name, 4 * block) == int(lib.ggml_row_size(t, 4 * block)), name
        StoredMatrix(name, (3, 2 * block), np.zeros(3 * row_bytes(name, 2 * block), np.uint8))
    with pytest.raises(ValueError, match="multiple of 256"):
        StoredMatrix("q4_k", (2, 128), np.zeros(144, np.uint8))
    with pytest.raises(ValueError, match="needs 68 uint8 bytes"):
        StoredMatrix("q8_0", (2, 32), np.zeros(67, np.uint8))
    with pytest.raises(ValueError, match="must be one of"):
        StoredMatrix("q2_k", (2, 256), np.zeros(168, np.uint8))
