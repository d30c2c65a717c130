"""Tests of the DFlash-2 numpy reference (pyggml_dkv.reference.dflash2, docs/dflash2.md).

Each test checks a property that a wrong reading of llama.cpp could break: the convolution's
causality and block boundaries, its weight layouts, the selector's score formula and the walk's
greedy-per-step semantics (against brute force over every path).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pyggml_dkv.reference import dflash2 as D2

H, K, GROUP = 8, 3, 2  # hidden, kernel taps, channels per group -> G = 4 groups
G = H // GROUP


def conv_weights(rng: np.random.Generator, hidden: int = H, kernel: int = K, group: int = GROUP):
    base = rng.standard_normal((2, kernel, hidden))
    proj = rng.standard_normal((2 * kernel * (hidden // group), hidden)) * 0.3
    return base, proj


def brute_conv(x, base, deltas, side, block_len):
    """The formula of docs/dflash2.md, one scalar at a time."""
    n, hidden = x.shape
    kernel, groups = base.shape[1], deltas.shape[3]
    out = np.zeros_like(x)
    for i in range(n):
        first = (i // block_len) * block_len
        for c in range(hidden):
            for t in range(kernel):
                if i - t >= first:
                    w = base[side, t, c] + deltas[i, side, t, c // (hidden // groups)]
                    out[i, c] += w * x[i - t, c]
    return out


# ------------------------------------------------------------------------------- convolution


def test_conv_hand_computed():
    x = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    base = np.array(
        [
            [[1.0, 0.5], [0.25, -1.0]],  # side 0: tap 0, tap 1
            [[2.0, 2.0], [0.0, 0.0]],
        ]
    )  # side 1: 2 * x
    deltas = np.zeros((3, 2, 2, 1))  # one group of two channels
    deltas[:, 0, :, 0] = [[0.1, 0.2], [0.0, 1.0], [-1.0, 0.5]]
    # row 0: (1+.1)*1, (.5+.1)*2 (tap 1 reads the zero before the block)
    # row 1: [1*3, .5*4] + [(.25+1)*1, (-1+1)*2]
    # row 2: [(1-1)*5, (.5-1)*6] + [(.25+.5)*3, (-1+.5)*4]
    want = np.array([[1.1, 1.2], [4.25, 2.0], [2.25, -5.0]])
    np.testing.assert_allclose(D2.dynamic_conv(x, base, deltas, 0), want, rtol=1e-15)
    np.testing.assert_allclose(D2.dynamic_conv(x, base, deltas, 1), 2 * x, rtol=1e-15)


def test_conv_group_of_channel_is_c_div_group_size():
    deltas = np.zeros((1, 2, 1, 2))
    deltas[0, 0, 0] = [10.0, 20.0]  # group 0 = channels 0, 1; group 1 = channels 2, 3
    out = D2.dynamic_conv(np.ones((1, 4)), np.zeros((2, 1, 4)), deltas, 0)
    np.testing.assert_array_equal(out, [[10.0, 10.0, 20.0, 20.0]])


def test_projection_layout_is_side_tap_group():
    """Flat projection index side*K*G + tap*G + group (ggml's {G, K, 2}, fastest first)."""
    proj = np.zeros((2 * K * G, H))
    proj[:, 0] = np.arange(2 * K * G)
    normed = np.zeros((1, H))
    normed[0, 0] = 1.0
    deltas = D2.conv_deltas(normed, proj, K, GROUP)
    for side, tap, group in itertools.product(range(2), range(K), range(G)):
        assert deltas[0, side, tap, group] == side * K * G + tap * G + group


def test_conv_matches_brute_force_with_blocks_and_long_kernel():
    rng = np.random.default_rng(0)
    base, _ = conv_weights(rng, kernel=5)  # kernel longer than the block: extra taps read zeros
    x = rng.standard_normal((9, H))
    deltas = rng.standard_normal((9, 2, 5, G))
    for side in (0, 1):
        got = D2.dynamic_conv(x, base, deltas, side, block_len=3)
        np.testing.assert_allclose(got, brute_conv(x, base, deltas, side, 3), rtol=1e-13, atol=1e-14)


def test_conv_is_causal():
    rng = np.random.default_rng(1)
    base, _ = conv_weights(rng)
    x, deltas = rng.standard_normal((6, H)), rng.standard_normal((6, 2, K, G))
    out = D2.dynamic_conv(x, base, deltas, 0)
    for j in range(6):
        x2, d2 = x.copy(), deltas.copy()
        x2[j] += 1.0
        d2[j] += 1.0
        out2 = D2.dynamic_conv(x2, base, d2, 0)
        np.testing.assert_array_equal(out2[:j], out[:j])
        assert not np.allclose(out2[j], out[j])


def test_conv_never_crosses_a_block_start():
    rng = np.random.default_rng(2)
    base, _ = conv_weights(rng)
    x, deltas = rng.standard_normal((8, H)), rng.standard_normal((8, 2, K, G))
    joint = D2.dynamic_conv(x, base, deltas, 1, block_len=4)
    for b in range(2):
        rows = slice(4 * b, 4 * b + 4)
        np.testing.assert_allclose(joint[rows], D2.dynamic_conv(x[rows], base, deltas[rows], 1), rtol=1e-15)
    # a block's first row sees its own row only, through tap 0
    c_group = np.arange(H) // GROUP
    for first in (0, 4):
        want = (base[1, 0] + deltas[first, 1, 0, c_group]) * x[first]
        np.testing.assert_allclose(joint[first], want, rtol=1e-15)


def test_conv_sublayer_order_and_causality():
    rng = np.random.default_rng(3)
    base, proj = conv_weights(rng)
    w = rng.standard_normal((H, H))
    rowwise = lambda y: np.tanh(y @ w.T)  # noqa: E731 - a row-independent stand-in for the MLP
    normed = rng.standard_normal((5, H))
    got = D2.conv_sublayer(normed, base, proj, rowwise, GROUP)

    deltas = D2.conv_deltas(normed, proj, K, GROUP)  # both sides from the un-convolved input
    want = D2.dynamic_conv(rowwise(D2.dynamic_conv(normed, base, deltas, 0)), base, deltas, 1)
    np.testing.assert_allclose(got, want, rtol=1e-15)

    for j in range(5):
        changed = normed.copy()
        changed[j] *= -2.0
        np.testing.assert_array_equal(D2.conv_sublayer(changed, base, proj, rowwise, GROUP)[:j], got[:j])


@pytest.mark.parametrize(
    "bad",
    [
        dict(side=2),
        dict(block_len=4),  # 6 rows do not split into blocks of 4
        dict(deltas=np.zeros((6, 2, K, 3))),  # 3 groups do not divide H = 8
        dict(x=np.full((6, H), np.nan)),
    ],
)
def test_conv_rejects_bad_arguments(bad):
    args = dict(x=np.zeros((6, H)), base_kernel=np.zeros((2, K, H)), deltas=np.zeros((6, 2, K, G)), side=0)
    args.update(bad)
    with pytest.raises(ValueError):
        D2.dynamic_conv(**args)


# ------------------------------------------------------------------------------- selector

VOCAB, RANK = 12, 4


def selector_inputs(rng: np.random.Generator, n: int = 5, vocab: int = VOCAB):
    return dict(
        hidden=rng.standard_normal((n, H)),
        logits=rng.standard_normal((n, vocab)) * 2.0,
        anchor=3,
        hidden_projection=rng.standard_normal((RANK, H)),
        predecessor_codebook=rng.standard_normal((vocab, RANK)),
        successor_codebook=rng.standard_normal((vocab, RANK)),
    )


def test_top_k_candidates_order_and_ties():
    cand, unary = D2.top_k_candidates(np.array([[0.5, 2.0, 2.0, -1.0, 3.0]]), 3)
    np.testing.assert_array_equal(cand, [[4, 1, 2]])
    np.testing.assert_array_equal(unary, [[3.0, 2.0, 2.0]])


def test_selector_scores_formula():
    rng = np.random.default_rng(4)
    inp = selector_inputs(rng)
    lat = D2.selector_scores(**inp, top_k=3)
    a, b = inp["predecessor_codebook"], inp["successor_codebook"]
    assert lat.candidates.shape == (4, 3) and lat.scores.shape == (4, 3, 3)
    for i in range(1, 5):  # draft position i reads block row i
        gamma = inp["hidden_projection"] @ inp["hidden"][i]
        for p, j in itertools.product(range(3), range(3)):
            pred = inp["anchor"] if i == 1 else lat.candidates[i - 2, p]
            c = lat.candidates[i - 1, j]
            want = sum(a[pred, r] * gamma[r] * b[c, r] for r in range(RANK)) + inp["logits"][i, c]
            assert lat.scores[i - 1, p, j] == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_selector_ignores_the_anchor_row():
    rng = np.random.default_rng(5)
    inp = selector_inputs(rng)
    lat = D2.selector_scores(**inp, top_k=3)
    inp["hidden"][0] += 5.0
    inp["logits"][0] = rng.standard_normal(VOCAB)
    again = D2.selector_scores(**inp, top_k=3)
    np.testing.assert_array_equal(again.candidates, lat.candidates)
    np.testing.assert_array_equal(again.scores, lat.scores)


def test_top_k_one_is_argmax_of_logits():
    rng = np.random.default_rng(6)
    inp = selector_inputs(rng, n=6)
    drafted = D2.greedy_walk(D2.selector_scores(**inp, top_k=1))
    np.testing.assert_array_equal(drafted, np.argmax(inp["logits"][1:], axis=1))


def test_greedy_walk_is_the_lexicographic_best_path():
    """Greedy per step = among all k^m paths, the one whose step scores (s_1, s_2, ...) are
    lexicographically largest (each step maximised given the steps before it)."""
    rng = np.random.default_rng(7)
    for _ in range(5):
        lat = D2.selector_scores(**selector_inputs(rng, n=5), top_k=3)

        def step_scores(path):
            prev = [0, *path[:-1]]
            return tuple(lat.scores[i, prev[i], path[i]] for i in range(len(path)))

        best = max(itertools.product(range(3), repeat=4), key=step_scores)
        want = [lat.candidates[i, j] for i, j in enumerate(best)]
        np.testing.assert_array_equal(D2.greedy_walk(lat), want)


def test_greedy_walk_is_not_the_best_total_path():
    cands = np.array([[5, 6], [7, 8]])
    scores = np.array(
        [
            [[1.0, 0.0], [1.0, 0.0]],  # position 1: candidate 0 wins
            [[0.0, 0.0], [10.0, 0.0]],
        ]
    )  # after candidate 1 the pair would score 10
    lat = D2.Lattice(candidates=cands, scores=scores)
    np.testing.assert_array_equal(D2.greedy_walk(lat), [5, 7])  # total 1, not 0 + 10


def test_greedy_walk_ties_and_p_min():
    cands = np.array([[1, 2, 3], [4, 5, 6]])
    scores = np.zeros((2, 3, 3))
    scores[0, :] = [2.0, 5.0, 5.0]  # tie: the first maximum wins, p(pick) = 0.488
    scores[1, 1] = [0.0, 0.01, 0.0]  # after index 1: nearly flat, p(pick) = 0.337
    lat = D2.Lattice(candidates=cands, scores=scores)
    np.testing.assert_array_equal(D2.greedy_walk(lat), [2, 5])
    np.testing.assert_array_equal(D2.greedy_walk(lat, p_min=0.4), [2])
    np.testing.assert_array_equal(D2.greedy_walk(lat, p_min=0.99), np.zeros(0, dtype=np.int64))


def test_pack_lattice_matches_llama_cpp_indexing():
    rng = np.random.default_rng(8)
    lat = D2.selector_scores(**selector_inputs(rng), top_k=3)
    packed = D2.pack_lattice(lat, n_embd=H * 2)
    assert packed.shape == (5, 16)
    np.testing.assert_array_equal(packed[0], 0.0)
    np.testing.assert_array_equal(packed[:, 12:], 0.0)
    # common/speculative.cpp's walk, transcribed: scores of row i start at k + pred*k
    pred, drafted = 0, []
    for i in range(1, 5):
        row = packed[i]
        scores = row[3 + pred * 3 : 3 + pred * 3 + 3]
        pred = int(np.argmax(scores))
        drafted.append(int(row[pred]))
    np.testing.assert_array_equal(D2.greedy_walk(lat), drafted)
    with pytest.raises(ValueError, match="cannot hold"):
        D2.pack_lattice(lat, n_embd=11)


def test_sample_path_distributions():
    rng = np.random.default_rng(9)
    lat = D2.selector_scores(**selector_inputs(rng), top_k=3)
    path = D2.sample_path(lat, 0.7, np.random.default_rng(0))
    prev = [0, *path.indices[:-1]]
    for i in range(4):
        z = lat.scores[i, prev[i]] / 0.7
        np.testing.assert_allclose(path.probs[i], np.exp(z - z.max()) / np.exp(z - z.max()).sum(), rtol=1e-14)
        assert path.tokens[i] == lat.candidates[i, path.indices[i]]
    full = D2.draft_distribution(lat.candidates, path.probs, VOCAB)
    np.testing.assert_allclose(full.sum(axis=1), 1.0, rtol=1e-14)
    assert np.count_nonzero(full, axis=1).max() <= 3
    np.testing.assert_array_equal(full[np.arange(4), path.tokens], path.probs[np.arange(4), path.indices])
    # at a vanishing temperature the draw is the greedy walk
    cold = D2.sample_path(lat, 1e-9, np.random.default_rng(1))
    np.testing.assert_array_equal(cold.tokens, D2.greedy_walk(lat))


def test_sample_path_draws_from_the_product_of_its_rows():
    """Over many draws, the frequency of each 2-step path matches q_1(a) * q_2(b | a)."""
    cands = np.array([[0, 1], [2, 3]])
    scores = np.array([[[0.0, 1.0], [0.0, 1.0]], [[2.0, 0.0], [-1.0, 1.0]]])
    lat = D2.Lattice(candidates=cands, scores=scores)
    gen = np.random.default_rng(2)
    counts = np.zeros((2, 2))
    n = 4000
    for _ in range(n):
        a, b = D2.sample_path(lat, 1.0, gen).indices
        counts[a, b] += 1
    q1 = np.exp(scores[0, 0]) / np.exp(scores[0, 0]).sum()
    want = np.array([q1[a] * np.exp(scores[1, a]) / np.exp(scores[1, a]).sum() for a in range(2)])
    np.testing.assert_allclose(counts / n, want, atol=0.03)


def test_selector_rejects_bad_arguments():
    rng = np.random.default_rng(10)
    inp = selector_inputs(rng)
    with pytest.raises(ValueError, match="top_k"):
        D2.selector_scores(**inp, top_k=VOCAB + 1)
    with pytest.raises(ValueError, match="ids outside"):
        D2.selector_scores(**{**inp, "anchor": VOCAB}, top_k=2)
    lat = D2.selector_scores(**inp, top_k=2)
    with pytest.raises(ValueError, match="temperature"):
        D2.sample_path(lat, 0.0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="p_min"):
        D2.greedy_walk(lat, p_min=1.5)
