"""Target-feature capture: both routes agree on every row across ubatch splits, and the captured
feature of layer i is the OUTPUT of decoder layer i (HF hidden_states[i + 1]), checked by
recomputing layers in numpy from the GGUF's weights and from llama.cpp's own logits."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="the llama.cpp host needs llama-cpp-python (pip install -e '.[llama]')")

from pyggml_dkv.hosts.llama_cpp import GGUFFile, HostError, LlamaTarget  # noqa: E402
from pyggml_dkv.hosts.llama_cpp.lowlevel import native_layer_inp  # noqa: E402
from tests.hosts.hosts_helpers import THREADS, llama_layer, rel_err, rms_norm, smollm2_path  # noqa: E402

pytestmark = pytest.mark.slow  # loads SmolLM2 in llama.cpp: the slow tier (pytest -m 'not slow' skips it)

LAYERS = (0, 7, 8, 28)
TEXT = "The quick brown fox jumps over the lazy dog. " * 4


@pytest.fixture(scope="module")
def gguf():
    return GGUFFile(smollm2_path())


@pytest.fixture(scope="module")
def targets():
    made = {}
    for route in ("native", "callback"):
        made[route] = LlamaTarget(
            smollm2_path(), n_ctx=256, n_batch=64, n_ubatch=16, n_threads=THREADS, capture_layers=LAYERS, capture=route
        )
    yield made
    for t in made.values():
        t.close()


@pytest.fixture(scope="module")
def prompt(targets):
    toks = targets["native"].tokenize(TEXT)
    assert 40 < toks.size <= 64  # several ubatches of 16 in one decode
    return toks


def captured(target: LlamaTarget, tokens: np.ndarray) -> np.ndarray:
    target.clear()
    target.decode(tokens, logits="last")
    return target.capture.features().reshape(tokens.size, len(LAYERS), target.n_embd).copy()


def test_routes_agree_on_every_row(targets, prompt) -> None:
    native = captured(targets["native"], prompt)
    callback = captured(targets["callback"], prompt)
    assert targets["native"].capture.route == "native" and targets["callback"].capture.route == "callback"
    assert np.isfinite(native).all() and np.abs(native).max() > 0
    # the same tensors (l_out-i is the layer input of i+1): identical, every row, every ubatch piece
    np.testing.assert_array_equal(native, callback)
    # rows differ from each other (a piece written to the wrong rows would show)
    assert not np.allclose(native[0], native[20])


def test_features_continue_across_decodes(targets, prompt) -> None:
    """Prompt in two decodes (positions continue): the same features as in one decode."""
    t = targets["callback"]
    whole = captured(t, prompt)
    t.clear()
    t.decode(prompt[:30], logits="none")
    first = t.capture.features().copy()
    t.decode(prompt[30:], logits="last")
    second = t.capture.features().copy()
    split = np.concatenate([first, second]).reshape(whole.shape)
    # different batch shapes may round differently: close, not equal
    assert rel_err(split, whole) < 1e-3


def test_layer_input_0_is_the_token_embedding(targets, prompt, gguf) -> None:
    """llama.cpp's layer input 0 = token_embd rows (validates our GGUF reader: embed_tokens for the drafter)."""
    t = targets["native"]
    fns = native_layer_inp()
    fns.set(t._ctx, 0, True)
    try:
        t.clear()
        t.decode(prompt, logits="last")
        inp0 = np.ctypeslib.as_array(fns.get(t._ctx, 0), shape=(prompt.size, t.n_embd)).copy()
    finally:
        fns.set(t._ctx, 0, False)
    embed = gguf.array("token_embd.weight")
    np.testing.assert_array_equal(inp0, embed[prompt])


def test_feature_i_is_the_output_of_layer_i(targets, prompt, gguf) -> None:
    """Recompute decoder layers 0 and 8 in numpy: the captured feature of layer i equals layer i
    applied to the feature of layer i-1 (the embedding for i = 0), i.e. HF hidden_states[i + 1]."""
    feats = captured(targets["native"], prompt)
    embed = gguf.array("token_embd.weight")[prompt]
    for il, x_in, slot in ((0, embed, 0), (8, feats[:, 1], 2)):
        want = llama_layer(gguf, il, x_in)
        got = feats[:, slot]
        err = rel_err(got, want)
        # llama.cpp computes Q4_1 products on q8-quantized activations: about 1e-2 from float64
        assert err < 3e-2, f"layer {il}: {err}"
        # the wrong definitions are far off: the layer's input, or the next layer's output
        assert rel_err(x_in, want) > 10 * err
        if il == 0:
            assert rel_err(llama_layer(gguf, 1, want), want) > 10 * err


def test_last_layer_needs_every_row_and_matches_the_logits(gguf) -> None:
    """Capturing layer n_layer-1 (callback route only) forces output rows for every token; its
    feature, through the final norm and the tied head, gives llama.cpp's logits."""
    path = smollm2_path()
    with pytest.raises(HostError, match="native route cannot capture the last layer"):
        LlamaTarget(path, n_ctx=64, n_threads=THREADS, capture_layers=(29,), capture="native")
    with LlamaTarget(path, n_ctx=64, n_batch=32, n_threads=THREADS, capture_layers=(29,), capture="auto") as t:
        assert t.capture.route == "callback" and t.capture.needs_all_outputs
        toks = t.tokenize("Hello there, how are you?")
        logits = np.array(t.decode(toks, logits="all"))
        last = t.capture.features()
        assert last.shape == (toks.size, t.n_embd)
        out = rms_norm(
            last.astype(np.float64),
            gguf.array("output_norm.weight"),
            float(gguf.arch_value("attention.layer_norm_rms_epsilon")),
        )
        mine = out @ gguf.array("token_embd.weight").astype(np.float64).T
        assert rel_err(mine, logits) < 2e-2
        assert (mine.argmax(axis=1) == logits.argmax(axis=1)).mean() > 0.8
