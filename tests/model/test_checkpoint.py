"""Checkpoint I/O (pyggml_dkv.model.checkpoint): dflash's config.json + safetensors, without torch."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest

from pyggml_dkv import reference as R
from pyggml_dkv.common.bf16 import from_bf16_bits, to_bf16_bits
from pyggml_dkv.model import hf_config as H
from pyggml_dkv.model import safetensors_io as S
from pyggml_dkv.model.config import DraftConfig
from pyggml_dkv.model.errors import CheckpointError, CheckpointNotFoundError
from pyggml_dkv.model.tensor_names import expected_shapes
from pyggml_dkv.model.weights import DraftWeights, load_checkpoint, save_checkpoint

SMALL = dict(hidden=32, n_layer=2, n_head=4, n_head_kv=2, head_dim=8, ffn=48, block_size=4, n_target_layers=3)


def small_cfg(**changes) -> DraftConfig:
    base = dict(SMALL, target_layer_ids=[2, 5, 9], mask_token_id=7, vocab=100)
    base.update(changes)
    return DraftConfig(**base)


def assert_same(a: DraftWeights, b: DraftWeights) -> None:
    assert a.cfg == b.cfg
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype == np.float32
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
        assert a[name].tobytes() == b[name].tobytes(), name  # bit-exact, signed zeros included


def raw_safetensors(path: Path, entries: list[tuple[str, str, list[int], bytes]], pad: bool = True) -> None:
    """Hand-made safetensors file: (name, dtype tag, shape, raw little-endian bytes)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset, blobs = 0, []
    for name, tag, shape, blob in entries:
        header[name] = {"dtype": tag, "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    raw = json.dumps(header).encode()
    if pad:
        raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def rewrite_config(ckpt: Path, **changes) -> None:
    hf = json.loads((ckpt / "config.json").read_text())
    for key, value in changes.items():
        if value is ...:
            hf.pop(key, None)
        else:
            hf[key] = value
    (ckpt / "config.json").write_text(json.dumps(hf))


def rewrite_tensors(ckpt: Path, tensors: dict, dtype: str = "float32") -> None:
    S.write_safetensors(ckpt / "model.safetensors", tensors, dtype)


@pytest.fixture
def ckpt(tmp_path) -> Path:
    w = DraftWeights.random(small_cfg(), seed=11)
    save_checkpoint(w, tmp_path / "ck")
    return tmp_path / "ck"


# ------------------------------------------------------------------------------- round trips


ROUND_TRIP_CFGS = {
    "plain": dict(),
    "sliding+yarn": dict(
        layer_types=["sliding", "full"],
        swa_window=5,
        freq_scale=0.25,
        ext_factor=1.0,
        n_ctx_orig=4096,
        beta_fast=16.0,
        beta_slow=2.0,
        rope_theta=1e6,
    ),
    "linear+logits": dict(
        freq_scale=0.5,
        output_multiplier=0.25,
        final_logit_softcapping=30.0,
        input_embedding_scale=3.0,
        rms_eps=1e-5,
        block_size=16,
    ),
    "no-vocab": dict(vocab=None, mask_token_id=123456),
}


@pytest.mark.parametrize("name", list(ROUND_TRIP_CFGS))
def test_round_trip_f32_is_bit_exact(tmp_path, name):
    w = DraftWeights.random(small_cfg(**ROUND_TRIP_CFGS[name]), seed=1)
    w.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert_same(w, DraftWeights.from_pretrained(tmp_path))
    header, meta = S.read_safetensors_header(tmp_path / "model.safetensors")
    assert meta == {"format": "pt"}
    assert {v["dtype"] for v in header.values()} == {"F32"}


def test_round_trip_yarn_attention_factor(tmp_path):
    w = DraftWeights.random(small_cfg(freq_scale=0.125, ext_factor=1.0, n_ctx_orig=2048, attn_factor=0.8), seed=2)
    w.save_pretrained(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["rope_parameters"]["attention_factor"] == pytest.approx(0.8 * (1 + 0.1 * math.log(8.0)))
    back = DraftWeights.from_pretrained(tmp_path)
    assert back.cfg.attn_factor == pytest.approx(0.8, rel=1e-15)
    assert back.cfg.replace(attn_factor=0.8) == w.cfg


@pytest.mark.parametrize("dtype, tag", [("bfloat16", "BF16"), ("float16", "F16"), ("bf16", "BF16"), ("f16", "F16")])
def test_round_trip_low_precision_is_exact_for_representable_values(tmp_path, dtype, tag):
    w = DraftWeights.random(small_cfg(), seed=4)
    if tag == "BF16":
        rounded = {k: from_bf16_bits(to_bf16_bits(v)) for k, v in w.items()}
    else:
        rounded = {k: v.astype(np.float16).astype(np.float32) for k, v in w.items()}
    w = DraftWeights(w.cfg, rounded)
    w.save_pretrained(tmp_path, dtype=dtype)
    header, _ = S.read_safetensors_header(tmp_path / "model.safetensors")
    assert {v["dtype"] for v in header.values()} == {tag}
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == {"BF16": "bfloat16", "F16": "float16"}[tag]
    assert_same(w, DraftWeights.from_pretrained(tmp_path))
    size = (tmp_path / "model.safetensors").stat().st_size
    assert size < 2.1 * w.n_params + 4096  # really 2 bytes a value


def test_bf16_save_rounds_to_nearest_even(tmp_path):
    x = np.array(
        [1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -(1 + 2**-8 + 2**-20), -0.0, 2**-130], dtype=np.float32
    )
    want = np.array([1.0, 1.0, 1 + 2**-6, 1 + 2**-7, -(1 + 2**-7), -0.0, 2**-130], dtype=np.float32)
    got = from_bf16_bits(to_bf16_bits(x))
    assert got.tobytes() == want.tobytes()  # ties to even, signed zero and subnormals kept
    y = np.array([3.0e38, -123.456, 7e-3, 1.5e-38], dtype=np.float32)
    got = from_bf16_bits(to_bf16_bits(y))
    assert np.all(np.abs(got - y) <= np.abs(y) * 2**-8) and np.all(np.isfinite(got))
    # saving unrounded f32 weights as bf16 stores exactly these roundings
    w = DraftWeights.random(small_cfg(), seed=5)
    w.save_pretrained(tmp_path, dtype="bfloat16")
    back = DraftWeights.from_pretrained(tmp_path)
    for name in w:
        np.testing.assert_array_equal(back[name], from_bf16_bits(to_bf16_bits(w[name])), err_msg=name)
        assert np.abs(back[name] - w[name]).max() <= np.abs(w[name]).max() * 2**-8


def test_bf16_bits_nan_and_inf():
    x = np.array([np.inf, -np.inf, np.nan], dtype=np.float32)
    got = from_bf16_bits(to_bf16_bits(x))
    assert got[0] == np.inf and got[1] == -np.inf and np.isnan(got[2])


# ------------------------------------------------------------------------------- safetensors parsing


def test_reads_handmade_bf16_f16_f32_file(tmp_path):
    bf16_vals = np.array([[1.0, -2.5, 0.15625], [3.0e38, -1e-39, 0.0]], dtype=np.float32)  # bf16-exact? rounded below
    bf16_bits = to_bf16_bits(bf16_vals)
    want_bf16 = (bf16_bits.astype(np.uint32) << 16).view(np.float32)
    f16 = np.array([0.5, -65504.0, 6.1e-5], dtype=np.float16)
    f32 = np.array([np.pi, -1e-45, 1e38], dtype=np.float32)
    path = tmp_path / "x.safetensors"
    raw_safetensors(
        path,
        [
            ("b", "BF16", [2, 3], bf16_bits.astype("<u2").tobytes()),
            ("h", "F16", [3], f16.astype("<f2").tobytes()),
            ("f", "F32", [1, 3], f32.astype("<f4").tobytes()),
            ("empty", "F32", [0, 4], b""),
        ],
        pad=False,
    )
    got = S.read_safetensors(path)
    assert set(got) == {"b", "h", "f", "empty"}
    np.testing.assert_array_equal(got["b"], want_bf16)
    assert got["b"][0].tolist() == [1.0, -2.5, 0.15625]
    np.testing.assert_array_equal(got["h"], f16.astype(np.float32))
    np.testing.assert_array_equal(got["f"], f32[None])
    assert got["empty"].shape == (0, 4)
    assert all(v.dtype == np.float32 for v in got.values())


def test_bf16_checkpoint_written_by_hand_loads(tmp_path):
    """A bf16 checkpoint whose file we did not write ourselves (header unpadded, names unsorted)."""
    w = DraftWeights.random(small_cfg(), seed=6)
    save_checkpoint(w, tmp_path)
    entries = [
        (n, "BF16", list(a.shape), to_bf16_bits(a).astype("<u2").tobytes()) for n, a in reversed(list(w.items()))
    ]
    raw_safetensors(tmp_path / "model.safetensors", entries, pad=False)
    back = load_checkpoint(tmp_path)
    for name in w:
        np.testing.assert_array_equal(back[name], from_bf16_bits(to_bf16_bits(w[name])))


def test_safetensors_package_interoperates(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((3, 5)).astype(np.float32), "b": rng.standard_normal(7).astype(np.float16)}
    st.save_file(tensors, str(tmp_path / "theirs.safetensors"))
    got = S.read_safetensors(tmp_path / "theirs.safetensors")
    np.testing.assert_array_equal(got["a"], tensors["a"])
    np.testing.assert_array_equal(got["b"], tensors["b"].astype(np.float32))
    for dtype, np_dtype in (("float32", np.float32), ("float16", np.float16)):
        S.write_safetensors(tmp_path / "ours.safetensors", tensors, dtype)
        theirs = st.load_file(str(tmp_path / "ours.safetensors"))
        assert set(theirs) == {"a", "b"}
        for k in tensors:
            assert theirs[k].dtype == np_dtype
            np.testing.assert_array_equal(theirs[k], tensors[k].astype(np_dtype))


@pytest.mark.parametrize("tag", ["F64", "I32", "F8_E4M3", "U8"])
def test_unsupported_dtype_is_refused_naming_tensor(tmp_path, tag):
    path = tmp_path / "x.safetensors"
    itemsize = {"F64": 8, "I32": 4, "F8_E4M3": 1, "U8": 1}[tag]
    raw_safetensors(path, [("ok", "F32", [2], b"\0" * 8), ("layers.0.bad", tag, [2], b"\0" * 2 * itemsize)])
    with pytest.raises(CheckpointError, match=rf"layers\.0\.bad.*{tag}"):
        S.read_safetensors(path)


def test_unsupported_dtype_in_checkpoint(ckpt):
    from safetensors.numpy import save_file

    tensors = dict(load_checkpoint(ckpt).items())
    tensors["norm.weight"] = np.ones(32, dtype=np.float64)
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'norm\.weight' has dtype F64"):
        load_checkpoint(ckpt)


@pytest.mark.parametrize(
    "corruption, match",
    [
        ("short", "not a valid safetensors file.*header too small"),
        ("huge_header", "not a valid safetensors file.*invalid header length"),
        ("not_json", "not a valid safetensors file.*invalid JSON"),
        ("bad_size", r"not a valid safetensors file.*invalid shape, data type, or offset"),
        ("out_of_file", "not a valid safetensors file.*not fully covered"),
        ("overlap", "not a valid safetensors file.*invalid offset for tensor `b`"),
        ("unknown_dtype", "not a valid safetensors file.*Q4_K"),
        ("duplicate", "duplicate key 'a'"),
    ],
)
def test_corrupt_safetensors_is_refused(tmp_path, corruption, match):
    path = tmp_path / "x.safetensors"
    good = np.ones(4, np.float32).tobytes()
    if corruption == "short":
        path.write_bytes(b"\1\0\0")
    elif corruption == "huge_header":
        path.write_bytes(struct.pack("<Q", 10**6) + b"{}")
    elif corruption == "not_json":
        path.write_bytes(struct.pack("<Q", 4) + b"{x: " + good)
    elif corruption == "bad_size":
        hdr = json.dumps(
            {
                "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "b": {"dtype": "F16", "shape": [8], "data_offsets": [16, 24]},
            }
        ).encode()
        path.write_bytes(struct.pack("<Q", len(hdr)) + hdr + good + good)
    elif corruption == "out_of_file":
        hdr = json.dumps({"a": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}).encode()
        path.write_bytes(struct.pack("<Q", len(hdr)) + hdr + good)
    elif corruption == "overlap":
        hdr = json.dumps(
            {
                "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
            }
        ).encode()
        path.write_bytes(struct.pack("<Q", len(hdr)) + hdr + good)
    elif corruption == "unknown_dtype":
        raw_safetensors(path, [("a", "Q4_K", [4], good)])
    elif corruption == "duplicate":
        hdr = (
            b'{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},'
            b' "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}'
        )
        path.write_bytes(struct.pack("<Q", len(hdr)) + hdr + good)
    with pytest.raises(CheckpointError, match=match):
        S.read_safetensors(path)


# ------------------------------------------------------------------------------- sharded checkpoints


def write_sharded(root: Path, w: DraftWeights, prefix: str = "") -> None:
    save_checkpoint(w, root)
    (root / "model.safetensors").unlink()
    names = sorted(w)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for shard, shard_names in shards.items():
        S.write_safetensors(
            root / shard, {prefix + n: w[n] for n in shard_names}, "bfloat16" if "1-of" in shard else "float32"
        )
        weight_map.update({prefix + n: shard for n in shard_names})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))


def test_sharded_index_loads(tmp_path):
    w = DraftWeights.random(small_cfg(), seed=8)
    write_sharded(tmp_path, w)
    back = load_checkpoint(tmp_path)
    names = sorted(w)
    for i, name in enumerate(names):
        want = from_bf16_bits(to_bf16_bits(w[name])) if i < len(names) // 2 else w[name]
        np.testing.assert_array_equal(back[name], want, err_msg=name)
    assert back.cfg == w.cfg


def test_sharded_index_refusals(tmp_path):
    w = DraftWeights.random(small_cfg(), seed=8)
    write_sharded(tmp_path, w)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())

    bad = dict(index, weight_map=dict(index["weight_map"], **{"norm.weight": "model-00009-of-00009.safetensors"}))
    index_path.write_text(json.dumps(bad))
    with pytest.raises(CheckpointNotFoundError, match="model-00009-of-00009.safetensors"):
        load_checkpoint(tmp_path)

    moved = dict(index["weight_map"])
    name = next(n for n, s in moved.items() if s.startswith("model-00001"))
    moved[name] = "model-00002-of-00002.safetensors"  # listed in the wrong shard
    index_path.write_text(json.dumps(dict(index, weight_map=moved)))
    with pytest.raises(CheckpointError, match=rf"{name}.*not in this shard|{name}.*not listed"):
        load_checkpoint(tmp_path)

    dropped = {n: s for n, s in index["weight_map"].items() if n != "norm.weight"}
    index_path.write_text(json.dumps(dict(index, weight_map=dropped)))
    with pytest.raises(CheckpointError, match=r"norm\.weight.*not listed"):
        load_checkpoint(tmp_path)

    index_path.write_text(json.dumps(dict(index, weight_map={"fc.weight": "../evil.safetensors"})))
    with pytest.raises(CheckpointError, match="bad shard file name"):
        load_checkpoint(tmp_path)


def test_model_prefix_is_stripped(tmp_path):
    w = DraftWeights.random(small_cfg(), seed=9)
    save_checkpoint(w, tmp_path)
    rewrite_tensors(tmp_path, {"model." + k: v for k, v in w.items()})
    assert_same(w, load_checkpoint(tmp_path))
    write_sharded(tmp_path / "sharded", w, prefix="model.")
    assert load_checkpoint(tmp_path / "sharded").cfg == w.cfg


def test_single_file_wins_over_index(tmp_path):
    w = DraftWeights.random(small_cfg(), seed=10)
    write_sharded(tmp_path, w)
    save_checkpoint(w, tmp_path)  # now both exist; transformers also prefers model.safetensors
    assert_same(w, load_checkpoint(tmp_path))


# ------------------------------------------------------------------------------- config.json mapping

# What dflash 0.1.0's DFlashDraftModel.save_pretrained writes with transformers 5.15
DFLASH_SAVED_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": None,
    "dflash_config": {"block_size": 8, "mask_token_id": 999, "target_layer_ids": [1, 3, 5]},
    "dtype": "float32",
    "eos_token_id": None,
    "head_dim": 32,
    "hidden_act": "silu",
    "hidden_size": 128,
    "initializer_range": 0.02,
    "intermediate_size": 256,
    "layer_types": ["full_attention", "full_attention"],
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "num_target_layers": 8,
    "pad_token_id": None,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "sliding_window": None,
    "tie_word_embeddings": False,
    "transformers_version": "5.15.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 1000,
}

# A published-style Qwen3 drafter config of the transformers 4.x era: block_size at the top level,
# rope_theta + rope_scaling, no layer_types.
LEGACY_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "block_size": 16,
    "bos_token_id": 151643,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2560,
    "initializer_range": 0.02,
    "intermediate_size": 9728,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "num_target_layers": 36,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_dflash_saved_config_maps():
    cfg = H.config_from_hf(DFLASH_SAVED_CONFIG)
    assert cfg == DraftConfig(
        hidden=128,
        n_layer=2,
        n_head=4,
        n_head_kv=2,
        head_dim=32,
        ffn=256,
        block_size=8,
        n_target_layers=3,
        rms_eps=1e-6,
        rope_theta=10000.0,
        mask_token_id=999,
        vocab=1000,
        target_layer_ids=[1, 3, 5],
    )


def test_legacy_config_maps():
    cfg = H.config_from_hf(LEGACY_CONFIG)
    assert (cfg.hidden, cfg.n_layer, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.ffn) == (2560, 5, 32, 8, 128, 9728)
    assert (cfg.block_size, cfg.n_target_layers, cfg.target_layer_ids) == (16, 5, [1, 9, 17, 25, 33])
    assert (cfg.rope_theta, cfg.freq_scale, cfg.ext_factor, cfg.attn_factor) == (1e6, 1.0, 0.0, 1.0)
    assert cfg.layer_types == ["full"] * 5 and cfg.swa_window == 0
    assert (cfg.mask_token_id, cfg.vocab) == (151669, 151936)


def test_config_to_hf_mirrors_dflash_keys():
    hf = H.config_to_hf(H.config_from_hf(DFLASH_SAVED_CONFIG))
    # every key dflash writes, except transformers' own version stamp; plus block_size at the top
    assert set(hf) == set(DFLASH_SAVED_CONFIG) - {"transformers_version"} | {"block_size"}
    for key in set(hf) - {"num_target_layers", "block_size"}:
        assert hf[key] == DFLASH_SAVED_CONFIG[key], key
    assert H.config_from_hf(hf) == H.config_from_hf(DFLASH_SAVED_CONFIG)


def test_dflash_config_takes_precedence_and_defaults():
    hf = dict(DFLASH_SAVED_CONFIG, block_size=4, mask_token_id=1, output_multiplier=2.0)
    cfg = H.config_from_hf(hf)
    assert (cfg.block_size, cfg.mask_token_id, cfg.output_multiplier) == (8, 999, 2.0)  # top level as fallback
    dc = {"mask_token_id": 3, "target_layer_ids": [0, 1]}
    cfg = H.config_from_hf(dict(DFLASH_SAVED_CONFIG, dflash_config=dc))
    assert cfg.block_size == 16 and cfg.n_target_layers == 2  # dflash's default block size
    # no target_layer_ids: dflash's build_target_layer_ids(num_target_layers, num_hidden_layers)
    cfg = H.config_from_hf(dict(DFLASH_SAVED_CONFIG, dflash_config={"mask_token_id": 3}, num_target_layers=36))
    assert cfg.target_layer_ids == [1, 33] and cfg.n_target_layers == 2
    assert H.build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    # absent rope entirely: transformers' default theta
    hf = {k: v for k, v in DFLASH_SAVED_CONFIG.items() if k != "rope_parameters"}
    assert H.config_from_hf(hf).rope_theta == 10000.0
    # rope_parameters' own theta wins over a top-level one
    assert H.config_from_hf(dict(DFLASH_SAVED_CONFIG, rope_theta=5.0)).rope_theta == 10000.0
    # softcap 0 / null mean none, as in dflash's compute_logits
    for cap in (0, None):
        hf = dict(
            DFLASH_SAVED_CONFIG, dflash_config=dict(DFLASH_SAVED_CONFIG["dflash_config"], final_logit_softcapping=cap)
        )
        assert H.config_from_hf(hf).final_logit_softcapping is None


def test_sliding_layers_mapping():
    hf = dict(
        DFLASH_SAVED_CONFIG,
        use_sliding_window=True,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
    )
    cfg = H.config_from_hf(hf)
    assert cfg.layer_types == ["sliding", "full"] and cfg.swa_window == 6
    # layer_types absent: Qwen3Config derives them from max_window_layers
    hf = {k: v for k, v in hf.items() if k != "layer_types"}
    assert H.config_from_hf(dict(hf, max_window_layers=1)).layer_types == ["full", "sliding"]
    assert H.config_from_hf(dict(hf, max_window_layers=28)).layer_types == ["full", "full"]
    # use_sliding_window false discards the window, as Qwen3Config does
    cfg = H.config_from_hf(dict(hf, use_sliding_window=False, max_window_layers=0))
    assert cfg.layer_types == ["full", "full"] and cfg.swa_window == 0


def hf_yarn(
    theta, dim, factor, orig, beta_fast=32, beta_slow=1, attention_factor=None, mscale=None, mscale_all_dim=None
):
    """transformers' `_compute_yarn_parameters`, restated in numpy: (inv_freq, attention_factor)."""

    def get_mscale(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        attention_factor = (
            get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
            if mscale and mscale_all_dim
            else get_mscale(factor)
        )

    def corr(n_rot):
        return dim * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    extrap = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    e = 1 - ramp
    return (extrap / factor) * (1 - e) + extrap * e, attention_factor


@pytest.mark.parametrize(
    "rope, kw",
    [
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}, {}),
        (
            {
                "type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 2048,
                "beta_fast": 16,
                "beta_slow": 2,
                "attention_factor": 0.8,
            },
            dict(beta_fast=16, beta_slow=2, attention_factor=0.8),
        ),
        (
            {
                "rope_type": "yarn",
                "factor": 16.0,
                "original_max_position_embeddings": 1024,
                "mscale": 0.707,
                "mscale_all_dim": 1.0,
            },
            dict(mscale=0.707, mscale_all_dim=1.0),
        ),
        ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8192, "truncate": True}, {}),
    ],
)
def test_yarn_mapping_matches_transformers_formula(rope, kw):
    theta = 1e6
    hf = dict(DFLASH_SAVED_CONFIG, rope_parameters=dict(rope, rope_theta=theta))
    cfg = H.config_from_hf(hf)
    factor, orig = rope["factor"], rope["original_max_position_embeddings"]
    assert cfg.freq_scale == 1 / factor and cfg.ext_factor == 1.0 and cfg.n_ctx_orig == orig
    assert (cfg.beta_fast, cfg.beta_slow) == (kw.get("beta_fast", 32), kw.get("beta_slow", 1))
    if not {"attention_factor", "mscale"} & set(kw):
        assert cfg.attn_factor == 1.0  # exactly: HF's default magnitude is what ggml adds itself
    inv_freq, attention = hf_yarn(theta, cfg.head_dim, factor, orig, **kw)
    pos = np.array([0, 1, 7, 100, 5000, 70000])
    angles, mscale = R.rope_angles(pos, cfg)
    np.testing.assert_allclose(angles, pos[:, None] * inv_freq[None, :], rtol=1e-12, atol=1e-9)
    assert mscale == pytest.approx(attention, rel=1e-6)  # ggml evaluates its part in float32


def test_rope_variants_mapping():
    base = {k: v for k, v in DFLASH_SAVED_CONFIG.items() if k != "rope_parameters"}
    # 4.x style: rope_theta + rope_scaling (rope_scaling wins over rope_parameters, like transformers)
    cfg = H.config_from_hf(
        dict(
            base,
            rope_theta=5e5,
            rope_scaling={"type": "yarn", "factor": 4.0},
            rope_parameters={"rope_type": "default"},
            max_position_embeddings=65536,
        )
    )
    assert (cfg.rope_theta, cfg.freq_scale, cfg.n_ctx_orig) == (5e5, 0.25, 65536)  # orig <- max_position_embeddings
    cfg = H.config_from_hf(
        dict(base, rope_scaling={"rope_type": "yarn", "factor": 4.0}, original_max_position_embeddings=1000)
    )
    assert cfg.n_ctx_orig == 1000  # a top-level original_max_position_embeddings wins
    cfg = H.config_from_hf(
        dict(
            base,
            rope_scaling={"rope_type": "yarn", "original_max_position_embeddings": 4096},
            max_position_embeddings=32768,
        )
    )
    assert cfg.freq_scale == 1 / 8  # factor from max_position_embeddings / original
    cfg = H.config_from_hf(dict(base, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}))
    assert (cfg.freq_scale, cfg.ext_factor, cfg.attn_factor) == (0.5, 0.0, 1.0)
    same = {"rope_type": "default", "rope_theta": 123.0}
    cfg = H.config_from_hf(dict(base, rope_parameters={"full_attention": same, "sliding_attention": same}))
    assert cfg.rope_theta == 123.0


# ------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "unsupported rope type 'dynamic'"),
        (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0}), "unsupported rope type 'llama3'"),
        (dict(rope_scaling={"type": "longrope", "short_factor": [1]}), "unsupported rope type 'longrope'"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "truncate": False}), "truncate=false"),
        (
            dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
            "partial_rotary_factor",
        ),
        (dict(partial_rotary_factor=0.25), "partial_rotary_factor"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "low_freq_factor": 1}), "low_freq_factor"),
        (
            dict(
                rope_parameters={
                    "full_attention": {"rope_type": "default", "rope_theta": 1.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 2.0},
                }
            ),
            "per-layer-type rope",
        ),
        (dict(architectures=["DFlash2DraftModel"]), r"DFlash-2 config without \['conv_kernel_size'"),
        (dict(architectures=["Qwen3ForCausalLM"]), "unsupported architecture"),
        (
            dict(dflash_config={"mask_token_id": 1, "target_layer_ids": [0], "conv_kernel_size": 4}),
            r"DFlash-2 key\(s\) \['conv_kernel_size'\] under architecture 'DFlashDraftModel'",
        ),
        (dict(selector_rank=8), r"DFlash-2 key\(s\) \['selector_rank'\] under architecture"),
        (dict(dflash_config={"mask_token_id": 1, "target_layer_ids": [0], "frobnicate": 1}), "frobnicate"),
        (
            dict(dflash_config={"mask_token_id": 1, "target_layer_ids": [0], "attention_mode": "mla"}),
            "attention_mode 'mla'",
        ),
        (dict(dflash_config={"mask_token_id": 1, "target_layer_ids": [0], "causal": True}), "causal=true"),
        (dict(frobnicate=1), r"unsupported config.json key\(s\) \['frobnicate'\]"),
        (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(is_causal=True), "is_causal"),
        (dict(layer_types=["sliding_attention", "full_attention"]), "without a sliding window"),
        (dict(layer_types=["chunked_attention", "full_attention"]), "chunked_attention"),
        (dict(layer_types=["full_attention"]), "layer_types must list 2"),
        (dict(dflash_config={"target_layer_ids": [0]}), "mask_token_id"),
        (
            dict(dflash_config={"mask_token_id": 1}, num_target_layers=...),
            "neither target_layer_ids nor num_target_layers",
        ),
        (dict(hidden_size=128.5), "hidden_size must be an integer"),
        (dict(num_attention_heads=3), "multiple of n_head_kv"),
        (dict(dflash_config={"mask_token_id": 5000, "target_layer_ids": [0]}), "mask_token_id 5000 outside vocab"),
    ],
)
def test_config_refusals(tmp_path, changes, match):
    hf = dict(DFLASH_SAVED_CONFIG)
    for key, value in changes.items():
        if value is ...:
            hf.pop(key, None)
        else:
            hf[key] = value
    with pytest.raises(CheckpointError, match=match):
        H.config_from_hf(hf)
    # and through load_checkpoint, naming config.json
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(tmp_path)


def test_extra_tensor_is_refused(ckpt):
    tensors = dict(load_checkpoint(ckpt).items())
    rewrite_tensors(ckpt, dict(tensors, **{"lm_head.weight": np.zeros((100, 32), np.float32)}))
    with pytest.raises(CheckpointError, match=r"lm_head\.weight"):
        load_checkpoint(ckpt)


@pytest.mark.parametrize(
    "extra, match",
    [
        ("layers.0.attention_conv.base_kernel", r"DFlash-2 tensor.*base_kernel.*config\.json is DFlash-1"),
        ("layers.1.mlp_conv.kernel_projection.weight", r"DFlash-2 tensor.*kernel_projection.*config\.json is DFlash-1"),
        ("candidate_selector.predecessor_codebook", r"DFlash-2 tensor.*predecessor_codebook.*config\.json is DFlash-1"),
        ("layers.0.self_attn.q_proj.bias", r"bias tensor.*q_proj\.bias"),
        ("rotary_emb.inv_freq", r"rotary_emb\.inv_freq"),
    ],
)
def test_unrunnable_tensors_are_refused(ckpt, extra, match):
    tensors = dict(load_checkpoint(ckpt).items())
    rewrite_tensors(ckpt, dict(tensors, **{extra: np.zeros(4, np.float32)}))
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(ckpt)


def test_missing_tensor_is_refused(ckpt):
    tensors = dict(load_checkpoint(ckpt).items())
    del tensors["layers.1.mlp.up_proj.weight"]
    rewrite_tensors(ckpt, tensors)
    with pytest.raises(CheckpointError, match=r"missing tensor.*layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(ckpt)


def test_wrong_shape_is_refused(ckpt):
    tensors = dict(load_checkpoint(ckpt).items())
    tensors["layers.0.self_attn.k_proj.weight"] = tensors["layers.0.self_attn.k_proj.weight"].T.copy()
    rewrite_tensors(ckpt, tensors)
    with pytest.raises(
        CheckpointError, match=r"'layers\.0\.self_attn\.k_proj\.weight' has shape \(32, 16\).*\(16, 32\)"
    ):
        load_checkpoint(ckpt)


def test_config_shape_mismatch_is_refused(ckpt):
    rewrite_config(ckpt, intermediate_size=64)
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight' has shape \(48, 32\), config needs \(64, 32\)"):
        load_checkpoint(ckpt)


def test_non_finite_weights_are_refused(ckpt):
    tensors = dict(load_checkpoint(ckpt).items())
    tensors["norm.weight"] = tensors["norm.weight"].copy()
    tensors["norm.weight"][3] = np.nan
    rewrite_tensors(ckpt, tensors)
    with pytest.raises(CheckpointError, match=r"norm\.weight.*NaN"):
        load_checkpoint(ckpt)


def test_missing_files_are_refused(tmp_path, ckpt):
    with pytest.raises(CheckpointNotFoundError, match="nowhere"):
        load_checkpoint(tmp_path / "nowhere")
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(
        CheckpointNotFoundError, match=r"no model\.safetensors or model\.safetensors\.index\.json in .*ck"
    ):
        load_checkpoint(ckpt)
    (ckpt / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointNotFoundError, match=r"pytorch_model\.bin.*only safetensors"):
        load_checkpoint(ckpt)
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"config\.json not found: .*ck/config\.json"):
        load_checkpoint(ckpt)
    with pytest.raises(FileNotFoundError):  # also an OSError for callers that expect one
        load_checkpoint(ckpt)
    with pytest.raises(ValueError):
        load_checkpoint(ckpt)


def test_bad_json_is_refused(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(ckpt)
    (ckpt / "config.json").write_text('{"hidden_size": 1, "hidden_size": 2}')
    with pytest.raises(CheckpointError, match="duplicate key 'hidden_size'"):
        load_checkpoint(ckpt)


# ------------------------------------------------------------------------------- save refusals


def test_save_refusals(tmp_path):
    w = DraftWeights.random(small_cfg(), seed=12)
    with pytest.raises(CheckpointError, match="unsupported checkpoint dtype 'int8'"):
        save_checkpoint(w, tmp_path / "a", dtype="int8")
    big = DraftWeights(w.cfg, dict(w.items(), **{"norm.weight": np.full(32, 1e5, np.float32)}))
    with pytest.raises(CheckpointError, match=r"norm\.weight.*overflow F16"):
        save_checkpoint(big, tmp_path / "b", dtype="float16")
    save_checkpoint(big, tmp_path / "b", dtype="bfloat16")  # fits bf16
    for changes, match in [
        (dict(freq_scale=0.5, ext_factor=0.5, n_ctx_orig=64), "ext_factor 0.5"),
        (dict(ext_factor=1.0, freq_scale=0.5), "n_ctx_orig"),
        (dict(attn_factor=0.9), "attn_factor 0.9 without YaRN"),
    ]:
        odd = DraftWeights(small_cfg(**changes), dict(w.items()))
        with pytest.raises(CheckpointError, match=match):
            save_checkpoint(odd, tmp_path / "c")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        save_checkpoint(w, tmp_path / "file")
    with pytest.raises(CheckpointError, match="needs DraftWeights"):
        save_checkpoint(dict(w.items()), tmp_path / "d")  # type: ignore[arg-type]


def test_save_without_target_layer_ids(tmp_path):
    w = DraftWeights.random(small_cfg(target_layer_ids=[]), seed=13)
    save_checkpoint(w, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["dflash_config"]["target_layer_ids"] == [0, 1, 2] and hf["num_target_layers"] == 3
    assert load_checkpoint(tmp_path).cfg == w.cfg.replace(target_layer_ids=[0, 1, 2])


def test_save_overwrites_and_leaves_no_temp_files(tmp_path):
    save_checkpoint(DraftWeights.random(small_cfg(), seed=1), tmp_path)
    w = DraftWeights.random(small_cfg(block_size=8), seed=2)
    save_checkpoint(w, tmp_path)
    assert_same(w, load_checkpoint(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_expected_names_are_dflash_names():
    names = set(expected_shapes(small_cfg()))
    assert {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "layers.1.self_attn.q_norm.weight",
        "layers.0.mlp.down_proj.weight",
        "layers.1.post_attention_layernorm.weight",
    } <= names
