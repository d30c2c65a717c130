"""Lanes: one DraftKvCache drafting for several requests in one compute.

The oracle for every lane is a single-lane cache run on that lane's trajectory alone (and, now
and then, the numpy reference). A hypothesis state machine plays a host with several requests:
they join (reset), leave (idle), append features, rewind after rejected drafts, jump past `cap`
(bulk append), and step with any subset of lanes active. Every active lane of every step must
match its single-lane twin at max|a-b|/max|b| <= 1e-6 (f32 weights and cache).
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
    rule,
    run_state_machine_as_test,
)

import pyggml_dkv.drafter.bulk_append as dkv
from pyggml_dkv import (
    Backend,
    DraftConfig,
    Drafter,
    DraftKvCache,
    DraftKvState,
    DraftWeights,
    FeatureRing,
    draft_kv_begin_step,
    draft_kv_free,
    draft_kv_init,
)
from pyggml_dkv import reference as R
from pyggml_dkv.common.numeric import relative_error
from pyggml_dkv.drafter.step_graph import lane_counts
from pyggml_dkv.ggml import GGMLError, live_objects

TOL = 1e-6
N_EXAMPLES = int(os.environ.get("PYGGML_DKV_LANES_EXAMPLES", "60"))
N_STEPS = int(os.environ.get("PYGGML_DKV_LANES_STEPS", "14"))

CONFIGS = {
    # GQA folded on the CPU (4 query heads over 2 K/V heads), a full and a sliding layer
    "gqa-full+swa": DraftConfig(
        hidden=64,
        n_layer=2,
        n_head=4,
        n_head_kv=2,
        head_dim=32,
        ffn=96,
        block_size=4,
        n_target_layers=2,
        layer_types=["full", "sliding"],
        swa_window=6,
    ),
    # no GQA (the unfolded attention), q_len 8, one sliding layer
    "mha-swa": DraftConfig(
        hidden=64,
        n_layer=1,
        n_head=2,
        n_head_kv=2,
        head_dim=32,
        ffn=64,
        block_size=8,
        n_target_layers=3,
        layer_types=["sliding"],
        swa_window=13,
    ),
}
_STATS = {"sequences": 0, "lane_steps": 0, "worst": 0.0}


@pytest.fixture(scope="module")
def shared():
    backend = Backend("cpu", n_threads=1)
    weights = {name: DraftWeights.random(cfg, seed=5) for name, cfg in CONFIGS.items()}
    uploaded = {name: w.to_backend(backend, "f32") for name, w in weights.items()}
    yield backend, weights, uploaded
    for bw in uploaded.values():
        bw.close()
    backend.close()


def features(rng: np.random.Generator, n: int, fc_in: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal((n, fc_in)) * scale).astype(np.float32)


class LanesHost(RuleBasedStateMachine):
    shared = None

    def __init__(self) -> None:
        super().__init__()
        self.cache = None
        self.twins: list[DraftKvCache] = []
        self.bulk_chunk_before = dkv.BULK_CHUNK

    @initialize(
        name=st.sampled_from(sorted(CONFIGS)),
        lanes=st.sampled_from([2, 3, 5]),
        cap=st.sampled_from([11, 19]),
        swa=st.sampled_from(["seed", "per_row"]),
        bulk_chunk=st.sampled_from([1024, 8]),
        seed=st.integers(0, 2**16),
    )
    def setup(self, name, lanes, cap, swa, bulk_chunk, seed):
        backend, weights, uploaded = self.shared
        self.cfg, self.w, self.cap, self.swa, self.n = CONFIGS[name], weights[name], cap, swa, lanes
        self.q = self.cfg.block_size
        self.rng = np.random.default_rng(seed)
        dkv.BULK_CHUNK = bulk_chunk
        self.cache = DraftKvCache(uploaded[name], backend, cap, cache_type="f32", swa=swa, lanes=lanes)
        self.twins = [DraftKvCache(uploaded[name], backend, cap, cache_type="f32", swa=swa) for _ in range(lanes)]
        self.rings = [FeatureRing(cap + 2 * self.q, self.cfg.fc_in) for _ in range(lanes)]
        # lanes' features differ wildly in scale: a lane that saw another's keys could not stay close
        self.scales = [10.0 ** float(self.rng.uniform(-2, 2)) for _ in range(lanes)]
        self.feats = [np.zeros((0, self.cfg.fc_in), np.float32) for _ in range(lanes)]
        _STATS["sequences"] += 1

    def teardown(self) -> None:
        for c in [self.cache, *self.twins]:
            if c is not None:
                c.close()
        dkv.BULK_CHUNK = self.bulk_chunk_before

    def _append(self, lane: int, n: int) -> None:
        rows = features(self.rng, n, self.cfg.fc_in, self.scales[lane])
        self.rings[lane].append(rows)
        self.feats[lane] = np.concatenate([self.feats[lane], rows])

    def _steppable(self, lane: int) -> bool:
        ring = self.rings[lane]
        c = ring.written
        return c >= 1 and c - min(c, self.cap) >= ring.oldest

    def _step(self, active: list[int], with_reference: bool = False) -> None:
        active = [lane for lane in active if self._steppable(lane)]
        if not active:
            return
        noise = [
            self.rng.standard_normal((self.q, self.cfg.hidden)).astype(np.float32) if i in active else None
            for i in range(self.n)
        ]
        rings = [self.rings[i] if i in active else None for i in range(self.n)]
        committed = [self.rings[i].written if i in active else None for i in range(self.n)]
        got = self.cache.step(rings, committed, noise)
        for lane in range(self.n):
            if lane not in active:
                assert got[lane] is None
                continue
            want = self.twins[lane].step(self.rings[lane], committed[lane], noise[lane])
            err = relative_error(got[lane], want)
            _STATS["lane_steps"] += 1
            _STATS["worst"] = max(_STATS["worst"], err)
            assert err <= TOL, f"lane {lane} of {active}, committed={committed[lane]}: {err:.2e}"
            assert self.cache.lane_next_pos(lane) == committed[lane]
            if with_reference:
                ref = R.reference_step(
                    self.w, self.feats[lane][: committed[lane]], committed[lane], self.cap, noise[lane], swa=self.swa
                )
                assert relative_error(got[lane], ref) <= 1e-4

    @rule(lane=st.integers(0, 4), n=st.integers(1, 8))
    def append_features(self, lane, n):
        self._append(lane % self.n, n)

    @rule(mask=st.integers(1, 31), reference=st.booleans())
    def accept_and_step(self, mask, reference):
        """The usual round: each active lane gets a few accepted tokens, then one step for all of them."""
        active = [i for i in range(self.n) if mask >> i & 1] or [0]
        for lane in active:
            self._append(lane, int(self.rng.integers(1, self.q + 1)))
        self._step(active, reference)

    @rule(lane=st.integers(0, 4))
    def step_one_lane(self, lane):
        """One lane alone (the graph of the fewest lanes that covers it; the others idle)."""
        lane %= self.n
        if self.rings[lane].written:
            self._step([lane])

    @rule(lane=st.integers(0, 4), back=st.integers(1, 10), refill=st.integers(0, 6))
    def rewind_one_lane(self, lane, back, refill):
        """Verification rejected `back` positions of one lane; then every lane steps (the others advance)."""
        lane %= self.n
        ring = self.rings[lane]
        pos = max(ring.written - back, 1, ring.oldest + self.cap if ring.oldest else 0)
        if pos >= ring.written:
            return
        ring.truncate(pos)
        self.feats[lane] = self.feats[lane][:pos]
        if refill:
            self._append(lane, refill)
        for other in range(self.n):
            if other != lane and self.rings[other].written:
                self._append(other, 1)
        self._step([i for i in range(self.n) if self.rings[i].written])

    @rule(lane=st.integers(0, 4), new_request=st.booleans())
    def reset_lane(self, lane, new_request):
        """A request leaves and another joins on its lane."""
        lane %= self.n
        self.cache.reset(lane)
        self.twins[lane].reset()
        assert self.cache.lane_next_pos(lane) == 0 and (self.cache.lane_slot_pos(lane) == -1).all()
        if new_request:
            self.rings[lane].clear()
            self.feats[lane] = self.feats[lane][:0]
            self.scales[lane] = 10.0 ** float(self.rng.uniform(-2, 2))

    @rule(lane=st.integers(0, 4), times=st.floats(1.0, 3.0))
    def big_jump(self, lane, times):
        """A long prompt on one lane: a bulk append into that lane's rows, wrapping its ring."""
        lane %= self.n
        self._append(lane, int(self.cap * times) + 1)
        self._step(list(range(self.n)))

    @invariant()
    def lanes_keep_their_own_slots(self):
        if self.cache is None:
            return
        for lane in range(self.n):
            assert (self.cache.lane_slot_pos(lane) == self.twins[lane].slot_pos).all()


@pytest.mark.slow  # hypothesis
def test_lanes_match_single_lane_caches_under_random_host_behaviour(shared, capsys):
    before = {k: v for k, v in live_objects().items() if v}
    LanesHost.shared = shared
    start = dict(_STATS)
    run_state_machine_as_test(
        LanesHost,
        settings=settings(
            max_examples=N_EXAMPLES,
            stateful_step_count=N_STEPS,
            deadline=None,
            database=None,
            derandomize=not os.environ.get("PYGGML_DKV_FUZZ_RANDOM"),
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
        ),
    )
    steps = _STATS["lane_steps"] - start["lane_steps"]
    with capsys.disabled():
        print(
            f"\nlanes: {_STATS['sequences'] - start['sequences']} sequences, {steps} lane steps against "
            f"single-lane caches, worst max|a-b|/max|b| = {_STATS['worst']:.2e}"
        )
    assert steps >= N_EXAMPLES
    assert {k: v for k, v in live_objects().items() if v} == before, "a sequence leaked ggml objects"


# ---------------------------------------------------------------- isolation


def _two_lane_outputs(bw, cpu, cfg, feats0: np.ndarray, feats1: np.ndarray, noise: np.ndarray) -> list[np.ndarray]:
    with DraftKvCache(bw, cpu, 23, cache_type="f32", lanes=2) as cache:
        r0, r1 = FeatureRing(64, cfg.fc_in), FeatureRing(64, cfg.fc_in)
        r0.append(feats0)
        r1.append(feats1)
        return [o.copy() for o in cache.step([r0, r1], [r0.written, r1.written], [noise, noise])]


def lanes_are_isolated(bw, cpu, cfg, seed: int = 3) -> bool:
    """Each lane's output is bit for bit the same whatever the other lane holds (features 1e4
    apart in scale, at the same positions): one key of the other lane let through would change it."""
    rng = np.random.default_rng(seed)
    mine = features(rng, 20, cfg.fc_in)
    small, large = features(rng, 20, cfg.fc_in, 1e-2), features(rng, 20, cfg.fc_in, 1e2)
    noise = rng.standard_normal((cfg.block_size, cfg.hidden)).astype(np.float32)
    lane0 = [_two_lane_outputs(bw, cpu, cfg, mine, other, noise)[0] for other in (small, large)]
    lane1 = [_two_lane_outputs(bw, cpu, cfg, other, mine, noise)[1] for other in (small, large)]
    return np.array_equal(*lane0) and np.array_equal(*lane1)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_no_lane_sees_another_lanes_rows(shared, cpu, name):
    _, weights, uploaded = shared
    cfg, bw = CONFIGS[name], uploaded[name]
    assert lanes_are_isolated(bw, cpu, cfg)
    rng = np.random.default_rng(8)
    feats = features(rng, 20, cfg.fc_in)
    noise = rng.standard_normal((cfg.block_size, cfg.hidden)).astype(np.float32)
    out = _two_lane_outputs(bw, cpu, cfg, feats, features(rng, 20, cfg.fc_in, 1e3), noise)[0]
    assert relative_error(out, R.reference_step(weights[name], feats, 20, 23, noise)) <= 1e-4


def test_the_isolation_check_catches_a_leak(shared, cpu, monkeypatch):
    """The check above can fail: with every lane's attention reading lane 0's K/V rows (a lane
    stride of 0 in the view), lane 1's output moves with lane 0's features."""
    import pyggml_dkv.drafter.layers as layers

    real = layers.kv_heads_view

    def leaky(g, cache, cfg, n_rows, lanes=1):
        view = real(g, cache, cfg, n_rows, lanes)
        if lanes == 1:
            return view
        return g.view(cache, view.ne, (*view.nb[1:3], 0), 0)

    monkeypatch.setattr(layers, "kv_heads_view", leaky)
    name = "gqa-full+swa"
    assert not lanes_are_isolated(shared[2][name], cpu, CONFIGS[name])


# ---------------------------------------------------------------- API and bad input


@pytest.fixture
def gqa(shared, cpu):
    name = "gqa-full+swa"
    return CONFIGS[name], shared[1][name], shared[2][name]


def _rings(cfg, lanes, n=12, seed=0):
    rng = np.random.default_rng(seed)
    rings = []
    for _ in range(lanes):
        r = FeatureRing(64, cfg.fc_in)
        r.append(features(rng, n, cfg.fc_in))
        rings.append(r)
    return rings


def test_geometry_and_graphs(gqa, cpu):
    cfg, _, bw = gqa
    assert lane_counts(1) == (1,) and lane_counts(5) == (1, 2, 4, 5) and lane_counts(8) == (1, 2, 4, 8)
    with DraftKvCache(bw, cpu, 19, cache_type="f32", lanes=5) as c:
        assert c.lanes == 5 and c.k_cache[0].ne[1] == 5 * c.kv_total
        assert c.noise_rows.numpy().tolist() == [
            lane * c.kv_total + c.cap + j for lane in range(5) for j in range(c.q_len)
        ]
        assert sorted({n for n, _ in c.graphs}) == [1, 2, 4, 5]
        assert c.gf is c.graphs[(5, 5 * c.a_step)].graph
        assert c.mask_full.ne == (c.kv_total, c.mask_rows, 1, 5)


def test_one_lane_cache_keeps_its_graph(gqa, cpu):
    """lanes=1 builds exactly the graphs of a cache without lanes: same sizes, same node count."""
    cfg, _, bw = gqa
    with DraftKvCache(bw, cpu, 19, cache_type="f32") as a, DraftKvCache(bw, cpu, 19, cache_type="f32", lanes=1) as b:
        assert a.lanes == b.lanes == 1
        assert sorted(a.graphs) == sorted(b.graphs) == [(1, r) for r in a.geometry.fold_buckets]
        assert a.gf.n_nodes == b.gf.n_nodes and a.mask_full.ne == b.mask_full.ne == (a.kv_total, a.mask_rows, 1, 1)


def test_lanes_join_and_leave_without_rebuilds(gqa, cpu):
    cfg, _, bw = gqa
    rings = _rings(cfg, 4, n=60)
    rng = np.random.default_rng(9)

    def addresses(c):  # every node but the outputs, which each step places in a new array
        return {
            k: [t.data_address for t in b.graph.nodes() if t.name not in ("hidden_states", "logits", "draft_ids")]
            for k, b in c.graphs.items()
        }

    with DraftKvCache(bw, cpu, 19, cache_type="f32", lanes=4) as c:
        before = addresses(c)
        objects = live_objects()
        for _ in range(40):
            active = [bool(rng.random() < 0.5) for _ in range(4)]
            if not any(active):
                active[int(rng.integers(4))] = True
            committed = [int(rng.integers(1, 61)) if a else None for a in active]
            noise = [
                rng.standard_normal((cfg.block_size, cfg.hidden)).astype(np.float32) if a else None for a in active
            ]
            out = c.step([r if a else None for r, a in zip(rings, active)], committed, noise)
            assert [o is not None for o in out] == active
            assert all(np.isfinite(o).all() for o in out if o is not None)
        assert addresses(c) == before
        assert all(b.galloc.n_allocs == 1 for b in c.graphs.values())
        assert live_objects() == objects


def test_idle_lanes_inside_the_graph_see_no_context(gqa, cpu):
    """An idle lane below the highest active one is computed, but its masks hide every context key
    (its attention skips them); a lane past it is not computed at all."""
    cfg, _, bw = gqa
    rings = _rings(cfg, 4)
    noise = np.zeros((cfg.block_size, cfg.hidden), np.float32)
    with DraftKvCache(bw, cpu, 19, cache_type="f32", lanes=4) as c:
        c.step(rings, [12] * 4, [noise] * 4)
        c.step([None, rings[1], None, None], [None, 12, None, None], [None, noise, None, None])
        assert c._computed.n_lanes == 2
        mask = c.mask_full.numpy()  # (lanes, 1, rows, kv_total)
        assert np.isneginf(mask[0, 0, :, : c.cap]).all()  # lane 0: idle, inside the 2-lane graph
        assert (mask[1, 0, :, :12] == 0).all()  # lane 1: its 12 positions
        assert (mask[2, 0, :, :12] == 0).all()  # lanes 2, 3: untouched, not computed


def test_drafter_lanes_propose_as_single_drafters(gqa):
    cfg, w, _ = gqa
    rng = np.random.default_rng(2)
    vocab = 50
    embed = rng.standard_normal((vocab, cfg.hidden)).astype(np.float32)
    head = rng.standard_normal((vocab, cfg.hidden)).astype(np.float32)
    kw = dict(embed_tokens=embed, lm_head=head, cap=19, weight_dtype="f32", cache_type="f32")
    with Drafter(w, lanes=3, **kw) as multi:
        singles = [Drafter(w, **kw) for _ in range(3)]
        try:
            for lane in range(3):
                feats = features(rng, 8 + 5 * lane, cfg.fc_in)
                multi.add_features(feats, lane=lane)
                singles[lane].add_features(feats)
            tokens = [3, None, 17]
            got = multi.propose_lanes(tokens)
            assert got[1] is None
            for lane in (0, 2):
                assert got[lane].tolist() == singles[lane].propose(tokens[lane]).tolist()
            # sampling on one lane, greedy on another, in one compute
            got = multi.propose_lanes([5, 6, None], temperature=[0.0, 0.8, 0.0], rng=np.random.default_rng(0))
            assert got[0].tolist() == singles[0].propose(5).tolist()
            ids, probs = got[1]
            assert ids.shape == (cfg.block_size - 1,) and np.allclose(probs.sum(axis=1), 1.0)
            assert multi.propose(9, lane=2).tolist() == singles[2].propose(9).tolist()
            multi.rewind(4, lane=2)
            singles[2].rewind(4)
            assert multi.committed_of(2) == 4 and multi.committed_of(1) == 13
            assert multi.propose(9, lane=2).tolist() == singles[2].propose(9).tolist()
            multi.reset(1)
            assert multi.committed_of(1) == 0 and multi.committed_of(0) == 8
            with pytest.raises(ValueError, match="lane 1.*at least one committed token"):
                multi.propose_lanes([1, 2, None])
            with pytest.raises(ValueError, match="lane must be an int in \\[0, 3\\)"):
                multi.add_features(features(rng, 1, cfg.fc_in), lane=3)
            with pytest.raises(ValueError, match="temperature must be one value or 3"):
                multi.propose_lanes([1, None, None], temperature=[0.0, 1.0])
            with pytest.raises(ValueError, match="every lane is idle"):
                multi.propose_lanes([None, None, None])
        finally:
            for d in singles:
                d.close()


def test_c_style_api_with_lanes(gqa, cpu):
    cfg, w, bw = gqa
    rings = _rings(cfg, 3, n=15, seed=4)
    noise = [
        np.random.default_rng(i).standard_normal((cfg.block_size, cfg.hidden)).astype(np.float32) for i in range(3)
    ]
    st_ = DraftKvState()
    assert draft_kv_init(st_, bw, cpu, 19, cache_type="f32", lanes=3)
    try:
        assert st_.lanes == 3
        for lane in (0, 2):
            draft_kv_begin_step(st_, bw, cpu, rings[lane], 10 + lane, lane=lane)
        st_.inp_embed.set(np.concatenate(noise))
        cpu.compute(st_.gf)
        hidden = st_.hidden_states.numpy()
        for lane in (0, 2):
            want = R.reference_step(w, rings[lane].read(0, 10 + lane), 10 + lane, 19, noise[lane])
            assert relative_error(hidden[lane * cfg.block_size : (lane + 1) * cfg.block_size], want) <= 1e-4
    finally:
        draft_kv_free(st_)


def test_bad_lane_input_is_refused_before_any_state_changes(gqa, cpu):
    cfg, _, bw = gqa
    rings = _rings(cfg, 3)
    noise = np.zeros((cfg.block_size, cfg.hidden), np.float32)
    c = DraftKvCache(bw, cpu, 19, cache_type="f32", lanes=3)
    c.step(rings, [12, 12, 12], [noise] * 3)
    before = [c.lane_slot_pos(i).copy() for i in range(3)]

    def unchanged():
        assert all((c.lane_slot_pos(i) == before[i]).all() for i in range(3))

    for lane in (3, -1, 1.5, "0"):
        with pytest.raises(ValueError, match="lane must be an int in \\[0, 3\\)"):
            c.rewind(5, lane=lane)
        with pytest.raises(ValueError, match="lane must be an int"):
            c.reset(lane)
    with pytest.raises(ValueError, match="names the lane"):
        c.rewind(5)
    wrong = FeatureRing(64, cfg.fc_in + 1)
    wrong.append(np.zeros((12, cfg.fc_in + 1), np.float32))
    with pytest.raises(ValueError, match="lane 2: ring has fc_in"):
        c.step([rings[0], rings[1], wrong], [12, 12, 12], [noise] * 3)
    unchanged()
    with pytest.raises(ValueError, match="lane 1: committed=99"):
        c.step(rings, [12, 99, 12], [noise] * 3)
    unchanged()
    with pytest.raises(ValueError, match="noise_embed must have shape"):
        c.step(rings, [12, 12, 12], [noise, noise[:2], noise])
    with pytest.raises(ValueError, match="all given or all None"):
        c.step(rings, [12, None, 12], [noise] * 3)
    with pytest.raises(ValueError, match="rings must be a list of 3"):
        c.step(rings[:2], [12, 12], [noise] * 2)
    with pytest.raises(ValueError, match="no active lane"):
        c.step([None] * 3, [None] * 3, [None] * 3)
    unchanged()
    # committed moving backwards on one lane while the others advance: that lane rewinds alone
    for r in rings:
        r.append(np.ones((2, cfg.fc_in), np.float32))
    out = c.step(rings, [14, 7, 14], [noise] * 3)
    assert c.lane_next_pos(1) == 7 and c.lane_next_pos(0) == c.lane_next_pos(2) == 14
    assert (c.lane_slot_pos(1)[7:12] == -1).all()
    for lane, committed in ((0, 14), (1, 7)):
        with DraftKvCache(bw, cpu, 19, cache_type="f32") as twin:
            assert relative_error(out[lane], twin.step(rings[lane], committed, noise)) <= TOL
    c.close()
    with pytest.raises(GGMLError, match="closed"):
        c.step(rings, [12, 12, 12], [noise] * 3)
    with pytest.raises(GGMLError, match="closed"):
        c.reset(0)
    with pytest.raises(ValueError, match="lanes must be"):
        DraftKvCache(bw, cpu, 19, lanes=0)


def test_move_lane_keeps_a_request_without_refolding(gqa, cpu):
    """A request leaves lane 1; the request on lane 3 moves into it: its rows move on the device
    (no refold), it steps as its single-lane twin, and lanes {0, 1} now compute a 2-lane graph."""
    cfg, _, bw = gqa
    rings = _rings(cfg, 4, n=40, seed=6)
    rng = np.random.default_rng(7)
    noise = [rng.standard_normal((cfg.block_size, cfg.hidden)).astype(np.float32) for _ in range(4)]
    with DraftKvCache(bw, cpu, 19, cache_type="f32", lanes=4) as c, DraftKvCache(bw, cpu, 19, cache_type="f32") as twin:
        c.step(rings, [30, 31, 32, 33], noise)
        twin.step(rings[3], 33, noise[3])
        slots_before = c.lane_slot_pos(3).copy()
        c.reset(1)
        c.move_lane(3, 1)
        assert (c.lane_slot_pos(1) == slots_before).all() and c.lane_next_pos(1) == 33
        assert c.lane_next_pos(3) == 0 and (c.lane_slot_pos(3) == -1).all()
        got = c.step([rings[0], rings[3], None, None], [31, 35, None, None], [noise[0], noise[1], None, None])
        assert c._computed.n_lanes == 2
        assert relative_error(got[1], twin.step(rings[3], 35, noise[1])) <= TOL
        assert (c.lane_slot_pos(1) == twin.slot_pos).all()
        with pytest.raises(ValueError, match="both lane 2"):
            c.move_lane(2, 2)
        with pytest.raises(ValueError, match="lane must be an int in \\[0, 4\\)"):
            c.move_lane(0, 4)
        c.begin_step(rings[0], 32, lane=0)
        with pytest.raises(GGMLError, match="between begin_step and compute"):
            c.move_lane(0, 2)


def test_drafter_move_lane(gqa):
    cfg, w, _ = gqa
    rng = np.random.default_rng(12)
    vocab = 40
    embed = rng.standard_normal((vocab, cfg.hidden)).astype(np.float32)
    head = rng.standard_normal((vocab, cfg.hidden)).astype(np.float32)
    kw = dict(embed_tokens=embed, lm_head=head, cap=19, weight_dtype="f32", cache_type="f32")
    feats = features(rng, 14, cfg.fc_in)
    with Drafter(w, lanes=3, **kw) as multi, Drafter(w, **kw) as single:
        multi.add_features(features(rng, 5, cfg.fc_in), lane=0)
        multi.add_features(feats, lane=2)
        single.add_features(feats)
        assert multi.propose_lanes([1, None, 2])[2].tolist() == single.propose(2).tolist()
        multi.move_lane(2, 1)
        assert multi.committed_of(1) == 14 and multi.committed_of(2) == 0
        more = features(rng, 3, cfg.fc_in)
        multi.add_features(more, lane=1)
        single.add_features(more)
        assert multi.propose(7, lane=1).tolist() == single.propose(7).tolist()
