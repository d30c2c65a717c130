"""examples/llama_cpp_spec.py, the real-host example, run as a user would (its screened-head route),
and examples/llama_cpp_quickstart.py, speculative_llama in ten lines."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # loads SmolLM2 in llama.cpp: the slow tier (pytest -m 'not slow' skips it)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llama_cpp_spec.py"
QUICKSTART = EXAMPLE.with_name("llama_cpp_quickstart.py")


def run_example(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=600)


def test_screened_head_decodes_losslessly_with_the_shipped_drafter():
    pytest.importorskip("llama_cpp", reason="the llama.cpp host needs llama-cpp-python")
    pytest.importorskip("gguf", reason="reading GGUF needs the gguf package")
    res = run_example("--lm-head-screen", "--max-tokens", "16")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "f32 lm_head through a q8_0 screen" in res.stderr
    assert "lossless: True" in res.stdout


@pytest.mark.parametrize("flags", [["--engine", "reference"], ["--drafter", "oracle"]])
def test_screened_head_needs_our_drafter(flags):
    pytest.importorskip("llama_cpp", reason="the example imports the llama.cpp host")
    res = run_example("--lm-head-screen", *flags)
    assert res.returncode != 0
    assert "--lm-head-screen goes with the ggml engine and a DFlash drafter" in res.stderr


def test_the_quickstart_speculates_with_the_shipped_drafter():
    pytest.importorskip("llama_cpp", reason="the llama.cpp host needs llama-cpp-python")
    pytest.importorskip("gguf", reason="reading GGUF needs the gguf package")
    res = subprocess.run([sys.executable, str(QUICKSTART)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.strip().splitlines()
    match = re.fullmatch(r"(\d+) tokens from (\d+) llama.cpp decodes", lines[-1])
    assert match and len(lines) >= 2, res.stdout
    tokens, decodes = map(int, match.groups())
    # plain decoding takes one decode per token (the prompt's included): drafts were accepted
    assert 0 < decodes < tokens, (tokens, decodes)
