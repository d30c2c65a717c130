"""An HF dflash checkpoint converted by llama.cpp's own converter (convert_hf_to_gguf.py, class
DFlashModel) loads to the same config and tensors as our safetensors loader reads.

The converter lives in the llama.cpp sources (llama-cpp-python's sdist ships them under
vendor/llama.cpp; the installed wheel does not): scripts/install_llama_cpp.sh extracts it from the
sdist of the pinned version into the cache (`llama.cpp-src-<version>`), or point
PYGGML_DKV_LLAMA_CPP_SRC at such a folder. It needs torch, transformers and sentencepiece (the
`torch` and `convert` extras) and a target model directory with a tokenizer; the target here is a
Qwen3 config with a tiny SentencePiece tokenizer trained on the spot (the converter copies its
vocabulary; the drafter's tensors do not depend on it).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pyggml_dkv.hosts.smollm2 import cache_dir
from pyggml_dkv.model.config import DraftConfig
from pyggml_dkv.model.weights import DraftWeights, load_checkpoint

pytestmark = pytest.mark.slow  # llama.cpp's HF -> GGUF converter with torch: the slow tier

pytest.importorskip("gguf")


def converter_sources() -> Path | None:
    """$PYGGML_DKV_LLAMA_CPP_SRC, else what install_llama_cpp.sh extracted for the installed llama-cpp-python."""
    if os.environ.get("PYGGML_DKV_LLAMA_CPP_SRC"):
        return Path(os.environ["PYGGML_DKV_LLAMA_CPP_SRC"])
    try:
        version = importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        return None
    return cache_dir() / f"llama.cpp-src-{version}"


SRC = converter_sources()
if SRC is None or not (SRC / "convert_hf_to_gguf.py").is_file():
    pytest.skip(
        "llama.cpp's converter is not here: run scripts/install_llama_cpp.sh (it extracts it from the "
        "pinned llama-cpp-python sdist into the cache), or set PYGGML_DKV_LLAMA_CPP_SRC to a llama.cpp "
        f"source tree (looked in {SRC})",
        allow_module_level=True,
    )
for _module in ("torch", "sentencepiece", "transformers"):
    pytest.importorskip(_module, reason=f"llama.cpp's converter needs {_module}")

N_VOCAB = 512


def target_dir(path: Path) -> Path:
    import sentencepiece as spm

    path.mkdir()
    text = path / "corpus.txt"
    words = [f"w{i}x{i % 7}" for i in range(3000)]
    text.write_text("\n".join(" ".join(words[i : i + 12]) for i in range(0, len(words), 12)))
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(path / "tokenizer"), vocab_size=300, model_type="bpe", minloglevel=2
    )
    text.unlink()
    (path / "tokenizer.vocab").unlink()
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": N_VOCAB,
        "hidden_size": 256,
        "num_hidden_layers": 12,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 512,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize(
    "changes",
    [
        dict(),
        dict(freq_scale=0.25, ext_factor=1.0, n_ctx_orig=1024, block_size=10, mask_token_id=300),
    ],
)
def test_converted_checkpoint_loads_to_the_same_drafter(changes, tmp_path):
    base = dict(vocab=N_VOCAB, mask_token_id=5, target_layer_ids=[1, 5, 9])
    base.update(changes)
    cfg = DraftConfig.toy(**base)
    draft = tmp_path / "draft"
    DraftWeights.random(cfg, seed=2).save_pretrained(draft, dtype="float32")
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
            "f32",
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
    for name in ours:
        np.testing.assert_array_equal(theirs[name], ours[name], err_msg=name)
