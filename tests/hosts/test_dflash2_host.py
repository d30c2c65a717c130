"""A DFlash-2 drafter in the llama.cpp host: greedy generation lossless, sampled generation
distributed as the target's (rejection sampling against the selector path's distributions).

The drafter is the shipped (trained, DFlash-1) SmolLM2 drafter lifted to DFlash-2: convolutions
near the identity and a selector whose codebook term moves some picks off the top logit. So its
drafts are accepted often (the paths where drafts are accepted get exercised) while every
DFlash-2 part of the step graph runs and matters (checked: its drafts differ from the DFlash-1
drafter's)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="the llama.cpp host needs llama-cpp-python (pip install -e '.[llama]')")

from pyggml_dkv import DraftWeights  # noqa: E402
from pyggml_dkv.hosts.llama_cpp import (  # noqa: E402
    GenerationConfig,
    LlamaTarget,
    SpeculativeGenerator,
    compare_to_plain,
    ggml_drafter,
    plain_greedy,
)
from pyggml_dkv.hosts.llama_cpp.drafters import lifted_smollm2_dflash2  # noqa: E402
from pyggml_dkv.hosts.llama_cpp.sampling import sampling_probs  # noqa: E402
from pyggml_dkv.hosts.pretrained import smollm2_drafter_path  # noqa: E402
from pyggml_dkv.model.weights import load_gguf  # noqa: E402
from tests.hosts.hosts_helpers import PROMPTS, THREADS, smollm2_path  # noqa: E402

pytestmark = pytest.mark.slow  # loads SmolLM2 in llama.cpp: the slow tier (pytest -m 'not slow' skips it)

NEAR_TIE = 0.5  # as tests/hosts/test_generate.py: batch-shape noise of this Q4_1 target
N_NEW = 40


@pytest.fixture(scope="module")
def weights() -> DraftWeights:
    return lifted_smollm2_dflash2()


@pytest.fixture(scope="module")
def target(weights):
    t = LlamaTarget(
        smollm2_path(), n_ctx=512, n_batch=64, n_threads=THREADS, capture_layers=weights.cfg.target_layer_ids
    )
    yield t
    t.close()


@pytest.fixture(scope="module")
def prompts(target):
    return [target.tokenize(target.chat_prompt(p)) for p in PROMPTS]


def test_greedy_generation_is_lossless_and_drafts_are_accepted(target, prompts, weights) -> None:
    dflash1 = load_gguf(smollm2_drafter_path())
    with (
        ggml_drafter(weights, str(smollm2_path()), cap=256) as drafter,
        ggml_drafter(dflash1, str(smollm2_path()), cap=256) as plain_drafter,
    ):
        gen = SpeculativeGenerator(target, drafter)
        per_round, differ = [], 0
        for prompt in prompts:
            ref = plain_greedy(target, prompt, N_NEW)
            res = gen.generate(prompt, GenerationConfig(max_tokens=N_NEW, record_logits=True))
            assert all(int(np.argmax(row)) == tok for row, tok in zip(res.logits, res.tokens))
            report = compare_to_plain(res, ref, NEAR_TIE)
            assert report["lossless"], report
            per_round.append(res.stats.tokens_per_round)
            # the selector and convolutions matter: the DFlash-1 drafter drafts otherwise from the same state
            last = int(res.tokens[-1])
            plain_drafter.reset()
            plain_drafter.add_features(drafter.ring.read(0, drafter.committed))
            differ += not np.array_equal(drafter.propose(last), plain_drafter.propose(last))
    print("tokens per round:", [round(x, 2) for x in per_round])
    assert np.mean(per_round) > 1.3, per_round  # drafts were accepted, often
    assert differ >= 1


# chi-square critical values at p = 1e-4 by degrees of freedom (seeded draws: deterministic anyway)
CHI2_P1E4 = {1: 15.14, 2: 18.42, 3: 21.11}


def test_sampled_generation_follows_the_targets_distribution(target, prompts, weights) -> None:
    """Token 2 given token 1, over many seeded generations, is distributed as the target's own
    sampling distribution (chi-square). Drafts are the selector's sampled paths, verified against
    their per-position distributions over the top-k candidates."""
    prompt = prompts[0]
    top_k, temperature = 4, 1.5  # a flat enough distribution that every candidate is seen often
    with ggml_drafter(weights, str(smollm2_path()), cap=256) as drafter:
        gen = SpeculativeGenerator(target, drafter)
        results = [
            gen.generate(
                prompt, GenerationConfig(max_tokens=3, temperature=temperature, top_k=top_k, seed=i, stop_at_eog=False)
            )
            for i in range(240)
        ]
    accepted = [r.stats.rounds[0].n_accepted for r in results if r.stats.rounds]
    assert 0 < sum(a > 0 for a in accepted) < len(accepted)  # both paths: drafts accepted and rejected
    first = Counter(int(r.tokens[0]) for r in results).most_common(1)[0][0]
    seconds = [int(r.tokens[1]) for r in results if int(r.tokens[0]) == first]
    target.clear()  # the target's own distribution for the token after prompt + first
    logits = target.decode(np.append(prompt, first), logits="last")[-1]
    target.clear()
    p = sampling_probs(np.asarray(logits)[None], temperature, top_k)[0]
    support = np.nonzero(p)[0]
    assert set(seconds) <= set(support.tolist())
    counts = np.array([seconds.count(int(t)) for t in support], dtype=np.float64)
    expected = counts.sum() * p[support]
    counts, expected = pool_rare_cells(counts, expected)
    assert counts.sum() >= 80 and counts.size >= 2, (counts, expected)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_P1E4[counts.size - 1], (counts, expected, chi2)


def pool_rare_cells(counts: np.ndarray, expected: np.ndarray, minimum: float = 5.0) -> tuple[np.ndarray, np.ndarray]:
    """The cells expected least pooled, smallest first, until every cell is expected `minimum`
    times or more (the chi-square approximation's rule)."""
    order = np.argsort(expected)
    counts, expected = list(counts[order]), list(expected[order])
    while len(expected) > 1 and expected[0] < minimum:
        counts[1] += counts.pop(0)
        expected[1] += expected.pop(0)
        pairs = sorted(zip(expected, counts))
        expected, counts = [e for e, _ in pairs], [c for _, c in pairs]
    return np.array(counts), np.array(expected)
