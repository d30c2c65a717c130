"""Drafters trained by this project and shipped with it (how each was made: its RECIPE.md)."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent

# SmolLM2-135M-Instruct's DFlash drafter, a llama.cpp dflash GGUF (q8_0)
SMOLLM2_DRAFTER = HERE / "smollm2-135m-dflash.gguf"


def smollm2_drafter_path() -> Path:
    """The shipped DFlash drafter for SmolLM2-135M-Instruct (pyggml_dkv/hosts/pretrained/RECIPE.md)."""
    if not SMOLLM2_DRAFTER.is_file():
        raise FileNotFoundError(f"the shipped drafter is missing: {SMOLLM2_DRAFTER} (a broken install?)")
    return SMOLLM2_DRAFTER
