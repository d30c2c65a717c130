"""What the step benchmark runs: configs, windows, systems, the speed targets, and its log."""

from __future__ import annotations

import sys

CAP = 4096
CONFIGS = {
    "toy": dict(hidden=256, n_layer=2, n_head=4, n_head_kv=2, head_dim=64, ffn=512, block_size=16, n_target_layers=3),
    "small": dict(
        hidden=1024, n_layer=5, n_head=16, n_head_kv=4, head_dim=64, ffn=3072, block_size=16, n_target_layers=5
    ),
    "qwen3-8b": dict(
        hidden=4096, n_layer=5, n_head=32, n_head_kv=8, head_dim=128, ffn=12288, block_size=16, n_target_layers=5
    ),
}
# default repetitions (timed steps per system per window); the one-shot graph is costly at big windows
DEFAULT_REPS = {"toy": 30, "small": 15, "qwen3-8b": 5}
DEFAULT_ONESHOT_REPS = {"toy": 30, "small": 8, "qwen3-8b": 3}
WINDOWS = (64, 256, 1024, 2048, 4096)
SYSTEMS = ("kv_f16", "kv_q8", "kv_q8_attbf16", "kv_bf16", "kv_q8_generic", "raw", "oneshot", "torch_fp32", "torch_bf16")
# timed only on request (--generic-q8): the q8_0 path of a CPU without AMX before old patch 0010
OPTIONAL_SYSTEMS = ("kv_q8_generic",)
KV_SYSTEMS = ("kv_f16", "kv_q8", "kv_q8_attbf16", "kv_bf16")
TORCH_SYSTEMS = ("torch_fp32", "torch_bf16")

# speed targets
FLAT_MAX = 1.8
RECOMPUTE_MIN = 10.0
TORCH_MIN = 2.0
OVERHEAD_MAX = 1.10
ROOF_MAX = 1.5


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
