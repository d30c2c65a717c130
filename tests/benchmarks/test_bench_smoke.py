"""The step benchmark in smoke mode: it runs, measures every system it was asked for, writes JSON.

Not a timed test: the ratios it prints are checked by a human, on a quiet machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_step.py"


def test_bench_step_quick_smoke(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--no-torch", "--reps", "2", "--threads", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "speed targets" in proc.stdout
    report = json.loads(out.read_text())
    assert report["machine"]["backend"] == "cpu"
    assert [r["config"] for r in report["results"]] == ["toy", "small"]
    for result in report["results"]:
        assert result["targets"] and result["windows"]
        text = json.dumps(result["windows"])
        for system in ("kv_f16", "kv_q8", "raw", "oneshot"):
            assert system in text
