"""`llama_cpp.Llama(draft_model=...)` adapter: our drafter inside llama-cpp-python's own generate().

    adapter = DFlashLlamaDraftModel(drafter)
    llm = llama_cpp.Llama(model_path, draft_model=adapter, logits_all=True, n_ctx=2048)
    adapter.attach(llm)                 # before the first generate()
    llm.create_completion(...) / llm.generate(...)

`pyggml_dkv.llama.speculative_llama(model_path, ...)` does all of this in one call, with the
drafter loaded for the target and freed with the Llama.

How it works: attach() turns on llama.cpp's native layer-input extraction for the drafter's
target layers on the Llama's context and wraps that context's decode(): after every decode
(prompt chunks and verify batches alike) the features of the decoded positions are copied into a
per-position store. When Llama.generate() asks for a draft with the token ids so far, the adapter
commits the features of every evaluated position the drafter lacks (rewinding past positions
llama-cpp-python re-evaluated) and proposes block_size - 1 tokens after the last id.

Limits (llama-cpp-python 0.3.36):
- pass logits_all=True: with a draft model Llama keeps logits for every row, but its score buffer
  is sized by the logits_all argument, so prompts longer than n_batch fail without it;
- the native route only: the last target layer (n_layer - 1) cannot be captured here;
- verification and sampling are Llama.generate()'s own (it samples each position with its sampler
  and keeps drafts while they equal the sampled token: lossless, but greedy drafts only; the
  draft distributions are not used);
- `draft_max` caps the tokens proposed per round (default: the drafter's block_size - 1);
- closing the Llama (close(), or its garbage collection) closes the adapter; the adapter closes the
  drafter only if it owns it (`owns_drafter=True`, as speculative_llama makes it). The adapter
  holds the Llama weakly, so no reference cycle keeps a deleted Llama (and its drafter) alive;
- Llama.generate() re-evaluates the last prompt token when the whole prompt is cached; the adapter
  follows positions, so that is handled, but a Llama state load (load_state) invalidates it:
  call adapter.reset().
- on a Xeon with AMX, a llama-cpp-python that GCC 12 built without `-fno-dse` dies in its own AMX
  kernels on batched decodes (amx_guard.py); attach() refuses such a Llama with the fix
  (scripts/install_llama_cpp.sh) instead of letting the first prompt kill the process.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import llama_cpp
import numpy as np
import numpy.typing as npt
from llama_cpp.llama_speculative import LlamaDraftModel

from ...ggml.capabilities import load_ggml_matmul_tiles
from .amx_guard import INSTALL_HINT, amx_kernels_work, llama_uses_amx_tiles
from .capture import NativeCapture
from .drafters import DraftSource, check_fits
from .errors import HostClosedError, HostError

log = logging.getLogger(__name__)


class DFlashLlamaDraftModel(LlamaDraftModel):
    """A LlamaDraftModel that drafts with a DFlash drafter fed by the Llama's own captured features."""

    def __init__(self, drafter: DraftSource, *, draft_max: int | None = None, owns_drafter: bool = False) -> None:
        """`draft_max`: at most this many tokens per draft (None: the drafter's block_size - 1);
        `owns_drafter`: close() (and closing the attached Llama) closes the drafter too."""
        limit = int(drafter.cfg.block_size) - 1
        if draft_max is not None:
            if isinstance(draft_max, bool) or not isinstance(draft_max, (int, np.integer)) or draft_max < 1:
                raise ValueError(f"draft_max must be a positive int or None, got {draft_max!r}")
            limit = min(limit, int(draft_max))
        self.drafter = drafter
        self.draft_max = limit
        self.owns_drafter = bool(owns_drafter)
        self.closed = False
        self._llama: weakref.ReferenceType[Any] | None = None
        self._store: np.ndarray | None = None
        self._written = 0  # positions [0, _written) hold features of the tokens Llama evaluated there
        self._stale_from = 0  # drafter features from this position on must be recomputed
        self.proposals = 0  # drafts handed to Llama.generate
        self.decodes = 0  # decodes of the Llama's context seen (prompt chunks and verify batches)

    @property
    def llama(self) -> Any:
        """The attached Llama (None before attach(), after close() or once the Llama is gone)."""
        return None if self._llama is None else self._llama()

    def attach(self, llama: Any) -> None:
        """Hook into `llama` (a llama_cpp.Llama built with draft_model=self)."""
        if self.closed:
            raise HostClosedError("this adapter was closed")
        if getattr(llama, "draft_model", None) is not self:
            raise HostError("attach() expects the Llama that was created with draft_model=this adapter")
        if llama._ctx is None or llama._ctx.ctx is None:
            raise HostClosedError("the Llama is closed")
        if getattr(llama.model_params, "use_extra_bufts", False) and not amx_kernels_work(llama.model_path):
            raise HostError(
                "this llama-cpp-python build dies of SIGILL in its AMX kernels on this CPU (GCC 12 dropped its "
                f"tile configuration); reinstall it with {INSTALL_HINT} (LlamaTarget instead loads such a "
                "build without AMX)"
            )
        n_layer = int(llama_cpp.llama_model_n_layer(llama.model))
        check_fits(
            self.drafter.cfg, self.drafter.vocab, n_embd=llama.n_embd(), n_layer=n_layer, n_vocab=llama.n_vocab()
        )
        if llama.scores.shape[0] < llama.n_ctx():
            raise HostError(
                "create the Llama with logits_all=True: llama-cpp-python 0.3.36 sizes its score buffer "
                "by that argument and fails on prompts longer than n_batch with a draft model otherwise"
            )
        self.capture = NativeCapture(self.drafter.cfg.target_layer_ids, llama.n_embd(), n_layer, llama.n_batch)
        self.capture.attach(llama._ctx.ctx)
        self._store = np.zeros((llama.n_ctx(), self.capture.fc_in), dtype=np.float32)
        original = llama._ctx.decode
        # as LlamaTarget does: llama.cpp's AMX matmuls trust tiles that PyTorch may have released
        reload_tiles = bool(getattr(llama.model_params, "use_extra_bufts", False)) and llama_uses_amx_tiles()

        def decode_and_capture(batch: Any) -> None:
            if self.closed:  # the adapter was closed before its Llama: plain decodes from now on
                original(batch)
                return
            n = int(batch.batch.n_tokens)
            pos0 = int(batch.batch.pos[0])
            self.capture.begin(n)
            if reload_tiles:
                load_ggml_matmul_tiles()
            original(batch)
            self.capture.end()
            self._store[pos0 : pos0 + n] = self.capture.features(n)
            if pos0 > self._written:
                raise HostError(f"Llama decoded position {pos0} before position {self._written}")
            self._written = pos0 + n
            self.decodes += 1
            self._stale_from = min(self._stale_from, pos0)

        llama._ctx.decode = decode_and_capture
        self._llama = weakref.ref(llama)
        # Llama.close() (called by its __del__ too) closes this ExitStack: free our side first
        stack = getattr(llama, "_stack", None)
        if stack is not None:
            stack.callback(self.close)

    def close(self) -> None:
        """Detach from the Llama and free what the adapter owns (the drafter, with owns_drafter).
        Idempotent; the Llama cannot draft with this adapter afterwards."""
        if self.closed:
            return
        self.closed = True
        llama = self.llama
        ctx = getattr(getattr(llama, "_ctx", None), "ctx", None)
        if ctx is not None and getattr(self, "capture", None) is not None:
            self.capture.set_enabled(False)  # the Llama lives on: stop llama.cpp's layer-input copies
        self._llama = None
        self._store = None
        if self.owns_drafter and hasattr(self.drafter, "close"):
            self.drafter.close()

    def reset(self) -> None:
        self.drafter.reset()
        self._written = 0
        self._stale_from = 0

    def __call__(self, input_ids: npt.NDArray[np.intc], /, **kwargs: Any) -> npt.NDArray[np.intc]:
        if self.closed:
            raise HostClosedError("this adapter was closed (with its Llama?)")
        store = self._store
        if self._llama is None or store is None:  # (both are set by attach, cleared by close)
            raise HostError("call attach(llama) before generating")
        ids = np.asarray(input_ids).reshape(-1)
        n_eval = ids.size - 1  # the last id has been sampled, not evaluated yet
        if n_eval < 1 or n_eval > self._written:
            return np.array([], dtype=np.intc)
        drafter = self.drafter
        keep = min(drafter.committed, self._stale_from, n_eval)
        if keep < drafter.committed:
            drafter.rewind(keep)
        if n_eval > drafter.committed:
            drafter.add_features(store[drafter.committed : n_eval])
        self._stale_from = n_eval
        self.proposals += 1
        return np.asarray(drafter.propose(int(ids[-1])), dtype=np.intc)[: self.draft_max]
