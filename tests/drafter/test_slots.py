"""SlotBook (drafter/slots.py): the host's record of which position each ring slot holds, and the
partial rewind that invalidates only the dropped slots."""

from __future__ import annotations

import numpy as np
import pytest

from pyggml_dkv import DraftConfig, DraftKvCache, DraftWeights, FeatureRing
from pyggml_dkv import reference as R
from pyggml_dkv.common.numeric import relative_error
from pyggml_dkv.drafter.slots import SlotBook


def test_missing_record_and_wrap():
    book = SlotBook(8)
    np.testing.assert_array_equal(book.missing(0, 5), np.arange(5))
    book.record(np.arange(5))
    assert book.missing(0, 5).size == 0
    book.record(np.arange(5, 12))  # 8..11 overwrite the slots of 0..3
    np.testing.assert_array_equal(book.slot_pos, [8, 9, 10, 11, 4, 5, 6, 7])
    assert book.missing(4, 12).size == 0
    np.testing.assert_array_equal(book.missing(2, 10), [2, 3])


def test_rewind_drops_only_later_positions_and_reports_the_overwritten_ones():
    book = SlotBook(8)
    book.record(np.arange(12))
    book.next_pos = 12
    book.rewind(10)
    np.testing.assert_array_equal(book.slot_pos, [8, 9, -1, -1, 4, 5, 6, 7])
    assert book.next_pos == 10
    # the window [2, 10) needs 2 and 3 again: their slots had been overwritten by 10 and 11
    np.testing.assert_array_equal(book.missing(2, 10), [2, 3])


def test_forget_only_clears_slots_still_holding_those_positions():
    book = SlotBook(4)
    book.record(np.arange(6))  # slots: 4 5 2 3
    book.forget(np.array([0, 1, 4]))  # 0 and 1 are no longer there; 4 is
    np.testing.assert_array_equal(book.slot_pos, [-1, 5, 2, 3])


def test_clear_and_bad_arguments():
    book = SlotBook(3)
    book.record(np.arange(3))
    book.next_pos = 3
    book.clear()
    assert book.next_pos == 0 and (book.slot_pos == -1).all()
    with pytest.raises(ValueError, match="cap"):
        SlotBook(0)
    with pytest.raises(TypeError, match="pos"):
        book.rewind(1.5)


@pytest.fixture(scope="module")
def toy(cpu):
    cfg = DraftConfig(
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
    )
    w = DraftWeights.random(cfg, seed=3)
    rng = np.random.default_rng(3)
    feats = rng.standard_normal((200, cfg.fc_in)).astype(np.float32)
    ring = FeatureRing(256, cfg.fc_in)
    ring.append(feats)
    noise = rng.standard_normal((cfg.block_size, cfg.hidden)).astype(np.float32)
    with w.to_backend(cpu, "f32") as bw:
        yield cfg, w, bw, ring, feats, noise


@pytest.mark.parametrize("back", [1, 3, 5])
def test_cache_partial_rewind_refolds_instead_of_rebuilding(toy, cpu, monkeypatch, back):
    """A rewind by a few positions in a wrapped window keeps every other row and refolds what the
    window needs (the dropped rows and the older ones they had overwritten) in the step graph's
    fold-in: no bulk append, and the result matches the reference."""
    import pyggml_dkv.drafter.cache as cache_mod

    cfg, w, bw, ring, feats, noise = toy
    cap = 40
    with DraftKvCache(bw, cpu, cap, cache_type="f32") as c:
        c.step(ring, 150, noise)
        kept = c.slot_pos[(c.slot_pos >= 0) & (c.slot_pos < 150 - back)].copy()
        bulk_calls = []
        monkeypatch.setattr(cache_mod, "bulk_append", lambda *a, **k: bulk_calls.append(a))
        c.rewind(150 - back)
        assert (c.slot_pos < 150 - back).all() and np.isin(kept, c.slot_pos).all()
        out = c.step(ring, 150 - back, noise)
        assert not bulk_calls, "a short rewind must not rebuild the window"
        assert c.next_pos == 150 - back
        want = R.reference_step(w, feats, 150 - back, cap, noise)
        assert relative_error(out, want) < 1e-4


def test_step_computes_the_smallest_graph_that_takes_its_rows(toy, cpu):
    """Fold-in buckets: a step of n new rows runs the smallest bucket >= n (its outputs are the
    step's), and agrees with the full a_step graph the C-style API computes."""
    cfg, w, bw, ring, feats, noise = toy
    with DraftKvCache(bw, cpu, 40, cache_type="f32") as c, DraftKvCache(bw, cpu, 40, cache_type="f32") as full:
        geo = c.geometry
        assert geo.fold_buckets[-1] == geo.a_step and list(geo.fold_buckets) == sorted(set(geo.fold_buckets))
        assert set(c.graphs) == {(1, b) for b in geo.fold_buckets} and c.gf is c.graphs[(1, geo.a_step)].graph
        assert c.next_graph() is c.gf  # before any begin_step: the a_step graph
        c.step(ring, 100, noise)
        full.step(ring, 100, noise)
        for n_new in (1, 2, geo.fold_buckets[0] + 1, geo.a_step):
            committed = c.next_pos + n_new
            out = c.step(ring, committed, noise)
            assert c.hidden_states is c.graphs[(1, geo.bucket_for(n_new))].hidden_states
            # what a benchmark times / profiles as the step's graph is the one step() ran
            assert c.next_graph() is c.next_graph(logits=True) is c.graphs[(1, geo.bucket_for(n_new))].graph
            full.begin_step(ring, committed)  # the C-style route: compute the a_step graph itself
            full.inp_embed.set(noise)
            cpu.compute(full.gf)
            assert full.hidden_states is full.graphs[(1, geo.a_step)].hidden_states
            np.testing.assert_allclose(out, full.hidden_states.numpy(), rtol=0, atol=1e-5)
            assert relative_error(out, R.reference_step(w, feats, committed, 40, noise)) < 1e-4
