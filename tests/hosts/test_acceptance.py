"""Speculative rejection sampling emits exactly the target's distribution (chi-square, many samples),
and greedy acceptance takes the longest argmax-matching prefix plus the bonus token."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="the llama.cpp host needs llama-cpp-python (pip install -e '.[llama]')")

from pyggml_dkv.hosts.llama_cpp.acceptance import accept_greedy, accept_sampled  # noqa: E402
from pyggml_dkv.hosts.llama_cpp.sampling import sampling_probs  # noqa: E402

# chi-square critical value, 5 degrees of freedom, p = 1e-4 (seeded draws: deterministic anyway)
CHI2_DF5_P1E4 = 25.74


def chi_square(counts: np.ndarray, p: np.ndarray) -> float:
    expected = counts.sum() * p
    return float(((counts - expected) ** 2 / expected).sum())


def run_rounds(accept, p: np.ndarray, q: np.ndarray, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Counts of the first emitted token, and of the second one in the rounds that emitted it."""
    rng = np.random.default_rng(seed)
    vocab = p.shape[1]
    first, second = np.zeros(vocab), np.zeros(vocab)
    k = q.shape[0]
    for _ in range(n):
        draft = np.array([rng.choice(vocab, p=q[j]) for j in range(k)])
        n_acc, out = accept(draft, q, p, rng)
        first[out[0]] += 1
        if out.size > 1:
            second[out[1]] += 1
    return first, second


@pytest.mark.slow  # a statistical test
def test_rejection_sampling_emits_the_target_distribution() -> None:
    rng = np.random.default_rng(7)
    vocab, k = 6, 3
    p = rng.dirichlet(np.ones(vocab), size=k + 1)  # the target's distributions, positions 0..k
    q = rng.dirichlet(np.ones(vocab) * 0.5, size=k)  # a draft distribution quite unlike p
    first, second = run_rounds(accept_sampled, p, q, 30_000, seed=1)
    assert chi_square(first, p[0]) < CHI2_DF5_P1E4
    assert second.sum() > 5_000
    assert chi_square(second, p[1]) < CHI2_DF5_P1E4

    # the test has the power to see a wrong rule: accepting every draft emits q, not p
    def accept_all(draft, q_, p_, rng_):
        return len(draft), np.append(draft, 0)

    wrong, _ = run_rounds(accept_all, p, q, 30_000, seed=1)
    assert chi_square(wrong, p[0]) > 10 * CHI2_DF5_P1E4


def test_rejection_sampling_with_equal_distributions_accepts_everything() -> None:
    rng = np.random.default_rng(3)
    p = rng.dirichlet(np.ones(5), size=4)
    for _ in range(200):
        draft = np.array([rng.choice(5, p=p[j]) for j in range(3)])
        n_acc, out = accept_sampled(draft, p[:3], p, rng)
        assert n_acc == 3 and out.size == 4 and (out[:3] == draft).all()


def test_greedy_acceptance_is_the_longest_matching_prefix_plus_bonus() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 11))
    best = logits.argmax(axis=1)
    for n_match in range(5):
        draft = best[:4].copy()
        if n_match < 4:
            draft[n_match] = (draft[n_match] + 1) % 11
        n_acc, out = accept_greedy(draft, logits)
        assert n_acc == n_match
        assert (out == best[: n_match + 1]).all()
    with pytest.raises(ValueError):
        accept_greedy(best[:4], logits[:4])


def test_sampling_probs_top_k_top_p() -> None:
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    assert np.allclose(sampling_probs(logits, 1.0), [[0.5, 0.3, 0.15, 0.05]])
    assert np.allclose(sampling_probs(logits, 1.0, top_k=2), [[0.625, 0.375, 0, 0]])
    assert np.allclose(sampling_probs(logits, 1.0, top_p=0.7), [[0.625, 0.375, 0, 0]])
    with pytest.raises(ValueError):
        sampling_probs(logits, 0.0)
