"""A drafter trajectory under valgrind memcheck (scripts/memcheck.sh): opt-in, it takes minutes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # valgrind: the slow tier

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    not os.environ.get("PYGGML_DKV_MEMCHECK"),
    reason="valgrind memcheck takes minutes: set PYGGML_DKV_MEMCHECK=1 (docs/hardening.md)",
)
def test_memcheck_trajectory():
    """scripts/memcheck.sh: a drafter trajectory under valgrind memcheck reports no error."""
    # the interpreter running the tests (and its packages), not whichever python3 is first on PATH
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "memcheck.sh")],
        capture_output=True,
        text=True,
        timeout=3600,
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable},
    )
    summary = re.findall(r"ERROR SUMMARY: .*", proc.stderr)
    assert proc.returncode == 0, f"exit {proc.returncode} {summary}\n{proc.stderr[-8000:]}"
    assert "memcheck trajectory ok" in proc.stdout, proc.stdout[-2000:]
