"""The step benchmark's measurements of the machine and of the work: bandwidth and matmul probes,
the cost model and roofline, the kernels each system's products use, and a per-op profiler."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from pyggml_dkv import DraftConfig
from pyggml_dkv.ggml import (
    bf16_attention_kernel,
    bf16_matmul_kernel,
    built_capabilities,
    cpu_features,
    half_matmul_avx2,
)
from pyggml_dkv.ggml.capabilities import F16_MATMUL_KERNEL


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
        for sym in (
            "scipy_openblas_set_num_threads64_",
            "scipy_openblas_set_num_threads",
            "openblas_set_num_threads64_",
            "openblas_set_num_threads",
        ):
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
    return {
        "flops": flops,
        "flops_graph": flops_graph,
        "flops_attention": attn,
        "bytes": nbytes,
        "bytes_weights": weight_bytes,
        "bytes_kv": kv_bytes,
    }


def roofline_s(
    cost: dict,
    bw_gbs: float,
    gflops: float,
    peaks: dict | None = None,
    matmul_instr: str | None = None,
    attention_instr: str | None = None,
) -> dict:
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
    return {
        "ms": 1e3 * max(t_mem, t_flop),
        "mem_ms": 1e3 * t_mem,
        "flop_ms": 1e3 * t_flop,
        "bound": "memory" if t_mem >= t_flop else "compute",
        "compute_rate_source": source,
    }


def kernels_used(
    kind: str, repack_kinds: tuple[str, ...] | str | None, attention: str, ne: tuple[int, ...] = (1024, 1024)
) -> dict:
    """Which CPU kernel runs a cache system's matrix products and attention, and the instruction
    the roofline charges them to (None: not one we probe, e.g. AMX tiles). `repack_kinds`: the
    repacking buffers the weights went to (BackendWeights.repack_kinds). `ne`: a matrix's shape
    (ggml order), where the kernel depends on it (bf16: AMX takes whole 16-row groups)."""
    kinds = (repack_kinds,) if isinstance(repack_kinds, str) else tuple(repack_kinds or ())
    feats = cpu_features()
    if kind == "f16":
        if feats["avx512"] and F16_MATMUL_KERNEL in built_capabilities():
            mm = ("f16 weights x f32 rows, AVX-512 FMA (old patch 0004)", "vfmadd231ps")
        elif half_matmul_avx2():
            mm = ("f16 weights x f32 rows, AVX2 FMA (old patch 0042)", None)
        else:
            mm = ("ggml f16 (llamafile tinyBLAS)", None)
    elif kind == "bf16":
        mm = {
            "amx": ("bf16 weights x bf16-rounded rows on AMX-BF16 tiles (old patch 0029)", None),
            "avx512_bf16": ("bf16 weights x bf16-rounded rows, AVX512-BF16 vdpbf16ps (old patch 0019)", "vdpbf16ps"),
            "avx512_fma": ("bf16 weights x f32 rows, AVX-512 FMA (old patch 0041)", "vfmadd231ps"),
            "avx2_fma": ("bf16 weights x f32 rows, AVX2 FMA (old patch 0042)", None),
        }.get(bf16_matmul_kernel(ne), ("ggml bf16 (llamafile tinyBLAS / vec_dot)", None))
    elif kinds == ("AMX", "CPU_DKV_REPACK"):  # backend_weights.VNNI_OVER_AMX_NARROW
        mm = (
            "q8_0 x q8_0 rows, AVX512-VNNI vpdpbusd (old patch 0010); the bulk appends' copies of fc / k_proj / "
            "v_proj on AMX int8 tiles (old patches 0002, 0007)",
            "vpdpbusd",
        )
    elif kinds == ("AMX",):
        mm = ("q8_0 on AMX int8 tiles (old patches 0002, 0007)", None)
    elif kinds == ("CPU_DKV_REPACK",):
        mm = ("q8_0 x q8_0 rows, AVX512-VNNI vpdpbusd (old patch 0010)", "vpdpbusd")
    else:
        mm = ("ggml generic q8_0 (vec_dot / llamafile tinyBLAS)", None)
    f32_att = (
        ("tiled f32, AVX-512 FMA (old patches 0003, 0006)", "vfmadd231ps") if feats["avx512"] else ("ggml f32", None)
    )
    att = f32_att
    if attention == "bf16":
        att = {
            "amx": ("bf16 products on AMX-BF16 tiles (old patch 0009)", None),
            "avx512_bf16": ("bf16 products, AVX512-BF16 vdpbf16ps (old patch 0011)", "vdpbf16ps"),
        }.get(bf16_attention_kernel(), f32_att)
    if feats["amx_usable"]:
        # AMX tiles are not probed: on such a CPU every roofline keeps the numpy rate (as before the
        # instruction-peak probes existed), so its figures stay comparable with earlier runs
        mm, att = (mm[0], None), (att[0], None)
    return {"matmul": mm[0], "matmul_instr": mm[1], "attention": att[0], "attention_instr": att[1]}


# ---------------------------------------------------------------------------- per-op profiler
class OpProfiler:
    """Times every node of a built ggml graph on its own (a one-node graph per node).

    Each node is put alone in a one-node graph of its own (ggml_graph_add_node), which the backend
    computes like the whole graph's node. Each per-node compute pays the CPU backend's per-graph
    overhead (plan + OpenMP fork/join), which the whole graph pays once: it is measured on a tiny
    ADD of the profiler's own (run on every thread, as the graph's ops are: waking the other
    threads is most of it) and subtracted from every node. (No-op nodes, VIEW / RESHAPE / PERMUTE,
    run on one thread; their ~2 us undercounted the ~20 us of waking a second one, so sums of
    small ops came out several times their share of the graph.) Call close() when done.
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
        self._baseline_objects = self._baseline_graph(backend)
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
            self.labels.append(
                {"i": i, "op": op, "phase": "noise" if noisy else "fold-in", "kind": kind, "weight": weight}
            )
        # the rows the graph folds in (its first fold-in product's columns): which of a cache's
        # graphs this is (one per fold-in size)
        first = next((lab["i"] for lab in self.labels if lab["phase"] == "fold-in" and lab["kind"] == "matmul"), None)
        self.fold_in_rows = int(graph.node(first).ne[1]) if first is not None else 0

    def _baseline_graph(self, backend):  # noqa: ANN001, ANN202
        """A one-node graph of a tiny ADD that runs on every thread: what computing a node on its own
        costs beyond the node's work."""
        from pyggml_dkv.ggml import Buffer, Context, Gallocr, Graph

        tensors = Context(n_tensors=2)
        a, b = tensors.new_tensor("f32", 64, 8), tensors.new_tensor("f32", 64, 8)
        buf = Buffer.alloc_ctx_tensors(tensors, backend)
        a.set(np.ones((8, 64), np.float32))
        b.set(np.ones((8, 64), np.float32))
        g = Context(n_tensors=4, graph_size=4)
        self.baseline = Graph(g, 4)
        self.baseline.expand(g.add(a, b))
        galloc = Gallocr(backend)
        galloc.alloc_graph(self.baseline)
        return [galloc, g, buf, tensors]

    def close(self) -> None:
        for obj in self._baseline_objects:
            obj.close()
        self._baseline_objects = []
        self.views_ctx.close()

    def run(self) -> list[float]:
        """Seconds per node, then (last) the baseline's seconds (min of a few)."""
        times = []
        with self.backend.lock:
            for v in self.views:
                t = time.perf_counter()
                status = self.lib.ggml_backend_graph_compute(self.backend.handle, v)
                times.append(time.perf_counter() - t)
                if status != 0:
                    raise RuntimeError(f"per-node compute failed with status {status}")
        base = []  # (Graph.compute takes the backend's lock itself)
        for _ in range(5):
            t = time.perf_counter()
            self.baseline.compute(self.backend)
            base.append(time.perf_counter() - t)
        return times + [min(base)]

    def summarize(self, runs: list[list[float]]) -> dict:
        # min over repetitions per node: interference from other processes only ever adds time
        per_node = np.min(np.asarray(runs), axis=0)
        overhead = float(per_node[-1])  # the baseline's
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
        return {
            "overhead_per_node_ms": 1e3 * overhead,
            "n_nodes": self.n,
            "fold_in_rows": self.fold_in_rows,
            "n_compute_nodes": sum(1 for label in self.labels if label["kind"] != "no-op"),
            "groups_ms": {k: 1e3 * v for k, v in sorted(groups.items())},
            "matmul_by_weight_ms": {k: 1e3 * v for k, v in sorted(by_weight.items())},
            "other_by_op_ms": {k: 1e3 * v for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])},
            "sum_ms": 1e3 * total,
        }
