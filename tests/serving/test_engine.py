"""SpeculativeEngine on SmolLM2-135M-Instruct with the shipped drafter: concurrent greedy requests
equal each request decoded alone (plain greedy, up to near-ties), with and without drafts;
joining, cancelling, the queue bound, max_tokens / stop tokens, draft length 0, shutdown."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="the llama.cpp host needs llama-cpp-python (pip install -e '.[llama]')")
pytest.importorskip("gguf", reason="reading the shipped GGUF drafter needs the gguf package")

from pyggml_dkv import Backend, DraftWeights  # noqa: E402
from pyggml_dkv.hosts.llama_cpp import LlamaTarget, compare_to_plain, ggml_drafter, plain_greedy  # noqa: E402
from pyggml_dkv.hosts.llama_cpp.batched_target import BatchedLlamaTarget  # noqa: E402
from pyggml_dkv.hosts.pretrained import smollm2_drafter_path  # noqa: E402
from pyggml_dkv.serving.calibration import calibrate  # noqa: E402
from pyggml_dkv.serving.engine import EngineClosedError, QueueFullError, RequestParams, SpeculativeEngine  # noqa: E402
from pyggml_dkv.serving.policy import CostModel, FixedPolicy, SpeedPolicy  # noqa: E402
from tests.hosts.hosts_helpers import PROMPTS, THREADS, smollm2_path  # noqa: E402

pytestmark = pytest.mark.slow  # loads SmolLM2 in llama.cpp: the slow tier (pytest -m 'not slow' skips it)

NEAR_TIE = 0.5
MAX = 32
PARALLEL = 4


@pytest.fixture(scope="module")
def weights() -> DraftWeights:
    return DraftWeights.from_pretrained(smollm2_drafter_path())


@pytest.fixture(scope="module")
def target(weights: DraftWeights) -> Iterator[BatchedLlamaTarget]:
    with BatchedLlamaTarget(
        smollm2_path(), n_parallel=PARALLEL, n_ctx=1024, n_threads=THREADS, capture_layers=weights.cfg.target_layer_ids
    ) as t:
        yield t


@pytest.fixture(scope="module")
def drafter(weights: DraftWeights) -> Iterator[Any]:
    backend = Backend("cpu", n_threads=THREADS)
    d = ggml_drafter(weights, str(smollm2_path()), backend=backend, cap=256, lanes=PARALLEL)
    yield d
    d.close()
    backend.close()


@pytest.fixture(scope="module")
def costs(target: BatchedLlamaTarget, drafter: Any) -> CostModel:
    return calibrate(target, drafter, PARALLEL, PARALLEL * drafter.cfg.block_size, reps=1)


@pytest.fixture(scope="module")
def prompts(target: BatchedLlamaTarget) -> list[np.ndarray]:
    return [target.tokenize(target.chat_prompt(p)) for p in PROMPTS]


@pytest.fixture(scope="module")
def plain() -> Iterator[Callable[[np.ndarray, int], Any]]:
    """plain_greedy of a prompt alone on a single-sequence LlamaTarget (cached)."""
    cache: dict[tuple[tuple[int, ...], int], Any] = {}
    with LlamaTarget(smollm2_path(), n_ctx=512, n_threads=THREADS) as lt:

        def get(prompt: np.ndarray, n: int) -> Any:
            key = (tuple(int(t) for t in prompt), n)
            if key not in cache:
                cache[key] = plain_greedy(lt, prompt, n)
            return cache[key]

        yield get


def greedy(n: int = MAX, **kw: Any) -> RequestParams:
    return RequestParams(max_tokens=n, record_gaps=True, **kw)


def check_plain(res: Any, ref: Any, max_tokens: int) -> None:
    """Lossless: equal to plain greedy up to a near-tie; then the same length and finish reason."""
    cmp = compare_to_plain(res, ref, NEAR_TIE)
    assert cmp["lossless"], cmp
    if cmp["first_divergence"] is None:
        assert res.tokens.size == ref.tokens.size, (res.tokens.size, ref.tokens.size)
        assert res.finish_reason == ("length" if ref.tokens.size == max_tokens else "stop")


def wait_tokens(handle: Any, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while len(handle.tokens) < n and not handle.done:
        assert time.monotonic() < deadline, f"{handle} made no progress"
        time.sleep(0.005)


@pytest.mark.parametrize("mode", ["no drafter", "7 drafts", "policy"])
def test_concurrent_greedy_requests_equal_each_alone(
    target: BatchedLlamaTarget, drafter: Any, costs: CostModel, prompts: list[np.ndarray], plain: Any, mode: str
) -> None:
    kw: dict[str, Any] = {
        "no drafter": {},
        "7 drafts": {"policy": FixedPolicy(7)},
        "policy": {"policy": SpeedPolicy(), "cost_model": costs},
    }[mode]
    engine = SpeculativeEngine(target, None if mode == "no drafter" else drafter, **kw)
    try:
        handles = [engine.submit(p, greedy()) for p in prompts]
        results = [h.result(timeout=120) for h in handles]
    finally:
        assert engine.shutdown(10)
    for p, res in zip(prompts, results):
        check_plain(res, plain(p, MAX), MAX)
        st = res.stats
        assert st.rounds == len(st.accepted) == len(st.emitted) > 0
        assert all(0 <= a <= k <= 7 for a, k in zip(st.accepted, st.draft_lengths))
    lanes = sorted(r.stats.lane for r in results)
    assert lanes == [0, 1, 2, 3]
    if mode == "no drafter":
        assert engine.stats.draft_steps == 0 and all(r.stats.draft_lengths == [0] * r.stats.rounds for r in results)
    if mode == "7 drafts":  # the shipped drafter's drafts are verified and some accepted
        assert sum(sum(r.stats.accepted) for r in results) > 0
        assert max(r.stats.tokens_per_round for r in results) > 1.2
    assert all(target.n_past_of(s) == 0 for s in range(PARALLEL))  # every sequence freed


def test_requests_join_while_others_run(
    target: BatchedLlamaTarget, drafter: Any, prompts: list[np.ndarray], plain: Any
) -> None:
    with SpeculativeEngine(target, drafter, policy=FixedPolicy(3)) as engine:
        first = engine.submit(prompts[0], greedy(48))
        wait_tokens(first, 4)
        assert not first.done
        later = [engine.submit(p, greedy()) for p in prompts[1:3]]
        results = [h.result(timeout=120) for h in [first, *later]]
    check_plain(results[0], plain(prompts[0], 48), 48)
    for p, res in zip(prompts[1:3], results[1:]):
        check_plain(res, plain(p, MAX), MAX)
    assert [r.stats.lane for r in results] == [0, 1, 2]
    assert results[1].stats.started_at > results[0].stats.first_token_at  # really joined a running batch


def test_cancel_frees_the_lane_for_a_later_request(
    target: BatchedLlamaTarget, drafter: Any, prompts: list[np.ndarray], plain: Any
) -> None:
    with SpeculativeEngine(target, drafter, parallel=2, max_queue=0, policy=FixedPolicy(3)) as engine:
        a = engine.submit(prompts[0], greedy(200))
        b = engine.submit(prompts[1], greedy(200))
        wait_tokens(a, 3)
        assert a.cancel() and not a.cancel()
        assert a.finish_reason == "cancelled" and a.done
        got = list(a)  # iteration ends at once
        assert got == a.tokens[: len(got)]
        n_at_cancel = len(a.tokens)
        c = engine.submit(prompts[2], greedy(24))  # the queue takes none: it needs a's lane
        res = c.result(timeout=120)
        assert res.stats.lane == a.stats.lane == 0
        check_plain(res, plain(prompts[2], 24), 24)
        assert len(a.tokens) == n_at_cancel
        b.cancel()
    assert b.finish_reason in ("cancelled", "stop", "length")


def test_a_full_queue_raises(target: BatchedLlamaTarget) -> None:
    engine = SpeculativeEngine(target, None, parallel=1, max_queue=1)
    prompt = target.tokenize(target.chat_prompt(PROMPTS[0]))
    try:
        running = engine.submit(prompt, RequestParams(max_tokens=200))
        wait_tokens(running, 1)  # it holds the only sequence
        queued = engine.submit(prompt, RequestParams(max_tokens=200))
        with pytest.raises(QueueFullError):
            engine.submit(prompt, RequestParams(max_tokens=4))
        assert queued.cancel()
        assert engine.waiting == 0
        again = engine.submit(prompt, RequestParams(max_tokens=4))  # room again
        running.cancel()
        assert again.result(timeout=60).finish_reason in ("length", "stop")
    finally:
        engine.shutdown(0)
    with pytest.raises(EngineClosedError):
        engine.submit(prompt, RequestParams(max_tokens=4))


def test_max_tokens_and_stop_tokens(
    target: BatchedLlamaTarget, drafter: Any, prompts: list[np.ndarray], plain: Any
) -> None:
    ref = plain(prompts[1], MAX).tokens.tolist()
    stop = ref[5]
    cut = ref.index(stop)  # its first occurrence ends the request; the stop token is not emitted
    with SpeculativeEngine(target, drafter, policy=FixedPolicy(7)) as engine:
        h_len = engine.submit(prompts[1], greedy(5))
        h_one = engine.submit(prompts[1], greedy(1))
        h_stop = engine.submit(prompts[1], greedy(MAX, stop_token_ids=(stop,)))
        h_first = engine.submit(prompts[1], greedy(MAX, stop_token_ids=(ref[0],)))
        r_len, r_one, r_stop, r_first = (h.result(timeout=120) for h in (h_len, h_one, h_stop, h_first))
    assert (r_len.finish_reason, r_len.tokens.tolist()) == ("length", ref[:5])
    assert (r_one.finish_reason, r_one.tokens.tolist()) == ("length", ref[:1])
    assert (r_stop.finish_reason, r_stop.tokens.tolist()) == ("stop", ref[:cut])
    assert (r_first.finish_reason, r_first.tokens.tolist(), r_first.stats.rounds) == ("stop", [], 0)
    assert all(k <= 4 for k in r_len.stats.draft_lengths)  # never drafts past max_tokens


def test_draft_length_zero_is_plain_decoding(
    target: BatchedLlamaTarget, drafter: Any, prompts: list[np.ndarray], plain: Any
) -> None:
    with SpeculativeEngine(target, drafter, policy=FixedPolicy(0)) as engine:
        results = [h.result(timeout=120) for h in [engine.submit(p, greedy()) for p in prompts[:2]]]
    assert engine.stats.draft_steps == 0
    for p, res in zip(prompts, results):
        assert set(res.stats.draft_lengths) == {0} and res.stats.tokens_per_round == 1.0
        check_plain(res, plain(p, MAX), MAX)


def test_sampling_requests_run_with_drafts(target: BatchedLlamaTarget, drafter: Any, prompts: list[np.ndarray]) -> None:
    params = RequestParams(max_tokens=24, temperature=0.8, top_p=0.95, top_k=40, seed=1)
    with SpeculativeEngine(target, drafter, policy=FixedPolicy(3)) as engine:
        results = [engine.submit(p, params) for p in prompts[:2]] + [engine.submit(prompts[2], greedy(8))]
        results = [h.result(timeout=120) for h in results]
    for res in results:
        assert res.finish_reason in ("length", "stop") and res.tokens.size >= 1
        assert ((res.tokens >= 0) & (res.tokens < target.n_vocab)).all()
        assert all(0 <= a <= k for a, k in zip(res.stats.accepted, res.stats.draft_lengths))


def test_shutdown(target: BatchedLlamaTarget, drafter: Any, costs: CostModel, prompts: list[np.ndarray]) -> None:
    engine = SpeculativeEngine(target, drafter, cost_model=costs)
    short = [engine.submit(p, RequestParams(max_tokens=6)) for p in prompts[:2]]
    assert engine.shutdown(60)  # finishes what is in flight
    assert all(h.finish_reason in ("length", "stop") for h in short)
    with pytest.raises(EngineClosedError):
        engine.submit(prompts[0])

    engine = SpeculativeEngine(target, drafter, parallel=2, cost_model=costs)
    long = [engine.submit(p, RequestParams(max_tokens=400)) for p in prompts[:3]]  # the third waits
    wait_tokens(long[0], 2)
    t0 = time.monotonic()
    assert not engine.shutdown(0.2)  # bounded: what is left is cancelled
    assert time.monotonic() - t0 < 5.0
    assert all(h.done for h in long)
    assert long[2].finish_reason == "cancelled" and long[2].tokens == []
    assert all(target.n_past_of(s) == 0 for s in range(PARALLEL))


def test_bad_requests_are_refused(target: BatchedLlamaTarget) -> None:
    with SpeculativeEngine(target, None) as engine:
        with pytest.raises(ValueError, match="max_tokens"):
            engine.submit([1, 2, 3], RequestParams(max_tokens=0))
        with pytest.raises(ValueError, match="top_p"):
            engine.submit([1, 2, 3], RequestParams(top_p=0.0))
        with pytest.raises(ValueError, match="token ids"):
            engine.submit([1, target.n_vocab])
        with pytest.raises(ValueError, match="no room"):
            engine.submit(np.ones(target.n_ctx_seq, dtype=np.int64))
        with pytest.raises(ValueError, match="non-empty"):
            engine.submit([])
    with pytest.raises(ValueError, match="parallel"):
        SpeculativeEngine(target, None, parallel=PARALLEL + 1)


@pytest.mark.parametrize("mode", ["no drafter", "3 drafts"])
def test_a_prompt_that_continues_an_earlier_request_keeps_its_positions(
    target: BatchedLlamaTarget, drafter: Any, prompts: list[np.ndarray], plain: Any, mode: str
) -> None:
    """A second turn (the first prompt, its answer, a new message) starts on the sequence and lane
    the first left, skipping the prefill of what they hold; its output stays plain greedy's."""
    d = None if mode == "no drafter" else drafter
    policy = FixedPolicy(0 if d is None else 3)
    with SpeculativeEngine(target, d, policy=policy) as engine:
        other = engine.submit(prompts[2], greedy(8))  # lane 0; the first turn goes to lane 1
        first = engine.submit(prompts[0], greedy(16)).result(timeout=120)
        other.result(timeout=120)
        assert first.stats.lane == 1 and first.finish_reason == "length"
        second_prompt = np.concatenate([prompts[0], first.tokens, prompts[1]])
        second = engine.submit(second_prompt, greedy()).result(timeout=120)
        # its sequence held the first prompt and all but the last answer token (never decoded)
        assert second.stats.lane == 1
        assert second.stats.cached_tokens == prompts[0].size + first.tokens.size - 1
        n_kept = target.n_past_of(1)
        if d is not None:  # the lane holds the features of exactly the sequence's positions
            assert d.rings[1].written == n_kept
            kept_features = d.rings[1].read(0, second_prompt.size)
        fresh = SpeculativeEngine(target, d, policy=policy, reuse_prefix=False)
        try:
            again = fresh.submit(second_prompt, greedy()).result(timeout=120)
        finally:
            fresh.shutdown(10)
    assert again.stats.cached_tokens == 0
    if d is not None:  # ... and they are the prompt's features, as a fresh prefill computes them
        target.clear()
        fresh_features = target.features(target.decode_blocks([(0, second_prompt, "none")])[0])
        target.clear()
        np.testing.assert_allclose(kept_features, fresh_features, rtol=0, atol=2e-3 * np.abs(fresh_features).max())
    check_plain(second, plain(second_prompt, MAX), MAX)
    if d is not None:
        assert sum(second.stats.accepted) > 0


def test_a_speculative_request_takes_the_slot_that_holds_its_prefix_features(
    target: BatchedLlamaTarget, drafter: Any, prompts: list[np.ndarray], plain: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two free slots hold the same prefix, the lower one from a plain request (no features in its
    lane): a speculative request continuing that prefix starts on the other, keeping the prefix
    (the lowest slot would have cost it the whole prefill)."""
    starts = iter([False, True, True])
    with SpeculativeEngine(target, drafter, policy=FixedPolicy(3)) as engine:
        monkeypatch.setattr(engine, "_starts_speculative", lambda: next(starts))
        handles = [engine.submit(prompts[0], greedy(8)) for _ in range(2)]
        first_plain, first_spec = (h.result(timeout=120) for h in handles)
        assert (first_plain.stats.lane, first_spec.stats.lane) == (0, 1)
        assert not first_plain.stats.speculative and first_spec.stats.speculative
        prompt = np.concatenate([prompts[0], first_spec.tokens, prompts[1]])
        second = engine.submit(prompt, greedy()).result(timeout=120)
    assert second.stats.lane == 1 and second.stats.speculative
    assert second.stats.cached_tokens == prompts[0].size + first_spec.tokens.size - 1
    check_plain(second, plain(prompt, MAX), MAX)


def test_a_request_cancelled_in_its_prefill_leaves_a_usable_prefix(
    target: BatchedLlamaTarget, drafter: Any, prompts: list[np.ndarray], plain: Any
) -> None:
    long_prompt = np.concatenate([prompts[0], prompts[1], prompts[2]])
    with SpeculativeEngine(target, drafter, parallel=1, policy=FixedPolicy(3), prefill_chunk=8) as engine:
        h = engine.submit(long_prompt, greedy())
        while engine.stats.prefill_decodes < 2:
            time.sleep(0.001)
        h.cancel()
        res = engine.submit(long_prompt, greedy()).result(timeout=120)
    assert 16 <= res.stats.cached_tokens < long_prompt.size and res.stats.cached_tokens % 8 == 0
    check_plain(res, plain(long_prompt, MAX), MAX)
    assert all(target.n_past_of(s) == 0 for s in range(PARALLEL))  # shutdown empties kept sequences


def test_a_listener_gets_each_rounds_tokens_in_order_then_the_end() -> None:
    from pyggml_dkv.serving.requests import RequestHandle

    got: list[Any] = []
    h = RequestHandle("r", 3, RequestParams(), lambda _: None)
    h._push([5, 6])
    h.subscribe(got.append)  # what came before arrives at once
    h._push([7])
    with pytest.raises(RuntimeError, match="already has a listener"):
        h.subscribe(got.append)
    assert h.cancel()
    h._push([8])  # after the end: dropped
    assert got == [[5, 6], [7], None]

    late: list[Any] = []
    ended = RequestHandle("r1", 3, RequestParams(), lambda _: None)  # ended before anyone listened
    ended._push([5, 6, 7])
    ended._finish("length")
    ended.subscribe(late.append)
    assert late == [[5, 6, 7], None]

    def broken(item: Any) -> None:
        raise ValueError("boom")

    h2 = RequestHandle("r2", 3, RequestParams(), lambda _: None)
    h2.subscribe(broken)
    assert h2._push([1]) and h2._push([2])  # the engine's thread goes on; the listener is dropped
    assert h2.tokens == [1, 2]


# chi-square critical value, 3 degrees of freedom, p = 1e-4 (seeded draws: deterministic anyway)
CHI2_DF3_P1E4 = 21.11


def test_sampled_requests_follow_the_targets_distribution(
    target: BatchedLlamaTarget, drafter: Any, prompts: list[np.ndarray]
) -> None:
    """End to end through the engine: with drafts verified by rejection sampling, the token after
    the first one is distributed as the target's own sampling distribution given the first
    (chi-square over many seeded requests). Wrong rows, lanes or draft distributions would skew it
    (accepting 60% of drafts blindly, for one, emits tokens outside the target's top-k)."""
    prompt = prompts[0]
    top_k = 4
    params = [RequestParams(max_tokens=3, temperature=1.0, top_k=top_k, seed=i, stop_at_eog=False) for i in range(400)]
    with SpeculativeEngine(target, drafter, policy=FixedPolicy(3), max_queue=len(params)) as engine:
        results = [h.result(timeout=300) for h in [engine.submit(prompt, p) for p in params]]
    firsts = Counter(int(r.tokens[0]) for r in results)
    first = firsts.most_common(1)[0][0]
    seconds = [int(r.tokens[1]) for r in results if int(r.tokens[0]) == first]
    drafted = [r for r in results if r.stats.draft_lengths and r.stats.draft_lengths[0] > 0]
    assert len(drafted) == len(results)  # every second token came out of a verify round with drafts
    accepted = [r.stats.accepted[0] for r in results]
    assert 0 < sum(a > 0 for a in accepted) < len(results)  # both paths: drafts accepted and rejected

    target.clear()  # the target's own distribution for the token after prompt + first
    logits = target.decode_blocks([(0, np.append(prompt, first), "last")])[0].logits
    p = target.target_probs(np.array(logits), 1.0, top_k)[0]
    target.clear()
    support = np.nonzero(p)[0]
    assert support.size == top_k and set(seconds) <= set(support.tolist())
    counts = np.array([seconds.count(int(t)) for t in support], dtype=np.float64)
    expected = counts.sum() * p[support]
    assert counts.sum() >= 150 and expected.min() >= 5, (counts, expected)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_DF3_P1E4, (counts, expected, chi2)


def test_where_drafting_does_not_pay_requests_settle_into_plain_decoding(
    target: BatchedLlamaTarget, drafter: Any, prompts: list[np.ndarray], plain: Any
) -> None:
    """A request that drafted in under a quarter of its first `give_up_rounds` rounds gives
    drafting up (its rows no longer captured, its lane emptied); once the requests that ran that
    long rarely drafted that often, new ones start plain, but for every `explore_every`-th;
    decodes of plain requests only capture nothing. The output stays plain greedy's throughout."""
    dear = CostModel({1: 0.01, 2: 0.05, 8: 0.4}, {1: 0.05, 2: 0.05, 4: 0.05})  # drafting never pays
    engine = SpeculativeEngine(
        target,
        drafter,
        parallel=1,
        policy=SpeedPolicy(probe_every=2),
        cost_model=dear,
        give_up_rounds=8,
        explore_every=4,
    )
    try:
        results = [engine.submit(prompts[i % len(prompts)], greedy(16)).result(timeout=120) for i in range(16)]
        started = [r.stats.speculative for r in results]
        # a request counts once it ran 8 rounds speculatively (shorter ones end at their stop
        # token first); the share falls 1 -> 0.7 -> ... under 0.1 after 7 of them; from the next
        # request on, 3 start plain, 1 explores, and so on
        counted = [i for i, r in enumerate(results) if r.stats.speculative and r.stats.rounds >= 8]
        assert len(counted) >= 7
        settled = counted[6] + 1
        assert (
            all(started[:settled]) and started[settled:] == ([False, False, False, True] * 4)[: len(results) - settled]
        )
        assert len(results) - settled >= 4
        assert all(
            r.stats.stopped_speculating_at is not None for r in results if r.stats.speculative and r.stats.rounds >= 8
        )
        assert all(set(r.stats.draft_lengths) == {0} for r, s in zip(results, started) if not s)
        assert engine.stats.plain_decodes > 0
        assert drafter.rings[0].written == 0  # a plain request's lane holds nothing
    finally:
        engine.shutdown(10)
    for i, res in enumerate(results):
        check_plain(res, plain(prompts[i % len(prompts)], 16), 16)

    cheap = CostModel({1: 0.01, 2: 0.0101, 8: 0.0105}, {1: 0.0001, 2: 0.0001, 4: 0.0001})  # drafting pays
    with SpeculativeEngine(target, drafter, parallel=1, cost_model=cheap, give_up_rounds=8, explore_every=4) as engine:
        results = [engine.submit(prompts[i % len(prompts)], greedy(16)).result(timeout=120) for i in range(6)]
    assert all(r.stats.speculative and r.stats.stopped_speculating_at is None for r in results)
    assert engine.stats.plain_decodes == 0
