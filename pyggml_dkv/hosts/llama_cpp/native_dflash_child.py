"""llama.cpp's own DFlash drafter, driven through libllama's C API (llama-cpp-python's ctypes
bindings). Run in a CHILD process (native_dflash.py starts it), so that what it measures never
shares a process with what it is compared with. It imports only the standard library, numpy and
llama_cpp.

    python -m pyggml_dkv.hosts.llama_cpp.native_dflash_child JOB.json

JOB.json: {"mode": "meta" | "trajectory" | "trajectory_seqs" | "bench" | "trajectory_dflash2", "gguf": path,
"out": directory, ...} ("bench" takes an optional "n_seq": that many sequences drafted in one packed
decode per step).
Arrays come in and go out as .npy files; the summary goes to out/result.json.

The drafter context works like llama.cpp's speculative driver (common/speculative.cpp, class
common_speculative_impl_draft_dflash): non-causal attention, nextn embeddings on, target
features injected as an embedding batch at their positions (llama_process DECODE: fc + hidden
norm, then every layer's K/V written to the context's cache), then the noise block as tokens
[last, mask, ...] at positions committed.. with logits for every row. The noise rows are then
removed from the cache (llama_memory_seq_rm). A window `cap` keeps only the last `cap`
positions, as DraftKvCache does.

Several sequences (Drafter(n_seq=N), "trajectory_seqs", "bench" with n_seq) share one context as
llama.cpp's server shares one draft context among its slots (one common_speculative, n_seq =
n_parallel): each step injects the new feature rows of every sequence in one llama_process (rows
of several sequences in one batch, each sequence's rows contiguous, lowest id first) and decodes
the noise blocks of all of them in one more (equal-width blocks, sequence 0's first), logits for
every row. The cache has one stream per sequence (kv_unified false, llama.cpp's default).

DFlash-2 drafters (dflash.selector_top_k > 0, docs/dflash2.md) are driven as common/speculative.cpp
drives them: nextn embeddings UNMASKED (one row per batch token, whatever its output flag), the
noise block decoded with every output flag off (the graph computes the logits of every row anyway:
the selector reads them), then the packed lattice read back (llama_get_embeddings_nextn: row i of a
block = [C_i as floats (k), S_i predecessor-major (k*k), zeros], row 0 zeros) and walked greedily
on the CPU exactly as `common_speculative_impl_draft_dflash::draft` does (`walk_lattice`).
"trajectory_dflash2" returns per step the walk's ids, the packed rows, and (with "logits") the
logits, read through output flags set on every row, which leaves the lattice as it is.
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


def walk_lattice(rows: np.ndarray, top_k: int, p_min: float = 0.0, n_min: int = 0) -> list[int]:
    """llama.cpp's DFlash-2 draft ids from one block's packed lattice rows (n_block_tokens, n_embd),
    transcribed from common/speculative.cpp (`draft`, the is_dflash2 branch): from predecessor 0
    (position 1's rows are all the anchor's), at each position i >= 1 the first maximum of
    S_i[pred, :] (std::max_element), an early stop when p_min > 0 and the pick's softmax over the
    k scores is below p_min (computed in float32 as there), and nothing at all when fewer than
    n_min ids were emitted."""
    rows = np.asarray(rows, dtype=np.float32)
    ids: list[int] = []
    pred = 0
    for i in range(1, rows.shape[0]):
        row = rows[i]
        scores = row[top_k + pred * top_k : top_k + (pred + 1) * top_k]
        pred = int(np.argmax(scores))  # the first maximum, as std::max_element
        if p_min > 0.0:
            total = np.float32(0.0)
            for k in range(top_k):
                total += np.exp(np.float32(scores[k] - scores[pred]), dtype=np.float32)
            if np.float32(1.0) / total < np.float32(p_min):
                break
        ids.append(int(row[pred]))  # (llama_token) row[pred]: the id, carried as a float
    if len(ids) < n_min:
        ids.clear()
    return ids


class Drafter:
    """One llama.cpp DFlash drafter context holding `n_seq` sequences (ids 0 .. n_seq-1).

    With n_seq > 1 it drafts like llama.cpp's server (one common_speculative for all slots,
    n_seq = n_parallel): one llama_process injects the new feature rows of every sequence, one
    more decodes every sequence's noise block (step_seqs)."""

    def __init__(
        self,
        gguf: str,
        n_ctx: int,
        threads: int,
        flash_attn: bool,
        n_batch: int = 512,
        context: bool = True,
        n_seq: int = 1,
    ) -> None:
        """`n_ctx`: the positions ONE sequence must hold (its window + noise block + headroom).
        `context` False: load the model only (a drafter without token_embd / output needs
        the target's context as ctx_other to run, not to load)."""
        import llama_cpp as L
        from llama_cpp import llama_cpp_ext as LX

        if n_seq < 1:
            raise ValueError(f"n_seq must be >= 1, got {n_seq}")
        self.L = L
        self.ctx = self.batch = None
        self.n_seq = n_seq
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(gguf.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama_model_load_from_file failed for {gguf}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.n_embd = L.llama_model_n_embd(self.model)
        self.mask_token = L.llama_vocab_mask(L.llama_model_get_vocab(self.model))
        # C++-linkage accessor (llama-ext.h; what common/speculative.cpp switches DFlash-2 on)
        top_k_fn = L.llama_cpp._lib._Z33llama_model_dflash_selector_top_kPK11llama_model
        top_k_fn.argtypes = [ctypes.c_void_p]
        top_k_fn.restype = ctypes.c_int32
        self.selector_top_k = int(top_k_fn(self.model))
        self.dflash2 = self.selector_top_k > 0
        if not context:
            return
        cp = L.llama_context_default_params()
        # KV layout (llama.cpp src/llama-context.cpp, src/llama-kv-cache.cpp): kv_unified is false
        # by default (llama_context_default_params) and then the cache has one STREAM per sequence
        # (n_stream = n_seq_max), each of n_ctx_seq = GGML_PAD(GGML_PAD(n_ctx, 256) / n_seq_max, 256)
        # cells: a sequence sees only its own stream, and a batch of several sequences is split
        # with split_equal(sequential) into ubatches of equal-width, consecutive-id sequence blocks.
        # So n_ctx is the per-sequence need (padded to 256, as llama.cpp pads it anyway) times
        # n_seq, as llama.cpp's server sizes a draft context (n_ctx_seq * n_parallel); with n_seq
        # 1 this is exactly the context of before. (kv_unified true would instead give one stream
        # of n_ctx cells shared by all sequences, masked per sequence.)
        cp.n_ctx = -(-max(n_ctx, 1) // 256) * 256 * n_seq
        cp.n_batch = n_batch
        cp.n_ubatch = n_batch
        cp.n_seq_max = n_seq
        cp.kv_unified = False
        cp.n_threads = threads
        cp.n_threads_batch = threads
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama_init_from_model failed")
        # as common/speculative.cpp: DFlash-2 reads its lattice from the UNMASKED nextn rows
        LX.llama_set_embeddings_nextn(self.ctx, True, not self.dflash2)
        self.LX = LX
        L.llama_set_causal_attn(self.ctx, False)
        self.batch = L.llama_batch_ext_init(self.ctx)
        self.mem = L.llama_get_memory(self.ctx)
        self.n_batch = n_batch
        # per sequence: positions [held_from[s], next_pos[s]) are in the cache
        self.next_pos = [0] * n_seq
        self.held_from = [0] * n_seq

    def _pos(self, idx: int, p: int) -> None:
        pos = (ctypes.c_int32 * 4)(p, p, p, 0)
        if not self.L.llama_batch_ext_set_pos(self.batch, idx, pos):
            raise RuntimeError("llama_batch_ext_set_pos failed")

    def _process(self) -> None:
        rc = self.L.llama_process(self.ctx, self.L.LLAMA_PROCESS_TYPE_DECODE, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_process returned {rc}")

    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.n_seq:
            raise ValueError(f"sequence {seq} out of range (n_seq {self.n_seq})")

    def inject(self, feats: np.ndarray, start: int, seq: int = 0) -> None:
        """Target features of positions start, start+1, ... into sequence `seq`'s K/V cache."""
        self.inject_seqs([(seq, feats, start)])

    def inject_seqs(self, rows: list[tuple[int, np.ndarray, int]]) -> None:
        """(seq, feats, start) per sequence, in increasing seq order: every sequence's rows in one
        embedding batch (one llama_process while they fit n_batch rows, else one per n_batch rows),
        each sequence's rows contiguous, as llama.cpp's split_equal wants them."""
        L = self.L
        n = 0
        L.llama_batch_ext_clear(self.batch)
        for seq, feats, start in rows:
            self._check_seq(seq)
            feats = np.ascontiguousarray(feats, dtype=np.float32)
            fc_in = feats.shape[1]
            for i in range(feats.shape[0]):
                if n == self.n_batch:
                    self._process()
                    L.llama_batch_ext_clear(self.batch)
                    n = 0
                row = feats[i].ctypes.data_as(ctypes.POINTER(ctypes.c_float))
                idx = L.llama_batch_ext_add_embd(self.batch, seq, L.llama_embd(row, 1, fc_in))
                if idx < 0:
                    raise RuntimeError(f"llama_batch_ext_add_embd returned {idx}")
                self._pos(idx, start + i)
                L.llama_batch_ext_set_output_logits(self.batch, idx, False)
                n += 1
        if n:
            self._process()

    def forget(self, seq: int, p0: int, p1: int = -1) -> None:
        """Drop positions [p0, p1) (p1 -1: to the end) from sequence `seq`'s cache."""
        self._check_seq(seq)
        if not self.L.llama_memory_seq_rm(self.mem, seq, p0, p1):
            raise RuntimeError(f"llama_memory_seq_rm({seq}, {p0}, {p1}) failed")

    def noise_logits(self, tokens: np.ndarray, committed: int, seq: int = 0) -> np.ndarray:
        """The noise block at positions committed.. -> logits (q_len, vocab); leaves no trace."""
        return self.noise_logits_seqs([(seq, tokens, committed)])[0]

    def _decode_noise_blocks(self, blocks: list[tuple[int, np.ndarray, int]], output_logits: bool) -> int:
        """One decode of the noise blocks (seq, tokens, committed), in increasing seq order, of equal
        width (llama.cpp's split_equal takes equal-width blocks of consecutive sequence ids), each
        row's logits output flag set to `output_logits`; returns the width q_len."""
        L = self.L
        q_len = len(blocks[0][1])
        if any(len(t) != q_len for _, t, _ in blocks):
            raise ValueError("the noise blocks of a packed decode must be of equal width")
        if len(blocks) * q_len > self.n_batch:
            raise ValueError(f"{len(blocks)} blocks of {q_len} exceed n_batch {self.n_batch}")
        L.llama_batch_ext_clear(self.batch)
        for seq, tokens, committed in blocks:
            self._check_seq(seq)
            for j, tok in enumerate(tokens):
                idx = L.llama_batch_ext_add_token(self.batch, seq, int(tok))
                if idx < 0:
                    raise RuntimeError(f"llama_batch_ext_add_token returned {idx}")
                self._pos(idx, committed + j)
                L.llama_batch_ext_set_output_logits(self.batch, idx, output_logits)
        self._process()
        return q_len

    def _read_logits(self, n_blocks: int, q_len: int) -> np.ndarray:
        """The last decode's logits of every row -> (n_blocks, q_len, vocab)."""
        out = np.empty((n_blocks, q_len, self.n_vocab), dtype=np.float32)
        for b in range(n_blocks):
            for j in range(q_len):
                ptr = self.L.llama_get_logits_ith(self.ctx, b * q_len + j)
                out[b, j] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        return out

    def _forget_noise(self, blocks: list[tuple[int, np.ndarray, int]]) -> None:
        for seq, _, committed in blocks:
            self.forget(seq, committed)

    def noise_logits_seqs(self, blocks: list[tuple[int, np.ndarray, int]]) -> np.ndarray:
        """(seq, tokens, committed) per sequence, in increasing seq order, blocks of equal width:
        one decode of all the noise blocks (sequence 0's block first, then 1's, ...), logits for
        every row -> (n_blocks, q_len, vocab); then each sequence's noise rows leave its cache."""
        q_len = self._decode_noise_blocks(blocks, output_logits=True)
        out = self._read_logits(len(blocks), q_len)
        self._forget_noise(blocks)
        return out

    def noise_lattice_seqs(
        self, blocks: list[tuple[int, np.ndarray, int]], logits: bool = False, p_min: float = 0.0, n_min: int = 0
    ) -> tuple[list[list[int]], np.ndarray, np.ndarray | None]:
        """DFlash-2: (seq, tokens, committed) per sequence, in increasing seq order, blocks of equal
        width, tokens = [anchor, mask, ...]: one decode of all the noise blocks with every output
        flag off (as common/speculative.cpp; `logits` True sets them on to read the logits too),
        the packed lattice rows read back (llama_get_embeddings_nextn) and walked per block
        (walk_lattice) -> (ids per block, packed rows (n_blocks, q_len, n_embd), logits
        (n_blocks, q_len, vocab) or None); then each sequence's noise rows leave its cache."""
        if not self.dflash2:
            raise ValueError("not a DFlash-2 drafter (dflash.selector_top_k is 0)")
        q_len = self._decode_noise_blocks(blocks, output_logits=logits)
        ptr = self.LX.llama_get_embeddings_nextn(self.ctx)
        if not ptr:
            raise RuntimeError("DFlash-2 selector produced no lattice (llama_get_embeddings_nextn is NULL)")
        packed = (
            np.ctypeslib.as_array(ptr, shape=(len(blocks) * q_len, self.n_embd))
            .reshape(len(blocks), q_len, self.n_embd)
            .copy()
        )
        ids = [walk_lattice(packed[b], self.selector_top_k, p_min, n_min) for b in range(len(blocks))]
        out = self._read_logits(len(blocks), q_len) if logits else None
        self._forget_noise(blocks)
        return ids, packed, out

    def _sync(self, seq: int, committed: int, cap: int) -> int:
        """Bring sequence `seq`'s cache to `committed` (rewinds drop later positions) and keep its
        last `cap` positions; returns the first position whose features must be injected."""
        if self.next_pos[seq] > committed:
            self.forget(seq, committed)
            self.next_pos[seq] = committed
        lo = max(0, committed - cap)
        if lo < self.held_from[seq]:  # a rewind reaches below what the window already dropped: refill it
            self.forget(seq, 0)
            self.next_pos[seq] = lo
        start = max(self.next_pos[seq], lo)
        self.forget(seq, 0, lo)
        self.held_from[seq] = lo
        return start

    def step(self, feats: np.ndarray, committed: int, tokens: np.ndarray, cap: int) -> np.ndarray:
        """Sequence 0: bring the cache to `committed` (rewinds drop later positions), keep the
        last `cap` positions, then draft. `feats`: all target features, row = position."""
        return self.step_seqs([feats], [committed], [tokens], cap)[0]

    def step_seqs(
        self, feats: list[np.ndarray], committed: list[int], tokens: list[np.ndarray], cap: int
    ) -> np.ndarray:
        """Sequences 0 .. len(feats)-1 at once: each brought to its `committed[s]` with its last
        `cap` positions kept, ONE llama_process for the new feature rows of every sequence, ONE for
        the noise blocks of all of them -> logits (n, q_len, vocab)."""
        return self.noise_logits_seqs(self._inject_for_step(feats, committed, tokens, cap))

    def draft2_seqs(
        self, feats: list[np.ndarray], committed: list[int], tokens: list[np.ndarray], cap: int, logits: bool = False
    ) -> tuple[list[list[int]], np.ndarray, np.ndarray | None]:
        """step_seqs for a DFlash-2 drafter: the same injection, then noise_lattice_seqs (the
        lattice and its greedy walk; the logits too with `logits`)."""
        return self.noise_lattice_seqs(self._inject_for_step(feats, committed, tokens, cap), logits)

    def _inject_for_step(
        self, feats: list[np.ndarray], committed: list[int], tokens: list[np.ndarray], cap: int
    ) -> list[tuple[int, np.ndarray, int]]:
        """Bring every sequence to its committed count (one llama_process for all the new feature
        rows) -> the (seq, tokens, committed) noise blocks to decode."""
        rows, blocks = [], []
        for s, (f, c, t) in enumerate(zip(feats, committed, tokens)):
            start = self._sync(s, c, cap)
            if c > start:
                rows.append((s, f[start:c], start))
            self.next_pos[s] = c
            blocks.append((s, t, c))
        if rows:
            self.inject_seqs(rows)
        return blocks

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
        ids_fn = lib._Z28llama_model_target_layer_idsPK11llama_model
        n_fn = lib._Z30llama_model_target_layer_ids_nPK11llama_model
        ids_fn.argtypes = n_fn.argtypes = [ctypes.c_void_p]
        ids_fn.restype = ctypes.POINTER(ctypes.c_int32)
        n_fn.restype = ctypes.c_uint32
        n_ids = n_fn(self.model)
        ids = ids_fn(self.model)
        return dict(
            target_layer_ids=[int(ids[i]) for i in range(n_ids)],
            meta=kv,
            n_embd=L.llama_model_n_embd(self.model),
            n_layer=L.llama_model_n_layer(self.model),
            n_head=L.llama_model_n_head(self.model),
            n_head_kv=L.llama_model_n_head_kv(self.model),
            n_vocab=self.n_vocab,
            mask=L.llama_vocab_mask(vocab),
            rope_type=L.llama_model_rope_type(self.model),
            n_params=L.llama_model_n_params(self.model),
            selector_top_k=self.selector_top_k,
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


def run_trajectory_dflash2(job: dict[str, Any], out: Path) -> dict[str, Any]:
    """A DFlash-2 drafter over a trajectory of commits: per step the greedy walk's ids
    (ids.npy (steps, q_len - 1), -1 past an early stop), the packed lattice rows (lattice.npy
    (steps, q_len, n_embd)) and, with job["logits"], the logits (logits.npy (steps, q_len, vocab))."""
    feats = np.load(job["feats"])
    tokens = np.load(job["tokens"])
    commits = job["commits"]
    want_logits = bool(job.get("logits", False))
    d = Drafter(job["gguf"], job["n_ctx"], job["threads"], job["flash_attn"])
    ids = np.full((len(commits), tokens.shape[1] - 1), -1, dtype=np.int64)
    packed, logits = [], []
    try:
        if not d.dflash2:
            raise SystemExit(f"{job['gguf']}: not a DFlash-2 drafter (dflash.selector_top_k is 0)")
        for k, c in enumerate(commits):
            walk, rows, lg = d.draft2_seqs([feats], [c], [tokens[k]], job["cap"], want_logits)
            ids[k, : len(walk[0])] = walk[0]
            packed.append(rows[0])
            if lg is not None:
                logits.append(lg[0])
    finally:
        d.close()
    np.save(out / "ids.npy", ids)
    np.save(out / "lattice.npy", np.stack(packed))
    if want_logits:
        np.save(out / "logits.npy", np.stack(logits))
    return dict(steps=len(commits), selector_top_k=d.selector_top_k, n_embd=d.n_embd)


def run_trajectory_seqs(job: dict[str, Any], out: Path) -> dict[str, Any]:
    """N sequences in one context, every step packed: feats (N, P, fc_in), commits (steps, N),
    tokens (steps, N, q_len) -> logits (steps, N, q_len, vocab)."""
    feats = np.load(job["feats"])
    tokens = np.load(job["tokens"])
    commits = np.asarray(job["commits"], dtype=np.int64)
    n_seq = feats.shape[0]
    d = Drafter(job["gguf"], job["n_ctx"], job["threads"], job["flash_attn"], n_seq=n_seq)
    try:
        logits = np.stack(
            [
                d.step_seqs(list(feats), [int(c) for c in commits[k]], list(tokens[k]), job["cap"])
                for k in range(commits.shape[0])
            ]
        )
    finally:
        d.close()
    np.save(out / "logits.npy", logits)
    return dict(steps=int(commits.shape[0]), n_seq=n_seq)


def run_bench(job: dict[str, Any], out: Path) -> dict[str, Any]:
    """Steady state at each window W with `n_seq` sequences (default 1) in one context: each step
    commits `n_new` new context rows to EVERY sequence and drafts every sequence's noise block
    with logits (step_seqs: one packed inject, one packed noise decode, all logits read back).
    Each sequence has its own random features and noise tokens. Seconds per (packed) step.
    A DFlash-2 drafter's step is common/speculative.cpp's instead (draft2_seqs): noise blocks
    [anchor, mask, ...] decoded with no logits read back, the packed lattice read and walked."""
    fc_in, q_len, n_new, reps = job["fc_in"], job["q_len"], job["n_new"], job["reps"]
    n_seq = int(job.get("n_seq", 1))
    rng = np.random.default_rng(0)
    results = {}
    dflash2 = False
    for W in job["windows"]:
        d = Drafter(job["gguf"], W + 2 * q_len + n_new + 256, job["threads"], job["flash_attn"], n_seq=n_seq)
        try:
            total = W + (reps + job["warmup"]) * n_new
            feats = list(rng.standard_normal((n_seq, total, fc_in), dtype=np.float32))
            tokens = list(rng.integers(0, d.n_vocab, size=(n_seq, q_len)).astype(np.int32))
            # a DFlash-2 drafter drafts as common/speculative.cpp: [anchor, mask, ...], no logits
            # read, the lattice read and walked; DFlash-1: every row's logits read
            if d.dflash2:
                for t in tokens:
                    t[1:] = d.mask_token
            dflash2 = d.dflash2
            step = d.draft2_seqs if d.dflash2 else d.step_seqs
            step(feats, [W] * n_seq, tokens, W)  # prefill the windows
            times = []
            for k in range(job["warmup"] + reps):
                committed = W + (k + 1) * n_new
                t0 = time.perf_counter()
                step(feats, [committed] * n_seq, tokens, W)
                if k >= job["warmup"]:
                    times.append(time.perf_counter() - t0)
        finally:
            d.close()
        results[str(W)] = times
    return dict(times=results, n_seq=n_seq, dflash2=dflash2)


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
    elif job["mode"] == "trajectory_seqs":
        result = run_trajectory_seqs(job, out)
    elif job["mode"] == "trajectory_dflash2":
        result = run_trajectory_dflash2(job, out)
    elif job["mode"] == "bench":
        result = run_bench(job, out)
    else:
        raise SystemExit(f"unknown mode {job['mode']!r}")
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
