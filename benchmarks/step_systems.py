"""The systems the step benchmark times side by side: the ring cache (per weight type and attention),
the raw graph, the one-shot recompute graph, and the PyTorch dflash model; and the Bench that
interleaves them per window."""

from __future__ import annotations

import argparse
import gc
import sys
import time

import numpy as np

from peak_probe import PeakSampler
from pyggml_dkv import Backend, DraftConfig, DraftKvCache, DraftWeights, FeatureRing, OneShotDrafter
from pyggml_dkv.common.numeric import relative_error
from pyggml_dkv.ggml import bf16_attention_supported
from pyggml_dkv.model.tensor_names import expected_shapes, is_norm
from step_config import CAP, CONFIGS, DEFAULT_ONESHOT_REPS, DEFAULT_REPS, TORCH_SYSTEMS, log
from step_probes import OpProfiler, kernels_used

PROBE = "peak probes"  # the pseudo-system of the rotation that samples the machine's peaks


# ---------------------------------------------------------------------------- inputs
def random_weights(cfg: DraftConfig, seed: int = 0) -> DraftWeights:
    return DraftWeights.random(cfg, seed)  # float32 draws in place: fine for qwen3-8b's ~1e9 parameters


def stats(samples_s: list[float]) -> dict:
    a = np.asarray(samples_s, dtype=np.float64) * 1e3
    if a.size == 0:
        return {"n": 0}
    return {
        "n": int(a.size),
        "median_ms": float(np.median(a)),
        "p10_ms": float(np.percentile(a, 10)),
        "p90_ms": float(np.percentile(a, 90)),
        "min_ms": float(a.min()),
        "samples_ms": [round(float(x), 4) for x in a],
    }


def paired_ratio(steps_s: list[float], graphs_s: list[float]) -> dict:
    """step / its own graph compute, call by call: median and p90 of the per-call ratios."""
    if not steps_s or len(steps_s) != len(graphs_s):
        return {}
    r = np.asarray(steps_s, dtype=np.float64) / np.asarray(graphs_s, dtype=np.float64)
    return {"median": float(np.median(r)), "p90": float(np.percentile(r, 90))}


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
        self.cache: DraftKvCache | None = None
        self.committed = 0
        self.last_graph_s: float | None = None  # the graph compute inside the last step() (see _set_cache)
        if not cap_per_window:
            self._set_cache(DraftKvCache(weights, backend, CAP, attention=attention))

    def _set_cache(self, cache: DraftKvCache) -> None:
        """Time the graph compute inside each step() (an instance attribute over the method), so a
        step's host part is its own step() minus its own graph: the same call, the same moment of
        the machine, where step()/raw compares medians taken at different moments."""
        compute = cache.compute

        def timed_compute(logits: bool = False) -> None:
            t = time.perf_counter()
            compute(logits)
            self.last_graph_s = time.perf_counter() - t

        cache.compute = timed_compute  # type: ignore[method-assign]
        self.cache = cache

    def start_window(self, ring: FeatureRing, window: int, noise: np.ndarray) -> np.ndarray:
        """Bring the cache to committed = window (bulk-appending what is missing); returns that step's output."""
        if self.cap_per_window:
            if self.cache is not None:
                self.cache.close()
            self._set_cache(DraftKvCache(self.weights, self.backend, window, attention=self.attention))
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
        self.weight_bytes = {dt: weight_nbytes(self.cfg, dt) for dt in ("f16", "q8_0", "bf16")}
        self.sampler: PeakSampler | None = None

    # -- setup
    def setup(self) -> None:
        cfg, args = self.cfg, self.args
        t0 = time.perf_counter()
        self.host = random_weights(cfg, seed=0)
        log(
            f"[{self.name}] random weights: {self.host.n_params / 1e6:.1f} M parameters ({time.perf_counter() - t0:.1f} s)"
        )
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
            log(f"[{self.name}] kv_q8_attbf16 left out: ggml was built without our bf16 attention kernel (fa-bf16)")
            self.systems = [s for s in self.systems if s != "kv_q8_attbf16"]
            sys_.discard("kv_q8_attbf16")
        need = {
            "f16": bool(sys_ & {"kv_f16", "raw", "oneshot"}),
            "q8_0": bool(sys_ & {"kv_q8", "kv_q8_attbf16"}),
            "bf16": "kv_bf16" in sys_,
        }
        for dtype in ("f16", "q8_0", "bf16"):
            if need[dtype]:
                t0 = time.perf_counter()
                self.bw[dtype] = self.host.to_backend(self.backend, dtype)
                log(
                    f"[{self.name}] {dtype} weights uploaded: {self.bw[dtype].nbytes / 2**20:.0f} MiB ({time.perf_counter() - t0:.1f} s)"
                )
        if sys_ & {"kv_f16", "raw"}:  # raw times kv_f16's step graph
            self.kv["kv_f16"] = KvSystem("kv_f16", self.bw["f16"], self.backend, args.cap_per_window)
        if "kv_q8" in sys_:
            self.kv["kv_q8"] = KvSystem("kv_q8", self.bw["q8_0"], self.backend, args.cap_per_window)
        if "kv_bf16" in sys_:
            self.kv["kv_bf16"] = KvSystem("kv_bf16", self.bw["bf16"], self.backend, args.cap_per_window)
        if "kv_q8_generic" in sys_:
            self.bw["q8_0_generic"] = self.host.to_backend(self.backend, "q8_0", repack=False)
            self.kv["kv_q8_generic"] = KvSystem(
                "kv_q8_generic", self.bw["q8_0_generic"], self.backend, args.cap_per_window
            )
        if "kv_q8_attbf16" in sys_:
            self.kv["kv_q8_attbf16"] = KvSystem(
                "kv_q8_attbf16", self.bw["q8_0"], self.backend, args.cap_per_window, attention="bf16"
            )
        self.oneshot = OneShotDrafter(self.bw["f16"], self.backend, CAP) if "oneshot" in self.systems else None
        if self.backend.is_cpu:
            sampler = PeakSampler(args.threads)
            self.sampler = sampler if sampler.available else None
        self.kernels = {}
        if self.backend.is_cpu:
            for sysname, bw_key, dt, att in (
                ("kv_f16", "f16", "f16", "f32"),
                ("kv_q8", "q8_0", "q8_0", "f32"),
                ("kv_q8_attbf16", "q8_0", "q8_0", "bf16"),
                ("kv_bf16", "bf16", "bf16", "f32"),
                ("kv_q8_generic", "q8_0_generic", "q8_0", "f32"),
            ):
                if sysname in self.kv:
                    self.kernels[sysname] = kernels_used(dt, self.bw[bw_key].repack_kinds, att)
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
        if self.sampler is not None:
            self.sampler.close()
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
                # the graph step() computes: the one sized for this step's fold-in rows
                ks.cache.next_graph(logits=True).compute(self.backend)

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
        for prep, step in runners.values():  # a second untimed step each (allocator, caches, OpenMP pools)
            prep()
            step()
        # the machine's peaks, sampled in the same rotation as the systems (peak_probe.PeakSampler)
        probe = PROBE if self.sampler is not None else None
        if probe is not None:
            active.append(probe)
        probes: list[dict[str, float]] = []
        log(f"[{self.name}] W={window}: warm-up {time.perf_counter() - t0:.1f} s")
        samples: dict[str, list[float]] = {s: [] for s in active}
        graph_s: dict[str, list[float]] = {s: [] for s in active if s in self.kv}  # each step()'s own graph compute
        gc.collect()
        gc.disable()
        try:
            t0 = time.perf_counter()
            with no_grad():
                for rep in range(self.reps):
                    order = active[rep % len(active) :] + active[: rep % len(active)]
                    for s in order:
                        if s == "oneshot" and rep >= self.oneshot_reps:
                            continue
                        if s == probe:
                            probes.append(self.sampler.sample())
                            continue
                        prep, step = runners[s]
                        prep()
                        t = time.perf_counter()
                        step()
                        samples[s].append(time.perf_counter() - t)
                        if s in graph_s:
                            graph_s[s].append(self.kv[s].last_graph_s)
        finally:
            gc.enable()
        log(f"[{self.name}] W={window}: {self.reps} reps in {time.perf_counter() - t0:.1f} s")
        for s in active:
            if s != probe:
                res["systems"][s] = stats(samples[s])
        for s, g in graph_s.items():
            res["systems"][s]["own_graph"] = stats(g)
            res["systems"][s]["over_own_graph"] = paired_ratio(samples[s], g)
        if probes:
            res["probes"] = interleaved_probes(probes)
        if self.args.profile:
            res["profile"] = self.profile_window(window)
        return res

    def profile_window(self, window: int) -> dict:
        out = {}
        pt = self.args.profile_threads or self.args.threads
        if pt != self.args.threads and getattr(self, "_prof_backend", None) is None:
            self._prof_backend = Backend(
                "cpu", n_threads=pt
            )  # CPU buffers are host memory: any CPU backend computes them
        backend = getattr(self, "_prof_backend", None) or self.backend
        for name, ks in self.kv.items():
            cache = ks.cache
            runs, prof = [], None
            for _ in range(self.args.profile_reps):
                c = ks.prepare(self.n_new)
                cache.begin_step(self.ring, c)
                cache.inp_embed.set(self.noise)
                if prof is None:
                    # the graph a step computes (its fold-in sized for n_new rows), not the a_step one
                    try:
                        prof = OpProfiler(cache.next_graph(logits=True), backend, cache.inp_embed)
                    except Exception as e:  # noqa: BLE001
                        log(f"[{self.name}] per-op profile unavailable: {e}")
                        return {}
                runs.append(prof.run())
            out[name] = prof.summarize(runs)
            prof.close()
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
        return {
            "config": self.name,
            "shape": CONFIGS[self.name],
            "fc_in": cfg.fc_in,
            "n_params": self.host.n_params,
            "n_new": self.n_new,
            "q_len": cfg.block_size,
            "a_step": a_step,
            "reps": self.reps,
            "oneshot_reps": self.oneshot_reps,
            "cap": CAP,
            "cap_per_window": self.args.cap_per_window,
            "weight_bytes": self.weight_bytes,
            "windows": windows,
            "kernels": self.kernels,
        }


def interleaved_probes(samples: list[dict[str, float]]) -> dict:
    """The median of each probe over one window's repetitions: the peaks of its steps' moments."""
    keys = [k for k in samples[0] if all(k in s for s in samples)]
    med = {k: float(np.median([s[k] for s in samples])) for k in keys}
    return {
        "n": len(samples),
        "peaks_gmacs": {k: v for k, v in med.items() if k != "read_gbs"},
        "read_gbs": med.get("read_gbs"),
        "samples": samples,
    }


def weight_nbytes(cfg: DraftConfig, dtype: str) -> int:
    """Bytes of the weights as the backend stores them (matrices in dtype, norm vectors f32)."""
    total = 0
    for name, shape in expected_shapes(cfg).items():
        n = int(np.prod(shape))
        if is_norm(name) or len(shape) == 1:
            total += 4 * n
        else:
            total += {"f16": 2 * n, "bf16": 2 * n, "q8_0": n // 32 * 34, "f32": 4 * n}[dtype]
    return total
