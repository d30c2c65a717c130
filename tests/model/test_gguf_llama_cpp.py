"""Cross-checks against llama.cpp itself (llama-cpp-python 0.3.36's libllama, in a child process):
its loader accepts the dflash GGUFs we write, and its own DFlash drafter computes what
DraftKvCache computes on the same file, features and noise tokens over a trajectory of commits
(including windows past the cap, kept in llama.cpp's draft cache by dropping older positions).
"""

from __future__ import annotations

import numpy as np
import pytest

from pyggml_dkv import DraftKvCache, FeatureRing
from pyggml_dkv import reference as R
from pyggml_dkv.common.numeric import relative_error
from pyggml_dkv.drafter.backend_weights import upload_stored
from pyggml_dkv.hosts.llama_cpp import native_dflash
from pyggml_dkv.hosts.llama_cpp.native_dflash import (
    llama_cpp_available,
    llama_dflash_bench,
    llama_dflash_trajectory,
    llama_model_info,
)
from pyggml_dkv.model.config import DraftConfig
from pyggml_dkv.model.weights import DraftWeights

pytestmark = pytest.mark.slow  # llama.cpp runs our GGUF files: the slow tier

pytest.importorskip("gguf")
if not llama_cpp_available():
    pytest.skip("llama-cpp-python is not installed (pip install pyggml_dkv[llama])", allow_module_level=True)


@pytest.fixture(scope="module")
def target_gguf():
    from pyggml_dkv.hosts.smollm2 import ModelUnavailableError, smollm2_gguf

    try:
        return smollm2_gguf()
    except ModelUnavailableError as e:
        pytest.skip(f"no target GGUF for the vocabulary: {e}")


def drafter(n_vocab: int, seed: int = 0, **changes) -> DraftWeights:
    cfg = DraftConfig.toy(vocab=n_vocab, mask_token_id=7, target_layer_ids=[1, 5, 9], **changes)
    rng = np.random.default_rng(seed + 1)
    emb = rng.standard_normal((n_vocab, cfg.hidden), dtype=np.float32)
    head = rng.standard_normal((n_vocab, cfg.hidden), dtype=np.float32) / np.float32(np.sqrt(cfg.hidden))
    return DraftWeights(cfg, dict(DraftWeights.random(cfg, seed=seed)), embed_tokens=emb, lm_head=head)


@pytest.mark.parametrize("dtype", ["f16", "q8_0", "q4_k", "q4_k_m"])
def test_llama_cpp_loads_what_we_write(dtype, tmp_path, target_gguf):
    w = drafter(49152, freq_scale=0.25, ext_factor=1.0, n_ctx_orig=4096)
    path = w.save_pretrained(tmp_path / "d.gguf", format="gguf", dtype=dtype, vocab_from=target_gguf)
    info = llama_model_info(path)
    cfg = w.cfg
    assert info["meta"]["general.architecture"] == "dflash"
    assert (info["n_embd"], info["n_layer"], info["n_head"], info["n_head_kv"]) == (
        cfg.hidden,
        cfg.n_layer,
        cfg.n_head,
        cfg.n_head_kv,
    )
    assert info["n_vocab"] == 49152 and info["mask"] == cfg.mask_token_id
    assert info["target_layer_ids"] == [i + 1 for i in cfg.target_layer_ids]  # layer inputs
    assert info["rope_type"] == 2  # LLAMA_ROPE_TYPE_NEOX
    meta = info["meta"]
    assert int(meta["dflash.block_size"]) == cfg.block_size
    assert int(meta["dflash.feed_forward_length"]) == cfg.ffn
    assert int(meta["dflash.attention.key_length"]) == cfg.head_dim
    assert float(meta["dflash.attention.layer_norm_rms_epsilon"]) == pytest.approx(cfg.rms_eps)
    assert meta["dflash.rope.scaling.type"] == "yarn" and float(meta["dflash.rope.scaling.factor"]) == 4.0
    assert info["n_params"] == w.n_params + w.embed_tokens.size + w.lm_head.size


def commits_trajectory(rng, cap: int, q_len: int, n: int) -> list[int]:
    c, out = 5, []
    for _ in range(n):
        out.append(c)
        r = rng.random()
        if r < 0.15 and c > q_len:
            c -= int(rng.integers(1, q_len))  # rejected drafts: rewind
        elif r < 0.3:
            c += int(rng.choice([2 * q_len + 3, cap + 5]))  # long accepts / prompt chunks
        else:
            c += int(rng.integers(1, q_len + 1))
    return out


# llama.cpp vs DraftKvCache on the same GGUF, max|a-b|/max|b| of the logits over the trajectory,
# measured (AMD EPYC Zen 5, 1 thread; flash attention off and on alike): f16 8.2e-4 (llama.cpp
# vs the float64 reference 8.2e-4, ours 2.2e-4); q8_0 1.7e-2 (both sides quantize activations
# to q8_0 in every product, each with its own rounding); Q4_K_M 2.3e-2 (q8_K activations; ours on
# the VNNI kernels of old patch 0020-0021, llama.cpp on its own; each 2.4e-2 from the
# reference). Tolerances ~2.5x those.
TOL = {
    ("f16", False): 2e-3,
    ("f16", True): 2e-3,
    ("q8_0", False): 4e-2,
    ("q8_0", True): 4e-2,
    ("q4_k_m", False): 6e-2,
    ("q4_k_m", True): 6e-2,
}


@pytest.mark.parametrize("dtype,flash_attn", list(TOL))
def test_llama_cpp_drafter_matches_ours(dtype, flash_attn, tmp_path, target_gguf, cpu, parity_log):
    path = drafter(49152).save_pretrained(tmp_path / "d.gguf", format="gguf", dtype=dtype, vocab_from=target_gguf)
    g = DraftWeights.from_pretrained(path)
    cfg, cap = g.cfg, 80
    rng = np.random.default_rng(4)
    commits = commits_trajectory(rng, cap, cfg.block_size, 24)
    feats = rng.standard_normal((max(commits) + 1, cfg.fc_in)).astype(np.float32)
    tokens = np.full((len(commits), cfg.block_size), cfg.mask_token_id, dtype=np.int32)
    tokens[:, 0] = rng.integers(0, 49152, size=len(commits))

    theirs = llama_dflash_trajectory(path, feats, commits, tokens, cap, flash_attn=flash_attn)
    assert theirs.shape == (len(commits), cfg.block_size, 49152)

    ring = FeatureRing(max(commits) + 1, cfg.fc_in)
    errs = {"llama.cpp-vs-ours": 0.0, "llama.cpp-vs-reference": 0.0, "ours-vs-reference": 0.0}
    agree = []
    emb, emb_buf = upload_stored(cpu, g.stored["embed_tokens"], "embed_tokens")
    head, head_buf = upload_stored(cpu, g.stored["lm_head"], "lm_head")
    try:
        with (
            g.to_backend(cpu, "native") as bw,
            DraftKvCache(bw, cpu, cap, lm_head=head, embed_tokens=emb, cache_type="f16") as cache,
        ):
            for k, committed in enumerate(commits):
                ring.write(min(ring.written, committed), feats[min(ring.written, committed) : committed])
                ours = cache.step_tokens(ring, committed, tokens[k], output="logits")
                want = R.reference_step(g, feats, committed, cap, g.embed_tokens[tokens[k]], lm_head=g.lm_head)
                errs["llama.cpp-vs-ours"] = max(errs["llama.cpp-vs-ours"], relative_error(theirs[k], ours))
                errs["llama.cpp-vs-reference"] = max(errs["llama.cpp-vs-reference"], relative_error(theirs[k], want))
                errs["ours-vs-reference"] = max(errs["ours-vs-reference"], relative_error(ours, want))
                same = theirs[k].argmax(-1) == ours.argmax(-1)
                agree.append(np.mean(same))
                # a random drafter has near-ties among 49152 logits: ids must agree wherever the
                # reference's top-2 margin exceeds what the tolerated error could swap
                top2 = np.sort(want, axis=-1)[:, -2:]
                decisive = top2[:, 1] - top2[:, 0] > 2 * TOL[(dtype, flash_attn)] * np.abs(want).max()
                assert same[decisive].all(), f"committed={committed}: draft ids differ on decisive rows"
    finally:
        for obj in (emb_buf, emb.ctx, head_buf, head.ctx):
            obj.close()
    case = f"toy 256/2L vocab 49152 cap {cap} fa={'on' if flash_attn else 'off'}"
    for name, e in errs.items():
        parity_log(f"{name} (logits)", f"w={dtype} kv=f16", e, case)
    parity_log("llama.cpp-vs-ours draft-id disagreement", f"w={dtype} kv=f16", 1.0 - float(np.mean(agree)), case)
    assert errs["llama.cpp-vs-ours"] <= TOL[(dtype, flash_attn)], errs


def test_llama_dflash_bench_wait_policies(tmp_path, target_gguf, monkeypatch):
    """The step benchmark's llama.cpp side runs under the OpenMP wait policy asked for (its own
    default when None, whatever this process has), and refuses a policy OpenMP does not know."""
    w = drafter(49152)
    path = w.save_pretrained(tmp_path / "d.gguf", format="gguf", dtype="f16", vocab_from=target_gguf)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # the benchmark's own process: must not leak into the child
    seen = []
    real_run = native_dflash.subprocess.run

    def run(*args, **kwargs):
        seen.append(kwargs["env"].get("OMP_WAIT_POLICY"))
        return real_run(*args, **kwargs)

    monkeypatch.setattr(native_dflash.subprocess, "run", run)
    for policy in (None, "passive", "active"):
        times = llama_dflash_bench(
            path,
            [8, 20],
            fc_in=w.cfg.fc_in,
            q_len=w.cfg.block_size,
            n_new=3,
            reps=2,
            warmup=1,
            threads=1,
            omp_wait_policy=policy,
        )
        assert sorted(times) == [8, 20] and all(len(t) == 2 and min(t) > 0 for t in times.values()), (policy, times)
    assert seen == [None, "PASSIVE", "ACTIVE"]
    with pytest.raises(ValueError, match="omp_wait_policy"):
        llama_dflash_bench(path, [8], fc_in=w.cfg.fc_in, q_len=w.cfg.block_size, omp_wait_policy="spin")
