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
    m = report["machine"]
    # the roofline's bandwidth is the read stream's where the probe runs (x86 with AVX2 and a compiler)
    want = m["read_bandwidth_samples_gbs"] if m["bandwidth_source"] == "read" else m["copy_bandwidth_samples_gbs"]
    assert m["bandwidth_gbs"] > 0 and min(want) <= m["bandwidth_gbs"] <= max(want)
    assert [r["config"] for r in report["results"]] == ["toy", "small"]
    for result in report["results"]:
        assert result["targets"] and result["windows"]
        text = json.dumps(result["windows"])
        for system in ("kv_f16", "kv_q8", "kv_bf16", "raw", "oneshot"):
            assert system in text


def test_bench_step_profile_is_of_the_graph_a_step_runs(tmp_path):
    """--profile times the nodes of the graph step() computes: its fold-in sized for the step's
    n_new rows (a cache has one graph per fold-in size), not the a_step graph (which overstated the
    fold-in's products ~3x)."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--configs", "toy", "--windows", "64", "--reps", "2", "--no-torch",
                           "--skip", "oneshot,kv_q8_attbf16,kv_bf16", "--profile", "--profile-reps", "1", "--threads", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())["results"][0]
    profiles = result["windows"][0]["profile"]
    assert set(profiles) >= {"kv_f16", "kv_q8"}
    for prof in profiles.values():
        assert result["n_new"] <= prof["fold_in_rows"] < result["a_step"], (prof["fold_in_rows"], result["n_new"], result["a_step"])


def test_bench_head_smoke(tmp_path):
    """bench_head.py runs every head variant on the shipped drafter and checks the screened f32
    head's drafts against the f32 head's itself (it exits non-zero otherwise)."""
    import pytest

    pytest.importorskip("gguf", reason="the SmolLM2 target GGUF is read with the gguf package")
    out = tmp_path / "head.json"
    proc = subprocess.run([sys.executable, str(BENCH.parent / "bench_head.py"), "--rounds", "1", "--steps", "5",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["variants"]) == {"head_q8_0", "head_f32", "head_f16", "head_f32_screened", "head_f16_screened"}
    assert report["variants"]["head_f32_screened"]["ids_equal_to_f32_head"] == 1.0
    assert all(v["n"] == 2 and v["median_ms"] > 0 for v in report["variants"].values())


def test_step_report_warns_when_the_machine_moved_during_the_run(capsys, monkeypatch):
    """The peaks are probed before and after the run; far apart, the report says the roofline
    figures are loose (an Emerald Rapids VM's FMA peak went 162 -> 98 G/s within an hour)."""
    import argparse

    monkeypatch.syspath_prepend(str(BENCH.parent))
    import step_report

    machine = {"cpu": "x", "omp_wait_policy": "PASSIVE", "bandwidth_gbs": 30.0, "matmul_gflops": 100.0,
               "cpu_features": {"avx2": True}, "peaks_gmacs": {"vfmadd231ps": 130.0}}
    for samples, warned in (([{"vfmadd231ps": 162.0}, {"vfmadd231ps": 98.0}], True),
                            ([{"vfmadd231ps": 162.0}, {"vfmadd231ps": 158.0}], False),
                            ([{"vfmadd231ps": 162.0}], False)):
        step_report.print_report([], {**machine, "peaks_samples_gmacs": samples}, argparse.Namespace(threads=2))
        out = capsys.readouterr().out
        assert ("WARNING: the instruction peaks moved" in out) == warned, out


def test_read_bandwidth_probe_and_report_line(monkeypatch):
    """The read probe measures a positive rate per trial (or is None without AVX2 / a compiler);
    the report names the bandwidth the roofline used, read or (older results) copy."""
    monkeypatch.syspath_prepend(str(BENCH.parent))
    import peak_probe
    import step_report

    rates = peak_probe.probe_read_bandwidth(2, trials=2, mib=16)
    assert rates is None or (len(rates) == 2 and all(r > 0.1 for r in rates))
    read = step_report.bandwidth_text({"bandwidth_gbs": 25.0, "bandwidth_source": "read", "copy_bandwidth_gbs": 31.0})
    assert read.startswith("read bandwidth 25.0 GB/s") and "copy 31.0" in read
    assert step_report.bandwidth_text({"bandwidth_gbs": 31.0}).startswith("copy bandwidth 31.0 GB/s")
