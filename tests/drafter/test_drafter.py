"""The host-facing Drafter, and the toy example's lossless speculative decoding."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from pyggml_dkv import DraftConfig, Drafter, DraftWeights
from pyggml_dkv import reference as R
from pyggml_dkv.drafter.drafter import sample_rows, sampling_probs

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
import toy_drafter  # noqa: E402
from toy_target import ToyTarget, ToyTargetConfig  # noqa: E402

VOCAB = 200


def make_drafter(cpu, swa="seed", **changes):
    cfg = DraftConfig(
        **{
            **dict(
                hidden=64,
                n_layer=2,
                n_head=2,
                n_head_kv=1,
                head_dim=64,
                ffn=128,
                block_size=8,
                n_target_layers=2,
                mask_token_id=VOCAB - 1,
                vocab=VOCAB,
                input_embedding_scale=0.5,
                output_multiplier=0.8,
                final_logit_softcapping=5.0,
            ),
            **changes,
        }
    )
    w = DraftWeights.random(cfg, seed=1)
    rng = np.random.default_rng(2)
    embed = rng.standard_normal((VOCAB, cfg.hidden)).astype(np.float32)
    head = (rng.standard_normal((VOCAB, cfg.hidden)) / 4).astype(np.float32)
    d = Drafter(w, embed_tokens=embed, lm_head=head, backend=cpu, cap=40, weight_dtype="f32", cache_type="f32", swa=swa)
    return d, w, embed, head


def reference_logits(w, feats, committed, cap, noise, head):
    return R.reference_step(w, feats, committed, cap, noise, lm_head=head)


def test_propose_greedy_is_argmax_of_the_reference(cpu):
    d, w, embed, head = make_drafter(cpu)
    with d:
        feats = np.random.default_rng(3).standard_normal((90, w.cfg.fc_in)).astype(np.float32)
        d.add_features(feats[:50])
        ids = d.propose(17)
        assert ids.shape == (w.cfg.block_size - 1,) and ids.dtype == np.int64
        noise = d.noise_embed(17)
        assert np.allclose(noise[0], embed[17] * 0.5) and np.allclose(noise[1:], embed[VOCAB - 1] * 0.5)
        logits = reference_logits(w, feats, 50, 40, noise, head)
        assert ids.tolist() == logits[1:].argmax(axis=1).tolist()
        # accept 3 drafts + commit their features, propose again
        d.add_features(feats[50:54])
        assert d.committed == 54
        ids2 = d.propose(int(ids[3]))
        want = reference_logits(w, feats, 54, 40, d.noise_embed(int(ids[3])), head)[1:].argmax(axis=1)
        assert ids2.tolist() == want.tolist()


def test_rewind_and_reset(cpu):
    d, w, _, head = make_drafter(cpu)
    with d:
        feats = np.random.default_rng(4).standard_normal((90, w.cfg.fc_in)).astype(np.float32)
        other = np.random.default_rng(5).standard_normal((10, w.cfg.fc_in)).astype(np.float32)
        d.add_features(feats[:60])
        d.propose(5)
        d.rewind(52)  # verification rejected 8 speculatively committed tokens
        d.add_features(other[:3])
        got = d.propose(9)
        all_feats = np.concatenate([feats[:52], other[:3]])
        want = reference_logits(w, all_feats, 55, 40, d.noise_embed(9), head)[1:].argmax(axis=1)
        assert got.tolist() == want.tolist()
        d.reset()
        assert d.committed == 0
        with pytest.raises(ValueError, match="add_features"):
            d.propose(1)
        d.add_features(feats[:7])
        want = reference_logits(w, feats, 7, 40, d.noise_embed(2), head)[1:].argmax(axis=1)
        assert d.propose(2).tolist() == want.tolist()


def test_propose_sampling_returns_probabilities(cpu):
    d, w, _, head = make_drafter(cpu)
    with d:
        feats = np.random.default_rng(6).standard_normal((30, w.cfg.fc_in)).astype(np.float32)
        d.add_features(feats)
        ids, probs = d.propose(3, temperature=0.7, top_k=20, top_p=0.9, rng=np.random.default_rng(0))
        assert probs.shape == (w.cfg.block_size - 1, VOCAB) and ids.shape == (w.cfg.block_size - 1,)
        assert np.allclose(probs.sum(axis=1), 1.0)
        assert ((probs > 0).sum(axis=1) <= 20).all()
        assert (probs[np.arange(len(ids)), ids] > 0).all()
        logits = reference_logits(w, feats, 30, 40, d.noise_embed(3), head)[1:]
        want = sampling_probs(logits, 0.7, 20, 0.9)
        assert np.abs(probs - want).max() < 1e-4


def test_sampling_helpers():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]))
    p = sampling_probs(logits, 1.0, 0, 1.0)
    assert np.allclose(p, np.exp(logits))
    p = sampling_probs(logits, 1.0, 2, 1.0)
    assert np.allclose(p[0], [0.5 / 0.8, 0.3 / 0.8, 0, 0])
    p = sampling_probs(logits, 1.0, 0, 0.7)  # smallest prefix reaching 0.7: 0.5 + 0.3
    assert np.allclose(p[0], [0.625, 0.375, 0, 0])
    draws = np.array([sample_rows(np.array([[0.2, 0.8]]), np.random.default_rng(i))[0] for i in range(2000)])
    assert 0.75 < draws.mean() < 0.85


def test_drafter_bad_input(cpu):
    d, w, embed, head = make_drafter(cpu)
    with d:
        d.add_features(np.zeros((3, w.cfg.fc_in), np.float32))
        with pytest.raises(ValueError, match="last_token"):
            d.propose(VOCAB)
        with pytest.raises(ValueError, match="temperature"):
            d.propose(1, temperature=-1.0)
        with pytest.raises(ValueError, match="top_p"):
            d.propose(1, temperature=1.0, top_p=0.0)
        with pytest.raises(ValueError, match="truncate"):
            d.rewind(10)
    with pytest.raises(ValueError, match="embed_tokens has 10 rows"):
        Drafter(w, embed_tokens=embed[:10], lm_head=head, backend=cpu, cap=40)
    with pytest.raises(ValueError, match="mask_token_id 199 is outside"):
        Drafter(w, embed_tokens=embed[:10], lm_head=head[:10], backend=cpu, cap=40)
    with pytest.raises(ValueError, match="lm_head_dtype"):
        Drafter(w, embed_tokens=embed, lm_head=head, backend=cpu, cap=40, lm_head_dtype="q4_0")


def test_lm_head_dtype_reaches_the_cache(cpu):
    """Drafter(lm_head_dtype=...) uploads the head in that type next to the weights' own."""
    cfg = DraftConfig(
        hidden=64,
        n_layer=2,
        n_head=2,
        n_head_kv=1,
        head_dim=64,
        ffn=128,
        block_size=8,
        n_target_layers=2,
        mask_token_id=VOCAB - 1,
        vocab=VOCAB,
    )
    w = DraftWeights.random(cfg, seed=1)
    rng = np.random.default_rng(2)
    embed = rng.standard_normal((VOCAB, cfg.hidden)).astype(np.float32)
    head = (rng.standard_normal((VOCAB, cfg.hidden)) / 4).astype(np.float32)
    feats = rng.standard_normal((20, cfg.fc_in)).astype(np.float32)
    ids = {}
    for head_dtype in (None, "q8_0"):
        with Drafter(
            w, embed_tokens=embed, lm_head=head, backend=cpu, cap=40, weight_dtype="f16", lm_head_dtype=head_dtype
        ) as d:
            assert d.cache.lm_head.type == (head_dtype or "f16")
            d.add_features(feats)
            ids[head_dtype] = d.propose(5)
    # a random drafter has near-ties, but most of its greedy drafts survive the q8_0 head
    assert np.mean(ids[None] == ids["q8_0"]) >= 0.5, ids


class OracleDrafter:
    """Proposes the target's true greedy continuation, corrupted at a random draft index: drives the
    speculative loop through every acceptance length, which a random drafter never does."""

    def __init__(self, truth_target: ToyTarget, prompt: list[int], n: int, q_len: int, seed: int) -> None:
        self.truth = [*prompt, *truth_target.greedy(prompt, n + q_len)]
        self.q_len = q_len
        self.rng = np.random.default_rng(seed)
        self.committed = 0

    def reset(self) -> None:
        self.committed = 0

    def add_features(self, rows) -> None:
        self.committed += len(rows)

    def propose(self, last: int) -> list[int]:
        # tokens 0..committed-1 have features; `last` sits at position committed
        assert self.truth[self.committed] == last
        draft = list(self.truth[self.committed + 1 : self.committed + self.q_len])
        wrong_at = int(self.rng.integers(0, self.q_len))  # q_len-1 means "all correct"
        if wrong_at < len(draft):
            draft[wrong_at] = (draft[wrong_at] + 1) % (ToyTargetConfig().vocab - 1)
        return draft


def test_speculative_decoding_is_lossless_for_every_acceptance_length():
    target = ToyTarget(seed=3)
    prompt = list(np.random.default_rng(3).integers(0, 500, size=20))
    truth = target.greedy(prompt, 120)
    oracle = OracleDrafter(ToyTarget(seed=3), prompt, 120, q_len=8, seed=1)
    report = toy_drafter.speculative_decode(target, oracle, prompt, 120)
    assert report.tokens == truth
    assert set(report.accepted_per_round) >= {0, 3, 7}  # rejections early, late, and full blocks


@pytest.mark.slow  # the whole example
def test_toy_example_runs_lossless_with_the_real_drafter(tmp_path, capsys):
    out = tmp_path / "report.json"
    rc = toy_drafter.main(
        ["--threads", "1", "--max-new-tokens", "40", "--cap", "64", "--block-size", "8", "--json", str(out)]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["lossless"] is True and report["new_tokens"] == 40
    assert report["draft_ms_median_cache"] > 0 and report["draft_ms_median_oneshot"] > 0
    assert "lossless (identical to greedy decoding): True" in capsys.readouterr().out


def test_toy_example_with_a_checkpoint(tmp_path):
    tcfg = ToyTargetConfig()
    w = DraftWeights.random(toy_drafter.drafter_config(tcfg, 8), seed=5)
    w.save_pretrained(tmp_path / "ckpt")
    assert (
        toy_drafter.main(
            [
                "--threads",
                "1",
                "--checkpoint",
                str(tmp_path / "ckpt"),
                "--max-new-tokens",
                "20",
                "--cap",
                "48",
                "--no-oneshot",
            ]
        )
        == 0
    )


def test_p_min_cuts_greedy_drafts_at_the_first_unsure_token(cpu):
    d, w, embed, head = make_drafter(cpu)
    feats = np.random.default_rng(5).standard_normal((60, w.cfg.fc_in)).astype(np.float32)
    noise = d.noise_embed(9)
    logits = reference_logits(w, feats, 60, 40, noise, head)[1:]
    p_top = 1.0 / np.exp(logits - logits.max(axis=1, keepdims=True)).sum(axis=1)
    with d:
        d.add_features(feats)
        full = d.propose(9)
    # a threshold between two rows' confidences: the draft stops before the first row under it
    order = np.sort(p_top)
    threshold = float((order[2] + order[3]) / 2)
    first_unsure = int(np.nonzero(p_top < threshold)[0][0])
    cut, _, _, _ = make_drafter(cpu)
    cut.p_min = threshold
    with cut:
        cut.add_features(feats)
        short = cut.propose(9)
        assert short.tolist() == full[:first_unsure].tolist()
        _, probs = cut.propose(9, temperature=1.0, rng=np.random.default_rng(0))  # sampling: never cut
        assert probs.shape[0] == w.cfg.block_size - 1
    for bad in (-0.1, 1.0, float("nan"), "0.5"):
        with pytest.raises(ValueError, match="p_min"):
            Drafter(w, embed_tokens=embed, lm_head=head, backend=cpu, cap=40, p_min=bad)
