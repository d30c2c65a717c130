"""The step benchmark's report: ratios against each other and the roofline, the speed targets with
PASS / MISS, the printed tables, and the plot."""

from __future__ import annotations

import argparse

from pyggml_dkv import DraftConfig
from step_config import FLAT_MAX, KV_SYSTEMS, OVERHEAD_MAX, RECOMPUTE_MIN, ROOF_MAX, SYSTEMS, TORCH_MIN, log
from step_probes import cost_model, roofline_s

# before / after instruction peaks further apart than this ratio: the report warns of a moving machine
DRIFT_WARN = 1.15


# ---------------------------------------------------------------------------- report
def fmt_stat(st: dict | None) -> str:
    if not st or not st.get("n"):
        return "-"
    return f"{st['median_ms']:.2f} [{st['p10_ms']:.2f}-{st['p90_ms']:.2f}]"


STAT = "median"  # set from --stat


def med(res: dict, s: str) -> float | None:
    """The chosen statistic (--stat, default median) of one system's step time at one window."""
    st = res["systems"].get(s)
    return st[f"{STAT}_ms"] if st and st.get("n") else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def window_rates(wres: dict, machine: dict) -> tuple[dict | None, float, str]:
    """The peaks and read bandwidth a window's roofline uses: those sampled between its steps
    (PeakSampler), else the run's, probed before and after it (results without samples)."""
    probes = wres.get("probes") or {}
    if probes.get("peaks_gmacs"):
        return probes["peaks_gmacs"], probes.get("read_gbs") or machine["bandwidth_gbs"], "interleaved"
    return machine.get("peaks_gmacs"), machine["bandwidth_gbs"], "run"


def rooflines(result: dict, wres: dict, machine: dict, peaks: dict | None, bw_gbs: float) -> dict:
    """Roofline of each cache system at one window with the given peaks and bandwidth."""
    cfg = DraftConfig(**result["shape"])
    roof = {}
    for key, dt, sysname in (
        ("f16", "f16", "kv_f16"),
        ("q8_0", "q8_0", "kv_q8"),
        ("q8_0_attbf16", "q8_0", "kv_q8_attbf16"),
        ("bf16", "bf16", "kv_bf16"),
    ):
        if dt not in result["weight_bytes"]:  # a result recorded before the system existed
            continue
        cost = cost_model(cfg, wres["window"], result["n_new"], result["weight_bytes"][dt], result["a_step"])
        kern = result.get("kernels", {}).get(sysname, {})
        r = roofline_s(
            cost, bw_gbs, machine["matmul_gflops"], peaks, kern.get("matmul_instr"), kern.get("attention_instr")
        )
        r.update(cost)
        r["measured_over_roofline"] = ratio(med(wres, sysname), r["ms"])
        r["system"] = sysname
        roof[key] = r
    return roof


def over_roofline(roof: dict, key: str) -> float | None:
    """One system's step / its roofline (None: the system is not in this result)."""
    return roof[key]["measured_over_roofline"] if key in roof else None


def best_over_roofline(roof: dict) -> float | None:
    return min(
        [r["measured_over_roofline"] for r in roof.values() if r["measured_over_roofline"] is not None], default=None
    )


def analyse(result: dict, machine: dict) -> None:
    """Adds roofline and ratios to every window of one config's result."""
    for wres in result["windows"]:
        peaks, bw, source = window_rates(wres, machine)
        roof = rooflines(result, wres, machine, peaks, bw)
        wres["roofline"] = roof
        wres["roofline_rates"] = {"source": source, "peaks_gmacs": peaks, "bandwidth_gbs": bw}
        # the same with the run's peaks (before / after it), for comparison with older results
        run_roof = rooflines(result, wres, machine, machine.get("peaks_gmacs"), machine["bandwidth_gbs"])
        kv_best = min([x for x in (med(wres, s) for s in KV_SYSTEMS) if x is not None], default=None)
        kv_best_f32 = min([x for x in (med(wres, "kv_f16"), med(wres, "kv_q8")) if x is not None], default=None)
        torch_best = min([x for x in (med(wres, "torch_fp32"), med(wres, "torch_bf16")) if x is not None], default=None)
        wres["ratios"] = {
            "step_over_raw": ratio(med(wres, "kv_f16"), med(wres, "raw")),
            "step_over_own_graph": wres["systems"].get("kv_f16", {}).get("over_own_graph", {}).get("median"),
            "oneshot_over_kv_f16": ratio(med(wres, "oneshot"), med(wres, "kv_f16")),
            "torch_best_over_kv_best": ratio(torch_best, kv_best),
            "torch_best_over_kv_best_f32_attention": ratio(torch_best, kv_best_f32),
            "kv_f16_over_roofline": over_roofline(roof, "f16"),
            "kv_q8_over_roofline": over_roofline(roof, "q8_0"),
            "kv_q8_attbf16_over_roofline": over_roofline(roof, "q8_0_attbf16"),
            "kv_bf16_over_roofline": over_roofline(roof, "bf16"),
            "kv_best_over_roofline": best_over_roofline(roof),
            "kv_best_over_roofline_run_peaks": best_over_roofline(run_roof),
        }


def targets(result: dict) -> list[dict]:
    """The issue's targets for one config: (name, value, bound, ok, applies)."""
    name = result["config"]
    by_w = {w["window"]: w for w in result["windows"]}
    out = []

    def add(target: str, value: float | None, op: str, bound: float, applies: bool, detail: str) -> None:
        ok = None if value is None else (value <= bound if op == "<=" else value >= bound)
        out.append(
            {"target": target, "value": value, "op": op, "bound": bound, "ok": ok, "applies": applies, "detail": detail}
        )

    if 64 in by_w and 4096 in by_w:
        add(
            "flat",
            ratio(med(by_w[4096], "kv_f16"), med(by_w[64], "kv_f16")),
            "<=",
            FLAT_MAX,
            name == "small",
            "kv_f16 @4096 / @64",
        )
    if 2048 in by_w:
        add(
            "vs recompute",
            by_w[2048]["ratios"]["oneshot_over_kv_f16"],
            ">=",
            RECOMPUTE_MIN,
            name == "small",
            "oneshot / kv_f16 @2048",
        )
    vals = [w["ratios"]["torch_best_over_kv_best"] for w in result["windows"]]
    if vals and all(v is not None for v in vals):
        add("vs PyTorch", min(vals), ">=", TORCH_MIN, name == "small", "min over windows of min(torch) / min(kv)")
    vals = [w["ratios"]["torch_best_over_kv_best_f32_attention"] for w in result["windows"]]
    if vals and all(v is not None for v in vals):
        add(
            "vs PyTorch f32 attention",
            min(vals),
            ">=",
            TORCH_MIN,
            False,
            "min over windows of min(torch) / min(kv_f16, kv_q8) (info)",
        )
    paired = [w["ratios"].get("step_over_own_graph") for w in result["windows"]]
    unpaired = [w["ratios"]["step_over_raw"] for w in result["windows"]]
    if paired and all(v is not None for v in paired):
        add(
            "host overhead",
            max(paired),
            "<=",
            OVERHEAD_MAX,
            name == "small",
            "max over windows of the median of kv_f16 step() / the graph compute inside that same step()",
        )
        if unpaired and all(v is not None for v in unpaired):
            add(
                "host overhead vs raw",
                max(unpaired),
                "<=",
                OVERHEAD_MAX,
                False,
                "max over windows of median kv_f16 step() / median raw graph, timed at other moments (info)",
            )
    elif unpaired and all(v is not None for v in unpaired):  # results from before the paired timing
        add(
            "host overhead",
            max(unpaired),
            "<=",
            OVERHEAD_MAX,
            name == "small",
            "max over windows of kv_f16 step() / raw graph",
        )
    vals = [w["ratios"]["kv_best_over_roofline"] for w in result["windows"]]
    if vals and all(v is not None for v in vals):
        add(
            "roofline",
            max(vals),
            "<=",
            ROOF_MAX,
            name in ("small", "qwen3-8b"),
            "max over windows of min(kv_f16 / roofline(f16), kv_q8 / roofline(q8_0), kv_q8_attbf16 / roofline(q8_0, bf16 "
            "attention), kv_bf16 / roofline(bf16))",
        )
    vals = [w["ratios"].get("kv_best_over_roofline_run_peaks") for w in result["windows"]]
    if vals and all(v is not None for v in vals) and any(w.get("probes") for w in result["windows"]):
        add(
            "roofline, run's peaks",
            max(vals),
            "<=",
            ROOF_MAX,
            False,
            "the same with the peaks and bandwidth probed before / after the run, not between the steps (info)",
        )
    for dt, sysname in (("f16", "kv_f16"), ("q8_0", "kv_q8"), ("bf16", "kv_bf16")):
        vals = [w["ratios"].get(f"{sysname}_over_roofline") for w in result["windows"]]
        if vals and all(v is not None for v in vals):
            add(
                f"roofline {dt}",
                max(vals),
                "<=",
                ROOF_MAX,
                False,
                f"max over windows of {sysname} / roofline({dt}) (info)",
            )
    return out


def bandwidth_text(machine: dict) -> str:
    """The bandwidth the roofline used, and the copy rate beside it (results before the read probe: copy only)."""
    copy = machine.get("copy_bandwidth_gbs", machine["bandwidth_gbs"])
    if machine.get("bandwidth_source") == "read":
        return f"read bandwidth {machine['bandwidth_gbs']:.1f} GB/s (the roofline's; copy {copy:.1f}, read+write)"
    return f"copy bandwidth {copy:.1f} GB/s (read+write; the roofline's)"


def print_report(results: list[dict], machine: dict, args: argparse.Namespace) -> None:
    p = print
    load = machine.get("load_average")
    p(
        f"\nmachine: {machine['cpu']}, {args.threads} threads, OMP_WAIT_POLICY {machine['omp_wait_policy']}"
        + (f", load average at start {load[0]:.1f}" if load else "")
        + f" | {bandwidth_text(machine)}"
        f" | f32 matmul {machine['matmul_gflops']:.0f} GFLOP/s | ggml {machine.get('ggml', '?')}"
        f" | torch {machine.get('torch', '-')}"
    )
    feats = machine.get("cpu_features", {})
    p(
        "cpu features ggml was built for: "
        + " ".join(k for k, v in feats.items() if v and k != "amx_usable")
        + f" | AMX in use: {'yes' if feats.get('amx_usable') else 'no'}"
    )
    pk = machine.get("peaks_gmacs") or {}
    if pk:
        p(
            f"instruction peaks, {args.threads} threads (G multiply-adds/s, registers only): "
            + ", ".join(f"{k} {fmt(v, '.0f')}" for k, v in pk.items())
        )
        samples = machine.get("peaks_samples_gmacs") or []
        drift = {
            k: max(s_[k] for s_ in samples) / min(s_[k] for s_ in samples)
            for k in pk
            if len(samples) > 1 and all(s_.get(k) for s_ in samples)
        }
        if drift and max(drift.values()) > DRIFT_WARN:
            # the probes before and after the run disagree: the machine's speed moved during it, so
            # the roofline ratios (and any ratio between systems timed at different moments) are loose
            p(
                "WARNING: the instruction peaks moved during the run (before / after: "
                + ", ".join(f"{k} {fmt(samples[0][k], '.0f')} / {fmt(samples[-1][k], '.0f')}" for k in drift)
                + "): this machine's speed changed; rerun on a quieter one for the roofline figures"
            )
    for r in results:
        s = r["shape"]
        p(
            f"\n== {r['config']}: hidden {s['hidden']}, {s['n_layer']} layers, {s['n_head']}/{s['n_head_kv']} heads x "
            f"{s['head_dim']}, ffn {s['ffn']}, q_len {s['block_size']}, fc_in {r['fc_in']}, {r['n_params'] / 1e6:.1f} M params; "
            f"n_new {r['n_new']} rows/step, cap {'= window' if r['cap_per_window'] else r['cap']}, "
            f"{r['reps']} reps (oneshot {r['oneshot_reps']})"
        )
        for sysname, k in r.get("kernels", {}).items():
            p(f"kernels {sysname}: matrix products: {k['matmul']}; attention: {k['attention']}")
        probed = [w for w in r["windows"] if w.get("probes")]
        if probed:
            p(
                f"the roofline's peaks (G multiply-adds/s) and read bandwidth, probed between the steps (median of "
                f"{probed[0]['probes']['n']} per window): "
                + "; ".join(
                    f"W {w['window']}: "
                    + ", ".join(f"{k} {v:.0f}" for k, v in w["probes"]["peaks_gmacs"].items())
                    + (f", read {w['probes']['read_gbs']:.1f} GB/s" if w["probes"].get("read_gbs") else "")
                    for w in probed
                )
            )
        cols = [s for s in SYSTEMS if any(s in w["systems"] for w in r["windows"])]
        head = f"{'window':>6} | " + " | ".join(f"{c:^21}" for c in cols)
        p("latency of one draft step, ms: median [p10-p90]")
        p(head)
        p("-" * len(head))
        for w in r["windows"]:
            p(f"{w['window']:>6} | " + " | ".join(f"{fmt_stat(w['systems'].get(c)):^21}" for c in cols))
        srcs = sorted({rf["compute_rate_source"] for w in r["windows"] for rf in w["roofline"].values()})
        p(
            f"\nratios and roofline, from the {STAT} step times (roofline = max(bytes/bandwidth, compute time); "
            f"compute rates from: {', '.join(srcs)}; bound m=memory c=compute)"
        )
        head2 = (
            f"{'window':>6} | {'step/raw':>8} | {'step/graph':>10} | {'oneshot/kv':>10} | {'torch/kv':>8} | {'roof f16 ms':>12} | "
            f"{'kv_f16/roof':>11} | {'roof q8 ms':>12} | {'kv_q8/roof':>10} | {'roof q8b ms':>12} | {'q8_attbf16/roof':>15} | "
            f"{'roof bf16 ms':>12} | {'kv_bf16/roof':>12} | {'GFLOP':>6} | {'MB read':>8} | err vs torch32"
        )
        p(head2)
        p("-" * len(head2))
        for w in r["windows"]:
            ra, rf = w["ratios"], w["roofline"]
            errs = " ".join(f"{k}={v:.1e}" for k, v in w["errors_vs_torch_fp32"].items())
            p(
                f"{w['window']:>6} | {fmt(ra['step_over_raw']):>8} | {fmt(ra.get('step_over_own_graph'), '.3f'):>10} | "
                f"{fmt(ra['oneshot_over_kv_f16'], '.1f'):>10} | "
                f"{fmt(ra['torch_best_over_kv_best']):>8} | {rf['f16']['ms']:>10.2f} {rf['f16']['bound'][0]} | "
                f"{fmt(ra['kv_f16_over_roofline']):>11} | {rf['q8_0']['ms']:>10.2f} {rf['q8_0']['bound'][0]} | "
                f"{fmt(ra['kv_q8_over_roofline']):>10} | {rf['q8_0_attbf16']['ms']:>10.2f} {rf['q8_0_attbf16']['bound'][0]} | "
                f"{fmt(ra['kv_q8_attbf16_over_roofline']):>15} | "
                + (f"{rf['bf16']['ms']:>10.2f} {rf['bf16']['bound'][0]} | " if "bf16" in rf else f"{'-':>12} | ")
                + f"{fmt(ra.get('kv_bf16_over_roofline')):>12} | {rf['f16']['flops'] / 1e9:>6.2f} | {rf['f16']['bytes'] / 1e6:>8.1f} | {errs}"
            )
        if any("profile" in w for w in r["windows"]):
            pth = next(pr["threads"] for w in r["windows"] for pr in w.get("profile", {}).values())
            p(
                f"\nper-op time of the step graph, {pth} thread(s) (each node computed alone, min over repetitions, "
                "per-node launch overhead subtracted), ms"
            )
            keys = sorted({k for w in r["windows"] for pr in w.get("profile", {}).values() for k in pr["groups_ms"]})
            head3 = (
                f"{'window':>6} {'cache':>6} | " + " | ".join(f"{k:>20}" for k in keys) + f" | {'sum':>8} | {'raw':>8}"
            )
            p(head3)
            p("-" * len(head3))
            for w in r["windows"]:
                for name, pr in w.get("profile", {}).items():
                    raw = med(w, "raw") if name == "kv_f16" else None
                    p(
                        f"{w['window']:>6} {name:>6} | "
                        + " | ".join(f"{pr['groups_ms'].get(k, 0.0):>20.2f}" for k in keys)
                        + f" | {pr['sum_ms']:>8.2f} | {fmt(raw):>8}"
                    )
            last = r["windows"][-1].get("profile", {}).get("kv_f16")
            if last:
                p(
                    f"matmuls by weight @W={r['windows'][-1]['window']} (kv_f16): "
                    + ", ".join(f"{k}={v:.2f}" for k, v in last["matmul_by_weight_ms"].items())
                )
                p(
                    f"other ops by ggml op @W={r['windows'][-1]['window']} (kv_f16): "
                    + ", ".join(f"{k}={v:.2f}" for k, v in last["other_by_op_ms"].items())
                )
                p(
                    f"per-node launch overhead (a tiny ADD on every thread, alone) ~{last['overhead_per_node_ms'] * 1e3:.0f} us x "
                    f"{last['n_compute_nodes']} compute nodes (subtracted)"
                )
        p("\nspeed targets:")
        for t in r["targets"]:
            verdict = "-" if t["ok"] is None else ("PASS" if t["ok"] else "MISS")
            scope = (
                ""
                if t["applies"] or t["detail"].endswith("(info)")
                else "  (info: the issue's target is for another config)"
            )
            p(f"  {t['target']:<24} {fmt(t['value'])} {t['op']} {t['bound']}  {verdict:<4}  {t['detail']}{scope}")


def plot(results: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not importable (pip install matplotlib): no plot written")
        return
    fig, ax = plt.subplots(figsize=(11, 6))
    colors = {
        "kv_f16": "C0",
        "kv_q8": "C1",
        "kv_q8_attbf16": "C5",
        "kv_bf16": "C6",
        "kv_q8_generic": "C8",
        "raw": "C7",
        "oneshot": "C3",
        "torch_fp32": "C2",
        "torch_bf16": "C4",
        "roofline f16": "k",
    }
    markers = ["o", "s", "^", "D"]
    styles = ["-", "--", "-.", (0, (5, 1, 1, 1))]
    for ci, r in enumerate(results):
        ws = [w["window"] for w in r["windows"]]
        for s in SYSTEMS:
            ys = [med(w, s) for w in r["windows"]]
            if any(y is not None for y in ys):
                pts = [(x, y) for x, y in zip(ws, ys) if y is not None]
                ax.plot(
                    *zip(*pts),
                    marker=markers[ci % 4],
                    linestyle=styles[ci % 4],
                    color=colors[s],
                    label=f"{r['config']} {s}",
                )
        ax.plot(
            ws,
            [w["roofline"]["f16"]["ms"] for w in r["windows"]],
            linestyle=":",
            marker=markers[ci % 4],
            color="k",
            label=f"{r['config']} roofline f16",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context window W (positions)")
    ax.set_ylabel(f"one draft step, ms ({STAT})")
    ax.set_title("DFlash draft step latency vs window")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: the lines fill the axes
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"plot written to {path}")
