"""Behaviour of DraftKvCache beyond parity: one graph forever, rewinds, masks, finiteness, drop-in API."""

from __future__ import annotations

import numpy as np
import pytest

from pyggml_dkv import (
    DraftConfig,
    DraftKvCache,
    DraftKvState,
    DraftWeights,
    FeatureRing,
    draft_kv_begin_step,
    draft_kv_free,
    draft_kv_init,
    draft_kv_reset,
)
from pyggml_dkv import reference as R
from pyggml_dkv.common.numeric import relative_error
from pyggml_dkv.ggml import GGMLError, live_objects

SMALL = dict(hidden=64, n_layer=2, n_head=2, n_head_kv=1, head_dim=64, ffn=128, block_size=8, n_target_layers=2)


def make(cfg_changes=None, cap=37, seed=0):
    cfg = DraftConfig(**{**SMALL, **(cfg_changes or {})})
    return cfg, DraftWeights.random(cfg, seed=seed)


def feature_ring(cfg, n, ring_cap=None, seed=0):
    rng = np.random.default_rng(seed)
    feats = rng.standard_normal((n, cfg.fc_in)).astype(np.float32)
    ring = FeatureRing(ring_cap or n, cfg.fc_in)
    ring.append(feats)
    return ring, feats


def noise_for(cfg, seed=0):
    return np.random.default_rng(seed).standard_normal((cfg.block_size, cfg.hidden)).astype(np.float32)


@pytest.fixture
def small(cpu):
    cfg, w = make()
    bw = w.to_backend(cpu, "f32")
    yield cfg, w, bw
    bw.close()


def tensor_addresses(cache):
    return [(t.name, t.op, t.data_address) for t in cache.gf.nodes()]


def test_geometry(small, cpu):
    cfg, _, bw = small
    with DraftKvCache(bw, cpu, 37, cache_type="f32") as c:
        assert (c.cap, c.q_len, c.a_step, c.trash_slot) == (37, 8, 18, 45)
        assert c.kv_total == 64 and c.kv_total % 32 == 0 and c.kv_total >= c.cap + c.q_len + 1
        assert c.fc_in == cfg.fc_in and c.any_full and not c.any_swa
        assert c.mask_swa is None and c.mask_full is not None
        assert c.k_cache[0].ne[:2] == (cfg.head_dim * cfg.n_head_kv, c.kv_total)
        assert c.noise_rows.numpy().tolist() == list(range(37, 45))
        assert c.hidden_states.shape == (cfg.block_size, cfg.hidden) and c.logits is None


def test_graph_built_once_and_never_reallocated(small, cpu):
    """1000 steps: same node count, same tensor addresses, no gallocr reallocation, no new ggml objects."""
    cfg, _, bw = small
    ring, _ = feature_ring(cfg, 3000, ring_cap=64)
    rng = np.random.default_rng(1)
    with DraftKvCache(bw, cpu, 37, cache_type="f32") as c:
        before = tensor_addresses(c)
        n_nodes, buffer_size, objects = c.gf.n_nodes, c.galloc.buffer_size, live_objects()
        committed = 1
        noise = noise_for(cfg)
        ring2 = FeatureRing(64, cfg.fc_in)
        feats = np.random.default_rng(2).standard_normal((1100, cfg.fc_in)).astype(np.float32)
        for _ in range(1000):
            step = int(rng.integers(1, cfg.block_size + 1))
            ring2.append(feats[committed : committed + step] if ring2.written else feats[: committed + step])
            committed = ring2.written
            c.step(ring2, committed, noise)
        assert c.gf.n_nodes == n_nodes
        assert tensor_addresses(c) == before
        assert c.galloc.n_allocs == 1 and c.galloc.buffer_size == buffer_size
        assert live_objects() == objects


def test_bulk_append_uses_temporaries_that_are_freed(small, cpu):
    cfg, w, bw = small
    ring, feats = feature_ring(cfg, 200)
    with DraftKvCache(bw, cpu, 150, cache_type="f32") as c:
        objects = live_objects()
        out = c.step(ring, 190, noise_for(cfg))  # 150 rows > a_step: bulk append
        assert live_objects() == objects
        want = R.reference_step(w, feats, 190, 150, noise_for(cfg))
        assert relative_error(out, want) < 1e-4


def test_bulk_append_in_several_chunks(cpu, monkeypatch):
    import pyggml_dkv.drafter.bulk_append as dkv

    monkeypatch.setattr(dkv, "BULK_CHUNK", 16)  # force 3+ chunks, one partial
    cfg, w = make()
    ring, feats = feature_ring(cfg, 120)
    with w.to_backend(cpu, "f32") as bw, DraftKvCache(bw, cpu, 50, cache_type="f32") as c:
        out = c.step(ring, 120, noise_for(cfg))
        assert relative_error(out, R.reference_step(w, feats, 120, 50, noise_for(cfg))) < 1e-4


def test_rewind_rebuilds_from_ring_and_reset_equals_fresh(small, cpu):
    cfg, w, bw = small
    ring, feats = feature_ring(cfg, 300)
    noise = noise_for(cfg)
    with DraftKvCache(bw, cpu, 37, cache_type="f32") as c, DraftKvCache(bw, cpu, 37, cache_type="f32") as fresh:
        for committed in (10, 30, 60, 100):
            c.step(ring, committed, noise)
        rewound = c.step(ring, 55, noise)  # committed decreased: reset + rebuild
        assert c.next_pos == 55
        assert np.array_equal(rewound, fresh.step(ring, 55, noise))
        c.reset()
        assert c.next_pos == 0 and (c.slot_pos == -1).all()
        fresh.reset()
        assert np.array_equal(c.step(ring, 77, noise), fresh.step(ring, 77, noise))
        assert relative_error(rewound, R.reference_step(w, feats, 55, 37, noise)) < 1e-4


@pytest.mark.parametrize("jump", ["1", "q_len", "a_step", "a_step+1", ">cap"])
def test_commit_jumps(small, cpu, jump):
    cfg, w, bw = small
    ring, feats = feature_ring(cfg, 400)
    q, a = cfg.block_size, 2 * cfg.block_size + 2
    size = {"1": 1, "q_len": q, "a_step": a, "a_step+1": a + 1, ">cap": 37 + 5}[jump]
    noise = noise_for(cfg)
    with DraftKvCache(bw, cpu, 37, cache_type="f32") as c:
        committed = 3
        while committed < 390:
            got = c.step(ring, committed, noise)
            assert relative_error(got, R.reference_step(w, feats, committed, 37, noise)) < 1e-4
            committed += size


def test_ring_wraps_many_times(small, cpu):
    """The window slides far past cap: ring slot p % cap reused over 20 times."""
    cfg, w, bw = small
    ring = FeatureRing(45, cfg.fc_in)
    feats = np.random.default_rng(5).standard_normal((800, cfg.fc_in)).astype(np.float32)
    noise = noise_for(cfg)
    with DraftKvCache(bw, cpu, 37, cache_type="f32") as c:
        committed = 0
        for step in range(160):
            n = 1 + step % 9
            ring.append(feats[committed : committed + n])
            committed += n
            got = c.step(ring, committed, noise)
            if step % 10 == 0:
                assert relative_error(got, R.reference_step(w, feats, committed, 37, noise)) < 1e-4
        assert committed > 20 * 37


def visible_columns(mask_tensor):
    m = mask_tensor.numpy()
    assert set(np.unique(m)) <= {0.0, -np.inf}
    return m == 0


def test_full_mask_hides_padding_and_empty_slots(small, cpu):
    cfg, _, bw = small
    ring, _ = feature_ring(cfg, 100)
    with DraftKvCache(bw, cpu, 37, cache_type="f32") as c:
        c.begin_step(ring, 5)
        c.compute()  # (over RPC the step graph writes the full mask: base + context row)
        vis = visible_columns(c.mask_full)
        assert (vis == vis[0]).all()  # same for every query row
        row = vis[0]
        assert row[:5].all() and not row[5:37].any()  # empty ring slots hidden
        assert row[37:45].all()  # noise slots visible
        assert not row[45:].any()  # trash + alignment hidden
        ap_rows = c.ap_rows.numpy()
        assert (ap_rows[5:] == c.trash_slot).all() and ap_rows[:5].tolist() == [0, 1, 2, 3, 4]
        assert (c.ap_pos.numpy()[5:] == 0).all()
        assert c.pos_q.numpy().tolist() == list(range(5, 5 + cfg.block_size))
        c.begin_step(ring, 60)  # bulk + wrap: live window [23, 60)
        c.compute()
        row = visible_columns(c.mask_full)[0]
        live = (c.slot_pos >= 23) & (c.slot_pos < 60)
        assert live.all() and row[:37].all()


@pytest.mark.parametrize("swa", ["seed", "per_row"])
def test_swa_mask(cpu, swa):
    cfg, w = make({"layer_types": ["sliding", "full"], "swa_window": 10})
    ring, _ = feature_ring(cfg, 200)
    with w.to_backend(cpu, "f32") as bw, DraftKvCache(bw, cpu, 37, swa=swa, cache_type="f32") as c:
        committed = 100
        c.step(ring, committed, noise_for(cfg))
        vis = visible_columns(c.mask_swa)
        q = cfg.block_size
        # one mask row per folded query row (CPU: each K/V head's query heads become extra rows)
        groups = cfg.n_head // cfg.n_head_kv
        assert c.fold_gqa and groups > 1 and vis.shape == (q * groups, c.kv_total) and c.mask_rows == q * groups
        for gi in range(1, groups):
            np.testing.assert_array_equal(vis[gi * q : (gi + 1) * q], vis[:q])
        for j in range(q):
            ring_part = vis[j, :37]
            seen = sorted(int(c.slot_pos[s]) for s in np.nonzero(ring_part)[0])
            if swa == "seed":  # anchored at committed, same for every row
                assert seen == list(range(committed - 10, committed))
            else:  # per row: (committed + j) - p < window
                assert seen == list(range(committed + j - 9, committed))
            assert vis[j, 37 : 37 + q].tolist() == [i <= j for i in range(q)]  # causal noise
            assert not vis[j, 37 + q :].any()
        assert visible_columns(c.mask_full)[0, :37].all()


def test_swa_off_uses_full_masks_only(cpu):
    cfg, w = make({"layer_types": ["sliding", "sliding"], "swa_window": 10})
    with w.to_backend(cpu, "f32") as bw, DraftKvCache(bw, cpu, 37, swa="off") as c:
        assert c.mask_swa is None and c.mask_full is not None and not c.any_swa


def test_nan_poisoning_of_unused_memory_never_reaches_outputs(cpu):
    """Fill every cache row attention can see but must ignore (empty ring slots, scratch, trash,
    alignment) with NaN, and every unwritten ring row is NaN by construction: outputs stay finite
    and correct."""
    cfg, w = make({"layer_types": ["full", "sliding"], "swa_window": 12})
    ring = FeatureRing(64, cfg.fc_in)  # unwritten rows are NaN
    feats = np.random.default_rng(9).standard_normal((300, cfg.fc_in)).astype(np.float32)
    noise = noise_for(cfg)
    with w.to_backend(cpu, "f32") as bw, DraftKvCache(bw, cpu, 37, cache_type="f32") as c:
        width = c.k_cache[0].ne[0]
        nan_rows = np.full((c.kv_total, width), np.nan, dtype=np.float32)
        for t in (*c.k_cache, *c.v_cache):
            t.set(nan_rows)
        c.ap_feat.set(np.full((c.a_step, c.fc_in), np.nan, dtype=np.float32))
        committed = 0
        for n in (3, 5, 1, 30, 7, 60, 2, 100):
            ring.append(feats[committed : committed + n])
            committed += n
            got = c.step(ring, committed, noise)
            assert np.isfinite(got).all(), f"NaN leaked at committed={committed}"
            assert relative_error(got, R.reference_step(w, feats, committed, 37, noise)) < 1e-4


def test_lm_head_array_and_tensor(small, cpu):
    from pyggml_dkv.drafter.backend_weights import upload_matrix

    cfg, w, bw = small
    ring, feats = feature_ring(cfg, 50)
    lm = np.random.default_rng(4).standard_normal((33, cfg.hidden)).astype(np.float32)
    noise = noise_for(cfg)
    want = R.reference_step(w, feats, 50, 37, noise, lm_head=lm)
    with DraftKvCache(bw, cpu, 37, lm_head=lm, cache_type="f32") as c:
        got = c.step(ring, 50, noise)
        assert got.shape == (cfg.block_size, 33) and relative_error(got, want) < 1e-4
    tensor, buf = upload_matrix(cpu, lm, "f32", "lm_head")
    with buf, DraftKvCache(bw, cpu, 37, lm_head=tensor, cache_type="f32") as c:
        assert relative_error(c.step(ring, 50, noise), want) < 1e-4


def test_logits_are_written_into_the_returned_array(small, cpu):
    """On the CPU a step's logits are computed straight into the array it returns (Tensor.place_in:
    no 3 MB copy a step at a real vocabulary): each step returns a new array, an earlier one keeps its
    values, `logits` reads the last one, and the values are the reference's."""
    cfg, w, bw = small
    ring, feats = feature_ring(cfg, 80)
    lm = np.random.default_rng(4).standard_normal((33, cfg.hidden)).astype(np.float32)
    noise = noise_for(cfg)
    with DraftKvCache(bw, cpu, 37, lm_head=lm, cache_type="f32") as c:
        first = c.step(ring, 50, noise)
        assert c.logits.data_address == first.ctypes.data  # computed in place, not copied out
        kept = first.copy()
        second = c.step(ring, 59, noise)
        assert second.ctypes.data != first.ctypes.data and c.logits.data_address == second.ctypes.data
        np.testing.assert_array_equal(first, kept)
        np.testing.assert_array_equal(c.logits.numpy(), second)
        assert relative_error(first, R.reference_step(w, feats, 50, 37, noise, lm_head=lm)) < 1e-4
        assert relative_error(second, R.reference_step(w, feats, 59, 37, noise, lm_head=lm)) < 1e-4


@pytest.mark.parametrize("head_dtype,tol", [("q8_0", 3e-2), ("f16", 3e-3), ("f32", 3e-3)])
def test_lm_head_dtype(cpu, head_dtype, tol):
    """lm_head_dtype uploads an array lm_head in its own type next to f16 weights: its logits carry
    that type's rounding (q8_0: int8 activations and weights per 32 values), the rest of the step
    is the f16 drafter's; q8_0 goes to the repacking buffer (AMX / VNNI) where the CPU has one."""
    cfg, w = make()
    ring, feats = feature_ring(cfg, 50)
    lm = np.random.default_rng(4).standard_normal((64, cfg.hidden)).astype(np.float32)
    noise = noise_for(cfg)
    want = R.reference_step(w, feats, 50, 37, noise, lm_head=lm)
    with (
        w.to_backend(cpu, "f16") as bw,
        DraftKvCache(bw, cpu, 37, lm_head=lm, cache_type="f32") as same,
        DraftKvCache(bw, cpu, 37, lm_head=lm, cache_type="f32", lm_head_dtype=head_dtype) as own,
    ):
        assert same.lm_head.type == "f16" and own.lm_head.type == head_dtype
        base, got = same.step(ring, 50, noise), own.step(ring, 50, noise)
    assert relative_error(base, want) < 3e-3
    err = relative_error(got, want)
    assert err < tol, err
    if head_dtype == "q8_0":
        assert err > 1e-4  # the q8_0 head really ran (f16 weights alone stay ~1e-3 away)
        assert relative_error(got, base) > 1e-4


def test_lm_head_dtype_refusals(small, cpu):
    from pyggml_dkv.drafter.backend_weights import upload_matrix

    cfg, w, bw = small
    lm = np.zeros((8, cfg.hidden), np.float32)
    with pytest.raises(ValueError, match="lm_head_dtype"):
        DraftKvCache(bw, cpu, 10, lm_head=lm, lm_head_dtype="q4_k")
    with pytest.raises(ValueError, match="lm_head_dtype='q8_0' was given without a lm_head"):
        DraftKvCache(bw, cpu, 10, lm_head_dtype="q8_0")
    tensor, buf = upload_matrix(cpu, lm, "f32", "lm_head")
    with buf, pytest.raises(ValueError, match="lm_head_dtype='q8_0' applies to a lm_head given as an array"):
        DraftKvCache(bw, cpu, 10, lm_head=tensor, lm_head_dtype="q8_0")


def test_drop_in_functions_match_the_class(small, cpu):
    cfg, w, bw = small
    ring, feats = feature_ring(cfg, 120)
    noise = noise_for(cfg)
    st = DraftKvState()
    with pytest.raises(GGMLError):
        st.gf  # noqa: B018 - not initialised yet
    assert draft_kv_init(st, bw, cpu, 37, None, cache_type="f32")
    with DraftKvCache(bw, cpu, 37, cache_type="f32") as c:
        for committed in (4, 40, 41, 90, 60):
            assert draft_kv_begin_step(st, bw, cpu, ring, committed)
            st.inp_embed.set(noise)
            cpu.compute(st.gf)
            assert np.array_equal(st.hidden_states.numpy(), c.step(ring, committed, noise))
        assert st.next_pos == 60 and st.cap == 37 and st.kv_total == c.kv_total
    draft_kv_reset(st)
    assert st.next_pos == 0
    other = w.to_backend(cpu, "f32")
    with pytest.raises(ValueError, match="not the ones"):
        draft_kv_begin_step(st, other, cpu, ring, 5)
    other.close()
    draft_kv_free(st)
    draft_kv_free(st)  # idempotent
    with pytest.raises(GGMLError):
        draft_kv_begin_step(st, bw, cpu, ring, 5)


def test_begin_step_without_compute_does_not_lose_rows(small, cpu):
    """If the host fills inputs but never computes, the next begin_step folds those rows in again."""
    cfg, w, bw = small
    ring, feats = feature_ring(cfg, 100)
    noise = noise_for(cfg)
    with DraftKvCache(bw, cpu, 37, cache_type="f32") as c:
        c.step(ring, 10, noise)
        c.begin_step(ring, 15)  # rows 10..14 staged, graph not computed
        got = c.step(ring, 20, noise)
        assert relative_error(got, R.reference_step(w, feats, 20, 37, noise)) < 1e-4


def test_invalid_arguments(small, cpu):
    cfg, _, bw = small
    ring, _ = feature_ring(cfg, 50)
    with pytest.raises(ValueError, match="cap"):
        DraftKvCache(bw, cpu, 0, cache_type="f32")
    with pytest.raises(ValueError, match="cap"):
        DraftKvCache(bw, cpu, 1 << 40)
    with pytest.raises(ValueError, match="cache_type"):
        DraftKvCache(bw, cpu, 10, cache_type="q4")
    with pytest.raises(ValueError, match="swa"):
        DraftKvCache(bw, cpu, 10, swa="maybe")
    with pytest.raises(TypeError, match="BackendWeights"):
        DraftKvCache(object(), cpu, 10)
    with pytest.raises(ValueError, match="lm_head"):
        DraftKvCache(bw, cpu, 10, lm_head=np.zeros((5, cfg.hidden + 1), np.float32))
    with DraftKvCache(bw, cpu, 37, cache_type="f32") as c:
        noise = noise_for(cfg)
        with pytest.raises(ValueError, match="committed must be > 0"):
            c.step(ring, 0, noise)
        with pytest.raises(ValueError, match="only holds features"):
            c.step(ring, 51, noise)
        with pytest.raises(ValueError, match="fc_in"):
            c.step(FeatureRing(10, cfg.fc_in + 1), 1, noise)
        with pytest.raises(ValueError, match="noise_embed"):
            c.step(ring, 5, noise[:-1])
        with pytest.raises(ValueError, match="NaN"):
            c.step(ring, 5, np.full_like(noise, np.nan))
        small_ring = FeatureRing(8, cfg.fc_in)
        small_ring.append(np.zeros((30, cfg.fc_in), np.float32))
        with pytest.raises(ValueError, match="overwritten"):
            c.step(small_ring, 30, noise)
        assert np.isfinite(c.step(ring, 5, noise)).all()  # still works after the errors
    with pytest.raises(GGMLError, match="closed"):
        c.step(ring, 5, noise)
    c.close()  # idempotent


@pytest.mark.parametrize("weight_type", ["f32", "f16", "q8_0"])
def test_threads_agree(cpu, weight_type):
    """The suite runs ggml on one thread; the same steps on two threads give the same answers
    (f16: the narrow matmul kernel, q8_0: ggml's AMX kernels where available, which split their
    rows and blocks over the threads, or the VNNI kernel of old patch 0010 without AMX)."""
    from pyggml_dkv import Backend
    from pyggml_dkv.ggml import amx_available, vnni_available

    cfg, w = make({"n_head": 4, "n_head_kv": 1, "block_size": 16})  # folded GQA: the tiled attention kernel
    ring, feats = feature_ring(cfg, 300)
    noise = noise_for(cfg)
    with (
        Backend("cpu", n_threads=2) as two,
        w.to_backend(cpu, weight_type) as bw1,
        w.to_backend(two, weight_type) as bw2,
        DraftKvCache(bw1, cpu, 100, cache_type="f32") as c1,
        DraftKvCache(bw2, two, 100, cache_type="f32") as c2,
    ):
        assert (bw2.n_repacked > 0) == (weight_type == "q8_0" and (amx_available() or vnni_available()))
        for committed in (5, 40, 41, 150, 300):
            assert relative_error(c2.step(ring, committed, noise), c1.step(ring, committed, noise)) < 1e-5


@pytest.mark.parametrize("cache_type", ["f16", "f32"])
def test_bf16_attention(cpu, cpu_runs_bf16_attention, cache_type):
    """attention="bf16" (old patch 0009): the steps stay within bf16 rounding of the reference
    along a trajectory with fold-ins, bulk appends and a ring wrap; NaN in memory attention must
    ignore still never leaks; on CPUs with AMX-BF16 the bf16 products really ran."""
    from pyggml_dkv import bf16_attention_supported

    if not bf16_attention_supported():
        pytest.skip("ggml built without our bf16 attention kernel (fa-bf16)")
    cfg, w = make(
        {"n_head": 4, "n_head_kv": 1, "block_size": 16, "layer_types": ["full", "sliding"], "swa_window": 50}
    )  # folded GQA (64 rows), head_dim 64
    ring, feats = feature_ring(cfg, 400)
    noise = noise_for(cfg)
    with (
        w.to_backend(cpu, "f32") as bw,
        DraftKvCache(bw, cpu, 100, cache_type=cache_type, attention="bf16") as fast,
        DraftKvCache(bw, cpu, 100, cache_type=cache_type) as exact,
    ):
        assert fast.attention == "bf16" and exact.attention == "f32"
        nan_rows = np.full((fast.kv_total, fast.k_cache[0].ne[0]), np.nan, dtype=np.float32)
        for t in (*fast.k_cache, *fast.v_cache):
            t.set(nan_rows)
        for committed in (5, 40, 41, 150, 400):
            got, ref_f32 = fast.step(ring, committed, noise), exact.step(ring, committed, noise)
            assert np.isfinite(got).all()
            want = R.reference_step(w, feats, committed, 100, noise)
            assert relative_error(got, want) < 3e-2, (committed, relative_error(got, want))
            if cpu_runs_bf16_attention:
                assert relative_error(got, ref_f32) > 1e-4  # not the f32 kernel


def test_bf16_attention_refusals(small, cpu, monkeypatch):
    import pyggml_dkv.drafter.args as D

    _, _, bw = small
    with pytest.raises(ValueError, match="attention"):
        DraftKvCache(bw, cpu, 10, attention="f16")
    monkeypatch.setattr(D, "bf16_attention_supported", lambda: False)
    with pytest.raises(ValueError, match="'fa-bf16'"):
        DraftKvCache(bw, cpu, 10, attention="bf16")
