"""LlamaTarget: the target model on llama-cpp-python's low-level API, with feature capture.

One model, one context, one sequence (seq id 0). The host decodes token batches at explicit
positions, reads the logits of the rows it asked for, and removes rejected positions from the
KV cache. Every decode also captures the drafter's target features of every token
(`capture.features()`), prompt chunks included.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, overload

import llama_cpp
import numpy as np

from ...ggml.capabilities import load_ggml_matmul_tiles
from .amx_guard import llama_uses_amx_tiles, model_params
from .capture import FeatureCapture, make_capture
from .errors import HostClosedError, HostError

log = logging.getLogger(__name__)

_backend_ready = False


def _quiet_llama_logs() -> None:
    """Route llama.cpp's log lines through llama-cpp-python's logger (errors only by default)."""
    import llama_cpp._logger as llama_logger

    if llama_logger.logger.level == logging.NOTSET:
        llama_logger.set_verbose(False)


class _LlamaModel:
    """A llama.cpp model and its context: loading, lifecycle and vocabulary, what LlamaTarget and
    BatchedLlamaTarget (batched_target.py) share. The subclass's __init__ loads the model
    (`_load_model`), then creates the context (`_init_context`) and its batch."""

    _model: Any  # llama_model* (None once closed)
    _ctx: Any  # llama_context*
    _batch: Any  # llama_batch
    capture: FeatureCapture | None

    # --- lifecycle -------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._ctx is None

    def _check_open(self) -> None:
        if self._ctx is None:
            raise HostClosedError("the llama.cpp target is closed")

    def close(self) -> None:
        """Free the batch, context and model. Idempotent."""
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if self._model is not None:
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    # --- vocabulary ------------------------------------------------------------------------

    def _load_model(self, model_path: str | os.PathLike, verbose: bool) -> None:
        """Load the GGUF (once llama.cpp's backend is up) and read its shape."""
        global _backend_ready
        path = Path(model_path)
        if not path.is_file():
            raise HostError(f"no such model file: {path}")
        if not verbose:
            _quiet_llama_logs()
        if not _backend_ready:
            llama_cpp.llama_backend_init()
            _backend_ready = True
        mparams = model_params(path)  # llama.cpp's defaults, minus AMX where this build would crash on it
        # llama.cpp's AMX matmuls trust the tiles they configured on this thread once; other code
        # (PyTorch's oneDNN) may have released them since: reload ggml's configuration per decode
        self._reload_tiles = bool(mparams.use_extra_bufts) and llama_uses_amx_tiles()
        self._model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
        if not self._model:
            self._model = None
            raise HostError(f"llama.cpp could not load {path}")
        self.model_path = path
        self.vocab_ptr = llama_cpp.llama_model_get_vocab(self._model)
        self.n_embd = int(llama_cpp.llama_model_n_embd(self._model))
        self.n_layer = int(llama_cpp.llama_model_n_layer(self._model))
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab_ptr))
        self.n_ctx_train = int(llama_cpp.llama_model_n_ctx_train(self._model))

    def _init_context(self, cparams: Any) -> None:
        """Create the llama.cpp context of `cparams`, with the feature capture's callback (or its
        attachment to the context)."""
        cb = getattr(self.capture, "callback", None)
        if cb is not None:
            cparams.cb_eval = cb
            cparams.cb_eval_user_data = None
        self._ctx = llama_cpp.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            self._ctx = None
            self.close()
            raise HostError("llama.cpp could not create a context")
        if self.capture is not None:
            self.capture.attach(self._ctx)

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> np.ndarray:
        self._check_open()
        raw = text.encode("utf-8")
        cap = len(raw) + 16
        buf = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self.vocab_ptr, raw, len(raw), buf, cap, add_special, parse_special)
        if n < 0:
            raise HostError(f"tokenize failed ({n})")
        return np.array(buf[:n], dtype=np.int32)

    def piece(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self.vocab_ptr, int(token), buf, 64, 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab_ptr, int(token), buf, -n, 0, False)
        return buf.raw[:n]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab_ptr, int(token)))

    def chat_prompt(self, user: str) -> str:
        """`user` in the model's chat template (ChatML for SmolLM2), ready for generation."""
        return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


class LlamaTarget(_LlamaModel):
    """A llama.cpp target model: decode at positions, logits, KV removal, captured features.

    capture_layers: the drafter's target_layer_ids (empty: no capture).
    capture: "auto" | "native" | "callback" (see capture.py).
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        n_ctx: int = 2048,
        n_batch: int = 512,
        n_ubatch: int | None = None,
        n_threads: int = 2,
        capture_layers: Sequence[int] = (),
        capture: str = "auto",
        verbose: bool = False,
    ) -> None:
        self._model = None
        self._ctx = None
        self._batch = None
        self._load_model(model_path, verbose)
        self.capture: FeatureCapture | None = None
        if capture_layers:
            self.capture = make_capture(capture, capture_layers, self.n_embd, self.n_layer, n_batch)
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = min(n_batch, n_ubatch or n_batch)
        cparams.n_seq_max = 1
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads
        self._init_context(cparams)
        self.n_ctx = int(llama_cpp.llama_n_ctx(self._ctx))
        self.n_batch = int(llama_cpp.llama_n_batch(self._ctx))
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.n_past = 0  # positions [0, n_past) are in the KV cache
        self.decode_seconds = 0.0

    # --- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> LlamaTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- decoding --------------------------------------------------------------------------

    def clear(self) -> None:
        """Empty the KV cache (a new request)."""
        self._check_open()
        llama_cpp.llama_memory_clear(self._memory, True)
        self.n_past = 0

    def truncate(self, n_keep: int) -> None:
        """Keep positions [0, n_keep) in the KV cache, drop the rest."""
        self._check_open()
        if not 0 <= n_keep <= self.n_past:
            raise HostError(f"cannot truncate to {n_keep} positions (the cache holds {self.n_past})")
        if n_keep < self.n_past:
            if not llama_cpp.llama_memory_seq_rm(self._memory, 0, n_keep, -1):
                raise HostError(f"llama.cpp could not remove positions >= {n_keep} from the KV cache")
            self.n_past = n_keep

    @overload
    def decode(self, tokens: Sequence[int] | np.ndarray, *, logits: Literal["all", "last"] = "last") -> np.ndarray: ...
    @overload
    def decode(self, tokens: Sequence[int] | np.ndarray, *, logits: Literal["none"]) -> None: ...
    @overload
    def decode(self, tokens: Sequence[int] | np.ndarray, *, logits: str) -> np.ndarray | None: ...

    def decode(self, tokens: Sequence[int] | np.ndarray, *, logits: str = "last") -> np.ndarray | None:
        """Decode `tokens` at positions n_past, n_past+1, ...; capture their features.

        logits: "all" (every row), "last" (the last row) or "none". Returns (n_out, n_vocab)
        float32, a view into llama.cpp's output buffer valid until the next decode, or None.
        At most n_batch tokens per call.
        """
        self._check_open()
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n = toks.size
        if n == 0 or n > self.n_batch:
            raise HostError(f"decode takes 1..{self.n_batch} tokens, got {n}")
        if self.n_past + n > self.n_ctx:
            raise HostError(f"decode of {n} tokens at position {self.n_past} exceeds n_ctx={self.n_ctx}")
        if toks.min() < 0 or toks.max() >= self.n_vocab:
            raise HostError(f"token ids must lie in [0, {self.n_vocab})")
        if logits not in ("all", "last", "none"):
            raise HostError(f"logits must be 'all', 'last' or 'none', got {logits!r}")
        cap = self.capture
        want_all = logits == "all" or (cap is not None and cap.needs_all_outputs)
        b = self._batch  # (open: the batch lives as long as the context)
        for i in range(n):
            b.token[i] = int(toks[i])
            b.pos[i] = self.n_past + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = want_all or (logits == "last" and i == n - 1)
        b.n_tokens = n
        if cap is not None:
            cap.begin(n)
        t0 = time.perf_counter()
        if self._reload_tiles:
            load_ggml_matmul_tiles()
        rc = llama_cpp.llama_decode(self._ctx, b)
        self.decode_seconds += time.perf_counter() - t0
        if rc != 0:
            if cap is not None:
                cap.rows = 0
            raise HostError(f"llama_decode failed with {rc} ({n} tokens at position {self.n_past})")
        self.n_past += n
        if cap is not None:
            cap.end()
        if logits == "none":
            return None
        n_out = n if want_all else 1
        out = np.ctypeslib.as_array(llama_cpp.llama_get_logits(self._ctx), shape=(n_out, self.n_vocab))
        return out if logits == "all" or not want_all else out[-1:]

    def prefill(self, tokens: Sequence[int] | np.ndarray, on_chunk=None) -> np.ndarray:
        """Decode a prompt in n_batch chunks; returns the last row's logits (n_vocab,) (a copy).

        on_chunk(features) is called after each chunk with its captured features (n, fc_in)."""
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if toks.size == 0:
            raise HostError("the prompt is empty")
        last = None
        for lo in range(0, toks.size, self.n_batch):
            chunk = toks[lo : lo + self.n_batch]
            is_last = lo + self.n_batch >= toks.size
            out = self.decode(chunk, logits="last" if is_last else "none")
            if on_chunk is not None and self.capture is not None:
                on_chunk(self.capture.features())
            if out is not None:  # the last chunk (the others ask for no logits)
                last = np.array(out[-1])
        assert last is not None
        return last
