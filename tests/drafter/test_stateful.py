"""Stateful test: a host doing random things to a ring cache for a long time.

A hypothesis RuleBasedStateMachine plays a host: it appends target features, steps the drafter,
rewinds after a rejected draft (ring.truncate + a smaller committed, with new features written
over the rejected positions), starts new requests (reset), steps behind the ring's head, and jumps
far ahead so the ring and the cache wrap. Every step is checked against the numpy reference
(`pyggml_dkv.reference.reference_step`) at max|a-b|/max|b| <= 1e-4 (f32 weights, f32 cache).

Each example (sequence) gets a fresh DraftKvCache drawn with its own config, cap, SWA flavour
and bulk-append chunk size; the Backend and the uploaded weights are shared by all examples.

Knobs: PYGGML_DKV_STATEFUL_EXAMPLES (sequences, default 200), PYGGML_DKV_STATEFUL_STEPS (rules
per sequence, default 12), PYGGML_DKV_FUZZ_RANDOM=1 (random instead of derandomized runs).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import pyggml_dkv.drafter.bulk_append as dkv
from pyggml_dkv import Backend, DraftConfig, DraftKvCache, DraftWeights, FeatureRing
from pyggml_dkv import reference as R
from pyggml_dkv.common.numeric import relative_error
from pyggml_dkv.ggml import live_objects

pytestmark = pytest.mark.slow  # hypothesis state machines: the slow tier

TOL = 1e-4
N_EXAMPLES = int(os.environ.get("PYGGML_DKV_STATEFUL_EXAMPLES", "200"))
N_STEPS = int(os.environ.get("PYGGML_DKV_STATEFUL_STEPS", "12"))

CONFIGS = {
    # q_len 4, a full and a sliding layer, window smaller than every cap
    "q4-full+swa6": DraftConfig(
        hidden=64,
        n_layer=2,
        n_head=2,
        n_head_kv=1,
        head_dim=32,
        ffn=96,
        block_size=4,
        n_target_layers=2,
        layer_types=["full", "sliding"],
        swa_window=6,
    ),
    # q_len 8, one sliding layer, GQA 2, window close to cap
    "q8-swa13": DraftConfig(
        hidden=64,
        n_layer=1,
        n_head=4,
        n_head_kv=2,
        head_dim=16,
        ffn=64,
        block_size=8,
        n_target_layers=3,
        layer_types=["sliding"],
        swa_window=13,
    ),
}
CAPS = (19, 11)

_STATS = {"sequences": 0, "steps": 0, "worst": 0.0}


@pytest.fixture(scope="module")
def shared():
    backend = Backend("cpu", n_threads=1)
    weights = {name: DraftWeights.random(cfg, seed=7) for name, cfg in CONFIGS.items()}
    uploaded = {name: w.to_backend(backend, "f32") for name, w in weights.items()}
    yield backend, weights, uploaded
    for bw in uploaded.values():
        bw.close()
    backend.close()


class HostMachine(RuleBasedStateMachine):
    shared = None  # (backend, host weights, uploaded weights), set by the test

    def __init__(self) -> None:
        super().__init__()
        self.cache = None
        self.bulk_chunk_before = dkv.BULK_CHUNK

    @initialize(
        name=st.sampled_from(sorted(CONFIGS)),
        cap=st.sampled_from(CAPS),
        swa=st.sampled_from(["seed", "per_row"]),
        bulk_chunk=st.sampled_from([1024, 8]),
        seed=st.integers(0, 2**16),
    )
    def setup(self, name, cap, swa, bulk_chunk, seed):
        backend, weights, uploaded = self.shared
        self.cfg = CONFIGS[name]
        self.w = weights[name]
        self.cap, self.swa = cap, swa
        self.q = self.cfg.block_size
        self.rng = np.random.default_rng(seed)
        dkv.BULK_CHUNK = bulk_chunk  # small chunks: a big jump takes several temporary graphs
        self.cache = DraftKvCache(uploaded[name], backend, cap, cache_type="f32", swa=swa)
        self.ring = FeatureRing(cap + 2 * self.q, self.cfg.fc_in)
        self.feats = np.zeros((0, self.cfg.fc_in), np.float32)  # the host's features of positions 0..written-1
        self.committed = 0  # what the cache was last stepped at
        _STATS["sequences"] += 1

    def teardown(self) -> None:
        if self.cache is not None:
            self.cache.close()
        dkv.BULK_CHUNK = self.bulk_chunk_before

    # ---------------------------------------------------------------- host actions
    def _new_rows(self, n: int) -> np.ndarray:
        return self.rng.standard_normal((n, self.cfg.fc_in)).astype(np.float32)

    def _append(self, n: int) -> None:
        rows = self._new_rows(n)
        self.ring.append(rows)
        self.feats = np.concatenate([self.feats, rows])

    def _step(self, committed: int) -> None:
        noise = self.rng.standard_normal((self.q, self.cfg.hidden)).astype(np.float32)
        got = self.cache.step(self.ring, committed, noise)
        want = R.reference_step(self.w, self.feats[:committed], committed, self.cap, noise, swa=self.swa)
        err = relative_error(got, want)
        _STATS["steps"] += 1
        _STATS["worst"] = max(_STATS["worst"], err)
        assert err <= TOL, f"committed={committed}: max|a-b|/max|b| = {err:.2e}"
        assert self.cache.next_pos == committed
        self.committed = committed

    def _steppable(self, committed: int) -> bool:
        return 1 <= committed <= self.ring.written and committed - min(committed, self.cap) >= self.ring.oldest

    @rule(n=st.integers(1, 8))
    def append_features(self, n):
        """Verification accepted n tokens: their features arrive (no step yet)."""
        self._append(n)

    @precondition(lambda self: self.ring.written >= 1)
    @rule()
    def step(self):
        if self._steppable(self.ring.written):  # after a deep rewind the window may need overwritten rows
            self._step(self.ring.written)
        else:
            with pytest.raises(ValueError, match="overwritten"):
                self.cache.step(self.ring, self.ring.written, np.zeros((self.q, self.cfg.hidden), np.float32))

    @precondition(lambda self: self.ring.written >= 1)
    @rule(n=st.integers(1, 8))
    def accept_and_step(self, n):
        """The usual cycle: n accepted tokens' features arrive, then the next draft."""
        self._append(n)
        self._step(self.ring.written)

    @precondition(lambda self: self.ring.written >= 2)
    @rule(back=st.integers(1, 10))
    def step_behind_head(self, back):
        """Step at a committed below what the ring holds (the cache rewinds if it was ahead)."""
        committed = self.ring.written - back
        if self._steppable(committed):
            self._step(committed)

    @precondition(lambda self: len(self.ring) >= 2)
    @rule(back=st.integers(1, 12), refill=st.integers(0, 6))
    def rewind(self, back, refill):
        """Verification rejected `back` positions: truncate, write different features there, step."""
        # no deeper than the ring can serve: the window of the new committed must still be readable
        pos = max(self.ring.written - back, 1, self.ring.oldest + self.cap if self.ring.oldest else 0)
        if pos >= self.ring.written:
            return
        self.ring.truncate(pos)
        self.feats = self.feats[:pos]
        if refill:
            self._append(refill)
        if self._steppable(self.ring.written):
            self._step(self.ring.written)

    @rule(new_request=st.booleans())
    def reset(self, new_request):
        """reset() (a new or restarted request); with new_request the host clears its ring too."""
        self.cache.reset()
        assert self.cache.next_pos == 0 and (self.cache.slot_pos == -1).all()
        if new_request:
            self.ring.clear()
            self.feats = self.feats[:0]
        elif self.ring.written >= 1 and self._steppable(self.ring.written):
            self._step(self.ring.written)

    @rule(times=st.floats(1.0, 4.0))
    def big_jump(self, times):
        """A long prompt or a burst: more than cap (and more than a_step) new rows, wrapping the rings."""
        self._append(int(self.cap * times) + 1)
        self._step(self.ring.written)

    @invariant()
    def bookkeeping(self):
        if self.cache is None:
            return
        slot = self.cache.slot_pos
        assert slot.shape == (self.cap,)
        live = slot[slot >= 0]
        assert (live % self.cap == np.nonzero(slot >= 0)[0]).all(), "a slot holds a position of another slot"
        assert len(set(live.tolist())) == live.size


def test_ring_cache_matches_reference_under_random_host_behaviour(shared, capsys):
    before = {k: v for k, v in live_objects().items() if v}
    HostMachine.shared = shared
    start = dict(_STATS)
    run_state_machine_as_test(
        HostMachine,
        settings=settings(
            max_examples=N_EXAMPLES,
            stateful_step_count=N_STEPS,
            deadline=None,
            database=None,
            derandomize=not os.environ.get("PYGGML_DKV_FUZZ_RANDOM"),
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
        ),
    )
    sequences = _STATS["sequences"] - start["sequences"]
    steps = _STATS["steps"] - start["steps"]
    with capsys.disabled():
        print(
            f"\nstateful: {sequences} sequences, {steps} steps checked against the reference, "
            f"worst max|a-b|/max|b| = {_STATS['worst']:.2e}"
        )
    assert sequences >= N_EXAMPLES
    assert steps >= N_EXAMPLES  # about half the rules step
    assert {k: v for k, v in live_objects().items() if v} == before, "a sequence leaked ggml objects"


def test_rewritten_positions_are_not_served_stale(shared):
    """Regression (found by the machine above): truncate + rewrite up to the same committed, or
    hand the cache another ring, must not reuse the K/V of the features that were replaced."""
    backend, weights, uploaded = shared
    name = "q4-full+swa6"
    w, cfg = weights[name], CONFIGS[name]
    rng = np.random.default_rng(11)
    feats = rng.standard_normal((40, cfg.fc_in)).astype(np.float32)
    noise = rng.standard_normal((cfg.block_size, cfg.hidden)).astype(np.float32)
    ring = FeatureRing(64, cfg.fc_in)
    ring.append(feats[:30])
    with DraftKvCache(uploaded[name], backend, 19, cache_type="f32") as cache:
        cache.step(ring, 30, noise)
        feats[25:30] = rng.standard_normal((5, cfg.fc_in))  # the host rejects 25.. and writes new features
        ring.truncate(25)
        ring.append(feats[25:30])
        got = cache.step(ring, 30, noise)
        assert relative_error(got, R.reference_step(w, feats, 30, 19, noise)) <= TOL
        other = FeatureRing(64, cfg.fc_in)  # same committed, another request's ring
        other_feats = rng.standard_normal((30, cfg.fc_in)).astype(np.float32)
        other.append(other_feats)
        got = cache.step(other, 30, noise)
        assert relative_error(got, R.reference_step(w, other_feats, 30, 19, noise)) <= TOL
        ring.write(28, feats[28:30])  # a write below `written` also counts as a drop
        assert ring.dropped_since(ring.epoch - 1) == 28
