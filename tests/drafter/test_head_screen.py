"""A cache with a screened lm_head (lm_head_screen="q8_0", drafter/head_screen.py): its draft ids
are the exact head's argmax, its hidden states those of the plain cache bit for bit, and its
logit steps those of the plain cache."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from pyggml_dkv import DraftConfig, Drafter, DraftKvCache, DraftWeights, FeatureRing
from pyggml_dkv.ggml import GGMLError, amx_available, vnni_available

VOCAB = 3008  # a multiple of 32: the screen goes to the repacking buffer (VNNI, or AMX tiles)


def config(**changes) -> DraftConfig:
    return DraftConfig(
        **{
            **dict(
                hidden=128,
                n_layer=2,
                n_head=4,
                n_head_kv=2,
                head_dim=32,
                ffn=256,
                block_size=8,
                n_target_layers=2,
                mask_token_id=VOCAB - 1,
                vocab=VOCAB,
                output_multiplier=0.7,
                final_logit_softcapping=30.0,
            ),
            **changes,
        }
    )


def target_matrices(cfg: DraftConfig) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    embed = rng.standard_normal((VOCAB, cfg.hidden)).astype(np.float32)
    head = (rng.standard_normal((VOCAB, cfg.hidden)) / 8).astype(np.float32)
    return embed, head


@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
def test_trajectory_ids_are_the_exact_heads(cpu, dtype, parity_log):
    """Steps of 1..a_step new rows and window wraps (cap 40): screened ids == the float64 argmax of
    the step's hidden states times the head as uploaded, == the plain cache's ids; hidden states
    equal to the plain cache's bit for bit."""
    cfg = config()
    embed, head = target_matrices(cfg)
    rng = np.random.default_rng(7)
    ring = FeatureRing(400, cfg.fc_in)
    ring.append(rng.standard_normal((400, cfg.fc_in)).astype(np.float32))
    tokens = np.full(cfg.block_size, cfg.mask_token_id, np.int32)
    with contextlib.ExitStack() as st:
        bw = st.enter_context(DraftWeights.random(cfg, seed=3).to_backend(cpu, dtype))
        plain = st.enter_context(DraftKvCache(bw, cpu, 40, lm_head=head, embed_tokens=embed))
        screened = st.enter_context(DraftKvCache(bw, cpu, 40, lm_head=head, embed_tokens=embed, lm_head_screen="q8_0"))
        assert screened.head_screen.scores_matrix.is_repacked == (vnni_available() or amx_available())
        exact_head = plain.lm_head.numpy().astype(np.float64)  # the head as uploaded (dtype's rounding)
        committed, differ, total = 0, 0, 0
        for step, n_new in enumerate([5, 1, 9, 18, 3, 8, 13, 2, 7, 30, 4]):
            committed += n_new
            tokens[0] = step * 37 % VOCAB
            if step % 3 == 2:  # logit steps in between (the full head's graphs) change nothing after them
                np.testing.assert_array_equal(
                    screened.step_tokens(ring, committed - 1, tokens, output="logits"),
                    plain.step_tokens(ring, committed - 1, tokens, output="logits"),
                )
            want_plain = plain.step_tokens(ring, committed, tokens, output="ids")
            got = screened.step_tokens(ring, committed, tokens, output="ids")
            assert screened.logits is None  # the screened graph computed last
            hidden = screened.hidden_states.numpy()
            np.testing.assert_array_equal(hidden, plain.hidden_states.numpy())
            exact = np.argmax(hidden.astype(np.float64) @ exact_head.T, axis=1)
            differ, total = differ + int((got != exact).sum()), total + got.size
            np.testing.assert_array_equal(got, exact)
            if dtype != "bf16":  # ggml's bf16 product rounds the hidden states to bf16 first
                np.testing.assert_array_equal(got, want_plain)
    parity_log(
        "screened-head ids vs float64 argmax",
        f"head={dtype} (disagreeing)",
        differ / total,
        f"hidden 128, vocab {VOCAB}, cap 40, {total} ids",
    )


def test_drafter_drafts_match_greedy_sampled_and_cut(cpu):
    """Greedy drafts through the screen, sampled drafts and p_min cuts through the full head: all
    as a plain drafter's."""
    cfg = config()
    embed, head = target_matrices(cfg)
    w = DraftWeights.random(cfg, seed=3)
    feats = np.random.default_rng(9).standard_normal((60, cfg.fc_in)).astype(np.float32)
    kw = dict(embed_tokens=embed, lm_head=head, backend=cpu, cap=32, weight_dtype="f16")
    with Drafter(w, **kw) as plain, Drafter(w, **kw, lm_head_screen="q8_0") as screened:
        for d in (plain, screened):
            d.add_features(feats[:45])
        for last in (3, 17, 2900):
            np.testing.assert_array_equal(screened.propose(last), plain.propose(last))
            ids_a, p_a = screened.propose(last, temperature=0.8, rng=np.random.default_rng(last))
            ids_b, p_b = plain.propose(last, temperature=0.8, rng=np.random.default_rng(last))
            np.testing.assert_array_equal(ids_a, ids_b)
            np.testing.assert_array_equal(p_a, p_b)
    with Drafter(w, **kw, p_min=0.05) as plain, Drafter(w, **kw, lm_head_screen="q8_0", p_min=0.05) as screened:
        for d in (plain, screened):
            d.add_features(feats[:45])
        np.testing.assert_array_equal(screened.propose(5), plain.propose(5))


def test_what_a_screened_cache_refuses(cpu):
    cfg = config()
    embed, head = target_matrices(cfg)
    ring = FeatureRing(64, cfg.fc_in)
    ring.append(np.ones((20, cfg.fc_in), np.float32))
    tokens = np.full(cfg.block_size, cfg.mask_token_id, np.int32)
    with DraftWeights.random(cfg, seed=3).to_backend(cpu, "f16") as bw:
        with DraftKvCache(bw, cpu, 32, lm_head=head, embed_tokens=embed, lm_head_screen="q8_0") as c:
            assert c.step_tokens(ring, 20, tokens, output="hidden").shape == (cfg.block_size, cfg.hidden)
        with DraftKvCache(bw, cpu, 32, embed_tokens=embed) as c, pytest.raises(GGMLError, match="needs .* an lm_head"):
            c.step_tokens(ring, 20, tokens, output="ids")
        with pytest.raises(ValueError, match="lm_head_screen='q8_0' was given without an lm_head"):
            DraftKvCache(bw, cpu, 32, embed_tokens=embed, lm_head_screen="q8_0")
        with pytest.raises(ValueError, match="lm_head_screen must be one of"):
            DraftKvCache(bw, cpu, 32, lm_head=head, lm_head_screen="q4_0")
        with pytest.raises(ValueError, match="screens an f32 / f16 / bf16 lm_head, this one is q8_0"):
            DraftKvCache(bw, cpu, 32, lm_head=head, lm_head_dtype="q8_0", lm_head_screen="q8_0")
    bad = config(output_multiplier=-1.0)
    with DraftWeights.random(bad, seed=3).to_backend(cpu, "f16") as bw:
        with pytest.raises(ValueError, match="output_multiplier > 0"):
            DraftKvCache(bw, cpu, 32, lm_head=head, lm_head_screen="q8_0")
    odd = config(hidden=80, head_dim=20)
    with DraftWeights.random(odd, seed=3).to_backend(cpu, "f16") as bw:
        with pytest.raises(ValueError, match="multiple of 32"):
            DraftKvCache(bw, cpu, 32, lm_head=np.zeros((VOCAB, 80), np.float32), lm_head_screen="q8_0")


def test_non_finite_hidden_states_raise(cpu):
    """A hidden state that overflows has no argmax: the step says so instead of returning an id."""
    cfg = config()
    embed, head = target_matrices(cfg)
    tensors = dict(DraftWeights.random(cfg, seed=3))
    tensors["norm.weight"] = np.full(cfg.hidden, 3e38, np.float32)  # the output norm overflows f32
    w = DraftWeights(cfg, tensors)
    ring = FeatureRing(64, cfg.fc_in)
    ring.append(np.ones((20, cfg.fc_in), np.float32))
    tokens = np.full(cfg.block_size, cfg.mask_token_id, np.int32)
    with (
        w.to_backend(cpu, "f16") as bw,
        DraftKvCache(bw, cpu, 32, lm_head=head, embed_tokens=embed, lm_head_screen="q8_0") as c,
    ):
        with pytest.raises(FloatingPointError, match="hidden states at noise rows .* are not finite"):
            c.step_tokens(ring, 20, tokens, output="ids")


def test_embedding_input_cache_steps_and_c_style_compute(cpu):
    """A cache fed embeddings: step() returns the full head's logits; the C-style begin_step +
    compute() runs the screened graph (exact draft_ids), compute(logits=True) the full one."""
    cfg = config()
    _, head = target_matrices(cfg)
    rng = np.random.default_rng(11)
    ring = FeatureRing(64, cfg.fc_in)
    ring.append(rng.standard_normal((30, cfg.fc_in)).astype(np.float32))
    noise = rng.standard_normal((cfg.block_size, cfg.hidden)).astype(np.float32)
    with (
        DraftWeights.random(cfg, seed=3).to_backend(cpu, "f16") as bw,
        DraftKvCache(bw, cpu, 32, lm_head=head) as plain,
        DraftKvCache(bw, cpu, 32, lm_head=head, lm_head_screen="q8_0") as screened,
    ):
        np.testing.assert_array_equal(screened.step(ring, 20, noise), plain.step(ring, 20, noise))
        for c in (plain, screened):
            c.begin_step(ring, 30)
            c.inp_embed.set(noise)
            c.compute()
        assert screened.logits is None and plain.logits is not None
        exact = np.argmax(
            screened.hidden_states.numpy().astype(np.float64) @ plain.lm_head.numpy().astype(np.float64).T, 1
        )
        np.testing.assert_array_equal(screened.draft_ids.numpy(), exact)
        np.testing.assert_array_equal(screened.draft_ids.numpy(), plain.draft_ids.numpy())
        screened.begin_step(ring, 30)
        screened.compute(logits=True)
        np.testing.assert_array_equal(screened.logits.numpy(), plain.logits.numpy())
