"""The speculative loop on SmolLM2 with an oracle drafter (the target's own greedy continuation cut
at random lengths, every acceptance length exercised) and the numpy reference drafter.

Lossless, stated for a batch-shape-dependent target: (a) every emitted token is the argmax of the
target's logits row that verified it; (b) against plain one-token greedy decoding the output
agrees up to the first divergence, and every divergence is a near-tie."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="the llama.cpp host needs llama-cpp-python (pip install -e '.[llama]')")

from pyggml_dkv import DraftWeights  # noqa: E402
from pyggml_dkv.hosts.llama_cpp import (  # noqa: E402
    GenerationConfig,
    GGUFFile,
    LlamaTarget,
    OracleDrafter,
    ReferenceDrafter,
    SpeculativeGenerator,
    compare_to_plain,
    plain_greedy,
    smollm2_draft_config,
    target_embeddings,
)
from pyggml_dkv.hosts.llama_cpp.sampling import sampling_probs  # noqa: E402
from tests.hosts.hosts_helpers import PROMPTS, THREADS, rel_err, smollm2_path  # noqa: E402

pytestmark = pytest.mark.slow  # loads SmolLM2 in llama.cpp: the slow tier (pytest -m 'not slow' skips it)

N_NEW = 48
# Logits of one position computed in batches of different shapes differ by up to ~0.1 on this
# model (Q4_1); a divergence is a near-tie when the top-2 gap is below this.
NEAR_TIE = 0.5
CFG = smollm2_draft_config()


@pytest.fixture(scope="module")
def target():
    t = LlamaTarget(smollm2_path(), n_ctx=512, n_batch=64, n_threads=THREADS, capture_layers=CFG.target_layer_ids)
    yield t
    t.close()


@pytest.fixture(scope="module")
def prompts(target):
    return [target.tokenize(target.chat_prompt(p)) for p in PROMPTS]


@pytest.fixture(scope="module")
def plain(target, prompts):
    return [plain_greedy(target, p, N_NEW) for p in prompts]


def oracle(target, prompt, plain_result, seed=0) -> OracleDrafter:
    return OracleDrafter(CFG, target.n_vocab, np.concatenate([prompt, plain_result.tokens]), seed=seed)


def test_greedy_with_oracle_is_lossless_and_exercises_every_length(target, prompts, plain) -> None:
    accepted = []
    drafter = OracleDrafter(CFG, target.n_vocab, [], seed=0)  # one shuffled cycle of cuts across runs
    gen = SpeculativeGenerator(target, drafter)
    for prompt, ref in list(zip(prompts, plain)) * 2:
        drafter.reference = np.concatenate([prompt, ref.tokens])
        drafter.lengths = []
        res = gen.generate(prompt, GenerationConfig(max_tokens=N_NEW, record_logits=True))
        # (a) every emitted token is the argmax of the row that verified it
        assert len(res.logits) == res.tokens.size
        assert all(int(np.argmax(row)) == tok for row, tok in zip(res.logits, res.tokens))
        # (b) agreement with plain greedy up to the first divergence, which must be a near-tie
        cmp = compare_to_plain(res, ref, NEAR_TIE)
        assert cmp["lossless"], cmp
        # while on track, the target accepts exactly what the oracle cut
        if cmp["first_divergence"] is None:
            want = [min(cut, r.n_draft) for cut, r in zip(drafter.lengths, res.stats.rounds)]
            assert [r.n_accepted for r in res.stats.rounds] == want
        accepted += [r.n_accepted for r in res.stats.rounds]
        # bookkeeping: KV and drafter agree; tokens/round is what the histogram says
        assert target.n_past == drafter.committed
        assert res.stats.n_tokens == res.tokens.size
    hist = np.bincount(accepted, minlength=CFG.block_size)
    assert (hist > 0).all(), f"acceptance lengths not all exercised: {hist.tolist()}"


def test_committed_features_are_the_accepted_tokens_features(target, prompts, plain) -> None:
    """The drafter received, in order, the features a single prefill of the final sequence gives."""
    prompt, ref = prompts[0], plain[0]
    drafter = oracle(target, prompt, ref, seed=3)
    res = SpeculativeGenerator(target, drafter).generate(prompt, GenerationConfig(max_tokens=N_NEW))
    got = drafter.features.copy()
    seq = np.concatenate([prompt, res.tokens])[: drafter.committed]
    target.clear()
    want = []
    for lo in range(0, seq.size, target.n_batch):
        target.decode(seq[lo : lo + target.n_batch], logits="none")
        want.append(target.capture.features().copy())
    want = np.concatenate(want)
    assert got.shape == want.shape
    assert rel_err(got, want) < 1e-2  # batch shapes differ: rounding, not different rows
    shifted = rel_err(got[1:], want[:-1])  # an off-by-one commit would look like this
    assert shifted > 10 * rel_err(got, want)


def test_stream_and_callback_equal_generate(target, prompts, plain) -> None:
    prompt, ref = prompts[1], plain[1]
    gen = SpeculativeGenerator(target, oracle(target, prompt, ref, seed=5))
    streamed = list(gen.stream(prompt, GenerationConfig(max_tokens=20)))
    seen: list[int] = []
    res = SpeculativeGenerator(target, oracle(target, prompt, ref, seed=5)).generate(
        prompt, GenerationConfig(max_tokens=20), on_token=seen.append
    )
    assert streamed == seen == res.tokens.tolist()
    assert gen.last_result is not None and gen.last_result.tokens.tolist() == streamed


def test_new_prompt_on_the_same_objects(target, prompts, plain) -> None:
    gen = SpeculativeGenerator(target, oracle(target, prompts[2], plain[2]))
    first = gen.generate(prompts[2], GenerationConfig(max_tokens=16)).tokens
    gen.drafter.reference = np.concatenate([prompts[3], plain[3].tokens])
    other = gen.generate(prompts[3], GenerationConfig(max_tokens=16)).tokens
    gen.drafter.reference = np.concatenate([prompts[2], plain[2].tokens])
    again = gen.generate(prompts[2], GenerationConfig(max_tokens=16)).tokens
    assert first.tolist() == again.tolist()
    assert compare_to_plain_tokens(other, plain[3].tokens)


def compare_to_plain_tokens(a: np.ndarray, b: np.ndarray) -> bool:
    n = min(a.size, b.size)
    return bool((a[:n] == b[:n]).all())


def test_max_tokens_stop_tokens_and_eog(target, prompts, plain) -> None:
    prompt, ref = prompts[2], plain[2]
    gen = SpeculativeGenerator(target, oracle(target, prompt, ref))
    res = gen.generate(prompt, GenerationConfig(max_tokens=5))
    assert res.tokens.size == 5 and res.finish_reason == "length"
    stop = int(ref.tokens[4])
    first_stop = int(np.nonzero(ref.tokens == stop)[0][0])
    res = gen.generate(prompt, GenerationConfig(max_tokens=N_NEW, stop_tokens=[stop]))
    assert res.finish_reason == "stop" and res.tokens.tolist() == ref.tokens[:first_stop].tolist()
    # the capital-of-France answer ends with <|im_end|> well within N_NEW tokens
    assert ref.tokens.size < N_NEW
    res = gen.generate(prompt, GenerationConfig(max_tokens=N_NEW))
    assert res.finish_reason == "stop" and res.tokens.size == ref.tokens.size


def test_context_limit() -> None:
    with LlamaTarget(
        smollm2_path(), n_ctx=256, n_batch=64, n_threads=THREADS, capture_layers=CFG.target_layer_ids
    ) as small:
        assert small.n_ctx == 256  # llama.cpp pads n_ctx to a multiple of 256
        prompt = small.tokenize(small.chat_prompt("Continue this list of animals: cat, dog, " * 21))
        assert 200 < prompt.size < 240
        ref = plain_greedy(small, prompt, 100)
        res = SpeculativeGenerator(small, oracle(small, prompt, ref)).generate(prompt, GenerationConfig(max_tokens=100))
        assert res.finish_reason == "context"
        assert small.n_past == small.n_ctx and prompt.size + res.tokens.size == small.n_ctx + 1
        assert compare_to_plain(res, ref, NEAR_TIE)["lossless"]


def test_reference_drafter_past_its_window(target, prompts, plain) -> None:
    """A DFlash-shaped drafter (numpy reference, random weights, window 8) whose window the prompt
    overflows: every round verified, output lossless, drafter and KV stay in step."""
    embed, head = target_embeddings(GGUFFile(smollm2_path()))
    weights = DraftWeights.random(CFG, seed=0)
    drafter = ReferenceDrafter(weights, embed, head, cap=8)
    prompt, ref = prompts[0], plain[0]
    assert prompt.size > 8
    res = SpeculativeGenerator(target, drafter).generate(prompt, GenerationConfig(max_tokens=8, record_logits=True))
    assert all(int(np.argmax(row)) == tok for row, tok in zip(res.logits, res.tokens))
    assert compare_to_plain(res, ref, NEAR_TIE)["lossless"]
    assert drafter.committed == target.n_past > 8 + prompt.size - 2
    assert res.stats.n_tokens == 1 + sum(r.n_emitted for r in res.stats.rounds)


def test_sampling(target, prompts, plain) -> None:
    prompt, ref = prompts[0], plain[0]
    cfg = GenerationConfig(max_tokens=12, temperature=0.9, top_k=40, seed=11, record_logits=True)
    runs = [SpeculativeGenerator(target, oracle(target, prompt, ref)).generate(prompt, cfg) for _ in range(2)]
    assert runs[0].tokens.tolist() == runs[1].tokens.tolist()  # seeded: reproducible
    for tok, row in zip(runs[0].tokens, runs[0].logits):
        assert sampling_probs(row, 0.9, 40)[0, tok] > 0  # inside the target's top-k at its position
    other = SpeculativeGenerator(target, oracle(target, prompt, ref)).generate(
        prompt, GenerationConfig(max_tokens=12, temperature=0.9, top_k=40, seed=12)
    )
    assert other.tokens.tolist() != runs[0].tokens.tolist()
    # at a temperature where the target's top token has p >= 0.999 at every position, sampling stays
    # on the oracle's track (the greedy continuation) and its drafts get accepted through p/q
    i = int(np.argmax([r.gaps[:16].min() for r in plain]))
    cool = GenerationConfig(max_tokens=16, temperature=float(plain[i].gaps[:16].min()) / 7, seed=1)
    drafter = oracle(target, prompts[i], plain[i])
    res = SpeculativeGenerator(target, drafter).generate(prompts[i], cool)
    assert sum(r.n_accepted for r in res.stats.rounds) > 0
    assert target.n_past == drafter.committed
