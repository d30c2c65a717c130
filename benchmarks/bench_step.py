"""Step benchmark: one draft step of the ring cache vs the one-shot graph vs PyTorch dflash.

    python benchmarks/bench_step.py --quick                  # < 2 min on 2 cores: toy + small, windows 64/1024
    python benchmarks/bench_step.py --configs small          # the full small config, every window
    python benchmarks/bench_step.py --configs qwen3-8b --reps 5 --json out.json --plot out.png
    python benchmarks/bench_step.py --configs small --profile  # + per-op time of the cache's step graph

Systems, each timed for ONE draft step at a context window of W positions:
  kv_f16     DraftKvCache, f16 weights, f16 K/V cache: cache.step(ring, committed, noise)
  kv_q8      DraftKvCache, q8_0 weights (in ggml's AMX buffer on CPUs with AMX), f16 K/V cache
  kv_q8_attbf16  the same with attention="bf16": attention's two products with bf16 inputs on AMX
             tiles (vendor/patches/0009), else on AVX512-BF16 (0011); PyTorch-bf16 precision; left
             out when ggml lacks the patch
  kv_q8_generic  (--generic-q8) kv_q8 with its q8_0 weights in the ordinary buffer: ggml's generic
             q8_0 kernels, the path of a CPU without AMX before patch 0010 (not in the targets)
  raw        kv_f16's step graph alone: cache.gf.compute(backend) after begin_step + inp_embed upload
             (so step()/raw shows the host overhead of step(): checks, ring copy, masks, uploads, download)
  oneshot    OneShotDrafter, f16 weights: recomputes features + context K/V of the whole window
             (its graph for a W-row window is built once, before timing, and reused step to step)
  torch_fp32 the PyTorch reference (dflash DFlashDraftModel) on the CPU in float32, with its DynamicCache
  torch_bf16 the same in bfloat16
Every system sees the same weights, the same features and the same noise block.

What one step is. Per step `n_new` (default q_len/2 + 1: half the block accepted + the bonus token)
new context rows are committed and the q_len noise rows are drafted:
  * kv_*: the caches are built with cap=4096 (the production geometry: attention always spans
    kv_total = align_up(4096 + q_len + 1, 32) rows, masks carry the window). Before each timed step
    the cache is rewound by n_new positions (DraftKvCache.rewind: a partial rewind, host
    bookkeeping only, no device work), so every
    timed step folds in exactly n_new rows through the step graph's fold-in path and attends to
    exactly W context positions, like the steady state of a request whose window is W.
    `--cap-per-window` instead builds a cache with cap=W per window and lets committed grow by
    n_new per step (window = min(committed, cap) = W, the ring wraps; nothing internal is touched,
    but the attention span is then W + q_len, not 4096 + q_len).
  * torch_*: dflash_generate's draft call: the DynamicCache holds W - n_new positions, the model gets
    the n_new new feature rows + the noise block (position_ids from W - n_new), the cache is cropped
    back to W (`_crop_to`, as dflash_generate does). The crop back to W - n_new before the next
    step is a view and is not timed.
  * oneshot: step(ring, committed=W, noise): reads the W window rows and recomputes everything.
Systems run interleaved: each repetition steps every system once, in an order rotated per
repetition, so machine noise (other processes, turbo, caches) hits all alike.

Machine probes: memory bandwidth (a 512 MiB numpy copy, read+write bytes / s) and dense matmul rate
(a 2048^3 numpy float32 matmul), each trial the best of 1 thread and `--threads` threads (on a shared
or hyperthreaded machine a second thread may not help); measured before and after the runs, the
medians of all trials are used.
Instruction peaks (benchmarks/peak_probe.py): the measured rate of vpdpbusd (AVX512-VNNI), vfmadd231ps
(f32 FMA) and vdpbf16ps (AVX512-BF16) on registers, on `--threads` threads, best of 3, before and after
the runs (median used). Where the products run on those instructions (no AMX: the f16 kernel of
patch 0004 and f32 attention on FMAs, q8_0 on VNNI (0010), attention="bf16" on vdpbf16ps (0011)) the
roofline's compute time is the sum over product kinds of multiply-adds / that instruction's peak;
elsewhere (a CPU with AMX in use: every system; no AVX-512; no compiler for the probe) it is
flops / the numpy matmul rate.
Roofline per window and weight type: max(bytes / bandwidth, compute time) with
  bytes = every weight once (as stored) + the window's K/V (2 * n_layer * W * n_head_kv*head_dim * 2 B)
          + the new feature rows (n_new * fc_in * 4 B)
  flops = 2 * (layer matrices) * q_len                      noise forward
        + 2 * (fc + per-layer wk, wv) * n_new                fold-in of the new rows
        + 2 * 2 * n_head * head_dim * q_len * (W + q_len) * n_layer   attention
(the step graph really folds in a_step = 2*q_len + 2 padded rows: "flops_graph" in the JSON).

Speed targets are printed with PASS/MISS:
  flat          kv_f16 @4096 / @64 <= 1.8                   (small)
  vs recompute  oneshot / kv_f16 @2048 >= 10                (small)
  vs PyTorch    min(torch_fp32, torch_bf16) / min(kv_*) >= 2 at every window (small); the same with
                f32 attention only (kv_f16, kv_q8) is printed as information
  host overhead kv_f16 / raw <= 1.10 at every window        (small)
  roofline      the best cache (kv_f16 vs roofline(f16), kv_q8 vs roofline(q8_0), kv_q8_attbf16 vs its own with bf16 attention) <= 1.5 x its roofline
                at every window (small, qwen3-8b); each weight type's own ratio is shown too
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import time
from pathlib import Path


# ---------------------------------------------------------------------------- thread env (before numpy)
def _early_threads(argv: list[str]) -> int:
    for i, a in enumerate(argv):
        if a == "--threads" and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith("--threads="):
            return int(a.split("=", 1)[1])
    return 2


def _early_wait_policy(argv: list[str]) -> str:
    for i, a in enumerate(argv):
        if a == "--omp-wait-policy" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--omp-wait-policy="):
            return a.split("=", 1)[1]
    return os.environ.get("OMP_WAIT_POLICY", "passive")


_THREADS = _early_threads(sys.argv[1:])
for _var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS"):
    os.environ[_var] = str(_THREADS)
# OpenMP (ggml's and torch's) must read this before their runtimes start. With the default
# (spinning) policy, on a machine where other processes compete for the cores, every ggml node
# cost a scheduler slice: toy steps took ~380 ms instead of ~5 ms. See README.
_WAIT_POLICY = _early_wait_policy(sys.argv[1:])
if _WAIT_POLICY != "default":
    os.environ["OMP_WAIT_POLICY"] = _WAIT_POLICY.upper()

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from pyggml_dkv.common.numeric import relative_error  # noqa: E402
from pyggml_dkv import Backend, DraftConfig, DraftKvCache, DraftWeights, FeatureRing, OneShotDrafter  # noqa: E402
from pyggml_dkv.ggml import bf16_attention_kernel, bf16_attention_supported, built_with_patches, cpu_features, cuda_graph_stats  # noqa: E402
from pyggml_dkv.model.tensor_names import expected_shapes, is_norm  # noqa: E402
from peak_probe import probe_peaks  # noqa: E402

CAP = 4096
CONFIGS = {
    "toy": dict(hidden=256, n_layer=2, n_head=4, n_head_kv=2, head_dim=64, ffn=512, block_size=16, n_target_layers=3),
    "small": dict(hidden=1024, n_layer=5, n_head=16, n_head_kv=4, head_dim=64, ffn=3072, block_size=16, n_target_layers=5),
    "qwen3-8b": dict(hidden=4096, n_layer=5, n_head=32, n_head_kv=8, head_dim=128, ffn=12288, block_size=16, n_target_layers=5),
}
# default repetitions (timed steps per system per window); the one-shot graph is costly at big windows
DEFAULT_REPS = {"toy": 30, "small": 15, "qwen3-8b": 5}
DEFAULT_ONESHOT_REPS = {"toy": 30, "small": 8, "qwen3-8b": 3}
WINDOWS = (64, 256, 1024, 2048, 4096)
SYSTEMS = ("kv_f16", "kv_q8", "kv_q8_attbf16", "kv_q8_generic", "raw", "oneshot", "torch_fp32", "torch_bf16")
# timed only on request (--generic-q8): the q8_0 path of a CPU without AMX before patch 0010
OPTIONAL_SYSTEMS = ("kv_q8_generic",)
KV_SYSTEMS = ("kv_f16", "kv_q8", "kv_q8_attbf16")
TORCH_SYSTEMS = ("torch_fp32", "torch_bf16")

# speed targets
FLAT_MAX = 1.8
RECOMPUTE_MIN = 10.0
TORCH_MIN = 2.0
OVERHEAD_MAX = 1.10
ROOF_MAX = 1.5


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- inputs
def random_weights(cfg: DraftConfig, seed: int = 0) -> DraftWeights:
    return DraftWeights.random(cfg, seed)  # float32 draws in place: fine for qwen3-8b's ~1e9 parameters


def stats(samples_s: list[float]) -> dict:
    a = np.asarray(samples_s, dtype=np.float64) * 1e3
    if a.size == 0:
        return {"n": 0}
    return {"n": int(a.size), "median_ms": float(np.median(a)), "p10_ms": float(np.percentile(a, 10)),
            "p90_ms": float(np.percentile(a, 90)), "min_ms": float(a.min()), "samples_ms": [round(float(x), 4) for x in a]}


# ---------------------------------------------------------------------------- machine probes
def probe_bandwidth(threads: int, trials: int = 5, mib: int = 512) -> list[float]:
    """GB/s of a large numpy copy, counting read + write bytes; best of 1 thread and `threads` threads per trial."""
    from concurrent.futures import ThreadPoolExecutor

    n = mib * 2**20 // 4
    src = np.ones(n, np.float32)
    dst = np.zeros_like(src)
    parts = [slice(i * n // threads, (i + 1) * n // threads) for i in range(threads)]

    def copy(s: slice) -> None:
        np.copyto(dst[s], src[s])

    out = []
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(copy, parts))
        np.copyto(dst, src)
        for _ in range(trials):
            t = time.perf_counter()
            np.copyto(dst, src)
            one = time.perf_counter() - t
            t = time.perf_counter()
            list(ex.map(copy, parts))
            many = time.perf_counter() - t
            out.append(2 * src.nbytes / min(one, many) / 1e9)
    return out


def _blas_set_threads():  # noqa: ANN202
    """A setter for numpy's OpenBLAS thread count (None when it cannot be found)."""
    import ctypes
    import glob

    libdir = Path(np.__file__).resolve().parent.parent / "numpy.libs"
    for lib in glob.glob(str(libdir / "libscipy_openblas*.so*")) + glob.glob(str(libdir / "libopenblas*.so*")):
        try:
            handle = ctypes.CDLL(lib)
        except OSError:
            continue
        for sym in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads64_",
                    "openblas_set_num_threads"):
            fn = getattr(handle, sym, None)
            if fn is not None:
                return lambda n, fn=fn: fn(ctypes.c_int(n))
    return None


def probe_matmul(threads: int, trials: int = 5, n: int = 2048) -> list[float]:
    """GFLOP/s of an n^3 numpy float32 matmul: best of 1 and `threads` BLAS threads per trial (on a shared or
    hyperthreaded machine the second thread may not help; the roofline should use the best rate seen)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    setter = _blas_set_threads() if threads > 1 else None
    counts = [threads, 1] if setter is not None else [threads]
    out = []
    try:
        for k in counts:
            if setter is not None:
                setter(k)
            a @ b
        for _ in range(trials):
            best = 0.0
            for k in counts:
                if setter is not None:
                    setter(k)
                t = time.perf_counter()
                a @ b
                best = max(best, 2 * n**3 / (time.perf_counter() - t) / 1e9)
            out.append(best)
    finally:
        if setter is not None:
            setter(threads)
    return out


# ---------------------------------------------------------------------------- cost model
def cost_model(cfg: DraftConfig, window: int, n_new: int, weight_bytes: int, a_step: int) -> dict:
    h, hd, q = cfg.hidden, cfg.head_dim, cfg.block_size
    kv_w = cfg.n_head_kv * hd
    layer_params = h * cfg.n_head * hd * 2 + h * kv_w * 2 + 3 * h * cfg.ffn  # wq, wo, wk, wv, gate/up/down
    fold_params = cfg.fc_in * h + cfg.n_layer * 2 * h * kv_w  # fc + wk, wv per layer
    attn = 2 * 2 * cfg.n_head * hd * q * (window + q) * cfg.n_layer
    flops = 2 * layer_params * cfg.n_layer * q + 2 * fold_params * n_new + attn
    flops_graph = 2 * layer_params * cfg.n_layer * q + 2 * fold_params * a_step + attn
    kv_bytes = 2 * cfg.n_layer * window * kv_w * 2
    nbytes = weight_bytes + kv_bytes + n_new * cfg.fc_in * 4
    return {"flops": flops, "flops_graph": flops_graph, "flops_attention": attn, "bytes": nbytes,
            "bytes_weights": weight_bytes, "bytes_kv": kv_bytes}


def roofline_s(cost: dict, bw_gbs: float, gflops: float, peaks: dict | None = None,
               matmul_instr: str | None = None, attention_instr: str | None = None) -> dict:
    """max(memory time, compute time). Compute time: with both products' instructions known and
    measured (`peaks`: instruction -> G multiply-adds / s), matmul MACs / peak(matmul_instr) +
    attention MACs / peak(attention_instr); otherwise flops / the numpy matmul rate `gflops`."""
    t_mem = cost["bytes"] / (bw_gbs * 1e9)
    peaks = peaks or {}
    if peaks.get(matmul_instr) and peaks.get(attention_instr):
        t_mm = (cost["flops"] - cost["flops_attention"]) / 2 / (peaks[matmul_instr] * 1e9)
        t_att = cost["flops_attention"] / 2 / (peaks[attention_instr] * 1e9)
        t_flop, source = t_mm + t_att, f"{matmul_instr}+{attention_instr}"
    else:
        t_flop, source = cost["flops"] / (gflops * 1e9), "numpy sgemm"
    return {"ms": 1e3 * max(t_mem, t_flop), "mem_ms": 1e3 * t_mem, "flop_ms": 1e3 * t_flop,
            "bound": "memory" if t_mem >= t_flop else "compute", "compute_rate_source": source}


def kernels_used(kind: str, repack_kind: str | None, attention: str) -> dict:
    """Which CPU kernel runs a cache system's matrix products and attention, and the instruction
    the roofline charges them to (None: not one we probe, e.g. AMX tiles)."""
    feats = cpu_features()
    patches = set(built_with_patches())
    if kind == "f16":
        if feats["avx512"] and "0004-cpu-mul-mat-f16-narrow.patch" in patches:
            mm = ("f16 weights x f32 rows, AVX-512 FMA (patch 0004)", "vfmadd231ps")
        else:
            mm = ("ggml f16 (llamafile tinyBLAS)", None)
    elif repack_kind == "AMX":
        mm = ("q8_0 on AMX int8 tiles (patches 0002, 0007)", None)
    elif repack_kind == "CPU_REPACK":
        mm = ("q8_0 x q8_0 rows, AVX512-VNNI vpdpbusd (patch 0010)", "vpdpbusd")
    else:
        mm = ("ggml generic q8_0 (vec_dot / llamafile tinyBLAS)", None)
    f32_att = ("tiled f32, AVX-512 FMA (patches 0003, 0006)", "vfmadd231ps") if feats["avx512"] else ("ggml f32", None)
    att = f32_att
    if attention == "bf16":
        att = {"amx": ("bf16 products on AMX-BF16 tiles (patch 0009)", None),
               "avx512_bf16": ("bf16 products, AVX512-BF16 vdpbf16ps (patch 0011)", "vdpbf16ps")}.get(bf16_attention_kernel(), f32_att)
    if feats["amx_usable"]:
        # AMX tiles are not probed: on such a CPU every roofline keeps the numpy rate (as before
        # issue 17), so its figures stay comparable with earlier runs
        mm, att = (mm[0], None), (att[0], None)
    return {"matmul": mm[0], "matmul_instr": mm[1], "attention": att[0], "attention_instr": att[1]}


# ---------------------------------------------------------------------------- per-op profiler
class OpProfiler:
    """Times every node of a built ggml graph on its own (a one-node graph per node).

    Each node is put alone in a one-node graph of its own (ggml_graph_add_node), which the backend
    computes like the whole graph's node. Each per-node compute pays the CPU backend's per-graph
    overhead (plan + OpenMP fork/join); that overhead is measured on no-op nodes
    (VIEW/RESHAPE/PERMUTE) and subtracted.
    """

    NOOPS = {"NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"}

    def __init__(self, graph, backend, noise_input) -> None:  # noqa: ANN001
        from pyggml_dkv.ggml import Context
        from pyggml_dkv.ggml._lowlevel import ffi as pffi
        from pyggml_dkv.ggml._lowlevel import lib as plib

        addr = lambda p: int(pffi.cast("uintptr_t", p))  # noqa: E731
        self.graph = graph
        self.backend = backend
        self.n = graph.n_nodes
        self.lib = plib
        self.views_ctx = Context(mem_size=self.n * int(plib.ggml_graph_overhead_custom(1, False)) + 1024)
        self.views = []
        for i in range(self.n):
            view = plib.ggml_new_graph_custom(self.views_ctx.handle, 1, False)
            plib.ggml_graph_add_node(view, graph.node(i).ptr)
            self.views.append(view)
        # classify the nodes: phase (fold-in / noise: depends on the noise input) and kind
        noise_dep = {addr(noise_input.ptr)}
        self.labels = []
        for i in range(self.n):
            node = graph.node(i)
            p = node.ptr
            srcs = [p.src[j] for j in range(10) if p.src[j] != pffi.NULL]
            if p.view_src != pffi.NULL:
                srcs.append(p.view_src)
            noisy = any(addr(s) in noise_dep for s in srcs)
            if noisy:
                noise_dep.add(addr(p))
            op = node.op
            weight = ""
            if op == "MUL_MAT" and srcs:
                w = pffi.string(plib.ggml_get_name(srcs[0])).decode()
                weight = w.rsplit(".", 2)[-2] if w.endswith(".weight") else w
            if op in self.NOOPS:
                kind = "no-op"
            elif op == "MUL_MAT":
                kind = "matmul"
            elif op == "FLASH_ATTN_EXT":
                kind = "attention"
            elif op in ("SET_ROWS", "GET_ROWS", "CPY", "CONT", "DUP"):
                kind = "copy/rows"
            else:
                kind = "elementwise"  # norms, rope, add, mul, silu, ...
            self.labels.append({"i": i, "op": op, "phase": "noise" if noisy else "fold-in", "kind": kind, "weight": weight})

    def run(self) -> list[float]:
        times = []
        with self.backend.lock:
            for v in self.views:
                t = time.perf_counter()
                status = self.lib.ggml_backend_graph_compute(self.backend.handle, v)
                times.append(time.perf_counter() - t)
                if status != 0:
                    raise RuntimeError(f"per-node compute failed with status {status}")
        return times

    def summarize(self, runs: list[list[float]]) -> dict:
        # min over repetitions per node: interference from other processes only ever adds time
        per_node = np.min(np.asarray(runs), axis=0)
        noop = [per_node[l["i"]] for l in self.labels if l["kind"] == "no-op"]
        overhead = float(np.median(noop)) if noop else 0.0
        groups: dict[str, float] = {}
        by_weight: dict[str, float] = {}
        by_op: dict[str, float] = {}  # the other ops, by ggml op
        for lab in self.labels:
            if lab["kind"] == "no-op":
                continue
            t = max(float(per_node[lab["i"]]) - overhead, 0.0)
            key = f"{lab['phase']}:{lab['kind']}"
            groups[key] = groups.get(key, 0.0) + t
            if lab["kind"] == "matmul":
                wk = f"{lab['phase']}:{lab['weight']}"
                by_weight[wk] = by_weight.get(wk, 0.0) + t
            elif lab["kind"] in ("elementwise", "copy/rows"):
                by_op[lab["op"]] = by_op.get(lab["op"], 0.0) + t
        total = sum(groups.values())
        return {"overhead_per_node_ms": 1e3 * overhead, "n_nodes": self.n,
                "n_compute_nodes": sum(1 for l in self.labels if l["kind"] != "no-op"),
                "groups_ms": {k: 1e3 * v for k, v in sorted(groups.items())},
                "matmul_by_weight_ms": {k: 1e3 * v for k, v in sorted(by_weight.items())},
                "other_by_op_ms": {k: 1e3 * v for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])},
                "sum_ms": 1e3 * total}


# ---------------------------------------------------------------------------- systems
def no_grad():  # noqa: ANN201
    """torch.inference_mode() when torch is loaded (the torch steps run under it anyway), else nothing."""
    if "torch" in sys.modules:
        return sys.modules["torch"].inference_mode()
    import contextlib

    return contextlib.nullcontext()


def rewind_cache(cache: DraftKvCache, pos: int) -> None:
    """Drop positions >= pos from the cache (DraftKvCache.rewind: no device work); the next
    begin_step folds them in again through the step graph's fold-in, as in a steady-state step."""
    if cache.next_pos > pos:
        cache.rewind(pos)


class KvSystem:
    """A DraftKvCache kept at window W; `prepare` (untimed) sets it up for the next step."""

    def __init__(self, name: str, weights, backend, cap_per_window: bool, attention: str = "f32") -> None:  # noqa: ANN001
        self.name, self.weights, self.backend = name, weights, backend
        self.cap_per_window, self.attention = cap_per_window, attention
        self.cache: DraftKvCache | None = None if cap_per_window else DraftKvCache(weights, backend, CAP, attention=attention)
        self.committed = 0

    def start_window(self, ring: FeatureRing, window: int, noise: np.ndarray) -> np.ndarray:
        """Bring the cache to committed = window (bulk-appending what is missing); returns that step's output."""
        if self.cap_per_window:
            if self.cache is not None:
                self.cache.close()
            self.cache = DraftKvCache(self.weights, self.backend, window, attention=self.attention)
        self.committed = window
        return self.cache.step(ring, window, noise)

    def prepare(self, n_new: int) -> int:
        if self.cap_per_window:
            self.committed += n_new
        else:
            rewind_cache(self.cache, self.committed - n_new)
        return self.committed

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()


class Bench:
    def __init__(self, name: str, args: argparse.Namespace, systems: list[str]) -> None:
        self.name = name
        self.args = args
        self.cfg = DraftConfig(**CONFIGS[name])
        self.systems = systems
        self.backend = Backend("cpu", n_threads=args.threads) if args.backend == "cpu" else Backend(args.backend)
        self.n_new = args.n_new or self.cfg.block_size // 2 + 1
        self.windows = [w for w in args.windows if w <= CAP]
        self.reps = args.reps or DEFAULT_REPS[name]
        self.oneshot_reps = min(args.oneshot_reps or DEFAULT_ONESHOT_REPS[name], self.reps)
        self.weight_bytes = {dt: weight_nbytes(self.cfg, dt) for dt in ("f16", "q8_0")}

    # -- setup
    def setup(self) -> None:
        cfg, args = self.cfg, self.args
        t0 = time.perf_counter()
        self.host = random_weights(cfg, seed=0)
        log(f"[{self.name}] random weights: {self.host.n_params / 1e6:.1f} M parameters ({time.perf_counter() - t0:.1f} s)")
        max_w = max(self.windows)
        steps = (self.reps + 8) * len(self.windows) if args.cap_per_window else 0
        self.n_pos = max_w + steps * self.n_new + cfg.block_size + 64
        rng = np.random.default_rng(1)
        self.feats = rng.standard_normal((self.n_pos, cfg.fc_in), dtype=np.float32)
        self.noise = rng.standard_normal((cfg.block_size, cfg.hidden), dtype=np.float32)
        self.ring = FeatureRing(self.n_pos, cfg.fc_in)
        self.ring.append(self.feats)
        self.bw = {}
        self.kv: dict[str, KvSystem] = {}
        sys_ = set(self.systems)
        if "kv_q8_attbf16" in sys_ and not bf16_attention_supported():
            log(f"[{self.name}] kv_q8_attbf16 left out: ggml was built without vendor/patches/0009")
            self.systems = [s for s in self.systems if s != "kv_q8_attbf16"]
            sys_.discard("kv_q8_attbf16")
        need = {"f16": bool(sys_ & {"kv_f16", "raw", "oneshot"}), "q8_0": bool(sys_ & {"kv_q8", "kv_q8_attbf16"})}
        for dtype in ("f16", "q8_0"):
            if need[dtype]:
                t0 = time.perf_counter()
                self.bw[dtype] = self.host.to_backend(self.backend, dtype)
                log(f"[{self.name}] {dtype} weights uploaded: {self.bw[dtype].nbytes / 2**20:.0f} MiB ({time.perf_counter() - t0:.1f} s)")
        if sys_ & {"kv_f16", "raw"}:  # raw times kv_f16's step graph
            self.kv["kv_f16"] = KvSystem("kv_f16", self.bw["f16"], self.backend, args.cap_per_window)
        if "kv_q8" in sys_:
            self.kv["kv_q8"] = KvSystem("kv_q8", self.bw["q8_0"], self.backend, args.cap_per_window)
        if "kv_q8_generic" in sys_:
            self.bw["q8_0_generic"] = self.host.to_backend(self.backend, "q8_0", repack=False)
            self.kv["kv_q8_generic"] = KvSystem("kv_q8_generic", self.bw["q8_0_generic"], self.backend, args.cap_per_window)
        if "kv_q8_attbf16" in sys_:
            self.kv["kv_q8_attbf16"] = KvSystem("kv_q8_attbf16", self.bw["q8_0"], self.backend, args.cap_per_window,
                                                attention="bf16")
        self.oneshot = OneShotDrafter(self.bw["f16"], self.backend, CAP) if "oneshot" in self.systems else None
        self.kernels = {}
        if self.backend.is_cpu:
            for sysname, bw_key, dt, att in (("kv_f16", "f16", "f16", "f32"), ("kv_q8", "q8_0", "q8_0", "f32"),
                                             ("kv_q8_attbf16", "q8_0", "q8_0", "bf16"),
                                             ("kv_q8_generic", "q8_0_generic", "q8_0", "f32")):
                if sysname in self.kv:
                    self.kernels[sysname] = kernels_used(dt, self.bw[bw_key].repack_kind, att)
        self.torch = {}
        for sysname in TORCH_SYSTEMS:
            if sysname in self.systems:
                import _torch_ref as TR

                t0 = time.perf_counter()
                dtype = sysname.split("_")[1]
                model = TR.build_model(self.host, dtype)
                drafter = TR.TorchDrafter(model, dtype, self.feats)
                self.torch[sysname] = (drafter, drafter.noise(self.noise))
                log(f"[{self.name}] torch {dtype} model built ({time.perf_counter() - t0:.1f} s)")

    def close(self) -> None:
        for s in self.kv.values():
            s.close()
        if self.oneshot is not None:
            self.oneshot.close()
        for bw in self.bw.values():
            bw.close()
        self.torch.clear()
        if getattr(self, "_prof_backend", None) is not None:
            self._prof_backend.close()
        self.backend.close()

    # -- one timed step per system
    def _runner(self, sysname: str, window: int):  # noqa: ANN202
        """(prepare, step): prepare is untimed, step is the timed draft step."""
        n = self.n_new
        if sysname in self.kv:
            ks = self.kv[sysname]
            state = {}

            def prep() -> None:
                state["c"] = ks.prepare(n)

            def step():  # noqa: ANN202
                return ks.cache.step(self.ring, state["c"], self.noise)
            return prep, step
        if sysname == "raw":
            ks = self.kv["kv_f16"]

            def prep() -> None:
                c = ks.prepare(n)
                ks.cache.begin_step(self.ring, c)
                ks.cache.inp_embed.set(self.noise)

            def step():  # noqa: ANN202
                ks.cache.gf.compute(self.backend)
            return prep, step
        if sysname == "oneshot":
            return (lambda: None), (lambda: self.oneshot.step(self.ring, window, self.noise))
        drafter, tnoise = self.torch[sysname]
        return (lambda: drafter.rewind(window - n)), (lambda: drafter.step(window, n, tnoise))

    def run_window(self, window: int) -> dict:
        n = self.n_new
        res: dict = {"window": window, "systems": {}, "errors_vs_torch_fp32": {}}
        outs = {}
        t0 = time.perf_counter()
        # warm every system to the window; the first output of each is checked against torch fp32
        for name, ks in self.kv.items():
            outs[name] = ks.start_window(self.ring, window, self.noise)
        if self.oneshot is not None:
            outs["oneshot"] = self.oneshot.step(self.ring, window, self.noise)  # builds the W-row graph
        for name, (drafter, tnoise) in self.torch.items():
            drafter.warm_to(window - n, tnoise)
            outs[name] = drafter.step(window, n, tnoise)[0].float().numpy()
        if "torch_fp32" in outs and not self.args.cap_per_window:
            ref = outs["torch_fp32"]
            for name, out in outs.items():
                if name != "torch_fp32":
                    res["errors_vs_torch_fp32"][name] = relative_error(out, ref)
        active = list(self.systems)
        runners = {s: self._runner(s, window) for s in active}
        for s, (prep, step) in runners.items():  # a second untimed step each (allocator, caches, OpenMP pools)
            prep()
            step()
        log(f"[{self.name}] W={window}: warm-up {time.perf_counter() - t0:.1f} s")
        samples: dict[str, list[float]] = {s: [] for s in active}
        gc.collect()
        gc.disable()
        try:
            t0 = time.perf_counter()
            with no_grad():
                for rep in range(self.reps):
                    order = active[rep % len(active):] + active[:rep % len(active)]
                    for s in order:
                        if s == "oneshot" and rep >= self.oneshot_reps:
                            continue
                        prep, step = runners[s]
                        prep()
                        t = time.perf_counter()
                        step()
                        samples[s].append(time.perf_counter() - t)
        finally:
            gc.enable()
        log(f"[{self.name}] W={window}: {self.reps} reps in {time.perf_counter() - t0:.1f} s")
        for s in active:
            res["systems"][s] = stats(samples[s])
        if self.args.profile:
            res["profile"] = self.profile_window(window)
        return res

    def profile_window(self, window: int) -> dict:
        out = {}
        pt = self.args.profile_threads or self.args.threads
        if pt != self.args.threads and getattr(self, "_prof_backend", None) is None:
            self._prof_backend = Backend("cpu", n_threads=pt)  # CPU buffers are host memory: any CPU backend computes them
        backend = getattr(self, "_prof_backend", None) or self.backend
        for name, ks in self.kv.items():
            cache = ks.cache
            try:
                prof = OpProfiler(cache.gf, backend, cache.inp_embed)
            except Exception as e:  # noqa: BLE001
                log(f"[{self.name}] per-op profile unavailable: {e}")
                return {}
            runs = []
            for _ in range(self.args.profile_reps):
                c = ks.prepare(self.n_new)
                cache.begin_step(self.ring, c)
                cache.inp_embed.set(self.noise)
                runs.append(prof.run())
            out[name] = prof.summarize(runs)
            out[name]["threads"] = pt
        return out

    def run(self) -> dict:
        cfg = self.cfg
        self.setup()
        windows = []
        # rows the step graph folds in per step (padded), as the cache reports it
        a_step = next((ks.cache.a_step for ks in self.kv.values() if ks.cache is not None), 2 * cfg.block_size + 2)
        try:
            for w in self.windows:
                windows.append(self.run_window(w))
                gc.collect()
        finally:
            self.close()
        return {"config": self.name, "shape": CONFIGS[self.name], "fc_in": cfg.fc_in, "n_params": self.host.n_params,
                "n_new": self.n_new, "q_len": cfg.block_size, "a_step": a_step, "reps": self.reps,
                "oneshot_reps": self.oneshot_reps, "cap": CAP, "cap_per_window": self.args.cap_per_window,
                "weight_bytes": self.weight_bytes, "windows": windows, "kernels": self.kernels}


def weight_nbytes(cfg: DraftConfig, dtype: str) -> int:
    """Bytes of the weights as the backend stores them (matrices in dtype, norm vectors f32)."""
    total = 0
    for name, shape in expected_shapes(cfg).items():
        n = int(np.prod(shape))
        if is_norm(name) or len(shape) == 1:
            total += 4 * n
        else:
            total += {"f16": 2 * n, "q8_0": n // 32 * 34, "f32": 4 * n}[dtype]
    return total


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


def analyse(result: dict, machine: dict) -> None:
    """Adds roofline and ratios to every window of one config's result."""
    cfg = DraftConfig(**result["shape"])
    for wres in result["windows"]:
        W = wres["window"]
        roof = {}
        for key, dt, sysname in (("f16", "f16", "kv_f16"), ("q8_0", "q8_0", "kv_q8"), ("q8_0_attbf16", "q8_0", "kv_q8_attbf16")):
            cost = cost_model(cfg, W, result["n_new"], result["weight_bytes"][dt], result["a_step"])
            kern = result.get("kernels", {}).get(sysname, {})
            r = roofline_s(cost, machine["bandwidth_gbs"], machine["matmul_gflops"], machine.get("peaks_gmacs"),
                           kern.get("matmul_instr"), kern.get("attention_instr"))
            r.update(cost)
            m = med(wres, sysname)
            r["measured_over_roofline"] = ratio(m, r["ms"])
            roof[key] = r
        wres["roofline"] = roof
        kv_best = min([x for x in (med(wres, s) for s in KV_SYSTEMS) if x is not None], default=None)
        kv_best_f32 = min([x for x in (med(wres, "kv_f16"), med(wres, "kv_q8")) if x is not None], default=None)
        torch_best = min([x for x in (med(wres, "torch_fp32"), med(wres, "torch_bf16")) if x is not None], default=None)
        attbf16_over_roof = ratio(med(wres, "kv_q8_attbf16"), roof["q8_0_attbf16"]["ms"])
        wres["ratios"] = {
            "step_over_raw": ratio(med(wres, "kv_f16"), med(wres, "raw")),
            "oneshot_over_kv_f16": ratio(med(wres, "oneshot"), med(wres, "kv_f16")),
            "torch_best_over_kv_best": ratio(torch_best, kv_best),
            "torch_best_over_kv_best_f32_attention": ratio(torch_best, kv_best_f32),
            "kv_f16_over_roofline": roof["f16"]["measured_over_roofline"],
            "kv_q8_over_roofline": roof["q8_0"]["measured_over_roofline"],
            "kv_q8_attbf16_over_roofline": attbf16_over_roof,
            "kv_best_over_roofline": min([x for x in (roof["f16"]["measured_over_roofline"],
                                                      roof["q8_0"]["measured_over_roofline"], attbf16_over_roof)
                                          if x is not None], default=None),
        }


def targets(result: dict) -> list[dict]:
    """The issue's targets for one config: (name, value, bound, ok, applies)."""
    name = result["config"]
    by_w = {w["window"]: w for w in result["windows"]}
    out = []

    def add(target: str, value: float | None, op: str, bound: float, applies: bool, detail: str) -> None:
        ok = None if value is None else (value <= bound if op == "<=" else value >= bound)
        out.append({"target": target, "value": value, "op": op, "bound": bound, "ok": ok, "applies": applies, "detail": detail})

    if 64 in by_w and 4096 in by_w:
        add("flat", ratio(med(by_w[4096], "kv_f16"), med(by_w[64], "kv_f16")), "<=", FLAT_MAX, name == "small",
            "kv_f16 @4096 / @64")
    if 2048 in by_w:
        add("vs recompute", by_w[2048]["ratios"]["oneshot_over_kv_f16"], ">=", RECOMPUTE_MIN, name == "small",
            "oneshot / kv_f16 @2048")
    vals = [w["ratios"]["torch_best_over_kv_best"] for w in result["windows"]]
    if vals and all(v is not None for v in vals):
        add("vs PyTorch", min(vals), ">=", TORCH_MIN, name == "small", "min over windows of min(torch) / min(kv)")
    vals = [w["ratios"]["torch_best_over_kv_best_f32_attention"] for w in result["windows"]]
    if vals and all(v is not None for v in vals):
        add("vs PyTorch f32 attention", min(vals), ">=", TORCH_MIN, False,
            "min over windows of min(torch) / min(kv_f16, kv_q8) (info)")
    vals = [w["ratios"]["step_over_raw"] for w in result["windows"]]
    if vals and all(v is not None for v in vals):
        add("host overhead", max(vals), "<=", OVERHEAD_MAX, name == "small", "max over windows of kv_f16 step() / raw graph")
    vals = [w["ratios"]["kv_best_over_roofline"] for w in result["windows"]]
    if vals and all(v is not None for v in vals):
        add("roofline", max(vals), "<=", ROOF_MAX, name in ("small", "qwen3-8b"),
            "max over windows of min(kv_f16 / roofline(f16), kv_q8 / roofline(q8_0), kv_q8_attbf16 / roofline(q8_0, bf16 attention))")
    for dt, sysname in (("f16", "kv_f16"), ("q8_0", "kv_q8")):
        vals = [w["ratios"][f"{sysname}_over_roofline"] for w in result["windows"]]
        if vals and all(v is not None for v in vals):
            add(f"roofline {dt}", max(vals), "<=", ROOF_MAX, False, f"max over windows of {sysname} / roofline({dt}) (info)")
    return out


def print_report(results: list[dict], machine: dict, args: argparse.Namespace) -> None:
    p = print
    load = machine.get("load_average")
    p(f"\nmachine: {machine['cpu']}, {args.threads} threads, OMP_WAIT_POLICY {machine['omp_wait_policy']}"
      + (f", load average at start {load[0]:.1f}" if load else "") + f" | copy bandwidth {machine['bandwidth_gbs']:.1f} GB/s "
      f"(read+write) | f32 matmul {machine['matmul_gflops']:.0f} GFLOP/s | ggml {machine.get('ggml', '?')}"
      f" | torch {machine.get('torch', '-')}")
    feats = machine.get("cpu_features", {})
    p("cpu features ggml was built for: " + " ".join(k for k, v in feats.items() if v and k != "amx_usable")
      + f" | AMX in use: {'yes' if feats.get('amx_usable') else 'no'}")
    pk = machine.get("peaks_gmacs") or {}
    if pk:
        p(f"instruction peaks, {args.threads} threads (G multiply-adds/s, registers only): "
          + ", ".join(f"{k} {fmt(v, '.0f')}" for k, v in pk.items()))
    for r in results:
        s = r["shape"]
        p(f"\n== {r['config']}: hidden {s['hidden']}, {s['n_layer']} layers, {s['n_head']}/{s['n_head_kv']} heads x "
          f"{s['head_dim']}, ffn {s['ffn']}, q_len {s['block_size']}, fc_in {r['fc_in']}, {r['n_params'] / 1e6:.1f} M params; "
          f"n_new {r['n_new']} rows/step, cap {'= window' if r['cap_per_window'] else r['cap']}, "
          f"{r['reps']} reps (oneshot {r['oneshot_reps']})")
        for sysname, k in r.get("kernels", {}).items():
            p(f"kernels {sysname}: matrix products: {k['matmul']}; attention: {k['attention']}")
        cols = [s for s in SYSTEMS if any(s in w["systems"] for w in r["windows"])]
        head = f"{'window':>6} | " + " | ".join(f"{c:^21}" for c in cols)
        p("latency of one draft step, ms: median [p10-p90]")
        p(head)
        p("-" * len(head))
        for w in r["windows"]:
            p(f"{w['window']:>6} | " + " | ".join(f"{fmt_stat(w['systems'].get(c)):^21}" for c in cols))
        srcs = sorted({rf["compute_rate_source"] for w in r["windows"] for rf in w["roofline"].values()})
        p(f"\nratios and roofline, from the {STAT} step times (roofline = max(bytes/bandwidth, compute time); "
          f"compute rates from: {', '.join(srcs)}; bound m=memory c=compute)")
        head2 = (f"{'window':>6} | {'step/raw':>8} | {'oneshot/kv':>10} | {'torch/kv':>8} | {'roof f16 ms':>12} | "
                 f"{'kv_f16/roof':>11} | {'roof q8 ms':>12} | {'kv_q8/roof':>10} | {'roof q8b ms':>12} | {'q8_attbf16/roof':>15} | "
                 f"{'GFLOP':>6} | {'MB read':>8} | err vs torch32")
        p(head2)
        p("-" * len(head2))
        for w in r["windows"]:
            ra, rf = w["ratios"], w["roofline"]
            errs = " ".join(f"{k}={v:.1e}" for k, v in w["errors_vs_torch_fp32"].items())
            p(f"{w['window']:>6} | {fmt(ra['step_over_raw']):>8} | {fmt(ra['oneshot_over_kv_f16'], '.1f'):>10} | "
              f"{fmt(ra['torch_best_over_kv_best']):>8} | {rf['f16']['ms']:>10.2f} {rf['f16']['bound'][0]} | "
              f"{fmt(ra['kv_f16_over_roofline']):>11} | {rf['q8_0']['ms']:>10.2f} {rf['q8_0']['bound'][0]} | "
              f"{fmt(ra['kv_q8_over_roofline']):>10} | {rf['q8_0_attbf16']['ms']:>10.2f} {rf['q8_0_attbf16']['bound'][0]} | "
              f"{fmt(ra['kv_q8_attbf16_over_roofline']):>15} | {rf['f16']['flops'] / 1e9:>6.2f} | {rf['f16']['bytes'] / 1e6:>8.1f} | {errs}")
        if any("profile" in w for w in r["windows"]):
            pth = next(pr["threads"] for w in r["windows"] for pr in w.get("profile", {}).values())
            p(f"\nper-op time of the step graph, {pth} thread(s) (each node computed alone, min over repetitions, "
              "per-node launch overhead subtracted), ms")
            keys = sorted({k for w in r["windows"] for pr in w.get("profile", {}).values() for k in pr["groups_ms"]})
            head3 = f"{'window':>6} {'cache':>6} | " + " | ".join(f"{k:>20}" for k in keys) + f" | {'sum':>8} | {'raw':>8}"
            p(head3)
            p("-" * len(head3))
            for w in r["windows"]:
                for name, pr in w.get("profile", {}).items():
                    raw = med(w, "raw") if name == "kv_f16" else None
                    p(f"{w['window']:>6} {name:>6} | " + " | ".join(f"{pr['groups_ms'].get(k, 0.0):>20.2f}" for k in keys)
                      + f" | {pr['sum_ms']:>8.2f} | {fmt(raw):>8}")
            last = r["windows"][-1].get("profile", {}).get("kv_f16")
            if last:
                p(f"matmuls by weight @W={r['windows'][-1]['window']} (kv_f16): "
                  + ", ".join(f"{k}={v:.2f}" for k, v in last["matmul_by_weight_ms"].items()))
                p(f"other ops by ggml op @W={r['windows'][-1]['window']} (kv_f16): "
                  + ", ".join(f"{k}={v:.2f}" for k, v in last["other_by_op_ms"].items()))
                p(f"per-node launch overhead ~{last['overhead_per_node_ms'] * 1e3:.0f} us x {last['n_compute_nodes']} compute nodes (subtracted)")
        p("\nspeed targets:")
        for t in r["targets"]:
            verdict = "-" if t["ok"] is None else ("PASS" if t["ok"] else "MISS")
            scope = "" if t["applies"] or t["detail"].endswith("(info)") else "  (info: the issue's target is for another config)"
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
    colors = {"kv_f16": "C0", "kv_q8": "C1", "kv_q8_attbf16": "C5", "raw": "C7", "oneshot": "C3", "torch_fp32": "C2", "torch_bf16": "C4",
              "roofline f16": "k"}
    markers = ["o", "s", "^", "D"]
    styles = ["-", "--", "-.", (0, (5, 1, 1, 1))]
    for ci, r in enumerate(results):
        ws = [w["window"] for w in r["windows"]]
        for s in SYSTEMS:
            ys = [med(w, s) for w in r["windows"]]
            if any(y is not None for y in ys):
                pts = [(x, y) for x, y in zip(ws, ys) if y is not None]
                ax.plot(*zip(*pts), marker=markers[ci % 4], linestyle=styles[ci % 4], color=colors[s],
                        label=f"{r['config']} {s}")
        ax.plot(ws, [w["roofline"]["f16"]["ms"] for w in r["windows"]], linestyle=":", marker=markers[ci % 4],
                color="k", label=f"{r['config']} roofline f16")
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


# ---------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="toy,small", help=f"comma list of {','.join(CONFIGS)} (default toy,small)")
    ap.add_argument("--windows", default=",".join(map(str, WINDOWS)), help="comma list of windows, each <= 4096")
    ap.add_argument("--reps", type=int, default=0, help="timed steps per system per window (default per config: "
                    + ", ".join(f"{k} {v}" for k, v in DEFAULT_REPS.items()) + ")")
    ap.add_argument("--oneshot-reps", type=int, default=0, help="timed one-shot steps per window (default per config: "
                    + ", ".join(f"{k} {v}" for k, v in DEFAULT_ONESHOT_REPS.items()) + "; at most --reps)")
    ap.add_argument("--backend", default="cpu", help="ggml backend of the cache and one-shot systems: cpu, cuda, cuda:N "
                    "(GGML_CUDA_DISABLE_GRAPHS=1 in the environment turns CUDA graphs off for comparison)")
    ap.add_argument("--threads", type=int, default=2, help="ggml, torch and BLAS threads (default 2)")
    ap.add_argument("--omp-wait-policy", choices=("passive", "active", "default"), default=None,
                    help="OMP_WAIT_POLICY for ggml's and torch's OpenMP threads (default: $OMP_WAIT_POLICY if set, "
                         "else passive; 'default' leaves it unset). Spinning threads wreck the timings on a "
                         "machine shared with other processes")
    ap.add_argument("--n-new", type=int, default=0, help="context rows committed per step (default q_len/2 + 1)")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch reference")
    ap.add_argument("--generic-q8", action="store_true",
                    help="also time kv_q8_generic: q8_0 weights on ggml's generic kernels (no AMX / VNNI repacking)")
    ap.add_argument("--skip", default="", help=f"comma list of systems to leave out ({','.join(SYSTEMS)})")
    ap.add_argument("--cap-per-window", action="store_true",
                    help="kv caches built with cap=W per window, committed growing (default: cap 4096 + rewind)")
    ap.add_argument("--profile", action="store_true", help="also time every op of the cache's step graph")
    ap.add_argument("--profile-reps", type=int, default=5, help="per-op profile repetitions (min per node is kept)")
    ap.add_argument("--profile-threads", type=int, default=0,
                    help="threads of the per-op profile (default --threads; 1 is steadier on a shared machine: "
                         "every node ends in a thread barrier that a descheduled thread stalls)")
    ap.add_argument("--stat", choices=("median", "p10", "min"), default="median",
                    help="statistic the ratios, roofline checks and targets use (default median; on a machine shared "
                         "with other processes p10 or min show the code's own cost better)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run (< 2 min on 2 cores): toy + small, windows 64,1024, 4 reps, torch fp32 only")
    ap.add_argument("--json", help="write every sample and figure to this JSON file")
    ap.add_argument("--plot", help="write a latency-vs-window PNG (needs matplotlib)")
    args = ap.parse_args(argv)
    if args.quick:
        args.configs = "toy,small"
        args.windows = "64,1024"
        args.reps = args.reps or 4
        args.oneshot_reps = args.oneshot_reps or 2
        args.skip = ",".join(filter(None, [args.skip, "torch_bf16"]))
    args.config_list = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in args.config_list:
        if c not in CONFIGS:
            ap.error(f"unknown config {c!r}; choose from {list(CONFIGS)}")
    args.windows = sorted({int(w) for w in str(args.windows).split(",") if w.strip()})
    if not args.windows or min(args.windows) < 1 or max(args.windows) > CAP:
        ap.error(f"windows must be in [1, {CAP}]")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    bad = skip - set(SYSTEMS)
    if bad:
        ap.error(f"unknown system(s) in --skip: {sorted(bad)}")
    args.systems = [s for s in SYSTEMS if s not in skip and not (args.no_torch and s in TORCH_SYSTEMS)
                    and (s not in OPTIONAL_SYSTEMS or args.generic_q8)]
    if args.systems and not args.no_torch and any(s in TORCH_SYSTEMS for s in args.systems):
        try:
            import _torch_ref  # noqa: F401
        except ImportError as e:
            log(f"PyTorch reference unavailable ({e}): running without it")
            args.systems = [s for s in args.systems if s not in TORCH_SYSTEMS]
    return args


def machine_info(args: argparse.Namespace) -> dict:
    from pyggml_dkv.ggml import version

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "n_cpus": os.cpu_count(), "threads": args.threads, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None, "python": platform.python_version(),
            "numpy": np.__version__, "ggml": version()}
    if any(s in TORCH_SYSTEMS for s in args.systems):
        import torch

        torch.set_num_threads(args.threads)
        info["torch"] = torch.__version__
    return info


def main(argv: list[str] | None = None) -> int:
    global STAT
    args = parse_args(argv)
    STAT = args.stat
    t_start = time.perf_counter()
    machine = machine_info(args)
    log("probing memory bandwidth and matmul rate ...")
    bw = probe_bandwidth(args.threads)
    mm = probe_matmul(args.threads)
    peaks = [probe_peaks(args.threads)] if args.backend == "cpu" else []
    results = []
    for name in args.config_list:
        results.append(Bench(name, args, args.systems).run())
        gc.collect()
    bw += probe_bandwidth(args.threads)
    mm += probe_matmul(args.threads)
    if peaks:
        peaks.append(probe_peaks(args.threads))
        machine["peaks_gmacs"] = {k: (float(np.median([p[k] for p in peaks])) if all(p[k] for p in peaks) else None)
                                  for k in peaks[0]}
    machine["cpu_features"] = cpu_features()
    machine.update({"bandwidth_gbs": float(np.median(bw)), "bandwidth_samples_gbs": bw,
                    "matmul_gflops": float(np.median(mm)), "matmul_samples_gflops": mm})
    for r in results:
        analyse(r, machine)
        r["targets"] = targets(r)
    machine["total_seconds"] = time.perf_counter() - t_start
    machine["backend"] = args.backend
    machine["cuda_graph_stats"] = cuda_graph_stats()  # what ggml's CUDA backend said about CUDA graphs
    machine["cuda_graphs_disabled"] = bool(os.environ.get("GGML_CUDA_DISABLE_GRAPHS"))
    print_report(results, machine, args)
    applicable = [t for r in results for t in r["targets"] if t["applies"] and t["ok"] is not None]
    print(f"\n{sum(t['ok'] for t in applicable)}/{len(applicable)} applicable targets met; "
          f"total run time {machine['total_seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "args": {k: v for k, v in vars(args).items()},
                                               "results": results}, indent=1))
        log(f"JSON written to {args.json}")
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
