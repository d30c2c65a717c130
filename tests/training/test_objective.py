"""The training objective: many anchors in one pass are exactly the drafter the host runs.

- Block rows of every anchor, computed together with the shared context and the block mask,
  equal the numpy reference drafter (pyggml_dkv.reference) run anchor by anchor.
- Labels, validity (greedy prefixes only), accepted lengths and the replayed rounds on hand-made cases.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="training needs torch (pip install -e '.[torch]')")
pytest.importorskip("dflash", reason="training uses the dflash package's model class")

from pyggml_dkv import DraftConfig, DraftWeights, reference  # noqa: E402
from pyggml_dkv.training.model import load_weights, new_model, to_draft_weights, unpermute_llama_qk  # noqa: E402
from pyggml_dkv.training.objective import (  # noqa: E402
    Frozen,
    accepted_lengths,
    anchor_range,
    block_labels,
    draft_hidden,
    sequence_loss,
    simulated_rounds,
)

VOCAB = 300
CFG = DraftConfig.toy(block_size=6, mask_token_id=5, vocab=VOCAB, target_layer_ids=[0, 1, 2], rope_theta=10000.0)


def toy_sequence(n: int = 70, seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, n).astype(np.int32)
    feats = rng.standard_normal((n, CFG.fc_in)).astype(np.float32)
    embed = rng.standard_normal((VOCAB, CFG.hidden)).astype(np.float32)
    head = rng.standard_normal((VOCAB, CFG.hidden)).astype(np.float32) / np.sqrt(CFG.hidden)
    return tokens, feats, embed, head


def test_many_anchors_in_one_pass_equal_the_reference_drafter_anchor_by_anchor():
    torch.set_num_threads(1)
    tokens, feats, embed, head = toy_sequence()
    weights = DraftWeights.random(CFG, seed=3)
    model = new_model(CFG, seed=0)
    load_weights(model, weights)
    model.eval()
    anchors = np.array([1, 9, 10, 33, 68])
    with torch.no_grad():
        hidden = draft_hidden(model, feats, tokens, anchors, Frozen.from_arrays(embed, head)).numpy()
    for row, p in zip(hidden, anchors):
        ids = np.full(CFG.block_size, CFG.mask_token_id)
        ids[0] = tokens[p]
        want = reference.reference_step(weights, feats[:p], int(p), 4096, embed[ids], dtype=np.float64)
        err = np.abs(row - want).max() / np.abs(want).max()
        assert err < 1e-5, (p, err)


def test_weights_round_trip_through_the_torch_model():
    weights = DraftWeights.random(CFG, seed=4)
    model = new_model(CFG, seed=0)
    load_weights(model, weights)
    back = to_draft_weights(model, CFG)
    assert set(back) == set(weights)
    for name in weights:
        np.testing.assert_array_equal(back[name], weights[name])


def test_unpermute_inverts_llama_cpp_s_qk_permutation():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6 * 8, 5))  # 6 heads of 8
    # llama.cpp's convert_hf_to_gguf permute (HF halves layout -> interleaved pairs)
    permuted = w.reshape(6, 2, 4, 5).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(unpermute_llama_qk(permuted, 6), w)


def test_labels_are_valid_only_along_a_greedy_prefix_inside_the_sequence():
    tokens = np.arange(10, 20)
    greedy = np.ones(10, bool)
    greedy[6] = False  # token 16 was sampled
    labels, valid = block_labels(tokens, greedy, np.array([3, 7, 8]), block=4)
    np.testing.assert_array_equal(labels[0], [14, 15, 16])
    np.testing.assert_array_equal(valid[0], [True, True, False])  # 16 sampled: it and all after drop
    np.testing.assert_array_equal(valid[1], [True, True, False])  # 18, 19, then past the end
    np.testing.assert_array_equal(valid[2], [True, False, False])
    np.testing.assert_array_equal(anchor_range(10, 4), np.arange(4, 9))


def test_accepted_lengths_and_replayed_rounds():
    tokens = np.arange(100, 112)
    greedy = np.ones(12, bool)
    anchors = anchor_range(12, 2)  # 2 .. 10
    drafts = np.stack([tokens[p + 1 : p + 4] if p + 4 <= 12 else np.full(3, -1) for p in anchors])
    drafts[1, 1] = 0  # anchor 3: first right, second wrong
    acc = accepted_lengths(drafts, tokens, greedy, anchors)
    assert acc[0] == 3 and acc[1] == 1
    assert simulated_rounds(acc, anchors, 12) == [4, 4, 1]  # anchors 2, 6, 10 (8, 9, 10: past the end -> -1 drafts)


def test_the_loss_falls_on_one_sequence():
    torch.set_num_threads(1)
    tokens, feats, embed, head = toy_sequence(40, seed=1)
    model = new_model(CFG, seed=0)
    frozen = Frozen.from_arrays(embed, head)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    anchors = anchor_range(tokens.size, 5)
    greedy = np.ones(tokens.size, bool)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss, stats = sequence_loss(model, frozen, tokens, feats, greedy, anchors, gamma=4.0)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0], losses


def test_feature_scaling_is_a_reparametrisation_the_saved_drafter_does_not_see():
    from pyggml_dkv.training.model import feature_scale, scale_features

    tokens, feats, embed, head = toy_sequence()
    feats[:, 7] *= 300.0  # one massive channel
    scale = feature_scale(feats)
    assert scale[7] > 100 * np.median(scale)
    model = new_model(CFG, seed=0)
    before = to_draft_weights(model, CFG)
    frozen = Frozen.from_arrays(embed, head)
    anchors = np.array([3, 30, 60])
    with torch.no_grad():
        out_before = draft_hidden(model, feats, tokens, anchors, frozen)
    scale_features(model, scale)
    after = to_draft_weights(model, CFG)
    with torch.no_grad():
        out_after = draft_hidden(model, feats, tokens, anchors, frozen)
    assert set(after) == set(before)
    np.testing.assert_allclose(after["fc.weight"], before["fc.weight"], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(out_after, out_before, rtol=1e-5, atol=1e-6)
    # the optimiser now moves the normalised weight: column 7's effective step is 1/scale as large
    raw = model.fc.parametrizations.weight.original
    assert torch.allclose(model.fc.weight, raw / torch.from_numpy(scale))


@pytest.mark.slow  # reads SmolLM2's GGUF
def test_init_from_target_copies_the_target_layers_in_the_drafter_s_layout():
    pytest.importorskip("gguf", reason="reading the target GGUF needs the gguf package")
    from pyggml_dkv.hosts.llama_cpp import smollm2_draft_config
    from pyggml_dkv.hosts.llama_cpp.gguf import GGUFFile
    from pyggml_dkv.training.model import init_from_target
    from tests.hosts.hosts_helpers import smollm2_path

    gguf = GGUFFile(smollm2_path())
    cfg = smollm2_draft_config(n_layer=2, block_size=8)
    model = new_model(cfg, seed=0)
    init_from_target(model, cfg, gguf, [28, 29])
    w = to_draft_weights(model, cfg)
    np.testing.assert_array_equal(w["layers.1.mlp.up_proj.weight"], gguf.array("blk.29.ffn_up.weight"))
    np.testing.assert_array_equal(
        w["layers.0.self_attn.q_proj.weight"], unpermute_llama_qk(gguf.array("blk.28.attn_q.weight"), cfg.n_head)
    )
    np.testing.assert_array_equal(
        w["layers.0.self_attn.k_proj.weight"], unpermute_llama_qk(gguf.array("blk.28.attn_k.weight"), cfg.n_head_kv)
    )
    np.testing.assert_array_equal(w["norm.weight"], gguf.array("output_norm.weight"))
    np.testing.assert_array_equal(w["layers.0.self_attn.q_norm.weight"], np.ones(cfg.head_dim, np.float32))
    with pytest.raises(ValueError, match="one target layer per drafter layer"):
        init_from_target(model, cfg, gguf, [28])
