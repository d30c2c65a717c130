"""llama.cpp's own DFlash drafter, driven through libllama's C API (llama-cpp-python's ctypes
bindings). Run in a CHILD process (native_dflash.py starts it), so that what it measures never
shares a process with what it is compared with. It imports only the standard library, numpy and
llama_cpp.

    python -m pyggml_dkv.hosts.llama_cpp.native_dflash_child JOB.json

JOB.json: {"mode": "meta" | "trajectory" | "bench", "gguf": path, "out": directory, ...}.
Arrays come in and go out as .npy files; the summary goes to out/result.json.

The drafter context works like llama.cpp's speculative driver (common/speculative.cpp, class
common_speculative_impl_draft_dflash): non-causal attention, nextn embeddings on, target
features injected as an embedding batch at their positions (llama_process DECODE: fc + hidden
norm, then every layer's K/V written to the context's cache), then the noise block as tokens
[last, mask, ...] at positions committed.. with logits for every row. The noise rows are then
removed from the cache (llama_memory_seq_rm). A window `cap` keeps only the last `cap`
positions, as DraftKvCache does.
"""

from __future__ import annotations

import ctypes
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("pyggml_dkv.hosts.llama_cpp.native_dflash_child")


class Drafter:
    """One llama.cpp DFlash drafter context (sequence 0)."""

    def __init__(self, gguf: str, n_ctx: int, threads: int, flash_attn: bool, n_batch: int = 512,
                 context: bool = True) -> None:
        """`context` False: load the model only (a drafter without token_embd / output needs
        the target's context as ctx_other to run, not to load)."""
        import llama_cpp as L
        from llama_cpp import llama_cpp_ext as LX

        self.L = L
        self.ctx = self.batch = None
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(gguf.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama_model_load_from_file failed for {gguf}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        if not context:
            return
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_batch
        cp.n_ubatch = n_batch
        cp.n_seq_max = 1
        cp.n_threads = threads
        cp.n_threads_batch = threads
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama_init_from_model failed")
        LX.llama_set_embeddings_nextn(self.ctx, True, True)
        L.llama_set_causal_attn(self.ctx, False)
        self.batch = L.llama_batch_ext_init(self.ctx)
        self.mem = L.llama_get_memory(self.ctx)
        self.n_batch = n_batch
        self.next_pos = 0  # positions [held_from, next_pos) are in the cache
        self.held_from = 0

    def _pos(self, idx: int, p: int) -> None:
        pos = (ctypes.c_int32 * 4)(p, p, p, 0)
        if not self.L.llama_batch_ext_set_pos(self.batch, idx, pos):
            raise RuntimeError("llama_batch_ext_set_pos failed")

    def _process(self) -> None:
        rc = self.L.llama_process(self.ctx, self.L.LLAMA_PROCESS_TYPE_DECODE, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_process returned {rc}")

    def inject(self, feats: np.ndarray, start: int) -> None:
        """Target features of positions start, start+1, ... into the drafter's K/V cache."""
        L = self.L
        feats = np.ascontiguousarray(feats, dtype=np.float32)
        fc_in = feats.shape[1]
        for s in range(0, feats.shape[0], self.n_batch):
            L.llama_batch_ext_clear(self.batch)
            for i in range(s, min(feats.shape[0], s + self.n_batch)):
                row = feats[i].ctypes.data_as(ctypes.POINTER(ctypes.c_float))
                idx = L.llama_batch_ext_add_embd(self.batch, 0, L.llama_embd(row, 1, fc_in))
                if idx < 0:
                    raise RuntimeError(f"llama_batch_ext_add_embd returned {idx}")
                self._pos(idx, start + i)
                L.llama_batch_ext_set_output_logits(self.batch, idx, False)
            self._process()

    def forget(self, p0: int, p1: int = -1) -> None:
        """Drop positions [p0, p1) (p1 -1: to the end) from the cache."""
        if not self.L.llama_memory_seq_rm(self.mem, 0, p0, p1):
            raise RuntimeError(f"llama_memory_seq_rm({p0}, {p1}) failed")

    def noise_logits(self, tokens: np.ndarray, committed: int) -> np.ndarray:
        """The noise block at positions committed.. -> logits (q_len, vocab); leaves no trace."""
        L = self.L
        L.llama_batch_ext_clear(self.batch)
        for j, tok in enumerate(tokens):
            idx = L.llama_batch_ext_add_token(self.batch, 0, int(tok))
            if idx < 0:
                raise RuntimeError(f"llama_batch_ext_add_token returned {idx}")
            self._pos(idx, committed + j)
            L.llama_batch_ext_set_output_logits(self.batch, idx, True)
        self._process()
        out = np.empty((len(tokens), self.n_vocab), dtype=np.float32)
        for j in range(len(tokens)):
            ptr = L.llama_get_logits_ith(self.ctx, j)
            out[j] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        self.forget(committed)
        return out

    def step(self, feats: np.ndarray, committed: int, tokens: np.ndarray, cap: int) -> np.ndarray:
        """Bring the cache to `committed` (rewinds drop later positions), keep the last `cap`
        positions, then draft. `feats`: all target features, row = position."""
        if self.next_pos > committed:
            self.forget(committed)
            self.next_pos = committed
        lo = max(0, committed - cap)
        if lo < self.held_from:  # a rewind reaches below what the window already dropped: refill it
            self.forget(0)
            self.next_pos = lo
        start = max(self.next_pos, lo)
        self.forget(0, lo)
        self.held_from = lo
        if committed > start:
            self.inject(feats[start:committed], start)
        self.next_pos = committed
        return self.noise_logits(tokens, committed)

    def meta(self) -> dict[str, Any]:
        L = self.L
        buf = ctypes.create_string_buffer(1 << 16)
        kv = {}
        for i in range(L.llama_model_meta_count(self.model)):
            L.llama_model_meta_key_by_index(self.model, i, buf, len(buf))
            k = buf.value.decode()
            if k.startswith("tokenizer.ggml.") and k not in ("tokenizer.ggml.mask_token_id", "tokenizer.ggml.model"):
                continue  # the vocabulary arrays: long and not what we check
            L.llama_model_meta_val_str_by_index(self.model, i, buf, len(buf))
            kv[k] = buf.value.decode()
        vocab = L.llama_model_get_vocab(self.model)
        # C++-linkage accessors (llama-ext.h): the mangled names libllama exports
        lib = L.llama_cpp._lib
        ids_fn = getattr(lib, "_Z28llama_model_target_layer_idsPK11llama_model")
        n_fn = getattr(lib, "_Z30llama_model_target_layer_ids_nPK11llama_model")
        ids_fn.argtypes = n_fn.argtypes = [ctypes.c_void_p]
        ids_fn.restype = ctypes.POINTER(ctypes.c_int32)
        n_fn.restype = ctypes.c_uint32
        n_ids = n_fn(self.model)
        ids = ids_fn(self.model)
        return dict(
            target_layer_ids=[int(ids[i]) for i in range(n_ids)],
            meta=kv, n_embd=L.llama_model_n_embd(self.model), n_layer=L.llama_model_n_layer(self.model),
            n_head=L.llama_model_n_head(self.model), n_head_kv=L.llama_model_n_head_kv(self.model),
            n_vocab=self.n_vocab, mask=L.llama_vocab_mask(vocab), rope_type=L.llama_model_rope_type(self.model),
            n_params=L.llama_model_n_params(self.model),
        )

    def close(self) -> None:
        L = self.L
        if self.batch:
            L.llama_batch_ext_free(self.batch)
        if self.ctx:
            L.llama_free(self.ctx)
        L.llama_model_free(self.model)


def run_trajectory(job: dict[str, Any], out: Path) -> dict[str, Any]:
    feats = np.load(job["feats"])
    tokens = np.load(job["tokens"])
    commits = job["commits"]
    d = Drafter(job["gguf"], job["n_ctx"], job["threads"], job["flash_attn"])
    try:
        logits = np.stack([d.step(feats, c, tokens[k], job["cap"]) for k, c in enumerate(commits)])
    finally:
        d.close()
    np.save(out / "logits.npy", logits)
    return dict(steps=len(commits))


def run_bench(job: dict[str, Any], out: Path) -> dict[str, Any]:
    """Steady state at each window W: `n_new` new context rows + one noise block with logits per step."""
    fc_in, q_len, n_new, reps = job["fc_in"], job["q_len"], job["n_new"], job["reps"]
    rng = np.random.default_rng(0)
    results = {}
    for W in job["windows"]:
        d = Drafter(job["gguf"], W + 2 * q_len + n_new + 256, job["threads"], job["flash_attn"])
        try:
            total = W + (reps + job["warmup"]) * n_new
            feats = rng.standard_normal((total, fc_in), dtype=np.float32)
            tokens = rng.integers(0, d.n_vocab, size=q_len).astype(np.int32)
            d.step(feats, W, tokens, W)  # prefill the window
            times = []
            for k in range(job["warmup"] + reps):
                committed = W + (k + 1) * n_new
                t0 = time.perf_counter()
                d.step(feats, committed, tokens, W)
                if k >= job["warmup"]:
                    times.append(time.perf_counter() - t0)
        finally:
            d.close()
        results[str(W)] = times
    return dict(times=results)


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    job = json.loads(Path(sys.argv[1]).read_text())
    out = Path(job["out"])
    if job["mode"] == "meta":
        d = Drafter(job["gguf"], 0, 1, False, context=False)
        try:
            result = d.meta()
        finally:
            d.close()
    elif job["mode"] == "trajectory":
        result = run_trajectory(job, out)
    elif job["mode"] == "bench":
        result = run_bench(job, out)
    else:
        raise SystemExit(f"unknown mode {job['mode']!r}")
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
