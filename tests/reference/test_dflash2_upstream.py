"""The DFlash-2 numpy reference against the upstream PyTorch one (the `dflash` package, 0.1.0,
`dflash/model.py`: GroupedDynamicCausalConv, CandidateSelector.select).

Kept apart from test_dflash2_reference.py because importing dflash (transformers) takes seconds.
Upstream runs one noise block per batch row, so its convolution is `dynamic_conv` with a single
block; its selector is given the rows after the anchor (dflash_generate's `draft_hidden[:, 1:]`).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", exc_type=ImportError)
dflash_model = pytest.importorskip("dflash.model", exc_type=ImportError)

from pyggml_dkv.reference import dflash2 as D2  # noqa: E402
from tests.torch_threads import torch_threads  # noqa: E402

pytestmark = pytest.mark.slow  # the PyTorch reference model: the slow tier

H, K, GROUP, RANK, VOCAB, TOP_K, N = 16, 3, 4, 6, 40, 4, 6


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(torch, 1):
        yield


def t64(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)).to(torch.float64)


def test_conv_matches_upstream_prepare_and_finish():
    rng = np.random.default_rng(0)
    conv = dflash_model.GroupedDynamicCausalConv(H, K, GROUP).to(torch.float64)
    base = rng.standard_normal((2, K, H))
    proj = rng.standard_normal((2 * K * (H // GROUP), H)) * 0.3
    with torch.no_grad():
        conv.base_kernel.copy_(t64(base))
        conv.kernel_projection.weight.copy_(t64(proj))
    normed, inner = rng.standard_normal((N, H)), rng.standard_normal((H, H))

    with torch.no_grad():
        side0, dynamic = conv.prepare(t64(normed)[None])
        side1 = conv.finish(torch.tanh(side0 @ t64(inner).T), dynamic)

    got = D2.conv_sublayer(normed, base, proj, lambda y: np.tanh(y @ inner.T), GROUP)
    np.testing.assert_allclose(got, side1[0].numpy(), rtol=1e-12, atol=1e-12)


def selector(rng: np.random.Generator):
    sel = dflash_model.CandidateSelector(
        type("Cfg", (), {"selector_rank": RANK, "selector_top_k": TOP_K, "vocab_size": VOCAB, "hidden_size": H})()
    ).to(torch.float64)
    weights = dict(
        hidden_projection=rng.standard_normal((RANK, H)),
        predecessor_codebook=rng.standard_normal((VOCAB, RANK)),
        successor_codebook=rng.standard_normal((VOCAB, RANK)),
    )
    with torch.no_grad():
        sel.hidden_projection.weight.copy_(t64(weights["hidden_projection"]))
        sel.predecessor_codebook.weight.copy_(t64(weights["predecessor_codebook"]))
        sel.successor_codebook.weight.copy_(t64(weights["successor_codebook"]))
    return sel, weights


def test_greedy_walk_matches_upstream_select():
    rng = np.random.default_rng(1)
    sel, weights = selector(rng)
    for anchor in (0, 7, 39):
        hidden, logits = rng.standard_normal((N, H)), rng.standard_normal((N, VOCAB)) * 3
        with torch.no_grad():
            path, _, q = sel.select(t64(hidden[1:])[None], t64(logits[1:])[None], torch.tensor([anchor]), 0.0)
        assert q is None
        lattice = D2.selector_scores(hidden, logits, anchor, **weights, top_k=TOP_K)
        np.testing.assert_array_equal(D2.greedy_walk(lattice), path[0].numpy())


def test_sampled_distributions_match_upstream_select():
    """Upstream draws its own path; along that path our q rows, spread over the vocabulary, must
    equal upstream's (whose candidate order is its own). Upstream's softmax runs in float32
    (`_sampling_probs` calls `.float()`), hence the tolerance."""
    rng = np.random.default_rng(2)
    sel, weights = selector(rng)
    hidden, logits = rng.standard_normal((N, H)), rng.standard_normal((N, VOCAB))
    torch.manual_seed(0)
    with torch.no_grad():
        path, cands, q = sel.select(t64(hidden[1:])[None], t64(logits[1:])[None], torch.tensor([5]), 0.8)
    lattice = D2.selector_scores(hidden, logits, 5, **weights, top_k=TOP_K)

    tokens = path[0].numpy()
    ours = []
    pred = 0
    for i, token in enumerate(tokens):
        z = lattice.scores[i, pred] / 0.8
        ours.append(np.exp(z - z.max()) / np.exp(z - z.max()).sum())
        pred = int(np.flatnonzero(lattice.candidates[i] == token)[0])
    got = D2.draft_distribution(lattice.candidates, np.array(ours), VOCAB)
    want = D2.draft_distribution(cands[0].numpy(), q[0].numpy(), VOCAB)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------- a whole drafter


def test_upstream_loads_our_checkpoint_and_drafts_what_the_reference_drafts(tmp_path):
    """A DFlash-2 checkpoint written here, loaded by upstream's DFlash2DraftModel.from_pretrained
    (its key_mapping appends `.weight` to the codebooks): the same parameters, the same draft
    hidden states as `reference.draft_forward` (upstream in float64; full layers, which both run
    non-causal), and at temperature 0 the same draft ids as `draft_step_dflash2`; with the conv and
    the selector zeroed out the hidden states differ (the check is not vacuous)."""
    from pyggml_dkv import reference as R
    from pyggml_dkv.common.numeric import relative_error
    from pyggml_dkv.model.config import DraftConfig
    from pyggml_dkv.model.weights import DraftWeights

    cfg = DraftConfig(
        hidden=64,
        n_layer=2,
        n_head=4,
        n_head_kv=2,
        head_dim=16,
        ffn=96,
        block_size=6,
        n_target_layers=2,
        target_layer_ids=[1, 3],
        vocab=VOCAB,
        mask_token_id=VOCAB - 1,
        rope_theta=10000.0,
        output_multiplier=0.9,
        final_logit_softcapping=8.0,
        conv_kernel_size=3,
        conv_group_size=8,
        selector_rank=RANK,
        selector_top_k=TOP_K,
    )
    w = DraftWeights.random(cfg, seed=4)
    w.save_pretrained(tmp_path)
    model = dflash_model.DFlash2DraftModel.from_pretrained(tmp_path, dtype=torch.float64).eval()
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    ours = {k + ".weight" if k.endswith("_codebook") else k: v for k, v in w.items()}
    assert set(state) == set(ours)
    for name, arr in ours.items():
        np.testing.assert_array_equal(state[name], arr, err_msg=name)

    rng = np.random.default_rng(5)
    committed, ctx_len = 40, 12
    all_feats = rng.standard_normal((committed, cfg.fc_in))
    noise = rng.standard_normal((cfg.block_size, cfg.hidden))
    head = rng.standard_normal((VOCAB, cfg.hidden)) / np.sqrt(cfg.hidden)
    pos = torch.arange(committed - ctx_len, committed + cfg.block_size)[None]
    with torch.no_grad():
        hidden = model(
            position_ids=pos,
            noise_embedding=t64(noise)[None],
            target_hidden=t64(all_feats[committed - ctx_len :])[None],
        )
        output_head = torch.nn.Linear(cfg.hidden, VOCAB, bias=False).to(torch.float64)
        output_head.weight.copy_(t64(head))
        path, _, _ = model.propose(hidden[:, 1:], torch.tensor([11]), output_head, 0.0)
    want = R.reference_step(w, all_feats, committed, ctx_len, noise)
    # transformers computes the rotary cos/sin in float32 even in a float64 model: ~3e-7 (a
    # DFlash-1 drafter shows the same ~2e-7), while a wrong convolution is O(1)
    assert relative_error(hidden[0].numpy(), want) < 2e-6
    lattice, ids = D2.draft_step_dflash2(w, all_feats, committed, ctx_len, noise, 11, head)
    np.testing.assert_array_equal(ids, path[0].numpy())
    # negative control: the same weights as a DFlash-1 drafter draft other hidden states
    plain = cfg.replace(conv_kernel_size=0, conv_group_size=0, selector_rank=0, selector_top_k=0)
    w1 = DraftWeights(plain, {k: v for k, v in w.items() if "_conv." not in k and "candidate_selector" not in k})
    assert relative_error(R.reference_step(w1, all_feats, committed, ctx_len, noise), want) > 1e-2
