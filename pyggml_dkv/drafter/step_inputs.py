"""StepInputs: fills the step graph's persistent inputs from numpy before each compute: the
fold-in rows (features, positions, ring slots; padding to the trash slot), the noise positions
and the masks. Host staging arrays are allocated once. A step changes a few key columns of each
mask: a split mask sends its one context row, the others their changed runs, and on an RPC backend
only the changed bytes travel (DeltaUpload)."""

from __future__ import annotations

import numpy as np

from ..ggml.delta import DeltaUpload
from ..ggml.writer import TensorWriter
from .bulk_append import read_rows
from .features import FeatureRing
from .masks import MaskImage, SplitMask, StepMasks
from .step_graph import CacheMemory, Geometry


class StepInputs:
    def __init__(self, mem: CacheMemory, geo: Geometry, fc_in: int, masks: StepMasks) -> None:
        self.mem, self.geo, self.masks = mem, geo, masks
        self._feat = np.zeros((geo.a_step, fc_in), dtype=np.float32)
        self._pos = np.zeros(geo.a_step, dtype=np.int32)
        self._rows = np.full(geo.a_step, geo.trash_slot, dtype=np.int32)
        self._pos_q = np.zeros(geo.q_len, dtype=np.int32)
        self._q_offsets = np.arange(geo.q_len, dtype=np.int32)
        # a split mask's base is constant: uploaded at the first step and again only when its
        # DeltaUpload forgot the device's copy (a buffer clear), not compared every step
        self._bases: list[tuple[DeltaUpload, np.ndarray]] = []
        self._full = self._mask_upload("mask_full", masks.full)
        self._sliding = self._mask_upload("mask_swa", masks.sliding)
        # the staging arrays above have the inputs' storage dtypes: written without Tensor.set's per-call checks
        self._feat_in, self._pos_in = TensorWriter(mem.ap_feat), TensorWriter(mem.ap_pos)
        self._rows_in, self._pos_q_in = TensorWriter(mem.ap_rows), TensorWriter(mem.pos_q)

    def _mask_upload(self, name: str, mask: MaskImage | SplitMask | None) -> DeltaUpload | None:
        """The upload of a mask's per-step part: the whole image, or a split mask's row."""
        if mask is None:
            return None
        if isinstance(mask, SplitMask):
            base, row = self.mem.mask_parts[name]
            self._bases.append((DeltaUpload.for_tensor(base), mask.base))
            return DeltaUpload.for_tensor(row)
        return DeltaUpload.for_tensor(getattr(self.mem, name))

    def fold_in(self, ring: FeatureRing, positions: np.ndarray) -> None:
        """The fold-in rows of `positions` (ascending, at most a_step); padding rows go to
        position 0 in the trash slot, so the graph's shape never changes."""
        n, cap = positions.size, self.geo.cap
        self._pos.fill(0)
        self._rows.fill(self.geo.trash_slot)
        if n:
            self._pos[:n] = positions
            self._rows[:n] = positions % cap
            if positions[-1] - positions[0] == n - 1:
                ring.read_into(int(positions[0]), self._feat[:n])
            else:  # a refill below and new rows above (after a rewind)
                self._feat[:n] = read_rows(ring, positions)
            self._feat_in.write_rows(self._feat[:n])  # only the real rows: padding reads stale, finite rows
        self._pos_in.write(self._pos)
        self._rows_in.write(self._rows)

    def noise_and_masks(self, slot_pos: np.ndarray, lo: int, committed: int) -> None:
        """Noise positions committed + j, and the masks of the window [lo, committed)."""
        np.add(committed, self._q_offsets, out=self._pos_q)
        self._pos_q_in.write(self._pos_q)
        for upload, image in self._bases:
            if not upload.knows_device:
                upload.upload(image)
        full, sliding = self.masks.fill(slot_pos, lo, committed)
        if full is not None:
            self._full.upload(full)  # type: ignore[union-attr]
        if sliding is not None:
            self._sliding.upload(sliding)  # type: ignore[union-attr]
