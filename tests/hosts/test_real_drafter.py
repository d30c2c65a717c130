"""pyggml_dkv's own Drafter as the host's drafter.

- Its proposals on features captured from llama.cpp agree with the numpy reference drafter, in
  the llama.cpp process itself (our ggml is private: tests/hosts/test_coexistence.py).
- The generation loop with it, lossless, in process and through RemoteDrafter."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="the llama.cpp host needs llama-cpp-python (pip install -e '.[llama]')")

from pyggml_dkv import Backend, DraftWeights  # noqa: E402
from pyggml_dkv.hosts.llama_cpp import (  # noqa: E402
    GenerationConfig,
    LlamaTarget,
    RemoteDrafter,
    SpeculativeGenerator,
    compare_to_plain,
    ggml_drafter,
    plain_greedy,
    smollm2_draft_config,
)
from pyggml_dkv.hosts.llama_cpp.drafters import ReferenceDrafter, target_embeddings  # noqa: E402
from pyggml_dkv.hosts.llama_cpp.gguf import GGUFFile  # noqa: E402
from tests.hosts.hosts_helpers import PROMPTS, THREADS, smollm2_path  # noqa: E402

pytestmark = pytest.mark.slow  # loads SmolLM2 in llama.cpp: the slow tier (pytest -m 'not slow' skips it)

CFG = smollm2_draft_config(n_layer=2)
NEAR_TIE = 0.5


def test_ggml_drafter_agrees_with_the_reference_drafter(tmp_path: Path) -> None:
    with LlamaTarget(
        smollm2_path(), n_ctx=256, n_batch=64, n_threads=THREADS, capture_layers=CFG.target_layer_ids
    ) as t:
        toks = t.tokenize(t.chat_prompt(PROMPTS[3]))
        logits = t.decode(toks, logits="last")
        feats = t.capture.features().copy()
        last = int(np.argmax(logits[-1]))
    cap = feats.shape[0] - 5  # the second proposal's window is past the drafter's cap
    weights = DraftWeights.random(smollm2_draft_config(n_layer=2), seed=1)
    embed, head = target_embeddings(GGUFFile(smollm2_path()))
    ref = ReferenceDrafter(weights, embed, head, cap=cap)
    out: dict[str, list] = {"logp_err": [], "ids_real": [], "ids_ref": []}
    with Backend("cpu", n_threads=1) as backend:
        real = ggml_drafter(
            weights, str(smollm2_path()), backend=backend, cap=cap, weight_dtype="f32", cache_type="f32"
        )
        try:
            for n in (feats.shape[0] - 3, feats.shape[0]):  # both windows past the cap
                real.reset()
                ref.reset()
                real.add_features(feats[:n])
                ref.add_features(feats[:n])
                _, p_real = real.propose(last, temperature=1.0, rng=np.random.default_rng(0))
                _, p_ref = ref.propose(last, temperature=1.0, rng=np.random.default_rng(0))
                out["logp_err"].append(float(np.abs(np.log(p_real) - np.log(p_ref)).max()))
                out["ids_real"].append(np.asarray(real.propose(last)).tolist())
                out["ids_ref"].append(np.asarray(ref.propose(last)).tolist())
        finally:
            real.close()
    print("max |log p_real - log p_ref| per proposal:", out["logp_err"])
    # f32 weights and cache against the numpy reference in float32: log-probabilities agree
    assert max(out["logp_err"]) < 1e-3, out["logp_err"]
    for a, b in zip(out["ids_real"], out["ids_ref"]):
        assert np.mean(np.array(a) == np.array(b)) >= 0.9


def test_real_drafter_next_to_llama_cpp() -> None:
    path = smollm2_path()
    with LlamaTarget(path, n_ctx=512, n_batch=64, n_threads=THREADS, capture_layers=CFG.target_layer_ids) as t:
        prompt = t.tokenize(t.chat_prompt(PROMPTS[0]))
        ref = plain_greedy(t, prompt, 24)
        with ggml_drafter(DraftWeights.random(CFG, seed=0), str(path), cap=16) as drafter:
            res = SpeculativeGenerator(t, drafter).generate(prompt, GenerationConfig(max_tokens=24, record_logits=True))
            assert all(int(np.argmax(row)) == tok for row, tok in zip(res.logits, res.tokens))
            assert compare_to_plain(res, ref, NEAR_TIE)["lossless"]
            assert drafter.committed == t.n_past > 16  # the window slid past the cap


def test_remote_drafter_drives_the_loop() -> None:
    """Our Drafter in a child process of its own: lossless, in step, and the
    same drafts as the same weights give in that process directly (checked above)."""
    path = smollm2_path()
    with LlamaTarget(path, n_ctx=512, n_batch=64, n_threads=THREADS, capture_layers=CFG.target_layer_ids) as t:
        prompt = t.tokenize(t.chat_prompt(PROMPTS[0]))
        ref = plain_greedy(t, prompt, 24)
        with RemoteDrafter(DraftWeights.random(CFG, seed=0), str(path), cap=16) as drafter:
            gen = SpeculativeGenerator(t, drafter)
            res = gen.generate(prompt, GenerationConfig(max_tokens=24, record_logits=True))
            assert all(int(np.argmax(row)) == tok for row, tok in zip(res.logits, res.tokens))
            assert compare_to_plain(res, ref, NEAR_TIE)["lossless"]
            assert drafter.committed == t.n_past > 16
            sampled = [
                gen.generate(prompt, GenerationConfig(max_tokens=8, temperature=0.8, seed=4)).tokens.tolist()
                for _ in range(2)
            ]
            assert sampled[0] == sampled[1]
        with pytest.raises(Exception, match="closed"):
            drafter.propose(1)


def test_a_dflash_gguf_drafter_drives_the_loop(tmp_path: Path) -> None:
    """A drafter read from a llama.cpp dflash GGUF (q8_0, written with the target's vocabulary):
    the loop stays lossless with it."""
    path = smollm2_path()
    gguf = DraftWeights.random(CFG, seed=2).save_pretrained(
        tmp_path / "drafter.gguf", format="gguf", dtype="q8_0", vocab_from=path
    )
    weights = DraftWeights.from_pretrained(gguf)
    assert weights.cfg.target_layer_ids == CFG.target_layer_ids and weights.stored
    with LlamaTarget(path, n_ctx=256, n_batch=64, n_threads=THREADS, capture_layers=CFG.target_layer_ids) as t:
        prompt = t.tokenize(t.chat_prompt(PROMPTS[1]))
        ref = plain_greedy(t, prompt, 16)
        with ggml_drafter(weights, str(path), cap=32) as drafter:
            res = SpeculativeGenerator(t, drafter).generate(prompt, GenerationConfig(max_tokens=16, record_logits=True))
        assert all(int(np.argmax(row)) == tok for row, tok in zip(res.logits, res.tokens))
        assert compare_to_plain(res, ref, NEAR_TIE)["lossless"]
