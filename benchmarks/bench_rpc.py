"""A draft step on ggml's RPC backend over loopback, next to the same step on the local CPU.

    python benchmarks/bench_rpc.py                       # small config, windows 64 and 2048
    python benchmarks/bench_rpc.py --configs toy,small --windows 64,1024,2048 --threads 2

Per config and window: step latency (median and p10 of `reps` steps) on Backend("cpu") and on
Backend("rpc:127.0.0.1:P") (a server started here, same thread count, OMP_WAIT_POLICY=PASSIVE),
and the bytes one RPC step sends (client -> server) and receives, counted by a relay
(pyggml_dkv.serving.traffic) in a separate pass, so the relay's hop is not in the latencies.

The geometry is production's: cap 4096 (the masks span kv_total = align_up(4096 + q_len + 1, 32)
rows whatever the window), f16 weights, f16 K/V. Each timed step commits n_new = q_len/2 + 1 new
positions; the steps end at window W (the first starts at W - (reps - 1) * n_new, at least 1).
Both backends get the same weights, features and noise, and their outputs must be bit-identical.
`--n-new` sets the positions committed per step; `--inputs tokens` feeds the noise block as token
ids looked up on the device (`step_tokens`, a cache built with `embed_tokens`) instead of
embeddings uploaded by the host (`step`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before ggml loads (see docs/rpc.md)

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pyggml_dkv import Backend, DraftConfig, DraftKvCache, DraftWeights, FeatureRing  # noqa: E402
from pyggml_dkv.serving import RpcServerProcess  # noqa: E402
from pyggml_dkv.serving.traffic import CountingRelay  # noqa: E402

CAP = 4096
CONFIGS = {
    "toy": DraftConfig.toy(),
    "small": DraftConfig(
        hidden=1024, n_layer=5, n_head=16, n_head_kv=4, head_dim=64, ffn=3072, block_size=16, n_target_layers=5
    ),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Run:
    """One cache on one backend, stepped through the timed trajectory."""

    def __init__(self, backend: Backend, weights: DraftWeights, feats: np.ndarray, embed: np.ndarray | None) -> None:
        self.backend = backend
        self.bw = weights.to_backend(backend, "f16")
        self.cache = DraftKvCache(self.bw, backend, CAP, cache_type="f16", embed_tokens=embed)
        self.feats = feats
        self.cfg = weights.cfg

    def _step(self, ring: FeatureRing, committed: int, noise: np.ndarray) -> np.ndarray:
        if self.cache.inp_tokens is not None:  # token ids: the bonus token, then mask tokens
            ids = np.full(self.cfg.block_size, 1, dtype=np.int32)
            ids[0] = committed % 997
            return self.cache.step_tokens(ring, committed, ids, output="hidden")
        block = noise.copy()  # the bonus token's embedding changes every step, the mask token's rows do not
        block[0] = np.random.default_rng(committed).standard_normal(self.cfg.hidden)
        return self.cache.step(ring, committed, block)

    def steps(self, commits: list[int], noise: np.ndarray, on_step=None) -> tuple[list[float], list[np.ndarray]]:  # noqa: ANN001
        ring = FeatureRing(CAP + 64, self.cfg.fc_in)
        self.cache.reset()
        ring.append(self.feats[: commits[0] - 1])
        self._step(ring, commits[0] - 1, noise)  # the bulk fill up to the first step, not timed
        written = commits[0] - 1
        times, outs = [], []
        for c in commits:
            ring.append(self.feats[written:c])
            written = c
            mark = on_step() if on_step else None
            t0 = time.perf_counter()
            outs.append(self._step(ring, c, noise))
            times.append(time.perf_counter() - t0)
            if on_step:
                on_step(mark)
        return times, outs

    def close(self) -> None:
        self.cache.close()
        self.bw.close()


def stats_ms(samples: list[float]) -> dict:
    a = np.array(samples) * 1e3
    return {"median_ms": round(float(np.median(a)), 3), "p10_ms": round(float(np.percentile(a, 10)), 3)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="small")
    ap.add_argument("--windows", default="64,2048")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--n-new", type=int, default=None, help="positions committed per step (default q_len/2 + 1)")
    ap.add_argument("--inputs", choices=("embed", "tokens"), default="embed")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    windows = [int(w) for w in args.windows.split(",")]
    results = []
    with RpcServerProcess(free_port(), threads=args.threads) as server:
        for name in args.configs.split(","):
            cfg = CONFIGS[name]
            weights = DraftWeights.random(cfg, seed=0)
            feats = np.random.default_rng(1).standard_normal((max(windows) + 64, cfg.fc_in)).astype(np.float32)
            noise = np.random.default_rng(2).standard_normal((cfg.block_size, cfg.hidden)).astype(np.float32)
            n_new = args.n_new or cfg.block_size // 2 + 1
            embed = (
                np.random.default_rng(3).standard_normal((1000, cfg.hidden)).astype(np.float32)
                if args.inputs == "tokens"
                else None
            )
            local = Run(Backend("cpu", n_threads=args.threads), weights, feats, embed)
            for w in windows:
                commits = [c for c in (w - i * n_new for i in reversed(range(args.reps))) if c >= 2]
                # bytes: through the relay (its own Backend: one per server per process, so in turn)
                with CountingRelay(server.port) as relay:
                    be = Backend(f"rpc:127.0.0.1:{relay.port}")
                    counted = Run(be, weights, feats, embed)
                    per_step: list[tuple[int, int]] = []

                    def count(mark=None):  # noqa: ANN001, ANN202
                        if mark is None:
                            return relay.snapshot()
                        per_step.append(relay.since(mark))  # noqa: B023 (called within this iteration)
                        return None

                    counted.steps(commits, noise, count)
                    counted.close()
                    be.close()
                sent = int(np.median([s for s, _ in per_step[1:]]))
                received = int(np.median([r for _, r in per_step[1:]]))
                # latency: local and direct RPC, alternating runs
                remote_be = Backend(server.spec)
                remote = Run(remote_be, weights, feats, embed)
                t_local, o_local = local.steps(commits, noise)
                t_rpc, o_rpc = remote.steps(commits, noise)
                t_local2, _ = local.steps(commits, noise)
                t_rpc2, _ = remote.steps(commits, noise)
                identical = all(np.array_equal(a, b) for a, b in zip(o_local, o_rpc))
                remote.close()
                remote_be.close()
                row = {
                    "config": name,
                    "window": w,
                    "n_new": n_new,
                    "inputs": args.inputs,
                    "threads": args.threads,
                    "steps": len(commits),
                    "local": stats_ms(t_local + t_local2),
                    "rpc": stats_ms(t_rpc + t_rpc2),
                    "rpc_sent_bytes_per_step": sent,
                    "rpc_received_bytes_per_step": received,
                    "bit_identical": identical,
                }
                results.append(row)
                print(
                    f"{name:6} W={w:5} n_new={n_new} {args.inputs:6}  local {row['local']['median_ms']:8.2f} ms   rpc {row['rpc']['median_ms']:8.2f} ms"
                    f"   sent {sent / 1024:7.1f} KiB  received {received / 1024:6.1f} KiB  identical={identical}",
                    flush=True,
                )
            local.close()
            local.backend.close()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
