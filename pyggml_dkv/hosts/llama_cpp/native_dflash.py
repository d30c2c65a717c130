"""llama.cpp's native DFlash drafter as a peer to compare with, run in a child process.

llama.cpp runs in `native_dflash_child.py` (a module that never imports our ggml), so a comparison
never shares a process with the code it checks; the arrays travel through .npy files. Needs llama-cpp-python
(`pip install pyggml_dkv[llama]`, 0.3.36: the first release whose llama.cpp runs DFlash).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...common.errors import PyggmlDkvError
from .amx_guard import INSTALL_HINT

log = logging.getLogger(__name__)

CHILD_MODULE = "pyggml_dkv.hosts.llama_cpp.native_dflash_child"


class LlamaCppError(PyggmlDkvError, RuntimeError):
    """llama.cpp's side failed (the message carries the child process's output)."""


def llama_cpp_available() -> bool:
    """Is llama-cpp-python installed (checked without importing it into this process)?"""
    return importlib.util.find_spec("llama_cpp") is not None


def _run(
    job: dict[str, Any], arrays: dict[str, np.ndarray], timeout: float, env: dict[str, str] | None = None
) -> tuple[dict[str, Any], Path]:
    work = Path(tempfile.mkdtemp(prefix="llama_dflash_"))
    for name, arr in arrays.items():
        np.save(work / f"{name}.npy", arr)
        job[name] = str(work / f"{name}.npy")
    job["out"] = str(work)
    (work / "job.json").write_text(json.dumps(job))
    proc = subprocess.run(
        [sys.executable, "-m", CHILD_MODULE, str(work / "job.json")],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    if proc.returncode == -signal.SIGILL:
        raise LlamaCppError(
            f"llama.cpp child ({job['mode']}) died of SIGILL: an instruction this CPU refuses (a "
            f"llama-cpp-python built for another CPU, or AMX tiles misconfigured; {INSTALL_HINT}):\n"
            f"{proc.stderr[-2000:]}"
        )
    if proc.returncode != 0 or not (work / "result.json").is_file():
        raise LlamaCppError(f"llama.cpp child ({job['mode']}) exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    log.debug("llama.cpp child log tail:\n%s", proc.stderr[-2000:])
    return json.loads((work / "result.json").read_text()), work


def llama_model_info(gguf: str | Path, timeout: float = 300) -> dict[str, Any]:
    """What llama.cpp's loader reports for a GGUF: its metadata as strings (vocabulary arrays
    left out), n_embd, n_layer, n_head, n_head_kv, n_vocab, mask, rope_type, n_params."""
    result, _ = _run(dict(mode="meta", gguf=str(gguf)), {}, timeout)
    return result


def llama_dflash_trajectory(
    gguf: str | Path,
    feats: np.ndarray,
    commits: list[int],
    tokens: np.ndarray,
    cap: int,
    *,
    flash_attn: bool = False,
    threads: int = 1,
    timeout: float = 600,
) -> np.ndarray:
    """llama.cpp's drafter over a trajectory of commits: logits (steps, q_len, vocab).
    `feats[p]`: the target features of position p; `tokens[k]`: step k's noise block ids."""
    n_ctx = max(cap, 1) + tokens.shape[1] + 256
    job = dict(
        mode="trajectory",
        gguf=str(gguf),
        commits=[int(c) for c in commits],
        cap=int(cap),
        n_ctx=n_ctx,
        threads=threads,
        flash_attn=flash_attn,
    )
    _, work = _run(
        job,
        dict(feats=np.ascontiguousarray(feats, dtype=np.float32), tokens=np.ascontiguousarray(tokens, dtype=np.int32)),
        timeout,
    )
    return np.load(work / "logits.npy")


@dataclass(frozen=True)
class LlamaDflash2Trajectory:
    """What llama.cpp's DFlash-2 drafter drafted at each step of a trajectory (docs/dflash2.md,
    section 2), as common/speculative.cpp takes it.

    ids[s]: the greedy walk of step s, (q_len - 1,), -1 past an early stop (p_min);
    packed[s]: its packed lattice rows as llama_get_embeddings_nextn returns them, (q_len, n_embd);
    candidates[s, i - 1] = C_i (k,) and scores[s, i - 1] = S_i (k, k) for the draft positions
    i = 1 .. q_len - 1, unpacked from those rows (S_1's k rows are all the anchor's);
    logits[s]: (q_len, vocab) the logits the selector read (output multiplier and soft cap
    applied in the graph), or None when not asked for."""

    ids: np.ndarray
    packed: np.ndarray
    candidates: np.ndarray
    scores: np.ndarray
    logits: np.ndarray | None

    @property
    def top_k(self) -> int:
        return int(self.candidates.shape[-1])


def unpack_lattice(packed: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's packed lattice rows (..., q_len, n_embd) -> candidates (..., q_len - 1, k) int64
    and scores (..., q_len - 1, k, k) float32 of the draft positions 1 .. q_len - 1 (row 0, the
    anchor's, is all zeros). Row i = [C_i as floats (k), S_i predecessor-major (k*k), zeros]."""
    rows = np.asarray(packed)[..., 1:, :]
    cand_f = rows[..., :top_k]
    candidates = cand_f.astype(np.int64)
    if not np.array_equal(candidates, cand_f):
        raise ValueError("packed lattice: a candidate id is not an integer (not a DFlash-2 lattice?)")
    scores = rows[..., top_k : top_k * (top_k + 1)].reshape(rows.shape[:-1] + (top_k, top_k))
    return candidates, np.ascontiguousarray(scores, dtype=np.float32)


def llama_dflash2_trajectory(
    gguf: str | Path,
    feats: np.ndarray,
    commits: list[int],
    tokens: np.ndarray,
    cap: int,
    *,
    logits: bool = False,
    flash_attn: bool = False,
    threads: int = 1,
    timeout: float = 600,
) -> LlamaDflash2Trajectory:
    """llama.cpp's DFlash-2 drafter over a trajectory of commits, drafting as common/speculative.cpp:
    nextn rows unmasked, the noise block decoded (every output flag off unless `logits`), the
    packed lattice read back and walked greedily (native_dflash_child.walk_lattice).
    `feats[p]`: the target features of position p; `tokens[k]`: step k's noise block ids,
    [anchor, mask, ...] (at most dflash.block_size of them: llama.cpp aborts on a longer block)."""
    tokens = np.ascontiguousarray(tokens, dtype=np.int32)
    n_ctx = max(cap, 1) + tokens.shape[1] + 256
    job = dict(
        mode="trajectory_dflash2",
        gguf=str(gguf),
        commits=[int(c) for c in commits],
        cap=int(cap),
        n_ctx=n_ctx,
        threads=threads,
        flash_attn=flash_attn,
        logits=bool(logits),
    )
    result, work = _run(job, dict(feats=np.ascontiguousarray(feats, dtype=np.float32), tokens=tokens), timeout)
    packed = np.load(work / "lattice.npy")
    candidates, scores = unpack_lattice(packed, int(result["selector_top_k"]))
    return LlamaDflash2Trajectory(
        ids=np.load(work / "ids.npy"),
        packed=packed,
        candidates=candidates,
        scores=scores,
        logits=np.load(work / "logits.npy") if logits else None,
    )


def llama_dflash_trajectory_seqs(
    gguf: str | Path,
    feats: np.ndarray | Sequence[np.ndarray],
    commits: Sequence[int] | Sequence[Sequence[int]] | np.ndarray,
    tokens: np.ndarray,
    cap: int,
    *,
    flash_attn: bool = False,
    threads: int = 1,
    timeout: float = 600,
) -> np.ndarray:
    """llama.cpp's drafter running N sequences in ONE context, every step packed as llama.cpp's
    server packs its slots: one llama_process injects the new feature rows of all sequences, one
    more decodes all N noise blocks (sequence 0's first) -> logits (steps, N, q_len, vocab).

    `feats`: per sequence, its target features (row = position): an array (N, P, fc_in) or N
    arrays (P_s, fc_in); `commits`: (steps,) shared by all sequences or (steps, N), each
    sequence's committed count per step; `tokens`: (steps, N, q_len), each sequence's noise block
    ids per step; `cap`: the window every sequence keeps. Sequence s of the result should equal
    llama_dflash_trajectory on sequence s's data alone (the cache has one stream per sequence)."""
    if isinstance(feats, np.ndarray) and feats.ndim == 3:
        packed = np.ascontiguousarray(feats, dtype=np.float32)
    else:
        rows = [np.asarray(f, dtype=np.float32) for f in feats]
        if not rows or any(r.ndim != 2 or r.shape[1] != rows[0].shape[1] for r in rows):
            raise ValueError("feats: one (P, fc_in) array per sequence, all of the same fc_in")
        packed = np.zeros((len(rows), max(r.shape[0] for r in rows), rows[0].shape[1]), dtype=np.float32)
        for s, r in enumerate(rows):
            packed[s, : r.shape[0]] = r
    n_seq = packed.shape[0]
    tokens = np.ascontiguousarray(tokens, dtype=np.int32)
    commits_arr = np.asarray(commits, dtype=np.int64)
    if commits_arr.ndim == 1:
        commits_arr = np.repeat(commits_arr[:, None], n_seq, axis=1)
    if commits_arr.ndim != 2 or commits_arr.shape[1] != n_seq:
        raise ValueError(f"commits: (steps,) or (steps, {n_seq}), got shape {commits_arr.shape}")
    if tokens.ndim != 3 or tokens.shape[:2] != commits_arr.shape:
        raise ValueError(f"tokens: (steps, N, q_len) = {commits_arr.shape + (-1,)}, got shape {tokens.shape}")
    if commits_arr.size and commits_arr.max() > packed.shape[1]:
        raise ValueError(f"a commit ({commits_arr.max()}) beyond the features given ({packed.shape[1]} rows)")
    n_ctx = max(cap, 1) + tokens.shape[2] + 256  # per sequence (the child multiplies by N)
    job = dict(
        mode="trajectory_seqs",
        gguf=str(gguf),
        commits=commits_arr.tolist(),
        cap=int(cap),
        n_ctx=n_ctx,
        threads=threads,
        flash_attn=flash_attn,
    )
    _, work = _run(job, dict(feats=packed, tokens=tokens), timeout)
    return np.load(work / "logits.npy")


def llama_dflash_bench(
    gguf: str | Path,
    windows: list[int],
    *,
    fc_in: int,
    q_len: int,
    n_new: int = 9,
    reps: int = 20,
    warmup: int = 3,
    flash_attn: bool = True,
    threads: int = 2,
    omp_wait_policy: str | None = None,
    n_seq: int = 1,
    timeout: float = 600,
) -> dict[int, list[float]]:
    """Seconds per steady-state step (n_new context rows + one noise block with logits) per window.

    `n_seq`: sequences drafted together in one llama.cpp context, as llama.cpp's server drafts
    its n_parallel slots (one common_speculative, n_seq = n_parallel). Each measured step then
    commits n_new new rows to EVERY sequence (one llama_process for all N*n_new feature rows) and
    decodes all N noise blocks in one llama_process with logits for every row, reading all
    N*q_len logit rows back and dropping the noise rows: the seconds are per PACKED step (all N
    sequences drafted), each sequence with its own random features and noise tokens, each
    keeping its own window W. n_seq 1 is the single-sequence step; n_seq * q_len must fit
    llama.cpp's batch (512 rows).

    `omp_wait_policy`: OMP_WAIT_POLICY for llama.cpp's process ("active" / "passive"), or None for
    OpenMP's default (spin a while, then sleep), whatever this process has. llama.cpp's ggml meets
    at `omp barrier` after every graph node, so PASSIVE (a futex sleep per node) slows its draft
    step by ~1.35x (docs/gguf-and-checkpoints.md, "Against llama.cpp's own drafter"); its fastest setting is the default.

    A DFlash-2 GGUF (dflash.selector_top_k > 0) is drafted as common/speculative.cpp drafts it:
    noise blocks [anchor, mask, ...] decoded with no logits read back, the packed lattice read
    (llama_get_embeddings_nextn) and walked greedily on the CPU, all inside the timed step.
    """
    if omp_wait_policy is not None and omp_wait_policy.lower() not in ("active", "passive"):
        raise ValueError(f"omp_wait_policy must be 'active', 'passive' or None, got {omp_wait_policy!r}")
    if isinstance(n_seq, bool) or not isinstance(n_seq, (int, np.integer)) or n_seq < 1:
        raise ValueError(f"n_seq must be an int >= 1, got {n_seq!r}")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if omp_wait_policy is not None:
        env["OMP_WAIT_POLICY"] = omp_wait_policy.upper()
    job = dict(
        mode="bench",
        gguf=str(gguf),
        windows=[int(w) for w in windows],
        fc_in=fc_in,
        q_len=q_len,
        n_new=n_new,
        reps=reps,
        warmup=warmup,
        flash_attn=flash_attn,
        threads=threads,
        n_seq=int(n_seq),
    )
    result, _ = _run(job, {}, timeout, env)
    return {int(w): t for w, t in result["times"].items()}
