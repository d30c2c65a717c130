"""Shared fixtures, and the parity figures printed in the test summary so regressions show."""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

# (comparison, precision) -> worst max|a-b|/max|b| seen, with the case that produced it
_WORST: dict[tuple[str, str], tuple[float, str]] = defaultdict(lambda: (0.0, ""))


def record_parity(comparison: str, precision: str, error: float, case: str) -> None:
    key = (comparison, precision)
    if error >= _WORST[key][0]:
        _WORST[key] = (error, case)


@pytest.fixture(scope="session")
def parity_log():
    return record_parity


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # type: ignore[no-untyped-def]
    from tests.fuzzing import TRIED

    if TRIED:
        terminalreporter.write_line(
            f"hardening fuzz: {sum(TRIED.values())} cases tried in {len(TRIED)} groups: {TRIED}"
        )
    if not _WORST:
        return
    terminalreporter.section("parity: worst max|a-b|/max|b|")
    for (comparison, precision), (error, case) in sorted(_WORST.items()):
        terminalreporter.write_line(f"{comparison:<28} {precision:<22} {error:.3e}   ({case})")


# Tests check results, not speed, so ggml computes on one thread unless asked
# (PYGGML_DKV_TEST_THREADS): a shared, busy machine cannot stretch the run by descheduling a
# thread its partner waits for. test_threads_agree and the tiled-kernel tests cover two threads.
TEST_THREADS = int(os.environ.get("PYGGML_DKV_TEST_THREADS", "1"))


@pytest.fixture(scope="session")
def cpu_has_amx_bf16() -> bool:
    """Does this CPU offer AMX-BF16 tiles (so attention="bf16" really runs bf16 products)?"""
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


@pytest.fixture(scope="session")
def cpu_runs_bf16_attention(cpu_has_amx_bf16) -> bool:
    """Does attention="bf16" really run bf16 products here (AMX-BF16 tiles, old patch 0009, or
    AVX512-BF16 dot products, old patch 0011), rather than the f32 kernel?"""
    from pyggml_dkv.ggml import bf16_attention_kernel

    return bf16_attention_kernel() != "f32"


@pytest.fixture(scope="session")
def cpu():
    from pyggml_dkv import Backend

    backend = Backend("cpu", n_threads=TEST_THREADS)
    yield backend
    backend.close()
