"""dflash GGUF files: write, read back, the key / tensor mapping, and refusals by name."""

from __future__ import annotations

import numpy as np
import pytest

from pyggml_dkv.common.bf16 import from_bf16_bits, to_bf16_bits
from pyggml_dkv.ggml.types import dequantize, quantize
from pyggml_dkv.model.config import DraftConfig
from pyggml_dkv.model.gguf_names import GGUFError
from pyggml_dkv.model.gguf_write import matrix_type, use_more_bits
from pyggml_dkv.model.weights import DraftWeights

gguf = pytest.importorskip("gguf")
from gguf import GGUFReader  # noqa: E402
from gguf import GGUFValueType as T  # noqa: E402

from tests.model.gguf_helpers import copy_gguf, write_vocab_gguf  # noqa: E402

N_VOCAB = 96


def toy_cfg(**changes) -> DraftConfig:
    base = dict(vocab=N_VOCAB, mask_token_id=5, target_layer_ids=[1, 4, 7])
    base.update(changes)
    return DraftConfig.toy(**base)


def toy_weights(cfg: DraftConfig, seed: int = 0, vocab_matrices: bool = True) -> DraftWeights:
    w = DraftWeights.random(cfg, seed=seed)
    if not vocab_matrices:
        return w
    rng = np.random.default_rng(seed + 1)
    emb = rng.standard_normal((N_VOCAB, cfg.hidden), dtype=np.float32)
    head = rng.standard_normal((N_VOCAB, cfg.hidden), dtype=np.float32) / np.float32(np.sqrt(cfg.hidden))
    return DraftWeights(cfg, dict(w), embed_tokens=emb, lm_head=head)


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory):
    return write_vocab_gguf(tmp_path_factory.mktemp("vocab") / "target.gguf", N_VOCAB)


@pytest.fixture(scope="module")
def toy_file(tmp_path_factory, vocab_file):
    w = toy_weights(toy_cfg())
    return w, w.save_pretrained(tmp_path_factory.mktemp("toy"), format="gguf", dtype="f32", vocab_from=vocab_file)


def fields(path) -> dict:
    return {k: f.contents() for k, f in GGUFReader(path, "r").fields.items() if not k.startswith("GGUF.")}


def expected_rounding(arr: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "f32":
        return arr
    if dtype == "f16":
        return arr.astype(np.float16).astype(np.float32)
    if dtype == "bf16":
        return from_bf16_bits(to_bf16_bits(arr))
    return dequantize(dtype, quantize(dtype, arr), arr.size).reshape(arr.shape)


def test_names_keys_and_target_layer_inputs(toy_file):
    w, path = toy_file
    assert path.name == "model.gguf"
    kv = fields(path)
    assert kv["general.architecture"] == "dflash"
    assert kv["dflash.target_layers"] == [2, 5, 8]  # layer inputs: our ids + 1
    assert kv["dflash.block_size"] == 16 and kv["dflash.embedding_length"] == 256
    assert kv["dflash.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert kv["tokenizer.ggml.mask_token_id"] == 5 and len(kv["tokenizer.ggml.tokens"]) == N_VOCAB
    names = {t.name for t in GGUFReader(path, "r").tensors}
    layer = {
        f"blk.{i}.{s}.weight"
        for i in range(2)
        for s in (
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "attn_q_norm",
            "attn_k_norm",
            "ffn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        )
    }
    assert (
        names
        == {"fc.weight", "enc.output_norm.weight", "output_norm.weight", "token_embd.weight", "output.weight"} | layer
    )
    t = {t.name: t for t in GGUFReader(path, "r").tensors}
    assert list(t["fc.weight"].shape) == [3 * 256, 256]  # ggml order [in, out]
    np.testing.assert_array_equal(np.asarray(t["enc.output_norm.weight"].data), w["hidden_norm.weight"])
    np.testing.assert_array_equal(np.asarray(t["output_norm.weight"].data), w["norm.weight"])
    np.testing.assert_array_equal(np.asarray(t["blk.1.attn_q.weight"].data), w["layers.1.self_attn.q_proj.weight"])


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k"])
def test_round_trip(dtype, tmp_path, vocab_file):
    cfg = toy_cfg()
    w = toy_weights(cfg)
    path = w.save_pretrained(tmp_path / f"d.{dtype}.gguf", format="gguf", dtype=dtype, vocab_from=vocab_file)
    r = DraftWeights.from_pretrained(path)
    assert r.cfg == cfg
    for name in w:
        want = w[name] if w[name].ndim == 1 else expected_rounding(w[name], dtype)
        np.testing.assert_array_equal(r[name], want, err_msg=name)
    np.testing.assert_array_equal(r.lm_head, expected_rounding(w.lm_head, dtype))
    np.testing.assert_array_equal(r.embed_tokens, expected_rounding(w.embed_tokens, dtype))
    matrices = [n for n in w if w[n].ndim == 2] + ["embed_tokens", "lm_head"]
    assert sorted(r.stored) == sorted(matrices)
    assert {m.type_name for m in r.stored.values()} == {dtype}
    raw = r.stored["fc.weight"].raw
    assert not raw.flags.owndata  # a view of the memory-mapped file, not a copy
    if dtype not in ("f32", "f16", "bf16"):
        np.testing.assert_array_equal(raw, quantize(dtype, w["fc.weight"]))


def test_q4_k_m_is_llama_cpps_mix(tmp_path, vocab_file):
    """dtype="q4_k_m": q4_K everywhere but q6_K for the head and for the V / down projections of
    the layers llama.cpp's Q4_K_M gives more bits (the toy's 2 layers: the second, as the last
    eighth), each matrix stored and read back in its own type."""
    cfg = toy_cfg()
    w = toy_weights(cfg)
    r = DraftWeights.from_pretrained(
        w.save_pretrained(tmp_path / "d.gguf", format="gguf", dtype="q4_k_m", vocab_from=vocab_file)
    )
    six = {"lm_head", "layers.1.self_attn.v_proj.weight", "layers.1.mlp.down_proj.weight"}
    for name, stored in r.stored.items():
        want_type = "q6_k" if name in six else "q4_k"
        assert stored.type_name == want_type == matrix_type(name, "q4_k_m", cfg.n_layer), name

        def of(d: DraftWeights) -> np.ndarray:
            return getattr(d, name) if name in ("lm_head", "embed_tokens") else d[name]

        np.testing.assert_array_equal(of(r), expected_rounding(of(w), want_type), err_msg=name)


def test_use_more_bits_follows_llama_cpp():
    """llama.cpp's use_more_bits (src/llama-quant.cpp): the first and last eighth, every third between."""
    assert [i for i in range(5) if use_more_bits(i, 5)] == [2, 4]
    assert [i for i in range(2) if use_more_bits(i, 2)] == [1]
    assert [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]


def test_without_vocab_matrices_and_path_forms(tmp_path, vocab_file):
    w = toy_weights(toy_cfg(), vocab_matrices=False)
    path = w.save_pretrained(tmp_path / "x.gguf", format="gguf", dtype="f16", vocab_from=vocab_file)
    assert path == tmp_path / "x.gguf"
    r = DraftWeights.from_pretrained(str(path))
    assert r.embed_tokens is None and r.lm_head is None


@pytest.mark.parametrize(
    "changes",
    [
        dict(freq_scale=0.25, ext_factor=1.0, n_ctx_orig=64, rope_theta=10000.0),  # YaRN
        dict(freq_scale=0.5),  # linear
        dict(freq_scale=0.5, attn_factor=0.9),
        dict(layer_types=["full", "sliding"], swa_window=24),
        dict(output_multiplier=0.7, final_logit_softcapping=3.0, input_embedding_scale=2.0, block_size=10),
    ],
)
def test_config_round_trip(changes, tmp_path, vocab_file):
    cfg = toy_cfg(**changes)
    path = DraftWeights.random(cfg).save_pretrained(tmp_path / "c.gguf", format="gguf", vocab_from=vocab_file)
    assert DraftWeights.from_pretrained(path).cfg == cfg


def test_yarn_keys_as_llama_cpp_reads_them(tmp_path, vocab_file):
    cfg = toy_cfg(freq_scale=0.25, ext_factor=1.0, n_ctx_orig=64)
    kv = fields(DraftWeights.random(cfg).save_pretrained(tmp_path / "y.gguf", format="gguf", vocab_from=vocab_file))
    assert kv["dflash.rope.scaling.type"] == "yarn"
    assert kv["dflash.rope.scaling.factor"] == 4.0
    assert kv["dflash.rope.scaling.original_context_length"] == 64
    assert "dflash.rope.scaling.attn_factor" not in kv  # llama.cpp's default magnitude is our attn_factor 1


@pytest.mark.parametrize(
    "name,value,ok",
    [
        ("yarn_beta_fast", 32.0, True),
        ("yarn_beta_slow", 1.0, True),
        ("yarn_ext_factor", 1.0, True),
        ("yarn_attn_factor", 1.0 + 0.1 * np.log(4.0), True),  # what the converter copies from an HF default
        ("yarn_beta_fast", 16.0, False),
        ("yarn_ext_factor", 0.5, False),
        ("yarn_attn_factor", 1.0, False),
    ],
)
def test_yarn_keys_the_converter_copies(name, value, ok, tmp_path, vocab_file):
    cfg = toy_cfg(freq_scale=0.25, ext_factor=1.0, n_ctx_orig=64)
    src = DraftWeights.random(cfg).save_pretrained(tmp_path / "y.gguf", format="gguf", vocab_from=vocab_file)
    path = copy_gguf(src, tmp_path / "z.gguf", set_keys={f"dflash.rope.scaling.{name}": (value, T.FLOAT32)})
    if ok:
        assert DraftWeights.from_pretrained(path).cfg == cfg
    else:
        with pytest.raises(GGUFError, match=name):
            DraftWeights.from_pretrained(path)


def test_write_refusals(tmp_path, vocab_file):
    w = toy_weights(toy_cfg())
    with pytest.raises(GGUFError, match="vocab_from"):
        w.save_pretrained(tmp_path / "a.gguf", format="gguf")
    with pytest.raises(GGUFError, match="dtype"):
        w.save_pretrained(tmp_path / "a.gguf", format="gguf", dtype="q2_k", vocab_from=vocab_file)
    small = write_vocab_gguf(tmp_path / "small.gguf", 50)
    with pytest.raises(GGUFError, match="vocab"):
        w.save_pretrained(tmp_path / "a.gguf", format="gguf", vocab_from=small)
    with pytest.raises(GGUFError, match="betas"):
        DraftWeights.random(toy_cfg(freq_scale=0.5, ext_factor=1.0, n_ctx_orig=64, beta_fast=16.0)).save_pretrained(
            tmp_path / "a.gguf", format="gguf", vocab_from=vocab_file
        )
    odd = DraftConfig(
        hidden=96,
        n_layer=1,
        n_head=2,
        n_head_kv=1,
        head_dim=48,
        ffn=160,
        block_size=4,
        n_target_layers=1,
        vocab=N_VOCAB,
        target_layer_ids=[3],
    )
    with pytest.raises(GGUFError, match="q4_k"):
        DraftWeights.random(odd).save_pretrained(
            tmp_path / "a.gguf", format="gguf", dtype="q4_k", vocab_from=vocab_file
        )
    with pytest.raises(ValueError, match="format"):
        w.save_pretrained(tmp_path / "a", format="onnx")
    assert not list(tmp_path.glob("a.gguf*"))


REFUSED_KEYS = [
    # DFlash-2 keys without the others (more in test_dflash2_files.py)
    ("dflash.conv_kernel_size", (4, T.UINT32), "missing key 'dflash.conv_group_size'"),
    ("dflash.selector_top_k", (4, T.UINT32), "missing key 'dflash.conv_kernel_size'"),
    ("dflash.has_confidence_head", (True, T.BOOL), "DSpark"),
    ("dflash.sample_from_anchor", (False, T.BOOL), "DSpark"),
    ("dflash.attention.value_scale", (0.5, T.FLOAT32), "value scale"),
    ("dflash.rope.dimension_count", (32, T.UINT32), "partial rotary"),
    ("dflash.rope.dimension_sections", ([32, 0, 0, 0], (T.ARRAY, T.INT32)), "M-RoPE"),
    ("dflash.attention.causal", (True, T.BOOL), "causal"),
    ("dflash.hidden_act", ("gelu", T.STRING), "silu"),
    ("dflash.attention.scale", (0.5, T.FLOAT32), "sqrt"),
    ("dflash.rope.scaling.type", ("longrope", T.STRING), "longrope"),
    ("dflash.rope.scaling.yarn_beta_fast", (16.0, T.FLOAT32), "yarn_beta_fast"),  # not even a yarn file
    ("dflash.rope.scaling.yarn_log_multiplier", (0.1, T.FLOAT32), "log-multiplier"),
    ("dflash.hyper_connection.count", (4, T.UINT32), "dflash.hyper_connection.count"),
    ("dflash.feed_forward_length", ([512, 256], (T.ARRAY, T.UINT32)), "per layer"),
    ("dflash.target_layers", ([0, 4], (T.ARRAY, T.INT32)), "target_layers"),
]


@pytest.mark.parametrize("name,value,match", REFUSED_KEYS, ids=[k for k, *_ in REFUSED_KEYS])
def test_refused_keys(name, value, match, toy_file, tmp_path):
    bad = copy_gguf(toy_file[1], tmp_path / "bad.gguf", set_keys={name: value})
    with pytest.raises(GGUFError, match=match):
        DraftWeights.from_pretrained(bad)


REFUSED_TENSORS = [
    ("blk.0.attn_post_norm.weight", (256,), "post-attention"),
    # DFlash-2 tensors in a file without the DFlash-2 keys
    ("selector_hidden.weight", (8, 256), "DFlash-2 tensor .* none of the keys"),
    ("blk.1.attn_conv_proj.weight", (8, 256), "DFlash-2 tensor .* none of the keys"),
    ("markov_w1.weight", (N_VOCAB, 8), "DSpark"),
    ("fc.scale", (1,), "scales"),
    ("blk.0.attn_sinks.weight", (4,), "sinks"),
    ("d2t", (N_VOCAB,), "d2t"),
    ("blk.0.something_new.weight", (4,), "does not define"),
]


@pytest.mark.parametrize("name,shape,match", REFUSED_TENSORS, ids=[n for n, *_ in REFUSED_TENSORS])
def test_refused_tensors(name, shape, match, toy_file, tmp_path):
    bad = copy_gguf(toy_file[1], tmp_path / "bad.gguf", add_tensors={name: np.zeros(shape, np.float32)})
    with pytest.raises(GGUFError, match=match) as e:
        DraftWeights.from_pretrained(bad)
    assert name in str(e.value)


def test_other_refusals(toy_file, tmp_path):
    src = toy_file[1]
    with pytest.raises(GGUFError, match="shared K/V"):
        DraftWeights.from_pretrained(copy_gguf(src, tmp_path / "a.gguf", drop_tensors=("blk.1.attn_v.weight",)))
    with pytest.raises(GGUFError, match="missing tensor"):
        DraftWeights.from_pretrained(copy_gguf(src, tmp_path / "b.gguf", drop_tensors=("blk.1.ffn_up.weight",)))
    with pytest.raises(GGUFError, match="mask_token_id"):
        DraftWeights.from_pretrained(copy_gguf(src, tmp_path / "c.gguf", drop_keys=("tokenizer.ggml.mask_token_id",)))
    with pytest.raises(GGUFError, match="target_layers"):
        DraftWeights.from_pretrained(copy_gguf(src, tmp_path / "d.gguf", drop_keys=("dflash.target_layers",)))
    with pytest.raises(GGUFError, match="architecture"):
        DraftWeights.from_pretrained(copy_gguf(src, tmp_path / "e.gguf", arch="qwen3"))
    (tmp_path / "f.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        DraftWeights.from_pretrained(tmp_path / "f.gguf")
    with pytest.raises(GGUFError, match="no such"):
        DraftWeights.from_pretrained(tmp_path / "missing.gguf")


def test_gguf_error_is_package_error():
    from pyggml_dkv.common.errors import PyggmlDkvError

    assert issubclass(GGUFError, PyggmlDkvError) and issubclass(GGUFError, ValueError)
