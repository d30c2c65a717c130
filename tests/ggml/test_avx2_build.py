"""The patched ggml on a CPU without AVX-512: built with AVX2 / FMA / F16C only and run through the
ops a drafter step uses (tests/ggml/avx2_check.c). The package's own ggml is built for the machine
(GGML_NATIVE), so on an AVX-512 machine nothing else compiles, links or runs the fallbacks our
patches leave for older x86 CPUs (the guards around their AVX-512 code; an AVX2-only build once
failed to compile). The build is cached under vendor/build/avx2-check, keyed by the patched source;
the first one takes ~20-60 s."""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from pyggml_dkv.common.numeric import relative_error
from pyggml_dkv.ggml import dequantize, quantize
from pyggml_dkv.reference import attention
from tests.ggml.helpers import as_bf16

pytestmark = pytest.mark.slow  # compiles ggml for AVX2: the slow tier

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "vendor" / "ggml"
BUILD = ROOT / "vendor" / "build" / "avx2-check"
CMAKE_ARGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX=ON",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DGGML_BMI2=ON",
    "-DGGML_AVX512=OFF",
    "-DGGML_OPENMP=ON",
    "-DGGML_BUILD_TESTS=OFF",
    "-DGGML_BUILD_EXAMPLES=OFF",
    # our kernel files (kernels/, copied there by build_ggml.sh) compile here too:
    # their guards around AVX-512 code are checked by this build
    f"-DGGML_CPU_DKV={'ON' if (SRC / 'src' / 'ggml-cpu' / 'dkv').is_dir() else 'OFF'}",
]
T, D, MF, MQ, HD, NQ, NH, NKV_H, NKV = 16, 256, 96, 64, 64, 70, 4, 2, 267


def _cpu_has_avx2() -> bool:
    try:
        return " avx2 " in Path("/proc/cpuinfo").read_text() + " "
    except OSError:
        return False


def _run(cmd: list[str], log: Path) -> None:
    with log.open("w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=900)
    if done.returncode:
        raise AssertionError(f"{' '.join(cmd[:3])} ... failed (rc {done.returncode}):\n" + log.read_text()[-3000:])


@pytest.fixture(scope="module")
def avx2_check() -> Path:
    """The check program linked against an AVX2-only build of vendor/ggml."""
    if not (SRC / "CMakeLists.txt").exists():
        pytest.skip("vendor/ggml is not there (build_ggml.sh fetches it)")
    if not (shutil.which("cmake") and shutil.which("cc") and _cpu_has_avx2()):
        pytest.skip("needs cmake, a C compiler and a CPU with AVX2")
    stamp_file = SRC / ".pyggml_dkv_source"
    program = Path(__file__).with_name("avx2_check.c")
    stamp = "|".join(
        [
            stamp_file.read_text().strip() if stamp_file.exists() else "unknown",
            " ".join(CMAKE_ARGS),
            hashlib.sha256(program.read_bytes()).hexdigest(),
        ]
    )
    key_file = BUILD / "key"
    exe = BUILD / "avx2_check"
    if not (key_file.exists() and key_file.read_text() == stamp and exe.exists()):
        if BUILD.exists():
            shutil.rmtree(BUILD)
        BUILD.mkdir(parents=True)
        jobs = str(max(1, min(os.cpu_count() or 1, 4)))
        _run(["cmake", "-S", str(SRC), "-B", str(BUILD / "cmake"), *CMAKE_ARGS], BUILD / "configure.log")
        _run(["cmake", "--build", str(BUILD / "cmake"), "-j", jobs], BUILD / "build.log")
        libs = {p.name: p for p in (BUILD / "cmake").rglob("libggml*.a")}
        order = [libs[n] for n in ("libggml.a", "libggml-cpu.a", "libggml-base.a")]
        _run(
            [
                "cc",
                "-O2",
                "-I",
                str(SRC / "include"),
                str(program),
                *map(str, order),
                "-fopenmp",
                "-lstdc++",
                "-lm",
                "-lpthread",
                "-o",
                str(exe),
            ],
            BUILD / "link.log",
        )
        key_file.write_text(stamp)
    return exe


def test_avx2_only_build_runs_the_drafter_ops(avx2_check: Path, tmp_path: Path) -> None:
    """RMSNorm x weights fused and unfused (bit for bit equal), an f16, a q8_0 and a bf16 product over
    16 columns and the f16 / bf16 ones over 37 rows x 9 columns (f16 and bf16 on the AVX2 narrow
    kernel, old patch 0042: the columns stay f32), and flash attention with a mask plane per head group over 267 f16 keys (a masked
    whole tile, a row seeing one key), 2 threads, against float64 math."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((T, D)).astype(np.float32)
    wn = rng.standard_normal(D).astype(np.float32)
    wf = (rng.standard_normal((MF, D)) * 0.1).astype(np.float32)
    wq = (rng.standard_normal((MQ, D)) * 0.1).astype(np.float32)
    wb = (rng.standard_normal((MF, D)) * 0.1).astype(np.float32)
    q = rng.standard_normal((NH, NQ, HD)).astype(np.float32)
    k = rng.standard_normal((NKV_H, NKV, HD)).astype(np.float16).astype(np.float32)
    v = rng.standard_normal((NKV_H, NKV, HD)).astype(np.float16).astype(np.float32)
    visible = rng.random((NKV_H, NQ, NKV)) < 0.7
    visible[:, :, 0] = True
    visible[0, :, 64:128] = False
    visible[1, 5] = False
    visible[1, 5, NKV - 1] = True
    mask = np.where(visible, 0, -np.inf).astype(np.float32)
    src, dst = tmp_path / "in.bin", tmp_path / "out.bin"
    np.concatenate([a.ravel() for a in (x, wn, wf, wq, wb, q, k, v, mask)]).astype(np.float32).tofile(src)
    done = subprocess.run([str(avx2_check), str(src), str(dst)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = np.fromfile(dst, dtype=np.float32)
    sizes = [T * D, T * D, T * MF, T * MQ, T * MF, 9 * 37, 9 * 37, NQ * NH * HD]
    assert out.size == sum(sizes)
    fused, unfused, yf, yq, yb, yf_tail, yb_tail, att = np.split(out, np.cumsum(sizes)[:-1])

    np.testing.assert_array_equal(fused.view(np.uint32), unfused.view(np.uint32))
    x64 = x.astype(np.float64)
    want_norm = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6) * wn
    assert relative_error(fused.reshape(T, D), want_norm) < 1e-6

    # f16 and bf16 weights x f32 columns (0042: only f32 rounding of the sums remains); q8_0 quantizes
    # the columns to q8_0
    want_f = x64 @ wf.astype(np.float16).astype(np.float64).T
    assert relative_error(yf.reshape(T, MF), want_f) < 2e-6, relative_error(yf.reshape(T, MF), want_f)
    assert relative_error(yf_tail.reshape(9, 37), want_f[:9, :37]) < 2e-6
    want_q = x64 @ dequantize("q8_0", quantize("q8_0", wq), wq.size).reshape(wq.shape).astype(np.float64).T  # as stored
    assert relative_error(yq.reshape(T, MQ), want_q) < 2e-2
    want_b = x64 @ as_bf16(wb).T
    assert relative_error(yb.reshape(T, MF), want_b) < 2e-6, relative_error(yb.reshape(T, MF), want_b)
    assert relative_error(yb_tail.reshape(9, 37), want_b[:9, :37]) < 2e-6

    att = att.reshape(NQ, NH, HD)
    want_att = np.stack(
        [
            attention(
                q[h][:, None].astype(np.float64),
                k[h // 2][:, None].astype(np.float64),
                v[h // 2][:, None].astype(np.float64),
                visible[h % 2],
            )[:, 0]
            for h in range(NH)
        ],
        axis=1,
    )
    assert math.isfinite(float(np.abs(att).max()))
    assert relative_error(att, want_att) < 2e-6, relative_error(att, want_att)
    np.testing.assert_allclose(att[5, 1], v[0, NKV - 1], rtol=1e-5, atol=1e-5)  # head 1: plane 1, row 5
