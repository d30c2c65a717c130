"""DFlash-2 in the ring cache: the convolutions and the candidate selector against the numpy
reference (docs/dflash2.md), over lanes, trajectories with rewinds, and both convolution paths.

Acceptance as for DFlash-1: hidden states and lattice scores max|a-b|/max|b| <= 1e-4 with f32
weights and cache, <= 5e-3 with an f16 cache; draft ids identical but where the reference's own
walk meets a near-tie (a score gap below the tolerance of the scores).
"""

from __future__ import annotations

import numpy as np
import pytest

from pyggml_dkv import DraftConfig, DraftKvCache, DraftWeights, FeatureRing, OneShotDrafter
from pyggml_dkv import reference as R
from pyggml_dkv.common.numeric import relative_error
from pyggml_dkv.drafter import dflash2_graph as D2
from pyggml_dkv.drafter.selector_walk import SelectorLattice, greedy_walk, sampled_walk
from pyggml_dkv.ggml import Buffer, Context, Gallocr, GGMLError, Graph
from pyggml_dkv.reference import dflash2 as R2

from .test_parity import trajectory

TOL = {"f32": 1e-4, "f16": 5e-3}
VOCAB = 320


def dflash2_config(**changes) -> DraftConfig:
    base = dict(
        hidden=128,
        n_layer=2,
        n_head=4,
        n_head_kv=2,
        head_dim=64,
        ffn=256,
        block_size=8,
        n_target_layers=2,
        vocab=VOCAB,
        conv_kernel_size=3,
        conv_group_size=16,
        selector_rank=32,
        selector_top_k=4,
    )
    base.update(changes)
    return DraftConfig(**base)


def vocab_tables(cfg: DraftConfig, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    embed = (rng.standard_normal((VOCAB, cfg.hidden)) * 0.5).astype(np.float32)
    head = (rng.standard_normal((VOCAB, cfg.hidden)) / np.sqrt(cfg.hidden) * 4).astype(np.float32)
    return embed, head


def near_tie_free_prefix(lattice: R2.Lattice, tol: float) -> int:
    """How many of the reference walk's picks are decided by more than `tol` (relative to the scores)."""
    scale = np.abs(lattice.scores).max()
    pred = 0
    for i in range(lattice.n_positions):
        row = np.sort(lattice.scores[i, pred])[::-1]
        if row[0] - row[1] <= tol * scale:
            return i
        pred = int(np.argmax(lattice.scores[i, pred]))
    return lattice.n_positions


def assert_lattice_close(got: SelectorLattice, want: R2.Lattice, tol: float) -> float:
    """Same candidate sets per position, scores close once both are put in the reference's order."""
    assert got.candidates.shape == want.candidates.shape
    errors = []
    for i in range(want.n_positions):
        assert set(got.candidates[i]) == set(want.candidates[i]), f"position {i + 1}: candidates differ"
    order = [np.argsort(c) for c in got.candidates]
    ref_order = [np.argsort(c) for c in want.candidates]
    for i in range(want.n_positions):
        prev_got = order[i - 1] if i else np.zeros(got.candidates.shape[1], dtype=int)
        prev_want = ref_order[i - 1] if i else np.zeros(got.candidates.shape[1], dtype=int)
        g = got.scores[i][prev_got][:, order[i]]
        w = want.scores[i][prev_want][:, ref_order[i]]
        errors.append(relative_error(g, w))
    worst = max(errors)
    assert worst <= tol, f"lattice scores differ by {worst:.3e} > {tol}"
    return worst


# ---------------------------------------------------------------------------- the convolution op


@pytest.mark.parametrize("custom_op", [True, False], ids=["custom-op", "standard-ops"])
@pytest.mark.parametrize("kernel,block,lanes", [(3, 8, 1), (3, 8, 3), (5, 3, 2), (1, 4, 2)])
def test_dynamic_conv_matches_reference(custom_op, kernel, block, lanes, cpu):
    """Both ways of building the convolution equal reference.dflash2.dynamic_conv per block, both
    sides, including kernels longer than the block (taps past its start read zeros)."""
    cfg = dflash2_config(conv_kernel_size=kernel)
    w = DraftWeights.random(cfg, seed=kernel + block)
    rng = np.random.default_rng(block)
    rows = block * lanes
    x = rng.standard_normal((rows, cfg.hidden)).astype(np.float32)
    deltas = (rng.standard_normal((rows, 2 * kernel * cfg.conv_groups)) * 0.3).astype(np.float32)
    with w.to_backend(cpu, "f32") as bw:
        ctx = Context(n_tensors=4)
        tx = ctx.new_tensor("f32", cfg.hidden, rows, name="x")
        td = ctx.new_tensor("f32", deltas.shape[1], rows, name="deltas")
        buf = Buffer.alloc_ctx_tensors(ctx, cpu)
        tx.set(x)
        td.set(deltas)
        g = Context(n_tensors=512, graph_size=512)
        gf = Graph(g, 512)
        outs = [D2.dynamic_conv(g, bw, 1, D2.MLP_CONV, tx, td, side, lanes, custom_op) for side in (0, 1)]
        for o in outs:
            o.set_output()
            gf.expand(o)
        galloc = Gallocr(cpu)
        galloc.alloc_graph(gf)
        gf.compute(cpu)
        base = w["layers.1.mlp_conv.base_kernel"].astype(np.float64)
        d4 = deltas.astype(np.float64).reshape(rows, 2, kernel, cfg.conv_groups)
        for side, o in enumerate(outs):
            want = R2.dynamic_conv(x.astype(np.float64), base, d4, side, block_len=block)
            assert relative_error(o.numpy(), want) <= 1e-6, (side, relative_error(o.numpy(), want))
        galloc.close()
        g.close()
        buf.close()
        ctx.close()


def test_dynamic_conv_op_checks_its_inputs(cpu):
    ctx = Context(n_tensors=8)
    x = ctx.new_tensor("f32", 64, 8)
    delta = ctx.new_tensor("f32", 3 * 4, 8)
    base = ctx.new_tensor("f32", 64, 3)
    g = Context(n_tensors=16, graph_size=16)
    with pytest.raises(ValueError, match="block must be a positive int dividing"):
        g.dynamic_conv(x, delta, base, 3)
    with pytest.raises(ValueError, match="one row per row of x"):
        g.dynamic_conv(x, ctx.new_tensor("f32", 12, 4), base, 4)
    with pytest.raises(ValueError, match="base must be"):
        g.dynamic_conv(x, delta, ctx.new_tensor("f32", 32, 3), 4)
    with pytest.raises(ValueError, match="taps of groups dividing"):
        g.dynamic_conv(x, ctx.new_tensor("f32", 3 * 5, 8), base, 4)
    g.close()
    ctx.close()


# ---------------------------------------------------------------------------- the ring cache


def run_dflash2_trajectory(
    cfg: DraftConfig, cap: int, cache_type: str, lanes: int, n_steps: int, seed: int, cpu, parity_log
) -> None:
    """Each lane follows its own trajectory; every step's hidden states, lattice and greedy ids
    are checked against the reference, lane by lane."""
    rng = np.random.default_rng(seed)
    w = DraftWeights.random(cfg, seed=seed)
    embed, head = vocab_tables(cfg, seed)
    tol = TOL[cache_type]
    commits = [trajectory(rng, cap, cfg.block_size, n_steps) for _ in range(lanes)]
    feats = [rng.standard_normal((max(c) + 1, cfg.fc_in)).astype(np.float32) for c in commits]
    rings = [FeatureRing(cap + 3 * cfg.block_size, cfg.fc_in) for _ in range(lanes)]
    worst = {"hidden": 0.0, "lattice": 0.0}
    ids_checked = 0
    with (
        w.to_backend(cpu, "f32") as bw,
        DraftKvCache(bw, cpu, cap, lm_head=head, embed_tokens=embed, cache_type=cache_type, lanes=lanes) as cache,
    ):
        for step in range(n_steps):
            tokens, committed = [], []
            for lane in range(lanes):
                c = commits[lane][step]
                ring = rings[lane]
                ring.write(min(ring.written, c), feats[lane][min(ring.written, c) : c])
                t = np.full(cfg.block_size, cfg.mask_token_id, dtype=np.int32)
                t[0] = rng.integers(0, VOCAB)
                tokens.append(t)
                committed.append(c)
            args = (rings, committed, tokens) if lanes > 1 else (rings[0], committed[0], tokens[0])
            ids = cache.step_tokens(*args, output="ids")
            hidden = [h.copy() for h in (cache.hidden_states.numpy().reshape(-1, cfg.block_size, cfg.hidden)[:lanes])]
            lattices = cache.step_tokens(*args, output="lattice")
            ids, lattices = (ids, lattices) if lanes > 1 else ([ids], [lattices])
            for lane in range(lanes):
                noise = embed[tokens[lane]]
                want_out = R.reference_step(w, feats[lane], committed[lane], cap, noise)
                want_lattice, want_ids = R2.draft_step_dflash2(
                    w, feats[lane], committed[lane], cap, noise, int(tokens[lane][0]), head
                )
                e = relative_error(hidden[lane], want_out)
                assert e <= tol, f"step {step} lane {lane}: hidden states differ by {e:.3e}"
                worst["hidden"] = max(worst["hidden"], e)
                worst["lattice"] = max(worst["lattice"], assert_lattice_close(lattices[lane], want_lattice, tol))
                # the graph's own walk is the host walk of its lattice, exactly
                np.testing.assert_array_equal(ids[lane][1:], greedy_walk(lattices[lane]))
                sure = near_tie_free_prefix(want_lattice, tol)
                np.testing.assert_array_equal(ids[lane][1 : 1 + sure], want_ids[:sure])
                ids_checked += sure
    assert ids_checked > n_steps * lanes * (cfg.block_size - 1) // 2, "most draft ids were near-ties: a vacuous test"
    for what, error in worst.items():
        parity_log(f"dflash2 cache-vs-reference ({what})", f"w=f32 kv={cache_type}", error, f"lanes={lanes}")


@pytest.mark.parametrize("cache_type", ["f32", "f16"])
def test_ring_cache_matches_reference(cache_type, cpu, parity_log):
    run_dflash2_trajectory(
        dflash2_config(), 37, cache_type, lanes=1, n_steps=25, seed=3, cpu=cpu, parity_log=parity_log
    )


def test_lanes_match_reference(cpu, parity_log):
    cfg = dflash2_config(block_size=6, conv_kernel_size=4, selector_top_k=5)
    run_dflash2_trajectory(cfg, 29, "f32", lanes=3, n_steps=15, seed=11, cpu=cpu, parity_log=parity_log)


def test_one_shot_graph_convolves_too(cpu):
    """The one-shot graph (a fresh graph per window) runs DFlash-2's convolutions as the cache does."""
    cfg = dflash2_config()
    w = DraftWeights.random(cfg, seed=5)
    rng = np.random.default_rng(5)
    feats = rng.standard_normal((40, cfg.fc_in)).astype(np.float32)
    ring = FeatureRing(64, cfg.fc_in)
    ring.append(feats[:30])
    noise = rng.standard_normal((cfg.block_size, cfg.hidden)).astype(np.float32)
    with w.to_backend(cpu, "f32") as bw, OneShotDrafter(bw, cpu, 48, cache_type="f32") as oneshot:
        got = oneshot.step(ring, 30, noise)
    assert relative_error(got, R.reference_step(w, feats, 30, 48, noise)) <= 1e-4


def test_convolutions_change_the_drafts(cpu):
    """A negative control: the same weights without their DFlash-2 parts give other hidden states,
    so the parity above does not hold by accident."""
    cfg = dflash2_config()
    w = DraftWeights.random(cfg, seed=2)
    plain_cfg = cfg.replace(conv_kernel_size=0, conv_group_size=0, selector_rank=0, selector_top_k=0)
    plain = DraftWeights(plain_cfg, {n: a for n, a in w.items() if n in R2_names_of(plain_cfg)})
    rng = np.random.default_rng(2)
    feats = rng.standard_normal((20, cfg.fc_in)).astype(np.float32)
    noise = rng.standard_normal((cfg.block_size, cfg.hidden)).astype(np.float32)
    a = R.reference_step(w, feats, 20, 32, noise)
    b = R.reference_step(plain, feats, 20, 32, noise)
    assert relative_error(a, b) > 1e-2


def R2_names_of(cfg: DraftConfig) -> set[str]:
    from pyggml_dkv.model.tensor_names import expected_shapes

    return set(expected_shapes(cfg))


# ---------------------------------------------------------------------------- walks on the host


def test_sampled_walk_distributions_match_reference():
    """The host's sampled walk draws from the reference's q_i: same path for the same draws, and
    probs rows that are the reference's draft_distribution."""
    rng = np.random.default_rng(0)
    m, k, vocab = 6, 4, 50
    cands = np.stack([rng.choice(vocab, k, replace=False) for _ in range(m)])
    scores = rng.standard_normal((m, k, k)) * 2
    scores[0] = scores[0, 0]
    lattice = R2.Lattice(candidates=cands, scores=scores)
    for seed in range(20):
        ids, probs = sampled_walk(
            SelectorLattice(cands, scores.astype(np.float32)), 0.8, vocab, np.random.default_rng(seed)
        )
        ref = R2.sample_path(lattice, 0.8, np.random.default_rng(seed))
        np.testing.assert_array_equal(ids, ref.tokens)
        np.testing.assert_allclose(probs, R2.draft_distribution(cands, ref.probs, vocab), atol=1e-6)
        assert np.allclose(probs.sum(axis=1), 1, atol=1e-5)


def test_greedy_walk_p_min_matches_reference():
    rng = np.random.default_rng(1)
    m, k = 7, 3
    cands = np.stack([rng.choice(100, k, replace=False) for _ in range(m)])
    scores = rng.standard_normal((m, k, k)) * 1.5
    scores[0] = scores[0, 0]
    for p_min in (0.0, 0.4, 0.6, 0.9):
        got = greedy_walk(SelectorLattice(cands, scores), p_min)
        np.testing.assert_array_equal(got, R2.greedy_walk(R2.Lattice(candidates=cands, scores=scores), p_min))


# ---------------------------------------------------------------------------- errors


def test_bad_requests_name_the_problem(cpu):
    cfg = dflash2_config()
    w = DraftWeights.random(cfg, seed=1)
    embed, head = vocab_tables(cfg, 1)
    with w.to_backend(cpu, "f32") as bw:
        with pytest.raises(ValueError, match="lm_head_screen does not apply to a DFlash-2"):
            DraftKvCache(bw, cpu, 32, lm_head=head, embed_tokens=embed, lm_head_screen="q8_0")
        with DraftKvCache(bw, cpu, 32, lm_head=head) as cache:  # embeddings in: no anchor ids, no selector
            assert cache.graphs[cache.geometry.graph_keys()[-1]].selector is None
    plain = DraftConfig.toy(vocab=VOCAB)
    with (
        DraftWeights.random(plain).to_backend(cpu, "f32") as bw,
        DraftKvCache(bw, cpu, 32, lm_head=vocab_tables(plain, 0)[1], embed_tokens=vocab_tables(plain, 0)[0]) as cache,
    ):
        ring = FeatureRing(64, plain.fc_in)
        ring.append(np.zeros((3, plain.fc_in), np.float32))
        with pytest.raises(GGMLError, match="needs a DFlash-2 drafter"):
            cache.step_tokens(ring, 3, np.zeros(plain.block_size, np.int32), output="lattice")


def test_sampling_lanes_draw_from_their_own_generators(cpu):
    """propose_lanes with one generator per lane: two lanes in the same state with equal seeds
    draw the same path, whatever the other lane draws; a shared generator makes them differ."""
    from pyggml_dkv import Drafter

    cfg = dflash2_config(selector_top_k=8)
    w = DraftWeights.random(cfg, seed=9)
    embed, head = vocab_tables(cfg, 9)
    feats = np.random.default_rng(9).standard_normal((12, cfg.fc_in)).astype(np.float32)
    with Drafter(w, embed_tokens=embed, lm_head=head, backend=cpu, cap=32, lanes=2, weight_dtype="f32") as d:
        for lane in (0, 1):
            d.add_features(feats, lane=lane)

        def draw(rng):
            return [ids.tolist() for ids, _ in d.propose_lanes([7, 7], temperature=2.0, rng=rng)]

        same = draw([np.random.default_rng(5), np.random.default_rng(5)])
        assert same[0] == same[1]
        assert draw([np.random.default_rng(5), np.random.default_rng(6)])[0] == same[0]
        shared = draw(np.random.default_rng(5))
        assert shared[0] == same[0] and shared[1] != shared[0]
        with pytest.raises(ValueError, match="rng must be a numpy Generator"):
            d.propose_lanes([7, 7], temperature=1.0, rng=[np.random.default_rng(1), 3])


def test_a_logits_step_leaves_the_selector_intact(cpu):
    """Asking a DFlash-2 cache for logits, then for ids and lattices again: every step's lattice
    and ids are still the reference's (the selector reads the logits where the graph put them)."""
    cfg = dflash2_config()
    w = DraftWeights.random(cfg, seed=6)
    embed, head = vocab_tables(cfg, 6)
    rng = np.random.default_rng(6)
    feats = rng.standard_normal((30, cfg.fc_in)).astype(np.float32)
    ring = FeatureRing(64, cfg.fc_in)
    ring.append(feats[:20])
    tokens = np.full(cfg.block_size, cfg.mask_token_id, dtype=np.int32)
    tokens[0] = 17
    with (
        w.to_backend(cpu, "f32") as bw,
        DraftKvCache(bw, cpu, 32, lm_head=head, embed_tokens=embed, cache_type="f32") as cache,
    ):
        want_lattice, want_ids = R2.draft_step_dflash2(w, feats, 20, 32, embed[tokens], 17, head)
        logits = cache.step_tokens(ring, 20, tokens, output="logits")
        want_logits = R.reference_step(w, feats, 20, 32, embed[tokens], lm_head=head)
        assert relative_error(logits, want_logits) <= 1e-4
        for _ in range(2):
            assert_lattice_close(cache.step_tokens(ring, 20, tokens, output="lattice"), want_lattice, 1e-4)
            ids = cache.step_tokens(ring, 20, tokens, output="ids")[1:]
            np.testing.assert_array_equal(ids, want_ids)
            cache.step_tokens(ring, 20, tokens, output="logits")
