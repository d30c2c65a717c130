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


def _run(job: dict[str, Any], arrays: dict[str, np.ndarray], timeout: float,
         env: dict[str, str] | None = None) -> tuple[dict[str, Any], Path]:
    work = Path(tempfile.mkdtemp(prefix="llama_dflash_"))
    for name, arr in arrays.items():
        np.save(work / f"{name}.npy", arr)
        job[name] = str(work / f"{name}.npy")
    job["out"] = str(work)
    (work / "job.json").write_text(json.dumps(job))
    proc = subprocess.run([sys.executable, "-m", CHILD_MODULE, str(work / "job.json")], capture_output=True, text=True,
                          timeout=timeout, env=env)
    if proc.returncode == -signal.SIGILL:
        raise LlamaCppError(f"llama.cpp child ({job['mode']}) died of SIGILL: an instruction this CPU refuses (a "
                            f"llama-cpp-python built for another CPU, or AMX tiles misconfigured; {INSTALL_HINT}):\n"
                            f"{proc.stderr[-2000:]}")
    if proc.returncode != 0 or not (work / "result.json").is_file():
        raise LlamaCppError(f"llama.cpp child ({job['mode']}) exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    log.debug("llama.cpp child log tail:\n%s", proc.stderr[-2000:])
    return json.loads((work / "result.json").read_text()), work


def llama_model_info(gguf: str | Path, timeout: float = 300) -> dict[str, Any]:
    """What llama.cpp's loader reports for a GGUF: its metadata as strings (vocabulary arrays
    left out), n_embd, n_layer, n_head, n_head_kv, n_vocab, mask, rope_type, n_params."""
    result, _ = _run(dict(mode="meta", gguf=str(gguf)), {}, timeout)
    return result


def llama_dflash_trajectory(gguf: str | Path, feats: np.ndarray, commits: list[int], tokens: np.ndarray, cap: int,
                            *, flash_attn: bool = False, threads: int = 1, timeout: float = 600) -> np.ndarray:
    """llama.cpp's drafter over a trajectory of commits: logits (steps, q_len, vocab).
    `feats[p]`: the target features of position p; `tokens[k]`: step k's noise block ids."""
    n_ctx = max(cap, 1) + tokens.shape[1] + 256
    job = dict(mode="trajectory", gguf=str(gguf), commits=[int(c) for c in commits], cap=int(cap), n_ctx=n_ctx,
               threads=threads, flash_attn=flash_attn)
    _, work = _run(job, dict(feats=np.ascontiguousarray(feats, dtype=np.float32),
                             tokens=np.ascontiguousarray(tokens, dtype=np.int32)), timeout)
    return np.load(work / "logits.npy")


def llama_dflash_bench(gguf: str | Path, windows: list[int], *, fc_in: int, q_len: int, n_new: int = 9,
                       reps: int = 20, warmup: int = 3, flash_attn: bool = True, threads: int = 2,
                       omp_wait_policy: str | None = None, timeout: float = 600) -> dict[int, list[float]]:
    """Seconds per steady-state step (n_new context rows + one noise block with logits) per window.

    `omp_wait_policy`: OMP_WAIT_POLICY for llama.cpp's process ("active" / "passive"), or None for
    OpenMP's default (spin a while, then sleep), whatever this process has. llama.cpp's ggml meets
    at `omp barrier` after every graph node, so PASSIVE (a futex sleep per node) slows its draft
    step by ~1.35x (README, "llama.cpp's GGUF drafters"); its fastest setting is the default.
    """
    if omp_wait_policy is not None and omp_wait_policy.lower() not in ("active", "passive"):
        raise ValueError(f"omp_wait_policy must be 'active', 'passive' or None, got {omp_wait_policy!r}")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if omp_wait_policy is not None:
        env["OMP_WAIT_POLICY"] = omp_wait_policy.upper()
    job = dict(mode="bench", gguf=str(gguf), windows=[int(w) for w in windows], fc_in=fc_in, q_len=q_len,
               n_new=n_new, reps=reps, warmup=warmup, flash_attn=flash_attn, threads=threads)
    result, _ = _run(job, {}, timeout, env)
    return {int(w): t for w, t in result["times"].items()}
