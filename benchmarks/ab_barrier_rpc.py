"""The node barrier (P2, barrier-futex) measured side by side: the same drafter step on two RPC
servers over loopback, llama.cpp's own `ggml-rpc-server` (ggml 0.25.3 unpatched: `omp barrier`)
and ours with PYGGML_DKV_GGML_KERNELS_ONLY=1 (the same ggml release and ggml's own kernels, with
our patches: the barrier; the argmax patch does not enter a hidden-state step). Steps alternate
between the two servers; one OMP_WAIT_POLICY for both per row.

    python benchmarks/ab_barrier_rpc.py --threads 2 --window 1024
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

from machine import cpu_family_model, cpu_name
from pyggml_dkv import Backend, DraftConfig, DraftKvCache, DraftWeights, FeatureRing
from pyggml_dkv.serving import RpcServerProcess

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(hidden=1024, n_layer=5, n_head=16, n_head_kv=4, head_dim=64, ffn=3072, block_size=16, n_target_layers=5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--dtype", default="f16")
    ap.add_argument("--policies", default="PASSIVE,ACTIVE")
    args = ap.parse_args()
    binary = subprocess.run(
        ["bash", str(ROOT / "scripts/build_llama_cpp_tool.sh"), "ggml-rpc-server"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    cfg = DraftConfig(**SMALL, vocab=1000, mask_token_id=2, target_layer_ids=[1, 8, 15, 22, 29])
    w = DraftWeights.random(cfg, seed=0)
    W, n_new = args.window, cfg.block_size // 2 + 1
    n_pos = W + (args.steps + 4) * n_new
    feats = np.random.default_rng(1).standard_normal((n_pos, cfg.fc_in)).astype(np.float32)
    noise = np.random.default_rng(2).standard_normal((cfg.block_size, cfg.hidden)).astype(np.float32)
    print(
        f"CPU: {cpu_name()} ({cpu_family_model()}), server threads {args.threads}, small drafter {args.dtype}, "
        f"window {W}, {n_new} new rows a step; median ms of {args.steps} steps each"
    )
    for policy in args.policies.split(","):
        env = dict(os.environ, OMP_WAIT_POLICY=policy)
        ours_env = dict(env, PYGGML_DKV_GGML_KERNELS_ONLY="1")
        with (
            RpcServerProcess.llama_cpp(binary, free_port(), threads=args.threads, env=env) as llama,
            RpcServerProcess(free_port(), threads=args.threads, env=ours_env) as ours,
        ):
            sides = {}
            for name, srv in (("llama.cpp ggml-rpc-server", llama), ("ours, ggml kernels", ours)):
                be = Backend(srv.spec, device_type="cpu")
                bw = w.to_backend(be, args.dtype, repack=False)
                cache = DraftKvCache(bw, be, W + (args.steps + 4) * n_new, cache_type="f16")
                ring = FeatureRing(n_pos, cfg.fc_in)
                ring.append(feats)
                cache.step(ring, W, noise)
                sides[name] = (be, bw, cache, ring, [W], [])
            for _ in range(args.steps):
                for _be, _bw, cache, ring, committed, times in sides.values():
                    committed[0] += n_new
                    t0 = time.perf_counter()
                    cache.step(ring, committed[0], noise)
                    times.append(time.perf_counter() - t0)
            med = {name: 1e3 * statistics.median(s[5]) for name, s in sides.items()}
            a, b = med.values()
            print(
                f"OMP_WAIT_POLICY={policy:8s} "
                + "  ".join(f"{k}: {v:.2f}" for k, v in med.items())
                + f"  ours/llama.cpp {b / a:.2f}"
            )
            for be, bw, cache, *_ in sides.values():
                cache.close()
                bw.close()
                be.close()


if __name__ == "__main__":
    main()
