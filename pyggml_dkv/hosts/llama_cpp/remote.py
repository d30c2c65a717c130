"""RemoteDrafter: pyggml_dkv's Drafter in a child process of its own (e.g. to keep the drafter's
threads and memory apart from the target's). The child is a fresh interpreter (spawn) that never
loads llama.cpp; features go to it and drafts come back over a pipe.

It has the DraftSource interface. Only propose() waits for the child; add_features, rewind and
reset are sent ahead (the pipe keeps them in order), so a child-side error surfaces at the next
propose(). Sampling draws come from a seed the host's generator passes along, so a seeded
generation is reproducible.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
from multiprocessing.process import BaseProcess
from typing import Any

import numpy as np

from ...model.config import DraftConfig
from ...model.weights import DraftWeights
from .drafters import check_fits_gguf
from .errors import HostClosedError, HostError
from .gguf import GGUFFile

log = logging.getLogger(__name__)


def _serve(conn: Any, cfg: dict, tensors: dict, gguf_path: str, n_threads: int | None, kwargs: dict) -> None:
    """Child process: build the Drafter, then answer messages until 'close'."""
    # the child shares the cores with llama.cpp and idles while it verifies: ggml's OpenMP threads
    # must sleep between computes, not spin (read when libgomp loads, i.e. before ggml is imported)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from .drafters import ggml_drafter

    backend = None
    try:
        if n_threads is not None:
            from ...ggml import Backend

            backend = kwargs["backend"] = Backend("cpu", n_threads=n_threads)
        drafter = ggml_drafter(DraftWeights(DraftConfig(**cfg), tensors), gguf_path, **kwargs)
    except BaseException as exc:  # report the failure instead of dying silently
        conn.send(("error", repr(exc)))
        return
    conn.send(("ready", None))
    failed: str | None = None
    while True:
        try:
            op, *args = conn.recv()
        except EOFError:  # the host went away without close()
            break
        if op == "close":
            break
        try:
            if failed is not None and op == "propose":
                conn.send(("error", failed))
                continue
            if op == "add":
                drafter.add_features(args[0])
            elif op == "rewind":
                drafter.rewind(args[0])
            elif op == "reset":
                drafter.reset()
                failed = None
            elif op == "propose":
                last, temperature, top_k, top_p, seed = args
                rng = np.random.default_rng(seed)
                conn.send(("ok", drafter.propose(last, temperature=temperature, top_k=top_k, top_p=top_p, rng=rng)))
        except BaseException as exc:
            failed = repr(exc)
            if op == "propose":
                conn.send(("error", failed))
    drafter.close()
    if backend is not None:
        backend.close()


class RemoteDrafter:
    """A `pyggml_dkv.Drafter` (built by `ggml_drafter(weights, gguf_path, **drafter_kwargs)`) in a child
    process; n_threads: its CPU backend's threads (default: the Drafter's own backend)."""

    def __init__(
        self,
        weights: DraftWeights,
        gguf_path: str,
        *,
        n_threads: int | None = None,
        timeout_s: float = 300.0,
        **drafter_kwargs: Any,
    ) -> None:
        gguf = GGUFFile(gguf_path)
        head_rows = gguf.tensors["output.weight" if "output.weight" in gguf.tensors else "token_embd.weight"][0]
        check_fits_gguf(weights.cfg, head_rows, gguf)  # fail here, before a process is started
        self.cfg = weights.cfg
        self.vocab = int(head_rows)
        self._committed = 0
        self._timeout = timeout_s
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc: BaseProcess | None = ctx.Process(
            target=_serve,
            args=(child, weights.cfg.to_dict(), dict(weights), str(gguf_path), n_threads, drafter_kwargs),
            daemon=True,
        )
        self._proc.start()
        child.close()
        status, detail = self._recv()
        if status != "ready":
            self.close()
            raise HostError(f"the drafter process failed to start: {detail}")

    def _recv(self) -> Any:
        if not self._conn.poll(self._timeout):
            raise HostError(f"the drafter process did not answer within {self._timeout} s")
        return self._conn.recv()

    def _send(self, *msg: Any) -> None:
        if self._proc is None:
            raise HostClosedError("the remote drafter is closed")
        self._conn.send(msg)

    @property
    def committed(self) -> int:
        return self._committed

    def add_features(self, rows: Any) -> None:
        arr = np.ascontiguousarray(rows, dtype=np.float32)
        if arr.ndim != 2 or arr.shape[1] != self.cfg.fc_in:
            raise ValueError(f"feature rows must be (n, {self.cfg.fc_in}), got {arr.shape}")
        self._send("add", arr)
        self._committed += arr.shape[0]

    def rewind(self, n_committed: int) -> None:
        if not 0 <= n_committed <= self._committed:
            raise ValueError(f"cannot rewind to {n_committed} (committed {self._committed})")
        self._send("rewind", n_committed)
        self._committed = n_committed

    def reset(self) -> None:
        self._send("reset")
        self._committed = 0

    def propose(
        self,
        last_token: int,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        rng: np.random.Generator | None = None,
    ) -> Any:
        seed = int((rng or np.random.default_rng()).integers(2**62))
        self._send("propose", int(last_token), float(temperature), int(top_k), float(top_p), seed)
        status, value = self._recv()
        if status != "ok":
            raise HostError(f"the drafter process failed: {value}")
        return value

    def close(self) -> None:
        """Stop the child process. Idempotent."""
        proc, self._proc = getattr(self, "_proc", None), None
        if proc is None:
            return
        try:
            self._conn.send(("close",))
        except (OSError, ValueError):
            pass
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        self._conn.close()

    def __enter__(self) -> RemoteDrafter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
