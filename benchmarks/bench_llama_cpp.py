"""Step benchmark against llama.cpp's own DFlash drafter, on the same GGUF.

    python benchmarks/bench_llama_cpp.py                         # small, f16 + q8_0, windows 64..4096
    python benchmarks/bench_llama_cpp.py --windows 64,1024 --reps 10 --json out.json

One steady-state draft step at window W, both sides: `n_new` (default 9) new context rows are
committed and one noise block of q_len tokens [last, mask, ...] is drafted, logits (q_len x
vocab) included and copied to the host.
  ours_logits  DraftKvCache (cap = W, committed grows by n_new per step) on the GGUF's own
               weights (dtype "native": the file's f16 / q8_0 blocks), token_embd / output from
               the file (output repacked like the drafter's matrices: the VNNI / AMX q8_0 kernels),
               step_tokens(ring, committed, tokens, output="logits"); this process runs under
               OpenMP's default wait policy like llama.cpp's (--omp-wait-policy)
  ours_ids     the same with output="ids": in-graph argmax, no logits copied (information)
  ours_head_q8 (a GGUF whose output is f32 / f16 / bf16) the same with the lm_head uploaded as q8_0
               (lm_head_dtype="q8_0"; on AMX / VNNI its product takes a third of the f16 one),
               with how far its logits and draft ids are from the file's head
  ours_ids_screened (a GGUF whose output is f32 / f16 / bf16) output="ids" from the file's head screened
               by a q8_0 copy (lm_head_screen="q8_0": only the tokens the screen cannot rule out
               are multiplied exactly), no logits; its ids must equal ours_ids' (checked, reported)
  llama_fa / llama_nofa  llama.cpp's drafter context (libllama C API in a child process, see
               pyggml_dkv/hosts/llama_cpp/native_dflash_child.py; OpenMP's default wait policy, its
               fastest, see --llama-omp-wait-policy) with flash attention on / off: inject the
               n_new feature rows (llama_process on an embedding batch), decode the noise block
               with logits for every row, read them (llama_get_logits_ith), drop the noise rows
               and the position that left the window (llama_memory_seq_rm)
The drafter is the `small` shape of bench_step.py (hidden 1024, 5 layers, 16/4 heads, block 16,
5 target layers) with random weights and the SmolLM2 vocabulary (49152 tokens), written once per
weight type as a dflash GGUF that both sides load.

DFlash-2 (`--drafter dflash2`, windows 64 / 2048 / 4096 unless given): the shipped SmolLM2 drafter
(hidden 576, 4 layers, block 8) lifted to DFlash-2 as tests/hosts/test_dflash2_host.py lifts it
(K 3, group 64, R 64, top-k 8; `lifted_smollm2_dflash2`), with the target's token embedding and
output as token_embd / output, written per weight type. A step is then the draft as each side's
host takes it:
  ours_ids     DraftKvCache.step_tokens(..., output="ids"): the selector's greedy walk in the graph,
               the ids copied out (what Drafter.propose takes)
  ours_lattice (information) output="lattice": the lattice copied out for a walk on the host
  ours_ids_head_q8 (a GGUF whose output is f16 / f32 / bf16) ours_ids with the lm_head uploaded as q8_0
  llama_fa / llama_nofa  llama.cpp's draft as common/speculative.cpp takes it: inject the n_new
               feature rows, decode the noise block [anchor, mask, ...] with no output rows, read the
               packed lattice (llama_get_embeddings_nextn) and walk it on the CPU, drop the noise rows
The goal: ours_ids / min(llama_fa, llama_nofa) <= 0.5. `--profile` adds the per-op time of our ids
graph at each window (benchmarks/step_probes.OpProfiler), summed by op and by weight.

llama.cpp runs in a child process (pyggml_dkv.hosts.llama_cpp.native_dflash: a comparison never
shares a process with the code it checks); `--rounds` alternations of our side and llama.cpp's
share the machine's noise between them (ratios side by side in one run, not interleaved step by
step). Reported: median and p10 per system, and ours / llama.cpp's best by median and by p10 (the
goal: <= 0.5 at every window and weight type).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from machine import early_option, set_omp_wait_policy  # noqa: E402  (benchmarks/machine.py: standard library only)

# Both sides run under OpenMP's default wait policy unless told otherwise: the policy of a llama.cpp
# host process, where our drafter runs. Ours (--omp-wait-policy) only governs the wait between graph
# computes (old patch 0005 gives the node barriers their own spin-then-sleep): under PASSIVE each step
# wakes a sleeping thread (on the model-167 Xeon VM 4-7% of a q8_0 step without a head in a plain
# loop of steps; here, with logits, within the noise: benchmarks/README.md). llama.cpp's child gets its
# own (--llama-omp-wait-policy): its ggml meets at `omp barrier` after every node, where PASSIVE costs
# a futex sleep per node
set_omp_wait_policy(early_option(sys.argv[1:], "--omp-wait-policy", os.environ.get("OMP_WAIT_POLICY", "default")))

import numpy as np  # noqa: E402

from machine import cpu_name  # noqa: E402  (benchmarks/machine.py: this script's folder is on sys.path)
from pyggml_dkv import Backend, DraftKvCache, FeatureRing  # noqa: E402
from pyggml_dkv.drafter.backend_weights import upload_stored  # noqa: E402
from pyggml_dkv.ggml import cpu_repack_kernel  # noqa: E402
from pyggml_dkv.hosts.llama_cpp.drafters import lifted_smollm2_dflash2, target_embeddings  # noqa: E402
from pyggml_dkv.hosts.llama_cpp.gguf import GGUFFile  # noqa: E402
from pyggml_dkv.hosts.llama_cpp.native_dflash import llama_cpp_available, llama_dflash_bench  # noqa: E402
from pyggml_dkv.hosts.smollm2 import smollm2_gguf  # noqa: E402
from pyggml_dkv.model.config import DraftConfig  # noqa: E402
from pyggml_dkv.model.weights import DraftWeights  # noqa: E402
from step_probes import kernels_used  # noqa: E402

log = logging.getLogger("bench_llama_cpp")

SMALL = dict(hidden=1024, n_layer=5, n_head=16, n_head_kv=4, head_dim=64, ffn=3072, block_size=16, n_target_layers=5)
N_VOCAB = 49152
WINDOWS = (64, 256, 1024, 2048, 4096)
WINDOWS_DFLASH2 = (64, 2048, 4096)
GOAL = 0.5


def stats(samples: list[float]) -> dict:
    a = np.asarray(samples) * 1e3
    return {"median_ms": float(np.median(a)), "p10_ms": float(np.percentile(a, 10)), "n": int(a.size)}


def write_drafter(dtype: str, out_dir: Path) -> Path:
    cfg = DraftConfig(**SMALL, vocab=N_VOCAB, mask_token_id=2, target_layer_ids=[1, 8, 15, 22, 29])
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((N_VOCAB, cfg.hidden), dtype=np.float32)
    head = rng.standard_normal((N_VOCAB, cfg.hidden), dtype=np.float32) / np.float32(32)
    w = DraftWeights(cfg, dict(DraftWeights.random(cfg, seed=0)), embed_tokens=emb, lm_head=head)
    return w.save_pretrained(out_dir / f"small.{dtype}.gguf", format="gguf", dtype=dtype, vocab_from=smollm2_gguf())


def lifted_dflash2() -> DraftWeights:
    """`lifted_smollm2_dflash2` (the shipped drafter with DFlash-2 parts) plus the target's token
    embedding and output (SmolLM2's tied embedding), so that llama.cpp runs the file without a
    target context."""
    w = lifted_smollm2_dflash2()
    embed, head = target_embeddings(GGUFFile(smollm2_gguf()))
    return DraftWeights(w.cfg, dict(w.items()), embed_tokens=embed, lm_head=head)


def write_dflash2_drafter(dtype: str, out_dir: Path) -> Path:
    return lifted_dflash2().save_pretrained(
        out_dir / f"smollm2-dflash2.{dtype}.gguf", format="gguf", dtype=dtype, vocab_from=smollm2_gguf()
    )


class Ours:
    """Our side for one GGUF: weights uploaded once, a DraftKvCache per window and round."""

    def __init__(self, path: Path, threads: int, profile: bool = False) -> None:
        self.profile = profile
        self.profiles: dict[int, dict] = {}
        self.g = DraftWeights.from_pretrained(path)
        self.backend = Backend("cpu", n_threads=threads)
        self.bw = self.g.to_backend(self.backend, "native")
        self.emb, self.emb_buf = upload_stored(self.backend, self.g.stored["embed_tokens"], "embed_tokens")
        self.head, self.head_buf = upload_stored(self.backend, self.g.stored["lm_head"], "lm_head", matmul_only=True)
        self.tokens = np.full(self.g.cfg.block_size, self.g.cfg.mask_token_id, dtype=np.int32)
        self.tokens[0] = 11
        self.rng = np.random.default_rng(1)

    def run(self, windows: list[int], n_new: int, reps: int, warmup: int) -> tuple[dict, dict]:
        """Seconds per step per system and window, and (for a GGUF whose head is not q8_0) how far
        the q8_0 head's logits and draft ids are from the file's head, per window."""
        cfg = self.g.cfg
        if cfg.is_dflash2:
            return self.run_dflash2(windows, n_new, reps, warmup)
        # the q8_0-head and screened systems apply to a float head (a quantized one is as cheap already)
        head_q8 = self.g.stored["lm_head"].type_name in ("f32", "f16", "bf16")
        names = ["ours_logits", "ours_ids"] + (["ours_head_q8", "ours_ids_screened"] if head_q8 else [])
        out: dict[str, dict[int, list[float]]] = {name: {} for name in names}
        agreement: dict[int, dict[str, float]] = {}
        for W in windows:
            n_pos = W + 2 * (reps + warmup + 1) * n_new + 1
            ring = FeatureRing(n_pos, cfg.fc_in)
            ring.append(self.rng.standard_normal((n_pos, cfg.fc_in), dtype=np.float32))
            with contextlib.ExitStack() as stack:
                cache = stack.enter_context(
                    DraftKvCache(self.bw, self.backend, W, lm_head=self.head, embed_tokens=self.emb)
                )
                # (system, its cache, output); each cache advances by n_new rows at each of its steps
                systems = [("ours_logits", cache, "logits"), ("ours_ids", cache, "ids")]
                if head_q8:
                    cache_q8 = stack.enter_context(
                        DraftKvCache(
                            self.bw,
                            self.backend,
                            W,
                            lm_head=self.g.lm_head,
                            embed_tokens=self.emb,
                            lm_head_dtype="q8_0",
                        )
                    )
                    systems.append(("ours_head_q8", cache_q8, "logits"))
                    cache_sc = stack.enter_context(
                        DraftKvCache(
                            self.bw, self.backend, W, lm_head=self.head, embed_tokens=self.emb, lm_head_screen="q8_0"
                        )
                    )
                    systems.append(("ours_ids_screened", cache_sc, "ids"))
                caches = list({id(c): c for _, c, _ in systems}.values())
                committed = {id(c): W for c in caches}
                for c in caches:
                    c.step_tokens(ring, W, self.tokens, output="logits" if c.logits is not None else "ids")  # prefill
                samples: dict[str, list[float]] = {name: [] for name in names}
                for k in range(warmup + reps):
                    for name, c, output in systems:
                        committed[id(c)] += n_new
                        t0 = time.perf_counter()
                        c.step_tokens(ring, committed[id(c)], self.tokens, output=output)
                        if k >= warmup:
                            samples[name].append(time.perf_counter() - t0)
                if head_q8:  # both heads on the same committed rows
                    last = max(committed.values()) + n_new
                    a = cache.step_tokens(ring, last, self.tokens, output="logits")
                    b = cache_q8.step_tokens(ring, last, self.tokens, output="logits")
                    ids_sc = cache_sc.step_tokens(ring, last, self.tokens, output="ids")
                    agreement[W] = {
                        "rel_err": float(np.abs(a - b).max() / np.abs(a).max()),
                        "draft_ids_equal": float(np.mean(a[1:].argmax(1) == b[1:].argmax(1))),
                        "screened_ids_equal": float(np.mean(a[1:].argmax(1) == ids_sc[1:])),
                    }
            for name, sm in samples.items():
                out[name][W] = sm
        return out, agreement

    def run_dflash2(self, windows: list[int], n_new: int, reps: int, warmup: int) -> tuple[dict, dict]:
        """A DFlash-2 drafter: seconds per step of ours_ids, ours_lattice and (float head)
        ours_ids_head_q8 per window, and how many of the q8_0 head's ids equal the file head's."""
        cfg = self.g.cfg
        head_q8 = self.g.stored["lm_head"].type_name in ("f32", "f16", "bf16")
        names = ["ours_ids", "ours_lattice"] + (["ours_ids_head_q8"] if head_q8 else [])
        out: dict[str, dict[int, list[float]]] = {name: {} for name in names}
        agreement: dict[int, dict[str, float]] = {}
        for W in windows:
            n_pos = W + 2 * (reps + warmup + 1) * n_new + 1
            ring = FeatureRing(n_pos, cfg.fc_in)
            ring.append(self.rng.standard_normal((n_pos, cfg.fc_in), dtype=np.float32))
            with contextlib.ExitStack() as stack:
                cache = stack.enter_context(
                    DraftKvCache(self.bw, self.backend, W, lm_head=self.head, embed_tokens=self.emb)
                )
                systems = [("ours_ids", cache, "ids"), ("ours_lattice", cache, "lattice")]
                if head_q8:
                    cache_q8 = stack.enter_context(
                        DraftKvCache(
                            self.bw,
                            self.backend,
                            W,
                            lm_head=self.g.lm_head,
                            embed_tokens=self.emb,
                            lm_head_dtype="q8_0",
                        )
                    )
                    systems.append(("ours_ids_head_q8", cache_q8, "ids"))
                caches = list({id(c): c for _, c, _ in systems}.values())
                committed = {id(c): W for c in caches}
                for c in caches:
                    # (not output="logits": on a DFlash-2 cache, walks after a logits step read stale logits)
                    c.step_tokens(ring, W, self.tokens, output="ids")  # prefill
                samples: dict[str, list[float]] = {name: [] for name in names}
                for k in range(warmup + reps):
                    for name, c, output in systems:
                        committed[id(c)] += n_new
                        t0 = time.perf_counter()
                        c.step_tokens(ring, committed[id(c)], self.tokens, output=output)
                        if k >= warmup:
                            samples[name].append(time.perf_counter() - t0)
                if head_q8:  # both heads on the same committed rows
                    last = max(committed.values()) + n_new
                    a = cache.step_tokens(ring, last, self.tokens, output="ids")
                    b = cache_q8.step_tokens(ring, last, self.tokens, output="ids")
                    agreement[W] = {"draft_ids_equal": float(np.mean(a[1:] == b[1:]))}
                if self.profile:
                    self.profiles.setdefault(
                        W, profile_ids_graph(cache, ring, max(committed.values()) + n_new, self.tokens, self.backend)
                    )
            for name, sm in samples.items():
                out[name][W] = sm
        return out, agreement

    def kernels(self) -> dict[str, int]:
        """Which kernel runs each of our matrix products (the head's included): description -> count."""
        counts: dict[str, int] = {}
        for t in [t for t in self.bw.tensors.values() if t.ne[1] > 1] + [self.head]:
            buffer = t.buffer_name
            if buffer in ("CPU_DKV_REPACK", "CPU_REPACK"):
                kernel = cpu_repack_kernel(t.type, t.ne)
            elif buffer == "AMX":
                kernel = f"{t.type} on ggml's AMX int8 tiles"
            elif t.type in ("f16", "bf16"):
                kernel = kernels_used(t.type, None, "f32", tuple(t.ne))["matmul"]
            else:
                kernel = f"ggml's {t.type} product (ordinary buffer)"
            counts[kernel] = counts.get(kernel, 0) + 1
        return counts

    def close(self) -> None:
        for obj in (self.emb_buf, self.emb.ctx, self.head_buf, self.head.ctx, self.bw, self.backend):
            obj.close()


def profile_ids_graph(
    cache: DraftKvCache, ring: FeatureRing, committed: int, tokens: np.ndarray, backend: Backend, reps: int = 5
) -> dict:
    """Per-op time of the graph a step_tokens(..., output="ids") runs (benchmarks/step_probes.OpProfiler:
    each node alone, the per-graph overhead subtracted), summed by op and by weight: ms."""
    from step_probes import OpProfiler

    cache.step_tokens(ring, committed, tokens, output="ids")  # the step's inputs set, its graph chosen
    prof = OpProfiler(cache.next_graph(False), backend, cache.inp_tokens)
    try:
        runs = [prof.run() for _ in range(reps)]
        per_node = np.min(np.asarray(runs)[:, :-1], axis=0) - np.min(np.asarray(runs)[:, -1])
        per_node = np.maximum(per_node, 0.0)
        by_op: dict[str, float] = {}
        by_weight: dict[str, float] = {}
        for lab, t in zip(prof.labels, per_node):
            by_op[lab["op"]] = by_op.get(lab["op"], 0.0) + 1e3 * float(t)
            if lab["kind"] == "matmul":
                by_weight[lab["weight"] or "?"] = by_weight.get(lab["weight"] or "?", 0.0) + 1e3 * float(t)
    finally:
        prof.close()
    return {
        "total_ms": 1e3 * float(per_node.sum()),
        "n_nodes": len(per_node),
        "by_op_ms": dict(sorted(by_op.items(), key=lambda kv: -kv[1])),
        "matmul_by_weight_ms": dict(sorted(by_weight.items(), key=lambda kv: -kv[1])),
    }


def bench_llama(
    path: Path,
    windows: list[int],
    n_new: int,
    reps: int,
    warmup: int,
    threads: int,
    omp_wait_policy: str | None,
    cfg: DraftConfig | None = None,
) -> dict[str, dict[int, list[float]]]:
    """llama.cpp's step, flash attention on and off (a DFlash-2 GGUF: drafted as common/speculative.cpp)."""
    cfg = cfg or DraftConfig(**SMALL)
    out = {}
    for name, fa in (("llama_fa", True), ("llama_nofa", False)):
        out[name] = llama_dflash_bench(
            path,
            windows,
            fc_in=cfg.fc_in,
            q_len=cfg.block_size,
            n_new=n_new,
            reps=reps,
            warmup=warmup,
            flash_attn=fa,
            threads=threads,
            omp_wait_policy=omp_wait_policy,
            timeout=1800,
        )
    return out


def report(results: dict, args: argparse.Namespace) -> None:
    print(
        f"\nDFlash draft step, ours vs llama.cpp (same GGUF, `small` drafter, vocab {N_VOCAB}, "
        f"{args.n_new} new rows + {SMALL['block_size']}-token noise block with logits)"
    )
    print(
        f"CPU: {results['cpu']}, {args.threads} threads, OMP_WAIT_POLICY ours {results['omp_wait_policy']}, "
        f"llama.cpp {results['llama_omp_wait_policy'] or 'default'}, "
        f"load average {results['load_avg_start'][0]:.1f} at the start; median ms (p10)"
    )
    systems = ("ours_logits", "ours_ids", "llama_fa", "llama_nofa")
    for dtype, res in results["runs"].items():
        print(
            f"\nweights {dtype}; our products: "
            + ", ".join(f"{k} x{n}" for k, n in results.get("kernels", {}).get(dtype, {}).items())
        )
        print(f"{'W':>6} " + " ".join(f"{s:>17}" for s in systems) + f" {'ours/best llama (p10)':>21} {'ids/best':>9}")
        for W in args.windows:
            cells = []
            for s in systems:
                st = res.get(s, {}).get(W)
                cells.append(f"{st['median_ms']:8.2f} ({st['p10_ms']:6.2f})" if st else f"{'-':>17}")
            best = min(res[s][W]["median_ms"] for s in ("llama_fa", "llama_nofa") if W in res.get(s, {}))
            best10 = min(res[s][W]["p10_ms"] for s in ("llama_fa", "llama_nofa") if W in res.get(s, {}))
            r = res["ours_logits"][W]["median_ms"] / best
            r10 = res["ours_logits"][W]["p10_ms"] / best10
            r_ids = res["ours_ids"][W]["median_ms"] / best
            ratios = {"ours_logits_over_best_llama": r, "p10": r10, "ours_ids_over_best_llama": r_ids}
            extra = ""
            if W in res.get("ours_head_q8", {}):
                rq = res["ours_head_q8"][W]["median_ms"] / best
                ag = results["head_q8_vs_file_head"][dtype][W]
                ratios["ours_head_q8_over_best_llama"] = rq
                flag_q8 = "ok" if rq <= GOAL else "MISS"
                extra = (
                    f"   head q8_0 {res['ours_head_q8'][W]['median_ms']:6.2f} ms, {rq:4.2f} {flag_q8}"
                    f" (logits {ag['rel_err']:.1e}, ids {100 * ag['draft_ids_equal']:.0f}% equal)"
                )
                rs = res["ours_ids_screened"][W]["median_ms"] / best
                ratios["ours_ids_screened_over_best_llama"] = rs
                extra += (
                    f"   ids screened {res['ours_ids_screened'][W]['median_ms']:6.2f} ms, {rs:4.2f} "
                    f"{'ok' if rs <= GOAL else 'MISS'} ({100 * ag['screened_ids_equal']:.0f}% equal)"
                )
            res.setdefault("ratios", {})[W] = ratios
            flag = "ok" if r <= GOAL else "MISS"
            print(f"{W:>6} " + " ".join(cells) + f" {r:>5.2f} ({r10:4.2f}) {flag:>4} {r_ids:>9.2f}" + extra)
    print(f"\ngoal: ours_logits / min(llama_fa, llama_nofa) <= {GOAL} at every window and weight type")
    if any("ours_head_q8" in res for res in results["runs"].values()):
        print(
            "head q8_0: ours with the same file's weights but the lm_head uploaded as q8_0 (lm_head_dtype='q8_0');\n"
            "its logits vs the file's head: max|a-b|/max|a|, and how many of the 15 draft ids are equal;\n"
            "ids screened: the file's head through a q8_0 screen (lm_head_screen='q8_0'), draft ids only (exact: "
            "equal to the file's head's)"
        )


def report_dflash2(results: dict, args: argparse.Namespace) -> None:
    print(
        f"\nDFlash-2 draft step, ours vs llama.cpp (same GGUF: {results['drafter']}, {args.n_new} new rows + "
        f"{results['q_len']}-token noise block [anchor, mask, ...] -> the selector's greedy walk)"
    )
    print(
        f"CPU: {results['cpu']}, {args.threads} threads, OMP_WAIT_POLICY ours {results['omp_wait_policy']}, "
        f"llama.cpp {results['llama_omp_wait_policy'] or 'default'}, "
        f"load average {results['load_avg_start'][0]:.1f} at the start; median ms (p10)"
    )
    systems = ("ours_ids", "ours_lattice", "llama_fa", "llama_nofa")
    for dtype, res in results["runs"].items():
        print(
            f"\nweights {dtype}; our products: "
            + ", ".join(f"{k} x{n}" for k, n in results.get("kernels", {}).get(dtype, {}).items())
        )
        print(f"{'W':>6} " + " ".join(f"{s:>17}" for s in systems) + f" {'ours_ids/best llama (p10)':>25}")
        for W in args.windows:
            cells = []
            for s in systems:
                st = res.get(s, {}).get(W)
                cells.append(f"{st['median_ms']:8.2f} ({st['p10_ms']:6.2f})" if st else f"{'-':>17}")
            best = min(res[s][W]["median_ms"] for s in ("llama_fa", "llama_nofa") if W in res.get(s, {}))
            best10 = min(res[s][W]["p10_ms"] for s in ("llama_fa", "llama_nofa") if W in res.get(s, {}))
            r = res["ours_ids"][W]["median_ms"] / best
            r10 = res["ours_ids"][W]["p10_ms"] / best10
            ratios = {
                "ours_ids_over_best_llama": r,
                "p10": r10,
                "ours_lattice_over_best_llama": res["ours_lattice"][W]["median_ms"] / best,
            }
            extra = ""
            if W in res.get("ours_ids_head_q8", {}):
                rq = res["ours_ids_head_q8"][W]["median_ms"] / best
                ratios["ours_ids_head_q8_over_best_llama"] = rq
                ag = results["head_q8_vs_file_head"][dtype][W]
                extra = (
                    f"   head q8_0 {res['ours_ids_head_q8'][W]['median_ms']:6.2f} ms, {rq:4.2f} "
                    f"{'ok' if rq <= GOAL else 'MISS'} (ids {100 * ag['draft_ids_equal']:.0f}% equal)"
                )
            res.setdefault("ratios", {})[W] = ratios
            flag = "ok" if r <= GOAL else "MISS"
            print(f"{W:>6} " + " ".join(cells) + f" {r:>11.2f} ({r10:4.2f}) {flag:>4}" + extra)
        for W, prof in results.get("profiles", {}).get(dtype, {}).items():
            top = ", ".join(f"{op} {ms:.2f}" for op, ms in list(prof["by_op_ms"].items())[:8])
            mm = ", ".join(f"{w} {ms:.2f}" for w, ms in list(prof["matmul_by_weight_ms"].items())[:6])
            print(
                f"  profile W {W}: nodes alone {prof['total_ms']:.2f} ms over {prof['n_nodes']} nodes; by op: {top}; "
                f"products by weight: {mm}"
            )
    print(f"\ngoal: ours_ids / min(llama_fa, llama_nofa) <= {GOAL} at every window and weight type")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="f16,q8_0", help="comma list of GGUF weight types (default f16,q8_0)")
    ap.add_argument(
        "--drafter",
        choices=("small", "dflash2"),
        default="small",
        help="small: the random `small` DFlash drafter, ours with logits; dflash2: the shipped SmolLM2 "
        "drafter lifted to DFlash-2, both sides' greedy walk",
    )
    ap.add_argument(
        "--windows",
        default=None,
        help=f"comma list (default {','.join(map(str, WINDOWS))}; dflash2: {','.join(map(str, WINDOWS_DFLASH2))})",
    )
    ap.add_argument("--profile", action="store_true", help="(dflash2) per-op time of our ids graph at each window")
    ap.add_argument("--reps", type=int, default=15, help="timed steps per system and window, over all rounds")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of our side and llama.cpp's (default 3)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--n-new",
        type=int,
        default=None,
        help="rows committed per step (default: half the block plus the bonus token, 9 for block 16)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--omp-wait-policy",
        choices=("default", "active", "passive"),
        default=None,
        help="OMP_WAIT_POLICY of our process (default: $OMP_WAIT_POLICY if set, else unset: OpenMP's "
        "default, as in a llama.cpp host)",
    )
    ap.add_argument(
        "--llama-omp-wait-policy",
        choices=("default", "active", "passive"),
        default="default",
        help="OMP_WAIT_POLICY of llama.cpp's process (default: unset, OpenMP's default, its fastest)",
    )
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    args.llama_omp_wait_policy = None if args.llama_omp_wait_policy == "default" else args.llama_omp_wait_policy
    args.dtypes = args.dtypes.split(",")
    if args.windows is None:
        args.windows = ",".join(map(str, WINDOWS_DFLASH2 if args.drafter == "dflash2" else WINDOWS))
    args.windows = [int(w) for w in args.windows.split(",")]
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args = parse_args(argv)
    if not llama_cpp_available():
        raise SystemExit("llama-cpp-python is not installed (pip install pyggml_dkv[llama])")
    write = write_dflash2_drafter if args.drafter == "dflash2" else write_drafter
    results: dict = {
        "cpu": cpu_name(),
        "threads": args.threads,
        "drafter": args.drafter,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
        "llama_omp_wait_policy": args.llama_omp_wait_policy,
        "load_avg_start": os.getloadavg(),
        "runs": {},
    }
    per_round = max(1, args.reps // args.rounds)
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes:
            path = write(dtype, Path(tmp))
            ours = Ours(path, args.threads, profile=args.profile and args.drafter == "dflash2")
            cfg = ours.g.cfg
            if args.n_new is None:
                args.n_new = cfg.block_size // 2 + 1
            results.update(n_new=args.n_new, q_len=cfg.block_size)
            results.setdefault("kernels", {})[dtype] = ours.kernels()
            samples: dict[str, dict[int, list[float]]] = {}
            try:
                # rounds alternate the two sides, so machine noise hits both alike
                for r in range(args.rounds):
                    ours_times, agreement = ours.run(args.windows, args.n_new, per_round, args.warmup)
                    if agreement:
                        results.setdefault("head_q8_vs_file_head", {})[dtype] = agreement
                    for part in (
                        ours_times,
                        bench_llama(
                            path,
                            args.windows,
                            args.n_new,
                            per_round,
                            args.warmup,
                            args.threads,
                            args.llama_omp_wait_policy,
                            cfg,
                        ),
                    ):
                        for name, by_w in part.items():
                            for W, t in by_w.items():
                                samples.setdefault(name, {}).setdefault(int(W), []).extend(t)
                    log.info(
                        "%s round %d/%d: %s",
                        dtype,
                        r + 1,
                        args.rounds,
                        {
                            n: {W: round(1e3 * float(np.median(t)), 1) for W, t in by_w.items()}
                            for n, by_w in samples.items()
                        },
                    )
                if ours.profiles:
                    results.setdefault("profiles", {})[dtype] = ours.profiles
            finally:
                ours.close()
            results["runs"][dtype] = {name: {W: stats(t) for W, t in by_w.items()} for name, by_w in samples.items()}
    if args.drafter == "dflash2":
        results["drafter"] = (
            "the SmolLM2 drafter lifted to DFlash-2 (hidden 576, 4 layers, K 3, group 64, R 64, top-k 8)"
        )
        report_dflash2(results, args)
    else:
        report(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
