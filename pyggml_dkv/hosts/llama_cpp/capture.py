"""Capture the target's hidden features for the drafter, every token of every decode.

The drafter's feature for target layer i is the OUTPUT of decoder layer i (HF
`hidden_states[i + 1]`, what the dflash reference trains on), which is llama.cpp's tensor
`l_out-i` and also llama.cpp's INPUT of layer i + 1. Features of one token are the captured
layers concatenated in `layer_ids` order: a row of `fc_in = len(layer_ids) * hidden`.

Two routes, chosen by measurement (docs/llama-cpp.md, "Capturing the target's features"; tests/hosts/test_capture.py):

- `NativeCapture`: llama.cpp's own extraction for its native DFlash
  (`llama_set_embeddings_layer_inp(ctx, i + 1, true)`): llama.cpp copies the layer inputs of every
  token of the batch into its output buffer while decoding; we copy them out after the decode.
  No Python runs during the decode. It cannot reach the last layer (there is no layer input
  n_layer), so a layer id of n_layer - 1 needs the callback route.
- `CallbackCapture`: a ggml scheduler eval callback (`cb_eval`, set when the context is created)
  that asks for `l_out-i` and copies each piece (one per ubatch, in order) into our buffer with
  llama.cpp's ggml. llama.cpp keeps only the output rows in the last layer, so capturing layer
  n_layer - 1 needs logits for every row of the decode.

Both write into one preallocated buffer `(n_batch, n_layers, hidden)` float32; `features(n)` is a
view `(n, fc_in)` of the last decode's rows, valid until the next decode.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Sequence

import llama_cpp
import numpy as np

from .errors import HostError
from .lowlevel import TENSOR_NE_OFFSET, libggml, native_layer_inp

log = logging.getLogger(__name__)


class FeatureCapture:
    """Common part: layer ids, the preallocated buffer, the last decode's row count, timing."""

    route = "none"

    def __init__(self, layer_ids: Sequence[int], hidden: int, n_layer: int, max_rows: int) -> None:
        ids = [int(i) for i in layer_ids]
        if not ids:
            raise HostError("capture needs at least one target layer id")
        bad = [i for i in ids if not 0 <= i < n_layer]
        if bad:
            raise HostError(
                f"target layer ids {bad} are out of range for a target with {n_layer} layers (valid: 0..{n_layer - 1})"
            )
        if len(set(ids)) != len(ids):
            raise HostError(f"target layer ids must be distinct, got {ids}")
        self.layer_ids = tuple(ids)
        self.hidden = int(hidden)
        self.n_layer = int(n_layer)
        self.max_rows = int(max_rows)
        self.fc_in = len(ids) * self.hidden
        self._buf = np.zeros((self.max_rows, len(ids), self.hidden), dtype=np.float32)
        self.rows = 0  # rows captured in the last decode
        self.seconds = 0.0  # cumulative time spent capturing (inside and after decodes)
        self.enabled = True  # False: decodes capture nothing (set_enabled)

    @property
    def needs_all_outputs(self) -> bool:
        """Whether every row of a decode must be an output row for the capture to see it."""
        return False

    def begin(self, n_tokens: int) -> None:
        """Before a decode of n_tokens tokens."""
        if n_tokens > self.max_rows:
            raise HostError(f"a decode of {n_tokens} tokens exceeds the capture buffer of {self.max_rows} rows")
        self.rows = 0
        self._expected = n_tokens

    def end(self) -> None:
        """After the decode returned."""

    def features(self, n: int | None = None, start: int = 0) -> np.ndarray:
        """Rows [start, start + n) of the last decode as (n, fc_in) float32 (a view)."""
        n = self.rows - start if n is None else n
        if start < 0 or n < 0 or start + n > self.rows:
            raise HostError(f"rows [{start}, {start + n}) were not captured (last decode: {self.rows} rows)")
        return self._buf[start : start + n].reshape(n, self.fc_in)

    def attach(self, ctx: int) -> None:
        """Called once the llama context exists."""

    def set_enabled(self, on: bool) -> None:
        """Capture in the following decodes or not (a decode without capture is a plain decode:
        what llama.cpp does to hand the features out is not done)."""
        self.enabled = bool(on)


class CallbackCapture(FeatureCapture):
    """cb_eval route: put `self.callback` into llama_context_params.cb_eval before creating the context."""

    route = "callback"

    def __init__(self, layer_ids: Sequence[int], hidden: int, n_layer: int, max_rows: int) -> None:
        super().__init__(layer_ids, hidden, n_layer, max_rows)
        self._slot = {f"l_out-{i}".encode(): j for j, i in enumerate(self.layer_ids)}
        self._cursor = [0] * len(self.layer_ids)
        self._name_offset: int | None = None
        self._ggml = libggml()
        self._expected = 0
        self._stage = np.empty((self.max_rows, self.hidden), dtype=np.float32)  # contiguous landing rows
        # keep a reference: ctypes frees the trampoline when the Python object dies
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._on_eval)
        self.error: BaseException | None = None

    @property
    def needs_all_outputs(self) -> bool:
        return self.n_layer - 1 in self.layer_ids

    def begin(self, n_tokens: int) -> None:
        super().begin(n_tokens)
        self._cursor = [0] * len(self.layer_ids)
        self.error = None

    def _name(self, t: int) -> bytes:
        if self._name_offset is None:
            self._name_offset = self._ggml.ggml_get_name(t) - t
        return ctypes.string_at(t + self._name_offset)

    def _on_eval(self, t: int, ask: bool, user_data: int) -> bool:
        # called from inside llama_decode for every graph node: keep the ask phase minimal
        try:
            if not self.enabled:
                return not ask  # ask for nothing; let llama.cpp go on
            slot = self._slot.get(self._name(t))
            if ask:
                return slot is not None
            if slot is None:
                return True
            t0 = time.perf_counter()
            ne0, ne1 = ctypes.cast(t + TENSOR_NE_OFFSET, ctypes.POINTER(ctypes.c_int64))[0:2]
            r0 = self._cursor[slot]
            if ne0 != self.hidden or r0 + ne1 > self.max_rows or not self._ggml.ggml_is_contiguous(t):
                raise HostError(f"unexpected l_out tensor: {ne0} x {ne1} at row {r0}")
            dst = self._stage[:ne1]
            self._ggml.ggml_backend_tensor_get(t, dst.ctypes.data, 0, ne0 * ne1 * 4)
            self._buf[r0 : r0 + ne1, slot] = dst
            self._cursor[slot] = r0 + ne1
            self.seconds += time.perf_counter() - t0
        except BaseException as exc:  # never let an exception unwind through C
            self.error = exc
            return False
        return True

    def end(self) -> None:
        if not self.enabled:  # begin() did not run: nothing of this decode to check
            self.rows = 0
            return
        if self.error is not None:
            raise HostError(f"feature capture failed: {self.error!r}") from self.error
        if len(set(self._cursor)) != 1:
            raise HostError(f"captured layers have different row counts {self._cursor}")
        self.rows = self._cursor[0]


class NativeCapture(FeatureCapture):
    """llama.cpp's own layer-input extraction (`llama_set_embeddings_layer_inp`)."""

    route = "native"

    def __init__(self, layer_ids: Sequence[int], hidden: int, n_layer: int, max_rows: int) -> None:
        super().__init__(layer_ids, hidden, n_layer, max_rows)
        fns = native_layer_inp()
        if fns is None:
            raise HostError("this libllama does not export llama_set/get_embeddings_layer_inp; use the callback route")
        if n_layer - 1 in self.layer_ids:
            raise HostError(
                f"the native route cannot capture the last layer ({n_layer - 1}): "
                "llama.cpp has no layer input n_layer; use the callback route"
            )
        self._fns = fns
        self._ctx: int | None = None

    def attach(self, ctx: int) -> None:
        self._ctx = ctx
        for i in self.layer_ids:
            self._fns.set(ctx, i + 1, self.enabled)

    def set_enabled(self, on: bool) -> None:
        # llama.cpp copies the layer inputs of every row of a decode out while the flags are set
        # (measured: 4-8% of a 1-row SmolLM2 decode on a 2-core Zen 4); flags change only here
        if bool(on) != self.enabled and self._ctx is not None:
            for i in self.layer_ids:
                self._fns.set(self._ctx, i + 1, bool(on))
        self.enabled = bool(on)

    def end(self) -> None:
        if self._ctx is None:
            raise HostError("NativeCapture used before attach()")
        if not self.enabled:
            self.rows = 0
            return
        t0 = time.perf_counter()
        n = self._expected
        for j, i in enumerate(self.layer_ids):
            ptr = self._fns.get(self._ctx, i + 1)
            src = np.ctypeslib.as_array(ptr, shape=(n, self.hidden))
            self._buf[:n, j] = src
        self.rows = n
        self.seconds += time.perf_counter() - t0


def make_capture(route: str, layer_ids: Sequence[int], hidden: int, n_layer: int, max_rows: int) -> FeatureCapture:
    """`route`: "native", "callback", or "auto" (native when it can reach every layer, else callback)."""
    if route == "auto":
        usable = native_layer_inp() is not None and n_layer - 1 not in layer_ids
        route = "native" if usable else "callback"
    if route == "native":
        return NativeCapture(layer_ids, hidden, n_layer, max_rows)
    if route == "callback":
        return CallbackCapture(layer_ids, hidden, n_layer, max_rows)
    raise HostError(f"capture route must be 'auto', 'native' or 'callback', got {route!r}")
