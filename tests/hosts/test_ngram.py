"""n-gram (prompt lookup) drafting and the hybrid with a DFlash drafter, and DFlash drafts cut at
low drafter confidence (p_min): lookup on hand-made histories, then each in the real loop."""

from __future__ import annotations

import numpy as np
import pytest

from pyggml_dkv.drafter.drafter import confident_prefix
from pyggml_dkv.hosts.llama_cpp import smollm2_draft_config
from pyggml_dkv.hosts.llama_cpp.ngram import HybridDrafter, NgramDrafter, TokenHistory, ngram_lookup

CFG = smollm2_draft_config(n_layer=1, block_size=6)


def test_lookup_takes_the_longest_most_recent_match():
    ctx = np.array([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3])
    # last 3 tokens "5 2 3" never occurred; "2 3" did, most recently before 7
    np.testing.assert_array_equal(ngram_lookup(ctx, 3, 2, 4), [7, 5, 2, 3])
    np.testing.assert_array_equal(ngram_lookup(ctx, 3, 2, 2), [7, 5])
    assert ngram_lookup(np.array([4, 5, 6, 7]), 3, 2, 4).size == 0  # nothing repeats
    assert ngram_lookup(np.array([4, 5, 6, 5]), 3, 2, 4).size == 0  # a single token is below min_ngram
    np.testing.assert_array_equal(ngram_lookup(np.array([4, 5, 6, 5]), 3, 1, 4), [6, 5])
    assert ngram_lookup(np.array([3]), 3, 1, 4).size == 0


def test_history_follows_observe_and_rewind():
    h = TokenHistory(capacity=2)
    h.observe([1, 2, 3])
    h.observe(np.array([4]))
    np.testing.assert_array_equal(h.tokens, [1, 2, 3, 4])
    h.rewind(2)
    np.testing.assert_array_equal(h.tokens, [1, 2])
    h.reset()
    assert h.tokens.size == 0


def test_ngram_drafter_bookkeeping_and_refusals():
    d = NgramDrafter(CFG, 49152)
    d.observe([5, 6, 7, 8, 5, 6])
    d.add_features(np.zeros((6, CFG.fc_in), np.float32))
    assert d.committed == 6
    np.testing.assert_array_equal(d.propose(7), [8, 5, 6, 7])  # context ... 5 6 7 -> after "5 6 7"
    with pytest.raises(ValueError, match="greedy"):
        d.propose(7, temperature=0.5)
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter(CFG, 49152, max_ngram=2, min_ngram=3)


def test_confident_prefix_cuts_at_the_first_unsure_row():
    logits = np.array([[5.0, 0.0, 0.0], [0.0, 0.1, 0.0], [0.0, 0.0, 9.0]])
    np.testing.assert_array_equal(confident_prefix(logits, 0.0), [0, 1, 2])
    np.testing.assert_array_equal(confident_prefix(logits, 0.5), [0])  # row 1 is a near-tie
    assert confident_prefix(logits, 0.999).size == 0


# --- in the real loop (llama.cpp target, our Drafter) -----------------------------------------


def _real_loop():
    pytest.importorskip("llama_cpp", reason="the llama.cpp host needs llama-cpp-python")
    from pyggml_dkv.hosts.llama_cpp import (
        GenerationConfig,
        LlamaTarget,
        SpeculativeGenerator,
        compare_to_plain,
        ggml_drafter,
        plain_greedy,
    )
    from tests.hosts.hosts_helpers import THREADS, smollm2_path

    return (
        GenerationConfig,
        LlamaTarget,
        SpeculativeGenerator,
        compare_to_plain,
        ggml_drafter,
        plain_greedy,
        THREADS,
        smollm2_path,
    )


@pytest.mark.slow  # SmolLM2 in llama.cpp
def test_ngram_hybrid_and_p_min_drafters_are_lossless_in_the_loop():
    (
        GenerationConfig,
        LlamaTarget,
        SpeculativeGenerator,
        compare_to_plain,
        ggml_drafter,
        plain_greedy,
        THREADS,
        smollm2_path,
    ) = _real_loop()
    from pyggml_dkv import DraftWeights

    path = smollm2_path()
    weights = DraftWeights.random(CFG, seed=0)
    # a prompt that makes the target repeat itself: n-gram drafts get accepted
    text = "Repeat exactly, three times: the quick brown fox jumps over the lazy dog."
    with LlamaTarget(path, n_ctx=512, n_batch=64, n_threads=THREADS, capture_layers=CFG.target_layer_ids) as t:
        prompt = t.tokenize(t.chat_prompt(text))
        ref = plain_greedy(t, prompt, 48)
        with ggml_drafter(weights, str(path)) as dflash, ggml_drafter(weights, str(path), p_min=0.3) as cut:
            drafters = {"ngram": NgramDrafter(CFG, dflash.vocab), "hybrid": HybridDrafter(dflash), "p_min": cut}
            for name, drafter in drafters.items():
                res = SpeculativeGenerator(t, drafter).generate(prompt, GenerationConfig(max_tokens=48))
                assert compare_to_plain(res, ref, 0.5)["lossless"], name
                if name == "ngram":
                    assert sum(r.n_accepted for r in res.stats.rounds) > 5  # the repetition was drafted
                    assert drafter.history.tokens.size == t.n_past
                if name == "hybrid":
                    assert drafter.rounds["ngram"] > 0 and drafter.rounds["dflash"] > 0
                    assert dflash.committed == t.n_past
                if name == "p_min":  # random weights are never sure: most drafts are cut to nothing
                    assert np.mean([r.n_draft for r in res.stats.rounds]) < CFG.block_size - 1
        with pytest.raises(ValueError, match="p_min"):
            ggml_drafter(weights, str(path), p_min=1.5)
