"""DeltaUpload: re-upload a persistent input tensor by sending only the bytes that changed.

For an input that lives in a buffer nothing else writes (not a Gallocr's: its memory is reused
during a compute) and that changes a little between computes, e.g. attention masks where a few
key columns appear or expire per step. The first upload sends everything; later ones compare the
new bytes with the last uploaded ones (64-bit words) and send each changed run with
ggml_backend_tensor_set at its offset (runs closer than `merge_gap` bytes are sent as one).

Writes through the binding (Tensor.set / set_bytes / fill) that overlap the tensor, and clears of
its buffer, make the DeltaUpload forget what the device holds; its next upload is whole. Writes
that bypass the binding (`lib` calls, graph outputs) must be followed by `invalidate()`.

Worth it where a transfer's cost is its bytes: an RPC backend over a network. In host memory one
whole copy is cheaper than many small ones, so `DeltaUpload.for_tensor` turns it on only for
tensors in RPC buffers (or when asked).
"""

from __future__ import annotations

import numpy as np

from . import liveness
from ._lowlevel import ffi, lib
from .tensor import Tensor, _on_rpc, check_rpc_transfer
from .writer import TensorWriter, writes_type

# a changed run costs its bytes plus one RPC message: command, sizes, the 296-byte serialized
# tensor and the offset (~313 bytes); so a run is worth as many unchanged bytes sent along
RUN_COST_BYTES = 320


class DeltaUpload:
    """Uploads to one tensor, sending only what changed since the last upload through it."""

    def __init__(self, tensor: Tensor, enabled: bool = True, merge_gap: int = RUN_COST_BYTES) -> None:
        self.tensor = tensor
        self.enabled = enabled
        self.merge_gap = merge_gap
        self._last: np.ndarray | None = None  # the bytes the device holds, as 64-bit words if possible
        self.bytes_sent = 0  # payload bytes sent by the last upload (for tests and benchmarks)
        self.runs_sent = 0
        tensor._check_io()
        start = liveness.addr(tensor.ptr.data)
        self.span = (start, start + tensor.nbytes)
        self.buffer_addr = liveness.addr(tensor.ptr.buffer)
        # a whole upload of an array already in the storage dtype skips Tensor.set's per-call checks
        self._writer = (
            TensorWriter(tensor) if not enabled and writes_type(tensor.type) and not tensor.is_repacked else None
        )
        if enabled:
            liveness.delta_uploads.add(self)

    @classmethod
    def for_tensor(cls, tensor: Tensor) -> DeltaUpload:
        """Enabled for a tensor in an RPC buffer, a plain whole upload elsewhere."""
        return cls(tensor, enabled=_on_rpc(tensor.ptr))

    @property
    def knows_device(self) -> bool:
        """Whether it knows what the device holds (False before the first upload and after a write
        or clear that bypassed it: the next upload is whole)."""
        return self._last is not None

    def invalidate(self) -> None:
        """Forget what the device holds (after something else wrote the tensor): next upload is whole."""
        self._last = None

    def upload(self, array: np.ndarray) -> None:
        """Make the tensor hold `array` (shape and dtype as Tensor.set takes them)."""
        t = self.tensor
        w = self._writer
        if w is not None and isinstance(array, np.ndarray) and array.dtype == w.dtype and array.flags.c_contiguous:
            w.write(array)
            self.bytes_sent, self.runs_sent = array.nbytes, 1
            return
        data = t._to_bytes(array)
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if not self.enabled:
            t.set_bytes(raw)
            self.bytes_sent, self.runs_sent = raw.nbytes, 1
            return
        words = raw.view(np.uint64) if raw.nbytes % 8 == 0 else raw
        last, self._last = self._last, None  # unknown device state until this upload went through
        if last is None or last.shape != words.shape:
            t.set_bytes(raw)  # (forgets nothing it still needs: _last is set after)
            self._last = words.copy()
            self.bytes_sent, self.runs_sent = raw.nbytes, 1
            return
        changed = np.flatnonzero(words != last)
        if changed.size == 0:  # the device holds these bytes already
            self._last = last
            self.bytes_sent, self.runs_sent = 0, 0
            return
        item = words.itemsize
        gap_items = max(1, self.merge_gap // item)
        breaks = np.flatnonzero(np.diff(changed) > gap_items)
        starts = np.concatenate(([changed[0]], changed[breaks + 1])) * item
        ends = (np.concatenate((changed[breaks], [changed[-1]])) + 1) * item
        total = int((ends - starts).sum())
        if total + len(starts) * RUN_COST_BYTES >= raw.nbytes:  # one whole upload is cheaper
            t.set_bytes(raw)
            self.bytes_sent, self.runs_sent = raw.nbytes, 1
        else:
            t._check_io()
            ptr, base = t.ptr, ffi.from_buffer(raw)
            for s, e in zip(starts.tolist(), ends.tolist()):
                lib.ggml_backend_tensor_set(ptr, base + s, s, e - s)
            check_rpc_transfer(ptr, t.name)
            self.bytes_sent, self.runs_sent = total, len(starts)
        self._last = words.copy()
