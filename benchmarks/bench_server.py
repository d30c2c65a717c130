"""OpenAI-compatible servers under concurrent clients: ours with and without the drafter,
llama.cpp's own llama-server with and without its native DFlash, and llama_cpp.server.

    python benchmarks/bench_server.py                        # 1/2/4/8 clients, chat and code prompts
    python benchmarks/bench_server.py --clients 1,4 --requests 2 --max-tokens 48 --json out.json --plot out.png

Every system serves the same SmolLM2-135M-Instruct GGUF on a loopback port. All are started
first and stay up; each serves `--warmup` requests; then each cell (prompt kind x C clients)
measures the systems in turn, `--rounds` times in a rotating order, so that the machine's drift
over minutes falls on all alike. In a cell each of C clients sends `--requests` chat requests one
after another (greedy, `--max-tokens` each, prompts of one kind taken round robin, each message
tagged with its own label so no two requests are the same prompt), all clients at once; reported
per system, kind and C: aggregate completion tokens per second (all tokens over all the wall time
of its rounds) and the median request latency.
  ours_spec      python -m pyggml_dkv.serve, the shipped drafter, --parallel 4
  ours_plain     the same with --drafter none
  llama_server   llama.cpp's llama-server (scripts/build_llama_server.sh), -np 4
  llama_dflash   llama-server with its native DFlash: --spec-type draft-dflash -md <the shipped drafter>
  llama_cpp_py   llama-cpp-python's own `python -m llama_cpp.server` (one request at a time)
Prompt kinds: `chat` (held-out prompts the drafter never trained on) and `code` (code and
repetitive text, where drafts are accepted often).
Goals (docs/server.md): ours_spec >= 0.95x ours_plain everywhere; ours_plain >= 0.9x llama_server.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from machine import cpu_family_model, cpu_name, git_commit  # noqa: E402  (benchmarks/machine.py)

log = logging.getLogger("bench_server")
ROOT = Path(__file__).resolve().parents[1]
CODE_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Write a Python class Stack with push, pop and peek methods.",
    "Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape, honeydew.",
    "Write a bash loop that prints the numbers from 1 to 20, one per line.",
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(cmd: list[str], port: int, log_path: Path, timeout: float = 300.0) -> subprocess.Popen:
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=log_path.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            # every system answers /v1/models once its model is loaded (llama_cpp.server has no /health)
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1.0).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{cmd[0]} did not answer within {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def commands(
    name: str, port: int, model: Path, drafter: Path, llama_server: str | None, threads: int, parallel: int, ctx: int
) -> list[str] | None:
    py = sys.executable
    if name in ("ours_spec", "ours_plain"):
        return [
            py,
            "-m",
            "pyggml_dkv.serve",
            "--port",
            str(port),
            "--threads",
            str(threads),
            "--parallel",
            str(parallel),
            "--ctx-size",
            str(ctx),
            "--log-level",
            "warning",
            "--max-queue",
            "64",
            *(["--drafter", "none"] if name == "ours_plain" else []),
        ]
    if name in ("llama_server", "llama_dflash"):
        if llama_server is None:
            return None
        cmd = [
            llama_server,
            "-m",
            str(model),
            "--port",
            str(port),
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-np",
            str(parallel),
            "-c",
            str(ctx * parallel),
            "--log-disable",
        ]
        if name == "llama_dflash":
            cmd += ["--spec-type", "draft-dflash", "-md", str(drafter), "--spec-draft-n-max", "7"]
        return cmd
    if name == "llama_cpp_py":
        return [
            py,
            "-m",
            "llama_cpp.server",
            "--model",
            str(model),
            "--port",
            str(port),
            "--n_threads",
            str(threads),
            "--n_ctx",
            str(ctx),
        ]
    raise ValueError(name)


def run_load(base: str, prompts: tuple[str, ...], clients: int, requests: int, max_tokens: int, tag: str = "") -> dict:
    """C clients, each sending `requests` chat requests in turn; aggregate tokens/s and latencies.
    With a `tag`, each request's message starts with its own label ("[tag.client.request] "): no
    two requests of a run are the same prompt, as in real traffic. (llama-server keeps earlier
    prompts in a host-memory cache across its slots and would otherwise skip the whole prefill
    of a prompt it saw in an earlier round; both servers still reuse the chat template's preamble.)"""

    def client(c: int) -> list[tuple[int, float]]:
        out = []
        with httpx.Client(timeout=600) as http:
            for r in range(requests):
                prompt = prompts[(c * requests + r) % len(prompts)]
                if tag:
                    prompt = f"[{tag}.{c}.{r}] {prompt}"
                t0 = time.perf_counter()
                resp = http.post(
                    base + "/v1/chat/completions",
                    json={
                        "model": "m",
                        "messages": [{"role": "user", "content": prompt}],
                        "max_tokens": max_tokens,
                        "temperature": 0,
                    },
                )
                resp.raise_for_status()
                out.append((int(resp.json()["usage"]["completion_tokens"]), time.perf_counter() - t0))
        return out

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(clients) as pool:
        results = [x for part in pool.map(client, range(clients)) for x in part]
    wall = time.perf_counter() - t0
    tokens = sum(n for n, _ in results)
    lat = np.array([s for _, s in results])
    return {"tokens": tokens, "wall_s": wall, "latencies_s": [float(x) for x in lat]}


def merge_loads(parts: list[dict]) -> dict:
    """Rounds of one system and cell: all tokens over all wall time, latency percentiles over all requests."""
    tokens = sum(p["tokens"] for p in parts)
    wall = sum(p["wall_s"] for p in parts)
    lat = np.array([x for p in parts for x in p["latencies_s"]])
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "rounds": len(parts),
        "latency_p50_s": float(np.median(lat)),
        "latency_p90_s": float(np.percentile(lat, 90)),
    }


def report(results: dict, args: argparse.Namespace) -> None:
    print(
        f"\nOpenAI-compatible servers, SmolLM2-135M-Instruct, {args.threads} threads, {args.requests} requests of "
        f"{args.max_tokens} tokens per client, greedy; CPU: {results['cpu']}"
    )
    systems = [s for s in args.systems if s in results["runs"]]
    for kind in args.kinds:
        print(f"\n{kind} prompts: aggregate tokens/s (median latency s)")
        print(f"{'clients':>8} " + " ".join(f"{s:>20}" for s in systems) + "   spec/plain  plain/llama")
        for c in args.clients:
            cells, row = [], {}
            for s in systems:
                r = results["runs"][s].get(kind, {}).get(str(c))
                row[s] = r
                cells.append(f"{r['tokens_per_s']:9.1f} ({r['latency_p50_s']:5.2f})" if r else f"{'-':>20}")
            sp = row.get("ours_spec"), row.get("ours_plain"), row.get("llama_server")
            a = f"{sp[0]['tokens_per_s'] / sp[1]['tokens_per_s']:10.2f}" if sp[0] and sp[1] else f"{'-':>10}"
            b = f"{sp[1]['tokens_per_s'] / sp[2]['tokens_per_s']:11.2f}" if sp[1] and sp[2] else f"{'-':>11}"
            print(f"{c:>8} " + " ".join(f"{x:>20}" for x in cells) + f"  {a}  {b}")
    print("\ngoals: ours_spec / ours_plain >= 0.95; ours_plain / llama_server >= 0.9")


def plot(results: dict, args: argparse.Namespace, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.kinds), figsize=(6 * len(args.kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], args.kinds):
        for s, runs in results["runs"].items():
            xs = [c for c in args.clients if str(c) in runs.get(kind, {})]
            ax.plot(xs, [runs[kind][str(c)]["tokens_per_s"] for c in xs], marker="o", label=s)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("aggregate tokens/s")
        ax.set_title(f"{kind} prompts ({results['cpu']}, {args.threads} threads)")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", default="ours_spec,ours_plain,llama_server,llama_dflash,llama_cpp_py")
    ap.add_argument("--kinds", default="chat,code")
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--rounds", type=int, default=3, help="measurements of each cell per system, interleaved")
    ap.add_argument("--warmup", type=int, default=12, help="requests each system serves before the measurements")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=4, help="sequences of the servers that batch")
    ap.add_argument("--ctx", type=int, default=1024, help="positions per request")
    ap.add_argument(
        "--llama-server", default=None, help="the llama-server binary (default: scripts/build_llama_server.sh)"
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    args.systems = args.systems.split(",")
    args.kinds = args.kinds.split(",")
    args.clients = [int(c) for c in args.clients.split(",")]
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = parse_args(argv)
    from pyggml_dkv.hosts.pretrained import smollm2_drafter_path
    from pyggml_dkv.hosts.smollm2 import smollm2_gguf
    from pyggml_dkv.training.prompts import HELD_OUT_PROMPTS

    model, drafter = smollm2_gguf(), smollm2_drafter_path()
    server = args.llama_server
    if server is None and any(s.startswith("llama_") and s != "llama_cpp_py" for s in args.systems):
        built = subprocess.run(
            ["bash", str(ROOT / "scripts/build_llama_server.sh")],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHON": sys.executable},
        )
        server = built.stdout.strip() if built.returncode == 0 else None
        if server is None:
            log.warning("llama-server unavailable, its systems are left out: %s", built.stderr[-500:])
    prompts = {"chat": tuple(HELD_OUT_PROMPTS[:8]), "code": CODE_PROMPTS}
    results: dict = {
        "cpu": cpu_name(),
        "cpu_id": cpu_family_model(),
        "commit": git_commit(),
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "requests": args.requests,
        "parallel": args.parallel,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "runs": {},
    }
    # every system is started first and left running; each (kind, clients) cell then measures the
    # systems in turn, `--rounds` times in a rotating order, so that the machine's drift over minutes
    # falls on all of them alike (an idle server costs nothing: each waits on a condition or a socket)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        bases: dict[str, str] = {}
        for name in args.systems:
            port = free_port()
            cmd = commands(name, port, model, drafter, server, args.threads, args.parallel, args.ctx)
            if cmd is None:
                continue
            proc = start(cmd, port, Path(tmp) / f"{name}.log")
            stack.callback(stop, proc)
            bases[name] = f"http://127.0.0.1:{port}"
            # warm-up: a fresh server of ours learns from its first requests whether drafting pays
            # on this machine (docs/server.md, "Plain requests"); every system gets the same
            run_load(bases[name], prompts["chat"], 1, args.warmup, args.max_tokens, tag="warm")
        names = list(bases)
        for kind in args.kinds:
            for c in args.clients:
                parts: dict[str, list[dict]] = {n: [] for n in names}
                for r in range(args.rounds):
                    for name in names[r % len(names) :] + names[: r % len(names)]:
                        parts[name].append(
                            run_load(
                                bases[name], prompts[kind], c, args.requests, args.max_tokens, tag=f"{kind}{c}.{r}"
                            )
                        )
                for name in names:
                    res = merge_loads(parts[name])
                    results["runs"].setdefault(name, {}).setdefault(kind, {})[str(c)] = res
                    log.info(
                        "%s %s %d clients: %.1f tokens/s, p50 %.2f s",
                        name,
                        kind,
                        c,
                        res["tokens_per_s"],
                        res["latency_p50_s"],
                    )
    report(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args, args.plot)


if __name__ == "__main__":
    main()
