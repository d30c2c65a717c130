"""DFlash-2 drafters in the model layer (docs/dflash2.md): the config, the tensor names and shapes,
random weights, and the files: safetensors checkpoints and GGUF, written and read back exactly,
converted by llama.cpp's own converter, loaded by llama.cpp's own loader, and every inconsistent
file refused with an error that names the key or tensor.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pyggml_dkv.model import safetensors_io as S
from pyggml_dkv.model.config import DFLASH2_FIELDS, DraftConfig
from pyggml_dkv.model.errors import CheckpointError, ConfigError, WeightsError
from pyggml_dkv.model.tensor_names import (
    SELECTOR_CODEBOOKS,
    dflash2_shapes,
    expected_shapes,
    is_conv_base_kernel,
    is_dflash2_tensor,
    is_fold_in_matrix,
    is_norm,
    is_selector_codebook,
)
from pyggml_dkv.model.weights import DraftWeights, load_checkpoint

gguf = pytest.importorskip("gguf")
from gguf import GGUFReader  # noqa: E402
from gguf import GGUFValueType as T  # noqa: E402

from pyggml_dkv.model.gguf_names import GGUFError  # noqa: E402
from pyggml_dkv.model.gguf_write import GGUF_DTYPES, codebook_type, matrix_type  # noqa: E402
from tests.model.gguf_helpers import copy_gguf, write_vocab_gguf  # noqa: E402
from tests.model.test_gguf import expected_rounding, fields  # noqa: E402

N_VOCAB = 96
D2 = dict(conv_kernel_size=3, conv_group_size=32, selector_rank=32, selector_top_k=4)


def d2_cfg(**changes) -> DraftConfig:
    base = dict(vocab=N_VOCAB, mask_token_id=5, target_layer_ids=[1, 4, 7], **D2)
    base.update(changes)
    return DraftConfig.toy(**base)


def d2_weights(cfg: DraftConfig | None = None, seed: int = 0) -> DraftWeights:
    cfg = cfg or d2_cfg()
    w = DraftWeights.random(cfg, seed=seed)
    rng = np.random.default_rng(seed + 1)
    emb = rng.standard_normal((cfg.vocab, cfg.hidden), dtype=np.float32)
    head = rng.standard_normal((cfg.vocab, cfg.hidden), dtype=np.float32) / np.float32(np.sqrt(cfg.hidden))
    return DraftWeights(cfg, dict(w), embed_tokens=emb, lm_head=head)


D2_LAYER_NAMES = (
    "attention_conv.base_kernel",
    "attention_conv.kernel_projection.weight",
    "mlp_conv.base_kernel",
    "mlp_conv.kernel_projection.weight",
)
SELECTOR_NAMES = (
    "candidate_selector.hidden_projection.weight",
    "candidate_selector.predecessor_codebook",
    "candidate_selector.successor_codebook",
)


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory):
    return write_vocab_gguf(tmp_path_factory.mktemp("vocab") / "target.gguf", N_VOCAB)


@pytest.fixture(scope="module")
def d2_file(tmp_path_factory, vocab_file):
    w = d2_weights()
    return w, w.save_pretrained(
        tmp_path_factory.mktemp("d2") / "d2.gguf", format="gguf", dtype="f32", vocab_from=vocab_file
    )


# ------------------------------------------------------------------------------- config


def test_config_fields_and_properties():
    cfg = d2_cfg()
    assert cfg.is_dflash2 and cfg.conv_groups == 256 // 32
    assert DraftConfig(**cfg.to_dict()) == cfg
    assert {k: cfg.to_dict()[k] for k in DFLASH2_FIELDS} == D2
    assert cfg.replace(selector_top_k=2).selector_top_k == 2
    one = DraftConfig.toy()
    assert not one.is_dflash2 and one.conv_groups == 0
    assert all(getattr(one, k) == 0 for k in DFLASH2_FIELDS)
    assert not cfg.replace(**{k: 0 for k in DFLASH2_FIELDS}).is_dflash2


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(selector_top_k=0), r"selector_top_k is 0 while"),
        (dict(conv_kernel_size=0), r"conv_kernel_size is 0 while"),
        (dict(selector_rank=-1), r"selector_rank must be an int >= 0"),
        (dict(conv_group_size=2.0), r"conv_group_size must be an int >= 0"),
        (dict(conv_group_size=48), r"conv_group_size 48 does not divide hidden 256"),
        (dict(vocab=None, mask_token_id=0), r"vocab must be set for DFlash-2"),
        (dict(selector_top_k=97), r"selector_top_k 97 exceeds vocab 96"),
        (dict(block_size=1), r"block_size must be >= 2 for DFlash-2"),
    ],
)
def test_config_refusals(changes, match):
    with pytest.raises(ConfigError, match=match):
        d2_cfg(**changes)


# ------------------------------------------------------------------------------- names, shapes, random weights


def test_expected_shapes_add_exactly_the_dflash2_tensors():
    cfg = d2_cfg()
    one = DraftConfig.toy(**{k: v for k, v in dataclasses.asdict(cfg).items() if k not in DFLASH2_FIELDS})
    added = {k: v for k, v in expected_shapes(cfg).items() if k not in expected_shapes(one)}
    want = {}
    for i in range(cfg.n_layer):
        for conv in ("attention_conv", "mlp_conv"):
            want[f"layers.{i}.{conv}.base_kernel"] = (2, 3, 256)
            want[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * 3 * 8, 256)
    want.update(
        {
            "candidate_selector.hidden_projection.weight": (32, 256),
            "candidate_selector.predecessor_codebook": (N_VOCAB, 32),
            "candidate_selector.successor_codebook": (N_VOCAB, 32),
        }
    )
    assert added == want == dflash2_shapes(cfg)
    assert set(expected_shapes(one)) <= set(expected_shapes(cfg))
    assert dflash2_shapes(one) == {}


def test_name_helpers_classify_the_dflash2_tensors():
    names = dflash2_shapes(d2_cfg())
    assert not any(is_norm(n) or is_fold_in_matrix(n) for n in names)
    assert all(is_dflash2_tensor(n) for n in names)
    assert {n for n in names if is_conv_base_kernel(n)} == {n for n in names if n.endswith("base_kernel")}
    assert {n for n in names if is_selector_codebook(n)} == set(SELECTOR_CODEBOOKS)
    # negative controls: DFlash-1's tensors are none of these
    one = expected_shapes(DraftConfig.toy())
    assert not any(is_dflash2_tensor(n) or is_conv_base_kernel(n) or is_selector_codebook(n) for n in one)


def test_random_weights_make_the_conv_and_the_selector_matter():
    cfg = d2_cfg(vocab=4000, conv_kernel_size=4, selector_rank=64)
    w = DraftWeights.random(cfg, seed=3)
    base = w["layers.0.attention_conv.base_kernel"]
    assert base[:, 0].min() >= 0.8 and base[:, 0].max() <= 1.2
    assert 0.15 < base[:, 1:].std() < 0.25
    proj = w["layers.1.mlp_conv.kernel_projection.weight"]
    assert proj.std() == pytest.approx(0.5 / np.sqrt(256), rel=0.05)
    book = w["candidate_selector.successor_codebook"]
    assert book.std() == pytest.approx(64**-0.25, rel=0.05)
    # an edge score term <A[p] * gamma, B[c]> with gamma from an RMS-1 row: O(1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((50, 256))
    gamma = x @ w["candidate_selector.hidden_projection.weight"].T
    edge = np.einsum("nr,nr,nr->n", w["candidate_selector.predecessor_codebook"][:50], gamma, book[50:100])
    assert 0.3 < edge.std() < 3.0
    # the DFlash-1 part is DFlash-1's random drafter, value for value
    plain = DraftWeights.random(DraftConfig.toy(vocab=4000), seed=3)
    for name in plain:
        np.testing.assert_array_equal(w[name], plain[name], err_msg=name)


def test_weights_refuse_missing_and_misshapen_dflash2_tensors():
    cfg = d2_cfg()
    tensors = dict(DraftWeights.random(cfg))
    with pytest.raises(WeightsError, match=r"missing tensor.*candidate_selector\.successor_codebook"):
        DraftWeights(cfg, {k: v for k, v in tensors.items() if k != "candidate_selector.successor_codebook"})
    bad = dict(tensors, **{"layers.1.mlp_conv.base_kernel": np.zeros((2, 4, 256), np.float32)})
    with pytest.raises(WeightsError, match=r"layers\.1\.mlp_conv\.base_kernel.*\(2, 4, 256\).*\(2, 3, 256\)"):
        DraftWeights(cfg, bad)


# ------------------------------------------------------------------------------- safetensors checkpoints


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_checkpoint_round_trip(dtype, tmp_path):
    w = DraftWeights.random(d2_cfg(), seed=4)
    w.save_pretrained(tmp_path, dtype=dtype)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["architectures"] == ["DFlash2DraftModel"]
    assert {k: hf["dflash_config"][k] for k in DFLASH2_FIELDS} == D2
    header, _ = S.read_safetensors_header(tmp_path / "model.safetensors")
    for name in SELECTOR_NAMES + tuple(f"layers.1.{n}" for n in D2_LAYER_NAMES):
        assert name in header, name  # the codebooks without `.weight`, as published
    r = load_checkpoint(tmp_path)
    assert r.cfg == w.cfg
    rounding = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[dtype]
    for name in w:
        np.testing.assert_array_equal(r[name], expected_rounding(w[name], rounding), err_msg=name)


def test_dflash1_checkpoint_is_unchanged(tmp_path):
    w = DraftWeights.random(DraftConfig.toy(vocab=N_VOCAB, mask_token_id=5), seed=4)
    w.save_pretrained(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["architectures"] == ["DFlashDraftModel"]
    assert not set(DFLASH2_FIELDS) & (set(hf) | set(hf["dflash_config"]))


def rewrite(ckpt: Path, tensors: dict | None = None, **config_changes) -> None:
    if tensors is not None:
        S.write_safetensors(ckpt / "model.safetensors", tensors)
    hf = json.loads((ckpt / "config.json").read_text())
    for key, value in config_changes.items():
        target = hf["dflash_config"] if key in DFLASH2_FIELDS and key in hf["dflash_config"] else hf
        if value is ...:
            target.pop(key)
        else:
            target[key] = value
    (ckpt / "config.json").write_text(json.dumps(hf))


@pytest.fixture
def d2_ckpt(tmp_path):
    w = DraftWeights.random(d2_cfg(), seed=5)
    w.save_pretrained(tmp_path / "ck")
    return w, tmp_path / "ck"


def test_checkpoint_spellings_upstream_accepts(d2_ckpt):
    """Codebooks spelled with `.weight` (what a state_dict holds), every name with a `model.`
    prefix, and the DFlash-2 values at the top level of config.json (dflash's _draft_value)."""
    w, ck = d2_ckpt
    tensors = {(k + ".weight" if k in SELECTOR_CODEBOOKS else k): v for k, v in w.items()}
    rewrite(ck, {"model." + k: v for k, v in tensors.items()})
    hf = json.loads((ck / "config.json").read_text())
    for k in DFLASH2_FIELDS:
        hf[k] = hf["dflash_config"].pop(k)
    (ck / "config.json").write_text(json.dumps(hf))
    r = load_checkpoint(ck)
    assert r.cfg == w.cfg
    for name in w:
        np.testing.assert_array_equal(r[name], w[name], err_msg=name)


@pytest.mark.parametrize(
    "edit, match",
    [
        (dict(drop="candidate_selector.successor_codebook"), r"missing tensor.*candidate_selector\.successor_codebook"),
        (
            dict(drop="layers.1.attention_conv.kernel_projection.weight"),
            r"missing tensor.*layers\.1\.attention_conv\.kernel_projection\.weight",
        ),
        (
            dict(shape=("layers.0.mlp_conv.base_kernel", (2, 2, 256))),
            r"'layers\.0\.mlp_conv\.base_kernel' has shape \(2, 2, 256\), config needs \(2, 3, 256\)",
        ),
        (
            dict(shape=("candidate_selector.hidden_projection.weight", (16, 256))),
            r"hidden_projection\.weight' has shape \(16, 256\), config needs \(32, 256\)",
        ),
        (dict(twice="candidate_selector.predecessor_codebook"), r"both 'candidate_selector\.predecessor_codebook'"),
        (dict(config=dict(conv_group_size=...)), r"DFlash-2 config without \['conv_group_size'\]"),
        (dict(config=dict(selector_top_k=0)), r"dflash_config\.selector_top_k must be > 0"),
        (dict(config=dict(conv_group_size=48)), r"conv_group_size 48 does not divide hidden 256"),
        (dict(config=dict(selector_top_k=500)), r"selector_top_k 500 exceeds vocab 96"),
        (dict(config=dict(vocab_size=...)), r"vocab must be set for DFlash-2"),
        (
            dict(config=dict(architectures=["DFlashDraftModel"])),
            r"DFlash-2 key\(s\) .* under architecture 'DFlashDraftModel'",
        ),
        (dict(config=dict(architectures=["DFlashDraftModel", "DFlash2DraftModel"])), "both DFlash-1 and DFlash-2"),
        (dict(config={k: ... for k in DFLASH2_FIELDS}), r"DFlash-2 config without \['conv_kernel_size'"),
        (
            dict(config=dict(architectures=["DFlashDraftModel"], **{k: ... for k in DFLASH2_FIELDS})),
            r"DFlash-2 tensor.*config\.json is DFlash-1",
        ),
    ],
)
def test_checkpoint_refusals(d2_ckpt, edit, match):
    w, ck = d2_ckpt
    load_checkpoint(ck)  # negative control: the unedited checkpoint loads
    tensors = dict(w.items())
    if "drop" in edit:
        del tensors[edit["drop"]]
    if "shape" in edit:
        name, shape = edit["shape"]
        tensors[name] = np.zeros(shape, np.float32)
    if "twice" in edit:
        tensors[edit["twice"] + ".weight"] = tensors[edit["twice"]]
    rewrite(ck, tensors, **edit.get("config", {}))
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(ck)


# ------------------------------------------------------------------------------- GGUF


def d2_type(name: str, dtype: str, cfg: DraftConfig) -> str:
    """The type our writer stores `name` in (docs/dflash2.md, "What we read and write")."""
    if is_conv_base_kernel(name):
        return "f32"
    if is_selector_codebook(name):
        return codebook_type(dtype, cfg.selector_rank)
    return matrix_type(name, dtype, cfg.n_layer)


@pytest.mark.parametrize("dtype", GGUF_DTYPES)
def test_gguf_round_trip(dtype, tmp_path, vocab_file):
    w = d2_weights()
    path = w.save_pretrained(tmp_path / "d.gguf", format="gguf", dtype=dtype, vocab_from=vocab_file)
    r = DraftWeights.from_pretrained(path)
    assert r.cfg == w.cfg
    types = {t.name: t.tensor_type.name.lower() for t in GGUFReader(path, "r").tensors}
    for name in list(dflash2_shapes(w.cfg)) + ["fc.weight", "layers.1.self_attn.v_proj.weight"]:
        kind = d2_type(name, dtype, w.cfg)
        np.testing.assert_array_equal(r[name], expected_rounding(w[name], kind), err_msg=name)
        if is_conv_base_kernel(name):
            assert name not in r.stored
        else:
            assert r.stored[name].type_name == kind, name
    assert types["blk.0.attn_conv_base"] == types["blk.1.ffn_conv_base"] == "f32"
    assert types["selector_predecessor.weight"] == codebook_type(dtype, 32)
    assert types["blk.1.ffn_conv_proj.weight"] == types["selector_hidden.weight"] == matrix_type("x", dtype, 2)


def test_gguf_names_keys_and_layouts(d2_file):
    w, path = d2_file
    kv = fields(path)
    assert {k: kv[f"dflash.{k}"] for k in DFLASH2_FIELDS} == D2
    reader = GGUFReader(path, "r")
    assert {f.name: f.types[0] for f in reader.fields.values() if f.name.split(".")[-1] in DFLASH2_FIELDS} == {
        f"dflash.{k}": T.UINT32 for k in DFLASH2_FIELDS
    }
    t = {t.name: t for t in reader.tensors}
    ne = {name: [int(n) for n in t[name].shape] for name in t}
    assert ne["blk.0.attn_conv_base"] == ne["blk.1.ffn_conv_base"] == [256, 3, 2]  # no `.weight` suffix
    assert ne["blk.1.attn_conv_proj.weight"] == ne["blk.0.ffn_conv_proj.weight"] == [256, 2 * 3 * 8]
    assert ne["selector_hidden.weight"] == [256, 32]
    assert ne["selector_predecessor.weight"] == ne["selector_successor.weight"] == [32, N_VOCAB]
    # the bytes are the (out, in) / (side, tap, channel) arrays, row-major: no transpose anywhere
    np.testing.assert_array_equal(np.asarray(t["blk.1.attn_conv_base"].data), w["layers.1.attention_conv.base_kernel"])
    np.testing.assert_array_equal(
        np.asarray(t["selector_successor.weight"].data), w["candidate_selector.successor_codebook"]
    )
    np.testing.assert_array_equal(
        np.asarray(t["blk.0.ffn_conv_proj.weight"].data), w["layers.0.mlp_conv.kernel_projection.weight"]
    )


def test_codebooks_fall_back_to_f16_where_q8_0_does_not_fit(tmp_path, vocab_file):
    w = d2_weights(d2_cfg(selector_rank=16))
    r = DraftWeights.from_pretrained(
        w.save_pretrained(tmp_path / "d.gguf", format="gguf", dtype="q8_0", vocab_from=vocab_file)
    )
    assert r.stored["candidate_selector.predecessor_codebook"].type_name == "f16"
    assert r.stored["candidate_selector.hidden_projection.weight"].type_name == "q8_0"
    assert codebook_type("q4_k", 32) == "q8_0" and codebook_type("bf16", 16) == "bf16"


def test_gguf_write_refusals(tmp_path, vocab_file):
    w = d2_weights(d2_cfg(selector_top_k=16))  # 16 + 16*16 = 272 > 256
    with pytest.raises(GGUFError, match=r"dflash\.selector_top_k = 16: the selector's lattice would not fit in n_embd"):
        w.save_pretrained(tmp_path / "a.gguf", format="gguf", vocab_from=vocab_file)
    assert not list(tmp_path.glob("a.gguf*"))
    # negative control: 15 + 15*15 = 240 fits
    d2_weights(d2_cfg(selector_top_k=15)).save_pretrained(tmp_path / "b.gguf", format="gguf", vocab_from=vocab_file)


DROP_ALL_D2_TENSORS = tuple(
    f"blk.{i}.{s}"
    for i in range(2)
    for s in ("attn_conv_base", "attn_conv_proj.weight", "ffn_conv_base", "ffn_conv_proj.weight")
) + ("selector_hidden.weight", "selector_predecessor.weight", "selector_successor.weight")

GGUF_REFUSALS = {
    "one key missing": (dict(drop_keys=("dflash.selector_rank",)), r"missing key 'dflash\.selector_rank'"),
    "key zero": (
        dict(set_keys={"dflash.conv_kernel_size": (0, T.UINT32)}),
        r"key 'dflash\.conv_kernel_size' = 0 must be > 0",
    ),
    "group does not divide": (
        dict(set_keys={"dflash.conv_group_size": (48, T.UINT32)}),
        r"'dflash\.conv_group_size' = 48 does not divide dflash\.embedding_length = 256",
    ),
    "lattice too wide": (
        dict(set_keys={"dflash.selector_top_k": (16, T.UINT32)}),
        r"'dflash\.selector_top_k' = 16: the selector's lattice would not fit in n_embd",
    ),
    "top-k beyond vocab": (
        dict(set_keys={"dflash.selector_top_k": (14, T.UINT32)}, vocab=12),
        r"'dflash\.selector_top_k' = 14 exceeds the vocabulary of 12",
    ),
    "keys without tensors": (
        dict(drop_tensors=DROP_ALL_D2_TENSORS),
        r"has the DFlash-2 keys .* but no DFlash-2 tensor",
    ),
    "tensors without keys": (
        dict(drop_keys=tuple(f"dflash.{k}" for k in DFLASH2_FIELDS)),
        r"tensor 'blk\.0\.attn_conv_base' is a DFlash-2 tensor .* none of the keys",
    ),
    "one tensor missing": (
        dict(drop_tensors=("blk.1.ffn_conv_proj.weight",)),
        r"missing DFlash-2 tensor 'blk\.1\.ffn_conv_proj\.weight'",
    ),
    "base kernel shape": (
        dict(replace={"blk.0.attn_conv_base": np.zeros((2, 4, 256), np.float32)}),
        r"'blk\.0\.attn_conv_base' has ne \{256, 4, 2\}, expected \{256, 3, 2\}",
    ),
    "projection shape": (
        dict(replace={"blk.1.ffn_conv_proj.weight": np.zeros((24, 256), np.float32)}),
        r"'blk\.1\.ffn_conv_proj\.weight' has ne \{256, 24\}, expected \{256, 48\}",
    ),
    "codebook rank": (
        dict(replace={"selector_successor.weight": np.zeros((N_VOCAB, 16), np.float32)}),
        r"'selector_successor\.weight' has ne \{16, 96\}, expected \{32, 96\}: its rank 16 differs "
        r"from dflash\.selector_rank = 32",
    ),
    "hidden projection rank": (
        dict(replace={"selector_hidden.weight": np.zeros((64, 256), np.float32)}),
        r"'selector_hidden\.weight' has ne \{256, 64\}.*rank 64 differs",
    ),
    "base kernel not f32": (
        dict(replace={"blk.1.ffn_conv_base": np.zeros((2, 3, 256), np.float16)}),
        r"'blk\.1\.ffn_conv_base' is F16: llama\.cpp adds the base kernel",
    ),
}


@pytest.mark.parametrize("case", list(GGUF_REFUSALS))
def test_gguf_read_refusals(case, tmp_path):
    edit, match = GGUF_REFUSALS[case]
    edit = dict(edit)
    vocab = edit.pop("vocab", N_VOCAB)
    cfg = d2_cfg(vocab=vocab, mask_token_id=3)
    src = DraftWeights.random(cfg).save_pretrained(
        tmp_path / "src.gguf", format="gguf", dtype="f32", vocab_from=write_vocab_gguf(tmp_path / "v.gguf", vocab)
    )
    replace = edit.pop("replace", {})
    # negative control: the copy without the edit loads (the copier itself breaks nothing)
    assert DraftWeights.from_pretrained(copy_gguf(src, tmp_path / "same.gguf")).cfg == cfg
    bad = copy_gguf(
        src,
        tmp_path / "bad.gguf",
        drop_tensors=tuple(replace) + edit.pop("drop_tensors", ()),
        add_tensors=replace,
        **edit,
    )
    with pytest.raises(GGUFError, match=match):
        DraftWeights.from_pretrained(bad)


def test_all_dflash2_keys_zero_is_dflash1(tmp_path, vocab_file):
    """A file with the four keys at 0 and no DFlash-2 tensor is what llama.cpp runs as DFlash-1."""
    one = d2_weights(d2_cfg(**{k: 0 for k in DFLASH2_FIELDS}))
    src = one.save_pretrained(tmp_path / "one.gguf", format="gguf", vocab_from=vocab_file)
    assert "dflash.conv_kernel_size" not in fields(src)
    zero = copy_gguf(src, tmp_path / "zero.gguf", set_keys={f"dflash.{k}": (0, T.UINT32) for k in DFLASH2_FIELDS})
    assert DraftWeights.from_pretrained(zero).cfg == one.cfg


# ------------------------------------------------------------------------------- llama.cpp's converter


@pytest.mark.slow  # llama.cpp
@pytest.mark.parametrize("outtype", ["f32", "f16"])
def test_llama_cpp_converts_our_checkpoint(outtype, tmp_path):
    """convert_hf_to_gguf.py (DFlashModel) turns the DFlash-2 checkpoint we write into a GGUF that
    reads back to our tensors: exactly for f32; for f16 with its types (base kernels F32, every
    other DFlash-2 tensor F16, the codebooks included)."""
    from tests.model.test_gguf_convert import N_VOCAB as TARGET_VOCAB
    from tests.model.test_gguf_convert import SRC, target_dir

    cfg = d2_cfg(vocab=TARGET_VOCAB, target_layer_ids=[1, 5, 9])
    draft = tmp_path / "draft"
    DraftWeights.random(cfg, seed=6).save_pretrained(draft, dtype="float32")
    out = tmp_path / "converted.gguf"
    proc = subprocess.run(
        [
            sys.executable,
            str(Path(SRC) / "convert_hf_to_gguf.py"),
            str(draft),
            "--target-model-dir",
            str(target_dir(tmp_path / "target")),
            "--outfile",
            str(out),
            "--outtype",
            outtype,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = load_checkpoint(draft)
    theirs = DraftWeights.from_pretrained(out)
    assert theirs.cfg == ours.cfg
    assert sorted(theirs) == sorted(ours)
    types = {t.name: t.tensor_type.name.lower() for t in GGUFReader(out, "r").tensors}
    for name in ours:
        kind = "f32" if outtype == "f32" or is_conv_base_kernel(name) or ours[name].ndim == 1 else "f16"
        np.testing.assert_array_equal(theirs[name], expected_rounding(ours[name], kind), err_msg=name)
    assert types["blk.0.attn_conv_base"] == types["blk.1.ffn_conv_base"] == "f32"
    want = outtype
    assert {
        types[n]
        for n in (
            "blk.0.attn_conv_proj.weight",
            "selector_hidden.weight",
            "selector_predecessor.weight",
            "selector_successor.weight",
        )
    } == {want}


# ------------------------------------------------------------------------------- llama.cpp's loader


@pytest.fixture(scope="module")
def llama_target():
    from pyggml_dkv.hosts.llama_cpp.native_dflash import llama_cpp_available

    if not llama_cpp_available():
        pytest.skip("llama-cpp-python is not installed (pip install pyggml_dkv[llama])")
    from pyggml_dkv.hosts.smollm2 import ModelUnavailableError, smollm2_gguf

    try:
        return smollm2_gguf()
    except ModelUnavailableError as e:
        pytest.skip(f"no target GGUF for the vocabulary: {e}")


def big_vocab_weights(seed: int = 0, **changes) -> DraftWeights:
    return d2_weights(d2_cfg(vocab=49152, mask_token_id=7, target_layer_ids=[1, 5, 9], **changes), seed=seed)


@pytest.mark.slow  # llama.cpp
@pytest.mark.parametrize("dtype", ["f16", "q4_k_m"])
def test_llama_cpp_loads_our_dflash2_gguf(dtype, tmp_path, llama_target):
    from pyggml_dkv.hosts.llama_cpp.native_dflash import llama_model_info

    w = big_vocab_weights()
    info = llama_model_info(w.save_pretrained(tmp_path / "d.gguf", format="gguf", dtype=dtype, vocab_from=llama_target))
    meta = info["meta"]
    assert {k: int(meta[f"dflash.{k}"]) for k in DFLASH2_FIELDS} == D2
    assert info["n_embd"] == 256 and info["n_vocab"] == 49152
    # every tensor of the file was created by llama.cpp's DFlash-2 loader (it also refuses unused ones)
    assert info["n_params"] == w.n_params + w.embed_tokens.size + w.lm_head.size


LLAMA_CPP_REFUSES = {
    "lattice too wide": (
        dict(set_keys={"dflash.selector_top_k": (16, T.UINT32)}),
        "too small for the selector lattice",
        "lattice would not fit",
    ),
    "group does not divide": (
        dict(set_keys={"dflash.conv_group_size": (48, T.UINT32)}),
        "divisible by conv_group_size",
        "does not divide",
    ),
    "tensors without keys": (
        dict(drop_keys=tuple(f"dflash.{k}" for k in DFLASH2_FIELDS)),
        "missing conv/selector metadata",
        "none of the keys",
    ),
    "codebook rank": (
        dict(
            drop_tensors=("selector_successor.weight",),
            add_tensors={"selector_successor.weight": np.zeros((49152, 16), np.float32)},
        ),
        "selector_successor.weight",
        "rank 16 differs",
    ),
}


@pytest.mark.slow  # llama.cpp
@pytest.mark.parametrize("case", list(LLAMA_CPP_REFUSES))
def test_llama_cpp_refuses_what_we_refuse(case, tmp_path, llama_target):
    from pyggml_dkv.hosts.llama_cpp.native_dflash import LlamaCppError, llama_model_info

    edit, theirs, ours = LLAMA_CPP_REFUSES[case]
    src = big_vocab_weights().save_pretrained(tmp_path / "d.gguf", format="gguf", dtype="f16", vocab_from=llama_target)
    bad = copy_gguf(src, tmp_path / "bad.gguf", **edit)
    with pytest.raises(LlamaCppError, match=theirs):
        llama_model_info(bad)
    with pytest.raises(GGUFError, match=ours):
        DraftWeights.from_pretrained(bad)


@pytest.mark.slow  # llama.cpp
def test_llama_cpp_runs_keys_without_tensors_as_dflash1(tmp_path, llama_target):
    """Where we are stricter: llama.cpp loads a file with the DFlash-2 keys and no DFlash-2 tensor
    (its graph is then DFlash-1's, while its draft loop would read a selector lattice because
    selector_top_k > 0); we refuse it."""
    from pyggml_dkv.hosts.llama_cpp.native_dflash import llama_model_info

    src = big_vocab_weights().save_pretrained(tmp_path / "d.gguf", format="gguf", dtype="f16", vocab_from=llama_target)
    bad = copy_gguf(src, tmp_path / "bad.gguf", drop_tensors=DROP_ALL_D2_TENSORS)
    assert int(llama_model_info(bad)["meta"]["dflash.selector_top_k"]) == 4
    with pytest.raises(GGUFError, match="no DFlash-2 tensor"):
        DraftWeights.from_pretrained(bad)


# ------------------------------------------------------------------------------- llama.cpp's DFlash-2 graph


@pytest.mark.slow  # llama.cpp
@pytest.mark.parametrize(
    "changes, swa",
    [
        (dict(), "seed"),
        (dict(layer_types=["sliding", "full"], swa_window=6), "llama"),
    ],
)
def test_llama_cpp_dflash2_logits_match_the_reference(changes, swa, tmp_path, llama_target):
    """llama.cpp's own DFlash-2 graph (src/models/dflash.cpp) on the f32 GGUF we write computes the
    numpy reference's logits: the convolutions, the in-graph logit scale and soft cap, and on a
    sliding layer narrower than the block the window flavour swa="llama". Negative controls: the
    same weights as a DFlash-1 drafter, and the dflash package's window flavour, are far off."""
    from pyggml_dkv import reference as R
    from pyggml_dkv.common.numeric import relative_error
    from pyggml_dkv.hosts.llama_cpp.native_dflash import llama_dflash_trajectory

    w = big_vocab_weights(seed=1, output_multiplier=0.8, final_logit_softcapping=5.0, **changes)
    cfg = w.cfg
    path = w.save_pretrained(tmp_path / "d.gguf", format="gguf", dtype="f32", vocab_from=llama_target)
    rng = np.random.default_rng(2)
    commits, cap = [5, 9, 20, 14], 80
    feats = rng.standard_normal((max(commits) + 1, cfg.fc_in)).astype(np.float32)
    tokens = np.full((len(commits), cfg.block_size), cfg.mask_token_id, dtype=np.int32)
    tokens[:, 0] = rng.integers(0, cfg.vocab, size=len(commits))
    theirs = llama_dflash_trajectory(path, feats, commits, tokens, cap)

    plain = cfg.replace(**{k: 0 for k in DFLASH2_FIELDS})
    w1 = DraftWeights(plain, {k: v for k, v in w.items() if not is_dflash2_tensor(k)})
    for k, committed in enumerate(commits):
        noise = w.embed_tokens[tokens[k]]
        want = R.reference_step(w, feats, committed, cap, noise, lm_head=w.lm_head, swa=swa)
        # measured 3e-4 .. 5e-4 (llama.cpp keeps its K/V cache in f16)
        assert relative_error(theirs[k], want) < 2e-3, committed
        as_dflash1 = R.reference_step(w1, feats, committed, cap, noise, lm_head=w.lm_head, swa=swa)
        assert relative_error(theirs[k], as_dflash1) > 0.1
        if cfg.any_swa:
            per_row = R.reference_step(w, feats, committed, cap, noise, lm_head=w.lm_head, swa="per_row")
            assert relative_error(theirs[k], per_row) > 0.1
