"""The draft-length policy (pyggml_dkv/serving/policy.py) on made-up costs: it drafts nothing where
verifying costs what decoding does per row (a compute-bound CPU), drafts where extra rows are
nearly free (memory-bound), more for requests that accept more, within every limit."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pyggml_dkv.serving.policy import (
    AcceptanceEstimate,
    CostModel,
    FixedPolicy,
    PolicyRequest,
    SpeedPolicy,
    expected_tokens,
    graph_lanes,
    round_cost,
)

# SmolLM2-135M on 2 CPU cores (docs/llama-cpp.md, "Where drafting pays"): verifying k rows costs almost k decodes
CPU = CostModel({1: 0.0058, 2: 0.0127, 4: 0.0184, 8: 0.0273, 16: 0.0442, 32: 0.09}, {1: 0.0033, 2: 0.004, 4: 0.005})
# a memory-bound target: 32 rows cost 1.2 single decodes
FLAT = CostModel({1: 0.010, 4: 0.0101, 8: 0.0103, 16: 0.0107, 32: 0.012}, {1: 0.002, 2: 0.002, 4: 0.0025})


def reqs(*rates: float, k_max: int = 7) -> list[PolicyRequest]:
    return [PolicyRequest(a, k_max, lane) for lane, a in enumerate(rates)]


def test_no_drafts_where_they_cannot_pay() -> None:
    assert SpeedPolicy().choose(reqs(0.55, 0.55, 0.55, 0.55), CPU, 4, 32) == [0, 0, 0, 0]
    assert SpeedPolicy().choose(reqs(0.1), FLAT, 4, 32) == [0]  # the drafter step alone costs more


def test_drafts_where_rows_are_cheap_and_more_for_better_requests() -> None:
    ks = SpeedPolicy().choose(reqs(0.9, 0.5, 0.2), FLAT, 4, 32)
    assert ks[0] == 7 and ks[0] >= ks[1] >= ks[2]
    # the choice is the best of every split the policy considers
    best = sum(expected_tokens(r.accept_rate, k) for r, k in zip(reqs(0.9, 0.5, 0.2), ks)) / round_cost(
        FLAT, ks, [0, 1, 2], 4
    )
    for alt in ([0, 0, 0], [7, 7, 7], [7, 0, 0], [1, 1, 1]):
        speed = sum(expected_tokens(r.accept_rate, k) for r, k in zip(reqs(0.9, 0.5, 0.2), alt)) / round_cost(
            FLAT, alt, [0, 1, 2], 4
        )
        assert speed <= best + 1e-12


@pytest.mark.parametrize("costs", [CPU, FLAT], ids=["cpu", "flat"])
def test_the_choice_is_the_best_split(costs: CostModel) -> None:
    """Against every split of up to 5 drafts for 3 requests on lanes 0, 1, 3 (graphs 1, 2, 4)."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        rs = [PolicyRequest(float(a), 5, lane) for a, lane in zip(rng.uniform(0.05, 0.99, 3), (0, 1, 3))]

        def speed(ks: tuple[int, ...]) -> float:
            return sum(expected_tokens(r.accept_rate, k) for r, k in zip(rs, ks)) / round_cost(
                costs, ks, [r.lane for r in rs], 4
            )

        best = max(speed(ks) for ks in itertools.product(range(6), repeat=3))
        assert speed(tuple(SpeedPolicy().choose(rs, costs, 4, 32))) == pytest.approx(best, rel=1e-12)


def test_limits_are_kept() -> None:
    ks = SpeedPolicy().choose(
        [PolicyRequest(0.95, 2, 0), PolicyRequest(0.95, 0, 1), PolicyRequest(0.95, 7, 2)], FLAT, 4, 32
    )
    assert ks[0] <= 2 and ks[1] == 0
    ks = SpeedPolicy().choose(reqs(0.95, 0.95, 0.95, 0.95), FLAT, 4, 10)
    assert 4 + sum(ks) <= 10
    assert FixedPolicy(5).choose(reqs(0.1, 0.1, k_max=3), CPU, 4, 32) == [3, 3]
    assert FixedPolicy(7).choose(reqs(0.1, 0.1, 0.1), CPU, 4, 12) == [7, 2, 0]
    assert FixedPolicy(0).choose(reqs(0.99), FLAT, 4, 32) == [0]


def test_a_long_idle_request_probes_one_draft() -> None:
    p = SpeedPolicy(probe_every=4)
    assert p.choose([PolicyRequest(0.55, 7, 0, idle_rounds=3)], CPU, 4, 32) == [0]
    assert p.choose([PolicyRequest(0.55, 7, 0, idle_rounds=4)], CPU, 4, 32)[0] >= 1  # more if D is paid anyway
    assert p.choose([PolicyRequest(0.55, 0, 0, idle_rounds=40)], CPU, 4, 32) == [0]
    # after two probes that led nowhere it waits 4 x probe_every
    assert p.choose([PolicyRequest(0.55, 7, 0, idle_rounds=15, probes=2)], CPU, 4, 32) == [0]
    assert p.choose([PolicyRequest(0.55, 7, 0, idle_rounds=16, probes=2)], CPU, 4, 32)[0] >= 1
    assert SpeedPolicy(probe_every=0).choose([PolicyRequest(0.55, 7, 0, idle_rounds=99)], CPU, 4, 32) == [0]


def test_cost_model_interpolates_and_follows_observations() -> None:
    m = CostModel({1: 0.01, 9: 0.09}, {1: 0.002})
    assert m.verify_s(5) == pytest.approx(0.05)
    assert m.verify_s(17) == pytest.approx(0.17)  # extrapolated
    for _ in range(200):
        m.observe_verify(5, 0.1)  # the machine got twice as slow
    assert m.verify_s(5) == pytest.approx(0.1, rel=1e-3)
    m.observe_verify(5, 100.0)  # one outlier moves it by alpha x at most 4, and half of that
    assert m.verify_s(5) < 0.1 * (1 + 0.2 * 3) * (1 + 0.1 * 3) + 1e-9
    m = CostModel({1: 0.01, 9: 0.09}, {1: 0.002})
    assert m.draft_s(1) == 0.002 and m.draft_s(4) == pytest.approx(0.008)  # unmeasured graph: scaled
    m.observe_draft(2, 0.003)
    assert m.draft_s(2) == 0.003 and m.draft_s(4) == pytest.approx(0.006)
    m.observe_draft(8, 0.005)
    assert m.draft_s(4) == 0.005  # the nearest measured size above
    with pytest.raises(ValueError):
        CostModel({})


def test_a_slower_machine_slows_every_prediction() -> None:
    """Plain rounds observe 1-row decodes only; when the CPU slows down, the draft rows and the
    drafter step, rarely observed, must be predicted slower too, or drafting looks cheap."""
    m = CostModel({1: 0.01, 2: 0.018, 8: 0.05}, {1: 0.004})
    for _ in range(100):
        m.observe_verify(1, 0.02)
    assert m.verify_s(1) == pytest.approx(0.02, rel=1e-2)
    assert m.verify_s(2) > 1.5 * 0.018 and m.verify_s(8) > 1.5 * 0.05 and m.draft_s(1) > 1.5 * 0.004
    # a machine twice as slow does not make one draft pay where it did not
    slow = [PolicyRequest(0.5, 7, 0)]
    assert (
        SpeedPolicy().choose(slow, m, 4, 32)
        == SpeedPolicy().choose(slow, CostModel({1: 0.01, 2: 0.018, 8: 0.05}, {1: 0.004}), 4, 32)
        == [0]
    )


def test_acceptance_estimate_and_graph_lanes() -> None:
    est = AcceptanceEstimate()
    assert est.rate(0.5) == 0.5
    for _ in range(30):
        est.observe(4, 4)  # every draft accepted
    assert est.rate(0.5) > 0.95
    for _ in range(30):
        est.observe(4, 0)
    assert est.rate(0.5) < 0.3  # (the prior's 4 pseudo-trials keep it off 0)
    est.observe(0, 0)  # no draft: no evidence
    assert [graph_lanes(i, 8) for i in range(8)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert [graph_lanes(i, 6) for i in range(6)] == [1, 2, 4, 4, 6, 6]


def test_a_batch_that_keeps_drafting_runs_a_plain_round_now_and_then() -> None:
    p = SpeedPolicy(probe_every=4)
    good = [PolicyRequest(0.95, 7, 0), PolicyRequest(0.95, 7, 1)]
    chosen = [p.choose(good, FLAT, 4, 32) for _ in range(10)]
    assert [any(ks) for ks in chosen] == [True] * 4 + [False] + [True] * 4 + [False]
