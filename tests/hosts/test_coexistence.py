"""pyggml_dkv inside a llama.cpp host: llama-cpp-python and pyggml_dkv in one process.

Each case is a fresh child process (tests/hosts/coexistence_cases.py) that loads the two in one order:
pyggml_dkv first, llama_cpp first, llama.cpp's libggml*.so dlopen()ed RTLD_GLOBAL before both,
or our extension loaded RTLD_GLOBAL first. In every case a DraftKvCache trajectory (q8_0 weights,
f16 ring cache, f32 and bf16 attention, commits with bulk appends and a rewind) must be
bit-identical to the one of a process without llama.cpp, llama.cpp's greedy tokens and all its
logits bit-identical to a process without pyggml_dkv, and our ggml must still answer as ours
(version, type names, graph op numbers, bf16 attention, CPU backend).

Needs the `llama` extra (llama-cpp-python) and the SmolLM2-135M-Instruct Q4_1 GGUF (fetched and
cached on first use); skips, saying which is missing, without them.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from tests.child import run_in_child
from tests.hosts.coexistence_cases import CASES

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parents[1]

pytestmark = [
    pytest.mark.slow,  # loads SmolLM2 in llama.cpp: the slow tier (pytest -m 'not slow' skips it)
    pytest.mark.skipif(
        importlib.util.find_spec("llama_cpp") is None, reason="llama_cpp is not installed (pip install -e '.[llama]')"
    ),
]

MIXED = [case for case in CASES if not case.startswith("isolated_")]


@pytest.fixture(scope="module")
def model_path() -> str:
    from pyggml_dkv.hosts.smollm2 import ModelUnavailableError, smollm2_gguf

    try:
        return str(smollm2_gguf())
    except ModelUnavailableError as exc:
        pytest.skip(f"SmolLM2 GGUF unavailable: {exc}")


def run_case(case: str, model_path: str, tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / f"{case}.json"
    proc = run_in_child("tests.hosts.coexistence_cases:run", case, str(out), model_path, timeout=300)
    assert proc.returncode == 0, f"case {case} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def isolated(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("isolated")
    return {case: run_case(case, model_path, tmp) for case in ("isolated_pyggml", "isolated_llama")}


def test_isolated_processes_are_what_the_cases_compare_with(isolated):
    ours, llama = isolated["isolated_pyggml"], isolated["isolated_llama"]
    assert ours["mapped_ggml_libraries"] == []  # ggml lives inside the extension
    assert ours["ggml"]["ggml_version"] == (ROOT / "pyggml_dkv" / "_libs" / "version").read_text().strip()
    assert ours["ggml"]["ggml_commit"] == (ROOT / "pyggml_dkv" / "_libs" / "build-id").read_text().strip()
    assert ("cpu", True) in [tuple(b) for b in ours["ggml"]["backends"]]
    assert ["CPU", "CPU"] in ours["ggml"]["devices"]
    assert len(llama["llama"]["tokens"]) == 16
    assert any("libggml" in path for path in llama["mapped_ggml_libraries"])


@pytest.mark.parametrize("case", MIXED)
def test_both_in_one_process_compute_as_when_alone(case, isolated, model_path, tmp_path):
    mixed = run_case(case, model_path, tmp_path)
    ours, llama = isolated["isolated_pyggml"], isolated["isolated_llama"]
    # llama.cpp's ggml is really in the process, and ours is still the one answering our calls
    assert any("libggml" in path for path in mixed["mapped_ggml_libraries"])
    assert mixed["ggml"] == ours["ggml"]
    # bit-identical results, before and after the other library computed
    assert mixed["trajectory"] == ours["trajectory"]
    assert mixed["trajectory_again"] == ours["trajectory"]
    assert mixed["llama"] == llama["llama"]
    assert mixed["llama_again"] == llama["llama"]


def test_llama_cpp_products_after_our_amx_kernels(model_path, tmp_path):
    """Both ggmls share the OpenMP threads; ggml's AMX matmuls load their tile configuration once per
    thread, our bf16 attention and bf16 products on AMX load others (old patches 0028 and 0029 put ggml's
    back). Without that llama.cpp's next batched decode returned NaN logits on an Emerald Rapids."""
    out = tmp_path / "tiles.json"
    proc = run_in_child("tests.hosts.coexistence_cases:tiles_after_attention", str(out), model_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(out.read_text())
    from pyggml_dkv.ggml.capabilities import bf16_attention_supported

    runs = 2 if bf16_attention_supported() else 1  # bf16 attention only where the build has it
    assert got["after"] == {key: got["before"] for key in got["after"]} and len(got["after"]) == runs


def test_llama_cpp_products_after_pytorch_released_the_tiles(model_path, tmp_path):
    """PyTorch (oneDNN) releases the AMX tiles of the thread its bf16 matmul ran on, and llama.cpp's
    AMX matmuls trust the configuration they loaded there once: its next batched decode died of
    SIGILL (the training pipeline's data generation, after PyTorch ran). LlamaTarget reloads ggml's
    tile configuration before each decode."""
    pytest.importorskip("torch")
    out = tmp_path / "tiles.json"
    proc = run_in_child("tests.hosts.coexistence_cases:tiles_after_torch", str(out), model_path, timeout=300)
    assert proc.returncode == 0, f"exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    got = json.loads(out.read_text())
    assert got["after"] == got["before"]
