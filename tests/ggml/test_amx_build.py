"""Our AMX code compiles where it cannot run. The package's ggml is built for its machine
(GGML_NATIVE), so on a CPU without AMX (AMD Zen 4 / 5, most CI machines) nothing compiles the AMX
kernels of kernels/ or ggml's AMX matmuls with our patch: a break there would first show on
an AMX Xeon. This compiles them (and every other kernel file) with the AMX flags of a Sapphire
Rapids build and checks that the tile instructions are really there (a wrong guard would compile
the kernel to its nullptr stub). Compile only: running them needs AMX (tests/ggml/test_amx.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # compiles C++: the slow tier

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "vendor" / "ggml" / "src"
DKV = SRC / "ggml-cpu" / "dkv"
# ggml's CMake options GGML_AVX512* / GGML_AMX_* as its CPU backend passes them (ggml-cpu/CMakeLists.txt)
ISA = [
    "-mf16c",
    "-mfma",
    "-mbmi2",
    "-mavx",
    "-mavx2",
    "-mavx512f",
    "-mavx512cd",
    "-mavx512vl",
    "-mavx512dq",
    "-mavx512bw",
    "-mavx512vbmi",
    "-mavx512vnni",
    "-mavx512bf16",
    "-mamx-tile",
    "-mamx-int8",
    "-mamx-bf16",
]
FLAGS = [
    "-O2",
    "-std=gnu++17",
    "-fopenmp",
    "-w",
    "-DNDEBUG",
    "-D_GNU_SOURCE",
    "-DGGML_USE_CPU_DKV",
    "-DGGML_USE_OPENMP",
]
INCLUDES = [f"-I{SRC}", f"-I{SRC / 'ggml-cpu'}", f"-I{SRC.parent / 'include'}"]


@pytest.fixture(scope="module")
def compiler() -> str:
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    if not DKV.is_dir():
        pytest.skip("vendor/ggml has no kernel folder (GGML_PATCHES=none or GGML_SRC build)")
    probe = subprocess.run(
        [cxx, *ISA, "-x", "c++", "-c", "-o", "/dev/null", "-"], input="", text=True, capture_output=True
    )
    if probe.returncode:
        pytest.skip(f"{cxx} cannot target AMX: {probe.stderr.strip()[-200:]}")
    return cxx


def compile_object(cxx: str, source: Path, out: Path) -> Path:
    obj = out / (source.name + ".o")
    done = subprocess.run(
        [cxx, *FLAGS, *ISA, *INCLUDES, "-c", str(source), "-o", str(obj)], capture_output=True, text=True
    )
    assert done.returncode == 0, (source.name, done.stderr[-3000:])
    return obj


def instructions(obj: Path) -> str:
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump to read the objects")
    return subprocess.run(
        [objdump, "-d", "--no-show-raw-insn", str(obj)], capture_output=True, text=True, check=True
    ).stdout


def test_every_kernel_file_compiles_for_an_amx_cpu(compiler, tmp_path):
    sources = sorted(DKV.glob("*.cpp"))
    assert sources
    for source in sources:
        compile_object(compiler, source, tmp_path)


@pytest.mark.parametrize("name", ["flash-attn-bf16-amx.cpp", "mm-bf16-amx.cpp"])
def test_our_amx_kernels_run_on_tiles(compiler, tmp_path, name):
    """Their bf16 tile products and a tile configuration of their own (loaded, then ggml's back)."""
    code = instructions(compile_object(compiler, DKV / name, tmp_path))
    assert "tdpbf16ps" in code and "ldtilecfg" in code


def test_our_amx_q8_0_products_run_on_tiles(compiler, tmp_path):
    """The q8_0 layout's wide products: signed activations x the layout's unsigned codes, and ggml's
    tile configuration loaded (mm-amx-q8_0.cpp; a wrong guard compiles it to its nullptr stub)."""
    code = instructions(compile_object(compiler, DKV / "mm-amx-q8_0.cpp", tmp_path))
    assert "tdpbsud" in code and "ldtilecfg" in code and "tilestored" in code


def test_ggml_amx_matmuls_compile_with_our_fix(compiler, tmp_path):
    """ggml's AMX matmuls with our fix (capability amx-tile-config): the tile configuration is
    written whole before ldtilecfg (the barrier GCC 12 needs) and loaded at every product."""
    source = SRC / "ggml-cpu" / "amx" / "mmq.cpp"
    text = source.read_text()
    assert "static thread_local bool done" not in text and "ggml_batch_offset_src0" in text
    code = instructions(compile_object(compiler, source, tmp_path))
    assert "ldtilecfg" in code and "tdpbssd" in code
