"""The step benchmark in smoke mode: it runs, measures every system it was asked for, writes JSON.

Not a timed test: the ratios it prints are checked by a human, on a quiet machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_step.py"


@pytest.mark.slow  # runs the benchmark script
def test_bench_step_quick_smoke(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--no-torch", "--reps", "2", "--threads", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
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
        for w in result["windows"]:
            # the graph compute timed inside each step() is part of it: positive, never longer
            kv = w["systems"]["kv_f16"]
            assert kv["own_graph"]["min_ms"] > 0 and kv["own_graph"]["median_ms"] <= kv["median_ms"]
            assert kv["over_own_graph"]["median"] >= 1.0
            assert w["ratios"]["step_over_own_graph"] == kv["over_own_graph"]["median"]


@pytest.mark.slow  # runs the benchmark script
def test_bench_step_profile_is_of_the_graph_a_step_runs(tmp_path):
    """--profile times the nodes of the graph step() computes: its fold-in sized for the step's
    n_new rows (a cache has one graph per fold-in size), not the a_step graph (which overstated the
    fold-in's products ~3x)."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--configs",
            "toy",
            "--windows",
            "64",
            "--reps",
            "2",
            "--no-torch",
            "--skip",
            "oneshot,kv_q8_attbf16,kv_bf16",
            "--profile",
            "--profile-reps",
            "1",
            "--threads",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())["results"][0]
    profiles = result["windows"][0]["profile"]
    assert set(profiles) >= {"kv_f16", "kv_q8"}
    for prof in profiles.values():
        assert result["n_new"] <= prof["fold_in_rows"] < result["a_step"], (
            prof["fold_in_rows"],
            result["n_new"],
            result["a_step"],
        )


@pytest.mark.slow  # runs the benchmark script
def test_bench_head_smoke(tmp_path):
    """bench_head.py runs every head variant on the shipped drafter and checks the screened f32
    head's drafts against the f32 head's itself (it exits non-zero otherwise)."""
    import pytest

    pytest.importorskip("gguf", reason="the SmolLM2 target GGUF is read with the gguf package")
    out = tmp_path / "head.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH.parent / "bench_head.py"), "--rounds", "1", "--steps", "5", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
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

    machine = {
        "cpu": "x",
        "omp_wait_policy": "PASSIVE",
        "bandwidth_gbs": 30.0,
        "matmul_gflops": 100.0,
        "cpu_features": {"avx2": True},
        "peaks_gmacs": {"vfmadd231ps": 130.0},
    }
    for samples, warned in (
        ([{"vfmadd231ps": 162.0}, {"vfmadd231ps": 98.0}], True),
        ([{"vfmadd231ps": 162.0}, {"vfmadd231ps": 158.0}], False),
        ([{"vfmadd231ps": 162.0}], False),
    ):
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


def test_peak_sampler_rates_agree_with_the_run_probes(monkeypatch):
    """The short probes taken between timed steps measure what the long ones before / after a run
    do (within this VM's noise), and the read probe a positive rate."""
    import pytest

    monkeypatch.syspath_prepend(str(BENCH.parent))
    import peak_probe

    sampler = peak_probe.PeakSampler(2, read_mib=16)
    if not sampler.available:
        pytest.skip("no AVX-512 instruction probe on this CPU / no compiler")
    # the best of several of each, alternating: other load on the machine only slows a probe
    samples, long_runs = [], []
    try:
        for _ in range(3):
            samples += [sampler.sample() for _ in range(3)]
            long_runs.append(peak_probe.probe_peaks(2, trials=2))
    finally:
        sampler.close()
    for name in long_runs[0]:
        if long_runs[0][name] is None:
            continue
        rate = max(r[name] for r in long_runs)
        short = max(s[name] for s in samples)
        # (a short probe may fit between another process's time slices where a long one cannot)
        assert rate / 3 < short < rate * 3, (name, short, rate)
    if "read_gbs" in samples[0]:
        assert all(s["read_gbs"] > 0.1 for s in samples)


def test_peak_sampler_counts_like_the_run_probes(monkeypatch):
    """A sample's rate is what probe_peaks would report for the same seconds: 12 chains x the
    instruction's multiply-adds x n per thread, summed over the threads; the read rate is the
    bytes each thread read over its own seconds, summed."""
    import types

    monkeypatch.syspath_prepend(str(BENCH.parent))
    import peak_probe

    sampler = peak_probe.PeakSampler(2, read_mib=1)
    sampler._sizes = {name: (lambda n: 0.5, 1000, macs) for name, (_, macs, _) in peak_probe.PROBES.items()}
    sampler._lib = types.SimpleNamespace(timed_read=lambda p, nbytes: 1e-3)
    sampler._read = [(None, 4_000_000), (None, 6_000_000)]
    got = sampler.sample()
    for name, (_, macs, _) in peak_probe.PROBES.items():
        assert got[name] == pytest.approx(2 * 1000 * 12 * macs / 0.5 / 1e9)
    assert got["read_gbs"] == pytest.approx((4e6 + 6e6) / 1e-3 / 1e9)


def _synthetic_result(probes: dict | None) -> tuple[dict, dict]:
    """A one-window result of the small config whose kv_f16 step took 10 ms, compute-bound (the
    bandwidth is huge), its products and attention charged to vfmadd231ps."""
    from step_config import CONFIGS

    window = {
        "window": 64,
        "systems": {"kv_f16": {"median_ms": 10.0, "p10_ms": 9.0, "p90_ms": 11.0, "n": 5}},
        "errors_vs_torch_fp32": {},
    }
    if probes is not None:
        window["probes"] = probes
    result = {
        "config": "small",
        "shape": CONFIGS["small"],
        "n_new": 9,
        "a_step": 34,
        "weight_bytes": {"f16": 131_000_000, "q8_0": 70_000_000},
        "windows": [window],
        "kernels": {"kv_f16": {"matmul_instr": "vfmadd231ps", "attention_instr": "vfmadd231ps"}},
    }
    machine = {"bandwidth_gbs": 1e6, "matmul_gflops": 100.0, "peaks_gmacs": {"vfmadd231ps": 200.0}}
    return result, machine


def test_roofline_uses_the_peaks_probed_between_the_steps(monkeypatch):
    """A window with samples taken between its steps is charged at those rates (here half the
    run's: the roofline doubles, the ratio halves); one without (older results) at the run's."""
    monkeypatch.syspath_prepend(str(BENCH.parent))
    import step_report

    result, machine = _synthetic_result({"n": 5, "peaks_gmacs": {"vfmadd231ps": 100.0}, "read_gbs": 1e6, "samples": []})
    step_report.analyse(result, machine)
    w = result["windows"][0]
    assert w["roofline_rates"]["source"] == "interleaved"
    ratios = w["ratios"]
    assert abs(ratios["kv_best_over_roofline"] * 2 - ratios["kv_best_over_roofline_run_peaks"]) < 1e-9
    names = [t["target"] for t in step_report.targets(result)]
    assert "roofline" in names and "roofline, run's peaks" in names

    result, machine = _synthetic_result(None)
    step_report.analyse(result, machine)
    w = result["windows"][0]
    assert w["roofline_rates"]["source"] == "run"
    assert w["ratios"]["kv_best_over_roofline"] == w["ratios"]["kv_best_over_roofline_run_peaks"]
    assert "roofline, run's peaks" not in [t["target"] for t in step_report.targets(result)]


def test_paired_ratio_is_per_call(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH.parent))
    from step_systems import paired_ratio

    # per-call ratios 2, 1.5, 1, 1: their median 1.25, not the medians' ratio 3.5 / 3 = 1.17
    r = paired_ratio([2.0, 3.0, 4.0, 6.0], [1.0, 2.0, 4.0, 6.0])
    assert abs(r["median"] - 1.25) < 1e-12
    assert paired_ratio([1.0], []) == {}


def test_host_overhead_target_is_the_paired_ratio(monkeypatch):
    """The target reads each step()'s own graph time (same call); the unpaired step / raw medians,
    timed at other moments, are information only; results without the paired timing fall back."""
    monkeypatch.syspath_prepend(str(BENCH.parent))
    import step_report

    result, machine = _synthetic_result(None)
    w = result["windows"][0]
    w["systems"]["raw"] = {"median_ms": 7.5, "p10_ms": 7.0, "p90_ms": 8.0, "n": 5}  # step / raw = 1.33
    w["systems"]["kv_f16"]["over_own_graph"] = {"median": 1.04, "p90": 1.08}
    step_report.analyse(result, machine)
    by_name = {t["target"]: t for t in step_report.targets(result)}
    assert (
        by_name["host overhead"]["value"] == 1.04
        and by_name["host overhead"]["ok"]
        and by_name["host overhead"]["applies"]
    )
    vs_raw = by_name["host overhead vs raw"]
    assert abs(vs_raw["value"] - 10.0 / 7.5) < 1e-9 and not vs_raw["ok"] and not vs_raw["applies"]

    del w["systems"]["kv_f16"]["over_own_graph"]
    step_report.analyse(result, machine)
    by_name = {t["target"]: t for t in step_report.targets(result)}
    assert abs(by_name["host overhead"]["value"] - 10.0 / 7.5) < 1e-9 and "host overhead vs raw" not in by_name


@pytest.mark.slow  # runs the benchmark script
def test_bench_products_smoke(tmp_path):
    """bench_products.py times each type's product hot on one thread and two, and streamed; its JSON
    carries the kernel, the per-product fixed cost and the thread speedup of each type."""
    bench = BENCH.parent / "bench_products.py"
    out = tmp_path / "products.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(bench),
            "--types",
            "q8_0,F16",
            "--columns",
            "9",
            "--reps",
            "1",
            "--rounds",
            "1",
            "--stream-mb",
            "4",
            "--work-mweights",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [(r["type"], r["columns"]) for r in report["results"]] == [("q8_0", 9), ("f16", 9)]
    for r in report["results"]:
        assert r["kernel"] and r["stream_matrices"] >= 2
        assert set(r["threads"]) == {"1", "2"} and set(r["speedup"]) == {"256", "1024", "3072"}
        assert all(v > 0 for v in r["threads"]["2"]["hot_us"].values())
        assert r["streamed_us"] > 0 and r["streamed_over_hot"] > 0
        assert r["bytes_per_weight"] == (2.0 if r["type"] == "f16" else 34 / 32)
    assert "streamed/hot" in proc.stdout
    bad = subprocess.run([sys.executable, str(bench), "--types", "q9_9"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown weight types ['q9_9']" in bad.stderr


def test_early_options_and_the_omp_wait_policy(monkeypatch):
    """The options the benchmarks read before their native libraries load: `--flag V` and `--flag=V`,
    else the default; the wait policy set upper-cased, 'default' leaving OMP_WAIT_POLICY unset (as a
    llama.cpp host runs), anything else refused by name."""
    import pytest

    monkeypatch.syspath_prepend(str(BENCH.parent))
    import machine

    argv = ["--threads", "3", "--omp-wait-policy=passive", "--json"]
    assert machine.early_option(argv, "--threads", "2") == "3"
    assert machine.early_option(argv, "--omp-wait-policy", "default") == "passive"
    assert machine.early_option(argv, "--json", "x") == "x"  # no value after it
    assert machine.early_option(argv, "--reps", "7") == "7"

    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    machine.set_omp_wait_policy("passive")
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    machine.set_omp_wait_policy("Default")
    assert "OMP_WAIT_POLICY" not in os.environ
    with pytest.raises(SystemExit, match="'spin'"):
        machine.set_omp_wait_policy("spin")


def test_bench_llama_cpp_refuses_a_bad_wait_policy_before_loading_anything():
    """A bad --omp-wait-policy stops bench_llama_cpp.py with its name, before ggml or llama.cpp load."""
    r = subprocess.run(
        [sys.executable, str(BENCH.parent / "bench_llama_cpp.py"), "--omp-wait-policy", "spin"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert "--omp-wait-policy must be active, passive or default, got 'spin'" in r.stderr
