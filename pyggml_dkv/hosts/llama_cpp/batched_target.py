"""BatchedLlamaTarget: the target model for several requests at once, one llama.cpp context.

`n_parallel` sequences (seq ids 0 .. n_parallel - 1) share one context. One `decode` takes a batch
whose rows belong to any of them, each row at an explicit position with or without logits; it
returns the logits of the rows asked for, in row order, and captures the drafter's target
features of EVERY row (`capture.features(n, start=row)`), so each sequence's committed tokens get
their feature rows whatever else shared the batch. `truncate(seq, n_keep)` removes a sequence's
positions >= n_keep (`llama_memory_seq_rm`), `clear_seq(seq)` empties it.

What llama.cpp imposes on a multi-sequence batch (llama-batch.cpp, llama-kv-cache.cpp, 0.3.36):

- per sequence, the batch's positions must continue its cache: the first is the cache's last
  position + 1 and they are consecutive and non-decreasing in row order. `decode` checks this
  itself (one position counter per sequence) and raises before llama.cpp sees the batch.
- `kv_unified=True` (the default here): one KV buffer for all sequences, each row attending only
  to its own sequence's cells (mask). The batch is cut into ubatches in row order
  (`split_simple`), so blocks of different lengths share one graph compute. We bound each
  sequence to `n_ctx // n_parallel` positions, so no request can starve the others of cells.
- `kv_unified=False`: one KV stream per sequence (`n_ctx / n_parallel` cells each). llama.cpp
  then splits the batch with `split_equal(sequential=True)`: a ubatch takes the SAME number of
  rows from each of a run of consecutive seq ids, so a batch of blocks of different lengths (or of
  non-consecutive seq ids) becomes several graph computes, and ubatches do not follow row order.
- features: the native route (`llama_set_embeddings_layer_inp`) puts the rows back into batch
  order when they are read (`output_reorder`), so it works with either layout; the callback
  route copies ubatch by ubatch, which is batch order only with `kv_unified=True` (required).
- logits come back in row order of the output rows (llama.cpp reorders them too).

Measured (SmolLM2-135M Q4_1, 2 threads, 4 sequences of 200 tokens; ms per decode, unified /
split): blocks 1,1,1,1: 22.4 / 22.3; 8,8,8,8: 128 / 124; 8,1,1,1: 51 / 63; 8,8,1,1: 79 / 95;
4,0,4,0: 36 / 55 (a gap in the seq ids splits the batch too). With one stream per sequence a
sequence's logits are bit-identical to decoding it alone; with the unified cache its cells end up
among other sequences' after removals, and the attention's sums in another order change last
bits: 4 concurrent greedy requests of 64 tokens matched plain decoding 4/4 split and 0-1/4
unified, every divergence at a near-tie (top-2 gap < 0.5). The unified cache is the default
because its cost depends on the number of rows only, which is what the engine's draft-length
policy models.

The vocabulary and lifecycle methods are `LlamaTarget`'s (their shared base, target.py). The verification rule (greedy
acceptance, rejection sampling, the target's sampling distribution) is exposed on the class for
engines in layers that may not import the hosts layer (`pyggml_dkv.serving.engine`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np

from ...common.checks import is_int
from ...ggml.capabilities import load_ggml_matmul_tiles
from .acceptance import accept_greedy, accept_sampled, target_probs, top2_gap
from .capture import FeatureCapture, make_capture
from .drafters import check_fits_target
from .errors import HostError
from .sampling import draw
from .target import _LlamaModel

log = logging.getLogger(__name__)

LLAMA_MAX_SEQ = 256  # llama-cparams.h


@dataclass(frozen=True)
class Block:
    """Rows of one sequence in a batch: `tokens` appended at the sequence's next positions;
    logits "all" (every row), "last" (the last row) or "none"."""

    seq_id: int
    tokens: Sequence[int] | np.ndarray
    logits: str = "all"


@dataclass(frozen=True)
class BlockRows:
    """Where a block landed: rows [start, start + n) of the batch (its features:
    `target.capture.features(n, start)`), its first position, and its logits rows (a view into
    llama.cpp's output buffer, valid until the next decode) or None."""

    seq_id: int
    start: int
    n: int
    pos: int
    logits: np.ndarray | None


class BatchedLlamaTarget(_LlamaModel):
    """A llama.cpp target with `n_parallel` sequences: multi-sequence decode, logits of chosen
    rows, features of every row, per-sequence KV removal.

    capture_layers: the drafter's target_layer_ids (empty: no capture).
    capture: "auto" | "native" | "callback" (capture.py; "callback" needs kv_unified=True).
    n_ctx: total KV cells; each sequence holds at most `n_ctx_seq` positions.
    """

    # the host's verification rule (hosts/llama_cpp/acceptance.py, sampling.py), for engines that
    # drive this target from a layer that may not import the hosts layer
    accept_greedy = staticmethod(accept_greedy)
    accept_sampled = staticmethod(accept_sampled)
    target_probs = staticmethod(target_probs)
    top2_gap = staticmethod(top2_gap)
    draw = staticmethod(draw)

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        n_parallel: int = 4,
        n_ctx: int = 4096,
        n_batch: int = 512,
        n_ubatch: int | None = None,
        n_threads: int = 2,
        capture_layers: Sequence[int] = (),
        capture: str = "auto",
        kv_unified: bool = True,
        verbose: bool = False,
    ) -> None:
        self._model: Any = None
        self._ctx: Any = None
        self._batch: Any = None
        for name, value, lo in (
            ("n_parallel", n_parallel, 1),
            ("n_ctx", n_ctx, 1),
            ("n_batch", n_batch, 1),
            ("n_threads", n_threads, 1),
        ):
            if not is_int(value) or value < lo:
                raise HostError(f"{name} must be an int >= {lo}, got {value!r}")
        if n_parallel > LLAMA_MAX_SEQ:
            raise HostError(f"n_parallel must be at most {LLAMA_MAX_SEQ} (llama.cpp's LLAMA_MAX_SEQ), got {n_parallel}")
        if n_ubatch is not None and (not is_int(n_ubatch) or n_ubatch < 1):
            raise HostError(f"n_ubatch must be an int >= 1 or None, got {n_ubatch!r}")
        if n_ctx < n_parallel:
            raise HostError(f"n_ctx={n_ctx} leaves no cell for each of {n_parallel} sequences")
        self._load_model(model_path, verbose)
        self.kv_unified = bool(kv_unified)
        self.capture: FeatureCapture | None = None
        if capture_layers:
            self.capture = make_capture(capture, capture_layers, self.n_embd, self.n_layer, n_batch)
            if self.capture.route == "callback" and not self.kv_unified:
                self.close()
                raise HostError(
                    "the callback capture route copies features ubatch by ubatch, which follows "
                    "the batch's row order only with kv_unified=True"
                )
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = min(n_batch, n_ubatch or n_batch)
        cparams.n_seq_max = n_parallel
        cparams.kv_unified = self.kv_unified
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads
        self._init_context(cparams)
        self.n_parallel = int(n_parallel)
        self.n_ctx = int(llama_cpp.llama_n_ctx(self._ctx))
        self.n_batch = int(llama_cpp.llama_n_batch(self._ctx))
        # positions per sequence: our own fair share of a unified cache, llama.cpp's stream size otherwise
        self.n_ctx_seq = self.n_ctx // self.n_parallel if self.kv_unified else int(llama_cpp.llama_n_ctx_seq(self._ctx))
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        b = self._batch
        self._tok = np.ctypeslib.as_array(b.token, shape=(self.n_batch,))
        self._pos = np.ctypeslib.as_array(b.pos, shape=(self.n_batch,))
        self._nseq = np.ctypeslib.as_array(b.n_seq_id, shape=(self.n_batch,))
        self._out = np.ctypeslib.as_array(b.logits, shape=(self.n_batch,))
        self._nseq[:] = 1
        self._seq_ptrs = [b.seq_id[i] for i in range(self.n_batch)]
        self._seq_shadow = np.full(self.n_batch, -1, dtype=np.int64)  # seq id last written per row
        self._n_past = [0] * self.n_parallel  # sequence s holds positions [0, _n_past[s])
        self.decode_seconds = 0.0
        self.decodes = 0

    def __enter__(self) -> BatchedLlamaTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- sequences -------------------------------------------------------------------------

    def _check_seq(self, seq_id: Any) -> int:
        if not is_int(seq_id) or not 0 <= int(seq_id) < self.n_parallel:
            raise HostError(f"seq_id must be an int in [0, {self.n_parallel}), got {seq_id!r}")
        return int(seq_id)

    def n_past_of(self, seq_id: int) -> int:
        """Positions [0, n) of sequence `seq_id` are in the KV cache."""
        return self._n_past[self._check_seq(seq_id)]

    def truncate(self, seq_id: int, n_keep: int) -> None:
        """Keep positions [0, n_keep) of sequence `seq_id`, drop the rest (llama_memory_seq_rm)."""
        self._check_open()
        s = self._check_seq(seq_id)
        if not is_int(n_keep) or not 0 <= n_keep <= self._n_past[s]:
            raise HostError(f"cannot truncate sequence {s} to {n_keep!r} positions (it holds {self._n_past[s]})")
        if n_keep < self._n_past[s]:
            if not llama_cpp.llama_memory_seq_rm(self._memory, s, int(n_keep), -1):
                raise HostError(f"llama.cpp could not remove positions >= {n_keep} of sequence {s}")
            self._n_past[s] = int(n_keep)

    def clear_seq(self, seq_id: int) -> None:
        """Empty sequence `seq_id` (a request left; the next one starts at position 0)."""
        self._check_open()
        s = self._check_seq(seq_id)
        if not llama_cpp.llama_memory_seq_rm(self._memory, s, -1, -1):
            raise HostError(f"llama.cpp could not clear sequence {s}")
        self._n_past[s] = 0

    def clear(self) -> None:
        """Empty every sequence."""
        self._check_open()
        llama_cpp.llama_memory_clear(self._memory, True)
        self._n_past = [0] * self.n_parallel

    def check_drafter(self, drafter: Any, lanes: int | None = None) -> None:
        """Raise unless `drafter` (a pyggml_dkv Drafter) fits this target: shape, vocab, the captured
        layers, n_batch >= its block size, and at least `lanes` lanes."""
        check_fits_target(self, drafter, "BatchedLlamaTarget")
        have_lanes = int(getattr(drafter, "lanes", 1))
        if lanes is not None and have_lanes < lanes:
            raise HostError(f"the drafter has {have_lanes} lanes, {lanes} are needed (Drafter(..., lanes={lanes}))")

    # --- decoding --------------------------------------------------------------------------

    def decode(
        self,
        tokens: Sequence[int] | np.ndarray,
        seq_ids: Sequence[int] | np.ndarray,
        positions: Sequence[int] | np.ndarray | None = None,
        logits: Sequence[bool] | np.ndarray | None = None,
        capture: bool = True,
    ) -> np.ndarray | None:
        """One llama_decode of n rows: row i is token `tokens[i]` of sequence `seq_ids[i]` at
        `positions[i]` (default: each sequence's next positions, in row order), with logits when
        `logits[i]` (default: none). Each sequence's positions must continue its cache,
        consecutive in row order. Captures every row's features (`capture=False`: none, a plain
        decode; `features()` then refuses).

        Returns the logits of the rows asked for, (n_out, n_vocab) float32 in row order (a view
        into llama.cpp's output buffer valid until the next decode; a copy when the capture made
        every row an output row), or None when no row asked."""
        self._check_open()
        toks = np.asarray(tokens).reshape(-1)
        seqs = np.asarray(seq_ids).reshape(-1)
        n = toks.size
        if n == 0 or n > self.n_batch:
            raise HostError(f"decode takes 1..{self.n_batch} rows, got {n}")
        if toks.dtype.kind not in "iu" or seqs.dtype.kind not in "iu":
            raise HostError("tokens and seq_ids must be integers")
        if seqs.size != n:
            raise HostError(f"seq_ids has {seqs.size} entries for {n} tokens")
        if toks.min() < 0 or toks.max() >= self.n_vocab:
            raise HostError(f"token ids must lie in [0, {self.n_vocab})")
        if seqs.min() < 0 or seqs.max() >= self.n_parallel:
            raise HostError(f"seq ids must lie in [0, {self.n_parallel})")
        want = np.zeros(n, dtype=bool) if logits is None else np.asarray(logits).reshape(-1)
        if want.size != n or want.dtype != bool:
            raise HostError(f"logits must be {n} booleans (one per row)")
        # positions: each sequence continues its cache, consecutive in row order
        expected = np.empty(n, dtype=np.int64)
        counts: dict[int, int] = {}
        for i, s in enumerate(seqs.tolist()):
            c = counts.get(s, 0)
            expected[i] = self._n_past[s] + c
            counts[s] = c + 1
        if positions is not None:
            pos = np.asarray(positions).reshape(-1)
            if pos.size != n or pos.dtype.kind not in "iu":
                raise HostError(f"positions must be {n} integers (one per row)")
            bad = np.nonzero(pos != expected)[0]
            if bad.size:
                i = int(bad[0])
                s = int(seqs[i])
                raise HostError(
                    f"row {i}: sequence {s} must continue at position {int(expected[i])}, got {int(pos[i])} "
                    f"(llama.cpp needs each sequence's positions to follow its cache, consecutive in row order)"
                )
        for s, c in counts.items():
            if self._n_past[s] + c > self.n_ctx_seq:
                raise HostError(
                    f"sequence {s}: {c} rows at position {self._n_past[s]} exceed its {self.n_ctx_seq} positions"
                )
        cap = self.capture
        if cap is not None:
            cap.set_enabled(capture)
            if not capture:
                cap = None
        all_out = bool(cap is not None and cap.needs_all_outputs)
        self._tok[:n] = toks
        self._pos[:n] = expected
        self._out[:n] = 1 if all_out else want
        changed = np.nonzero(self._seq_shadow[:n] != seqs)[0]
        for i in changed.tolist():
            self._seq_ptrs[i][0] = int(seqs[i])
        self._seq_shadow[changed] = seqs[changed]
        self._batch.n_tokens = n
        if cap is not None:
            cap.begin(n)
        t0 = time.perf_counter()
        if self._reload_tiles:
            load_ggml_matmul_tiles()
        rc = llama_cpp.llama_decode(self._ctx, self._batch)
        self.decode_seconds += time.perf_counter() - t0
        self.decodes += 1
        if rc != 0:
            if self.capture is not None:
                self.capture.rows = 0
            for s in counts:  # a failed decode may have kept some ubatches: back to the state before
                llama_cpp.llama_memory_seq_rm(self._memory, s, self._n_past[s], -1)
            raise HostError(f"llama_decode failed with {rc} ({n} rows of sequences {sorted(counts)})")
        for s, c in counts.items():
            self._n_past[s] += c
        if self.capture is not None:
            self.capture.end()
        n_want = int(want.sum())
        if n_want == 0:
            return None
        n_out = n if all_out else n_want
        out = np.ctypeslib.as_array(llama_cpp.llama_get_logits(self._ctx), shape=(n_out, self.n_vocab))
        return out[want] if all_out and n_want < n else out

    def decode_blocks(self, blocks: Sequence[Block | tuple[Any, ...]], *, capture: bool = True) -> list[BlockRows]:
        """Decode blocks of rows (one or more per sequence, in order) in one batch, each appended
        at its sequence's next positions; returns where each landed and its logits rows.
        `capture=False`: a plain decode, no features (as in decode)."""
        if not blocks:
            raise HostError("decode_blocks needs at least one block")
        toks: list[np.ndarray] = []
        seqs: list[np.ndarray] = []
        want: list[np.ndarray] = []
        placed: list[tuple[int, int, int, int, str]] = []
        start = 0
        pos_of: dict[int, int] = {}
        for blk in blocks:
            if isinstance(blk, tuple) and len(blk) in (2, 3):
                blk = Block(*blk)
            if not isinstance(blk, Block):
                raise HostError(f"blocks must be Block objects or (seq_id, tokens[, logits]) tuples, got {blk!r}")
            s = self._check_seq(blk.seq_id)
            t = np.asarray(blk.tokens).reshape(-1)
            if t.size == 0 or t.dtype.kind not in "iu":
                raise HostError(f"a block of sequence {s} must hold at least one integer token id")
            if blk.logits not in ("all", "last", "none"):
                raise HostError(f"block logits must be 'all', 'last' or 'none', got {blk.logits!r}")
            w = np.zeros(t.size, dtype=bool)
            if blk.logits == "all":
                w[:] = True
            elif blk.logits == "last":
                w[-1] = True
            p = pos_of.get(s, self._n_past[s])
            pos_of[s] = p + t.size
            toks.append(t)
            seqs.append(np.full(t.size, s, dtype=np.int64))
            want.append(w)
            placed.append((s, start, t.size, p, blk.logits))
            start += t.size
        w_all = np.concatenate(want)
        out = self.decode(np.concatenate(toks).astype(np.int64), np.concatenate(seqs), logits=w_all, capture=capture)
        rows: list[BlockRows] = []
        o = 0
        for s, st, n, p, lg in placed:
            k = n if lg == "all" else 1 if lg == "last" else 0
            rows.append(BlockRows(s, st, n, p, None if k == 0 or out is None else out[o : o + k]))
            o += k
        return rows

    def features(self, rows: BlockRows) -> np.ndarray:
        """The captured features (n, fc_in) of a block of the last decode (a view)."""
        if self.capture is None:
            raise HostError("this target captures no features (capture_layers=())")
        return self.capture.features(rows.n, rows.start)
