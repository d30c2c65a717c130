"""Parity with llama.cpp's own DFlash-2 drafter (libllama 0.3.36 in a child process, driven as
common/speculative.cpp drives it: pyggml_dkv/hosts/llama_cpp/native_dflash_child.py): the same
DFlash-2 GGUF, the same context features and noise blocks along a trajectory with rewinds and
jumps past the window, and per step

* the candidate sets C_i of every draft position equal (but where the k-th and (k+1)-th logits
  are a near-tie: counted),
* the lattice scores S_i equal within a measured tolerance (max|a-b| / max|reference| per step,
  over the (predecessor, candidate) pairs both sides hold),
* the draft ids (the greedy walk) identical but at a near-tie: the first pick where they part
  must be one whose two scores are within twice that tolerance of each other, or one the other
  side does not hold as a candidate (a candidate-set near-tie) (both counted);

with the float64 numpy reference (pyggml_dkv.reference.dflash2) as the third party. Our cache
runs swa="llama" (llama.cpp's sliding-window rule), and the drafter has one sliding layer whose
window (6) is narrower than the block (16).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama.cpp's drafter needs llama-cpp-python (pip install -e '.[llama]')")
pytest.importorskip("gguf", reason="writing a GGUF drafter needs the gguf package")

pytestmark = pytest.mark.slow  # llama.cpp's DFlash-2 drafter over SmolLM2's vocabulary: minutes

from pyggml_dkv import DraftConfig, DraftKvCache, DraftWeights, FeatureRing  # noqa: E402
from pyggml_dkv import reference as R  # noqa: E402
from pyggml_dkv.drafter.backend_weights import upload_stored  # noqa: E402
from pyggml_dkv.drafter.selector_walk import SelectorLattice, greedy_walk  # noqa: E402
from pyggml_dkv.hosts.llama_cpp.native_dflash import llama_dflash2_trajectory, unpack_lattice  # noqa: E402
from pyggml_dkv.hosts.llama_cpp.native_dflash_child import walk_lattice  # noqa: E402
from pyggml_dkv.reference import dflash2 as R2  # noqa: E402
from tests.drafter.test_parity import trajectory  # noqa: E402
from tests.hosts.hosts_helpers import smollm2_path  # noqa: E402

log = logging.getLogger(__name__)

N_VOCAB = 49152  # SmolLM2's: the GGUF takes its tokenizer from the target
D2 = dict(conv_kernel_size=3, conv_group_size=32, selector_rank=32, selector_top_k=4)
CAP = 80

# Tolerances, measured over the 24 steps below (AMD EPYC family 25 model 17, Zen 4, 1 thread):
# lattice scores, max|a-b| / max|reference| per step over the pairs both sides hold: f32 file
# llama.cpp-vs-ours 2.1e-4 (both keep the K/V cache in f16; each ~2.3e-4 from the float64
# reference), f16 file 7.0e-4 (both also round the activations to f16 in every product; llama.cpp
# 7.2e-4, ours 3.2e-4 from the reference). Logits, llama.cpp vs the reference: f32 4.9e-4, f16 1.0e-3.
# SCORE_TOL ~2.5x the lattice figures; LOGIT_TOL ~3x the logit figures decides which differing
# candidate sets are near-ties (the k-th and (k+1)-th logits within LOGIT_TOL * max|logits|);
# two picks are a near-tie when their scores are within 2 * SCORE_TOL * max|scores| (each side
# may be off by SCORE_TOL).
SCORE_TOL = {"f32": 6e-4, "f16": 2e-3}
LOGIT_TOL = {"f32": 1.5e-3, "f16": 3e-3}


def d2_drafter(seed: int = 0) -> DraftWeights:
    """A random DFlash-2 drafter of the `toy` shape (H 256 >= k*(k+1) = 20, block 16) with one
    sliding layer, an output multiplier and a soft cap (applied in-graph by llama.cpp for DFlash-2)."""
    cfg = DraftConfig.toy(
        vocab=N_VOCAB,
        mask_token_id=7,
        target_layer_ids=[1, 5, 9],
        layer_types=["sliding", "full"],
        swa_window=6,
        output_multiplier=1.25,
        final_logit_softcapping=30.0,
        **D2,
    )
    w = DraftWeights.random(cfg, seed=seed)
    rng = np.random.default_rng(seed + 1)
    emb = rng.standard_normal((N_VOCAB, cfg.hidden), dtype=np.float32)
    head = rng.standard_normal((N_VOCAB, cfg.hidden), dtype=np.float32) / np.float32(np.sqrt(cfg.hidden))
    return DraftWeights(cfg, dict(w), embed_tokens=emb, lm_head=head)


# ------------------------------------------------------------------------------- the walk


@pytest.mark.parametrize("p_min, n_min", [(0.0, 0), (0.3, 0), (0.3, 5), (0.0, 20)])
def test_walk_lattice_is_the_reference_walk(p_min, n_min):
    """The child's transcription of common/speculative.cpp's walk, on packed rows, is the walk of
    selector_walk (p_min included) and of the reference, ties going to the first candidate."""
    rng = np.random.default_rng(3)
    k, q_len, n_embd = 4, 9, 32
    for trial in range(40):
        cand = rng.integers(0, 1000, size=(q_len - 1, k))
        scores = rng.standard_normal((q_len - 1, k, k)).astype(np.float32)
        if trial % 4 == 0:  # exact ties: the first index wins
            scores[:, :, 2] = scores[:, :, 1]
        scores[0] = scores[0, :1]  # position 1: every row is the anchor's
        packed = np.zeros((q_len, n_embd), dtype=np.float32)
        packed[1:, :k] = cand
        packed[1:, k : k * (k + 1)] = scores.reshape(q_len - 1, k * k)
        got = walk_lattice(packed, k, p_min, n_min)
        want = greedy_walk(SelectorLattice(cand, scores), p_min)
        want = want.tolist() if len(want) >= n_min else []
        assert got == want
        c2, s2 = unpack_lattice(packed, k)
        np.testing.assert_array_equal(c2, cand)
        np.testing.assert_array_equal(s2, scores)
        if n_min == 0:
            assert got == R2.greedy_walk(R2.Lattice(cand, scores.astype(np.float64)), p_min).tolist()


# ------------------------------------------------------------------------------- parity


def shared_scores(a_cand, a_scores, b_cand, b_scores, i):
    """Position i's scores (k, k) of both lattices over the (predecessor, candidate) pairs both
    hold, by token id: two equal-length vectors."""
    prev_a = a_cand[i - 1] if i else None
    prev_b = b_cand[i - 1] if i else None
    xs, ys = [], []
    for j, c in enumerate(a_cand[i]):
        jb = np.flatnonzero(b_cand[i] == c)
        if not jb.size:
            continue
        if i == 0:  # the anchor's row
            xs.append(a_scores[i, 0, j])
            ys.append(b_scores[i, 0, jb[0]])
            continue
        for p, pid in enumerate(prev_a):
            pb = np.flatnonzero(prev_b == pid)
            if pb.size:
                xs.append(a_scores[i, p, j])
                ys.append(b_scores[i, pb[0], jb[0]])
    return np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)


def score_error(a_cand, a_scores, ref: R2.Lattice) -> float:
    """max|a - ref| / max|ref| over the pairs both hold, one block."""
    diff = 0.0
    for i in range(ref.n_positions):
        x, y = shared_scores(a_cand, a_scores, ref.candidates, ref.scores, i)
        if x.size:
            diff = max(diff, float(np.abs(x - y).max()))
    return diff / float(np.abs(ref.scores).max())


def candidate_near_ties(a_cand, b_cand, logits: np.ndarray, k: int, tol: float) -> int:
    """Positions whose candidate sets differ; each must be a near-tie at the k-th place of the
    reference's logits (the ids in one set only are within tol * max|logits| of the k-th logit)."""
    ties = 0
    scale = float(np.abs(logits).max())
    for i in range(a_cand.shape[0]):
        only = set(a_cand[i].tolist()) ^ set(b_cand[i].tolist())
        if not only:
            continue
        row = logits[i + 1]
        kth = float(np.sort(row)[::-1][k - 1])
        gaps = [abs(float(row[t]) - kth) for t in only]
        assert max(gaps) <= tol * scale, f"position {i + 1}: candidate sets differ by {only}, gaps {gaps}"
        ties += 1
    return ties


def first_split(a_ids, b_ids) -> int | None:
    """Index of the first draft position where two walks pick differently (None: identical)."""
    for i, (x, y) in enumerate(zip(a_ids, b_ids)):
        if x != y:
            return i
    return None


def split_reason(ids_a, cand_a, ids_b, cand_b, at: int, ref: R2.Lattice, tol: float) -> str | None:
    """Walks that agree up to position `at` and part there: why? "candidates" when one side's pick
    is not among the other's candidates there (a candidate-set near-tie, checked as such by
    candidate_near_ties), "scores" when the two picks' reference scores after the shared
    predecessor are within tol * max|scores| of each other, None when neither explains it."""
    if ids_a[at] not in cand_b[at] or ids_b[at] not in cand_a[at]:
        return "candidates"
    if at and ids_a[at - 1] not in ref.candidates[at - 1]:
        return "candidates"  # the shared predecessor is one the reference does not hold
    pred = 0 if at == 0 else int(np.flatnonzero(ref.candidates[at - 1] == ids_a[at - 1])[0])
    picks = [np.flatnonzero(ref.candidates[at] == t) for t in (ids_a[at], ids_b[at])]
    if not all(p.size for p in picks):
        return "candidates"
    row = ref.scores[at, pred]
    if abs(float(row[picks[0][0]] - row[picks[1][0]])) <= tol * float(np.abs(ref.scores).max()):
        return "scores"
    return None


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_llama_cpp_dflash2_drafter_matches_ours(dtype, tmp_path, cpu, parity_log):
    target = smollm2_path()
    path = d2_drafter().save_pretrained(tmp_path / "d2.gguf", format="gguf", dtype=dtype, vocab_from=target)
    g = DraftWeights.from_pretrained(path)
    cfg = g.cfg
    k, q_len, tol, logit_tol = cfg.selector_top_k, cfg.block_size, SCORE_TOL[dtype], LOGIT_TOL[dtype]
    rng = np.random.default_rng(4)
    commits = trajectory(rng, CAP, q_len, 24)
    feats = rng.standard_normal((max(commits) + 1, cfg.fc_in)).astype(np.float32)
    tokens = np.full((len(commits), q_len), cfg.mask_token_id, dtype=np.int32)
    tokens[:, 0] = rng.integers(0, N_VOCAB, size=len(commits))

    theirs = llama_dflash2_trajectory(path, feats, commits, tokens, CAP, logits=True)
    assert theirs.ids.shape == (len(commits), q_len - 1) and theirs.candidates.shape == (len(commits), q_len - 1, k)
    assert not theirs.packed[:, 0].any(), "row 0 of a block (the anchor's) is not all zeros"
    assert not theirs.packed[:, :, k * (k + 1) :].any(), "the packed rows are not zero past the lattice"

    errs = {
        "llama.cpp-vs-ours": 0.0,
        "llama.cpp-vs-reference": 0.0,
        "ours-vs-reference": 0.0,
        "llama.cpp-vs-reference (logits)": 0.0,
    }
    cand_ties = {"llama.cpp-vs-ours": 0, "llama.cpp-vs-reference": 0}
    # steps whose walks part at a near-tie, by kind: (candidate-set near-ties, score near-ties)
    id_ties = {"llama.cpp-vs-ours": [0, 0], "llama.cpp-vs-reference": [0, 0], "ours-vs-reference": [0, 0]}
    equal_steps = selector_moved = 0
    ring = FeatureRing(max(commits) + 1, cfg.fc_in)
    emb, emb_buf = upload_stored(cpu, g.stored["embed_tokens"], "embed_tokens")
    head, head_buf = upload_stored(cpu, g.stored["lm_head"], "lm_head")
    try:
        with (
            g.to_backend(cpu, "native") as bw,
            DraftKvCache(bw, cpu, CAP, lm_head=head, embed_tokens=emb, cache_type="f16", swa="llama") as cache,
        ):
            for s, committed in enumerate(commits):
                ring.write(min(ring.written, committed), feats[min(ring.written, committed) : committed])
                ours_ids = cache.step_tokens(ring, committed, tokens[s], output="ids")[1:]
                ours = cache.step_tokens(ring, committed, tokens[s], output="lattice")
                out = R.reference_step(g, feats, committed, CAP, g.embed_tokens[tokens[s]], swa="llama")
                logits = R.lm_logits(out, g.lm_head, cfg)
                ref = R2.selector_lattice(g, out, logits, int(tokens[s, 0]))
                ref_ids = R2.greedy_walk(ref)
                their_ids = theirs.ids[s]
                # the selector matters: somewhere its walk leaves the per-position argmax of the logits
                selector_moved += not np.array_equal(their_ids, theirs.logits[s][1:].argmax(-1))
                # llama.cpp's ids are the walk of its own lattice (the child walks what it read)
                np.testing.assert_array_equal(
                    their_ids, greedy_walk(SelectorLattice(theirs.candidates[s], theirs.scores[s]))
                )
                errs["llama.cpp-vs-reference (logits)"] = max(
                    errs["llama.cpp-vs-reference (logits)"],
                    float(np.abs(theirs.logits[s] - logits).max() / np.abs(logits).max()),
                )
                cand_ties["llama.cpp-vs-ours"] += candidate_near_ties(
                    theirs.candidates[s], ours.candidates, logits, k, logit_tol
                )
                cand_ties["llama.cpp-vs-reference"] += candidate_near_ties(
                    theirs.candidates[s], ref.candidates, logits, k, logit_tol
                )
                ours_as_ref = R2.Lattice(ours.candidates, ours.scores.astype(np.float64))
                errs["llama.cpp-vs-ours"] = max(
                    errs["llama.cpp-vs-ours"], score_error(theirs.candidates[s], theirs.scores[s], ours_as_ref)
                )
                errs["llama.cpp-vs-reference"] = max(
                    errs["llama.cpp-vs-reference"], score_error(theirs.candidates[s], theirs.scores[s], ref)
                )
                errs["ours-vs-reference"] = max(
                    errs["ours-vs-reference"], score_error(ours.candidates, ours.scores, ref)
                )
                sides = {
                    "llama.cpp": (their_ids, theirs.candidates[s]),
                    "ours": (ours_ids, ours.candidates),
                    "reference": (ref_ids, ref.candidates),
                }
                for name in id_ties:
                    (a, cand_a), (b, cand_b) = (sides[n] for n in name.split("-vs-"))
                    at = first_split(a, b)
                    if at is None:
                        equal_steps += name == "llama.cpp-vs-ours"
                        continue
                    why = split_reason(a, cand_a, b, cand_b, at, ref, 2 * tol)
                    assert why is not None, (
                        f"step {s} (committed {committed}): {name} draft ids part at position {at + 1} "
                        f"without a near-tie: {a.tolist()} vs {b.tolist()}"
                    )
                    id_ties[name][why == "scores"] += 1
    finally:
        for obj in (emb_buf, emb.ctx, head_buf, head.ctx):
            obj.close()
    case = f"toy 256/2L dflash2 k={k} vocab {N_VOCAB} cap {CAP} sliding window 6"
    for name, e in errs.items():
        parity_log(f"dflash2 {name}" + ("" if "logits" in name else " (lattice)"), f"w={dtype} kv=f16", e, case)
    log.info(
        "%s: score errors %s; candidate-set near-ties %s; draft-id near-ties %s; identical draft steps "
        "llama.cpp-vs-ours %d/%d",
        dtype,
        {n: f"{e:.2e}" for n, e in errs.items()},
        cand_ties,
        id_ties,
        equal_steps,
        len(commits),
    )
    print(
        f"\n[{dtype}] score errors { ({n: f'{e:.2e}' for n, e in errs.items()}) }; positions with candidate-set "
        f"near-ties {cand_ties}; steps whose walks part at (candidate-set, score) near-ties {id_ties}; "
        f"identical draft steps llama.cpp-vs-ours {equal_steps}/{len(commits)}; llama.cpp's walk off the "
        f"logits' argmax at {selector_moved}/{len(commits)} steps"
    )
    assert errs["llama.cpp-vs-ours"] <= tol, errs
    assert errs["llama.cpp-vs-reference"] <= tol and errs["ours-vs-reference"] <= tol, errs
    assert equal_steps >= len(commits) // 2, "most steps' walks part at near-ties: a vacuous test"
    assert selector_moved >= len(commits) // 2, "the walk is mostly the logits' argmax: the selector is not tested"


def test_llama_dflash_bench_drafts_a_dflash2_gguf(tmp_path):
    """The step benchmark's llama.cpp side on a DFlash-2 GGUF times common/speculative.cpp's draft
    (the lattice read and walked, no logits) at every window asked for."""
    from pyggml_dkv.hosts.llama_cpp.native_dflash import _run, llama_dflash_bench

    w = d2_drafter()
    path = w.save_pretrained(tmp_path / "d2.gguf", format="gguf", dtype="f16", vocab_from=smollm2_path())
    times = llama_dflash_bench(
        path, [8, 20], fc_in=w.cfg.fc_in, q_len=w.cfg.block_size, n_new=3, reps=2, warmup=1, threads=1
    )
    assert sorted(times) == [8, 20] and all(len(t) == 2 and min(t) > 0 for t in times.values()), times
    result, _ = _run(
        dict(
            mode="bench",
            gguf=str(path),
            windows=[8],
            fc_in=w.cfg.fc_in,
            q_len=w.cfg.block_size,
            n_new=3,
            reps=1,
            warmup=0,
            flash_attn=False,
            threads=1,
        ),
        {},
        300,
    )
    assert result["dflash2"] is True
