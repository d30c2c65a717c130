"""StepInputs: fills the step graph's persistent inputs from numpy before each compute: the
fold-in rows (features, positions, ring slots; padding to the trash slot), and per lane its noise
positions and masks. Host staging arrays are allocated once. A step changes a few key columns of
each mask: a split mask sends its one context row, the others their changed runs, and on an RPC
backend only the changed bytes travel (DeltaUpload).

With lanes, the fold-in rows of every lane begun for a step are packed one after another (each
lane's rows carry their lane's ring slots), and each lane writes only its own views of the noise
and mask inputs (step_graph.LaneInputs)."""

from __future__ import annotations

import numpy as np

from ..ggml.delta import DeltaUpload
from ..ggml.writer import TensorWriter
from .bulk_append import read_rows
from .features import FeatureRing
from .masks import MaskImage, SplitMask, StepMasks
from .step_graph import CacheMemory, Geometry, LaneInputs


class LaneUploads:
    """One lane's noise positions and masks: its host images and the uploads into its views."""

    def __init__(self, views: LaneInputs, geo: Geometry, masks: StepMasks) -> None:
        self.masks = masks
        self._pos_q = np.zeros(geo.q_len, dtype=np.int32)
        self._q_offsets = np.arange(geo.q_len, dtype=np.int32)
        self._pos_q_in = TensorWriter(views.pos_q)
        # a split mask's base is constant: uploaded at the first step and again only when its
        # DeltaUpload forgot the device's copy (a buffer clear), not compared every step
        self._bases: list[tuple[DeltaUpload, np.ndarray]] = []
        self._full = self._mask_upload(views, "mask_full", masks.full)
        self._sliding = self._mask_upload(views, "mask_swa", masks.sliding)
        self.idle = False  # whether the device holds this lane's idle masks (no context key visible)

    def _mask_upload(self, views: LaneInputs, name: str, mask: MaskImage | SplitMask | None) -> DeltaUpload | None:
        """The upload of a mask's per-step part: the whole image, or a split mask's row."""
        if mask is None:
            return None
        if isinstance(mask, SplitMask):
            self._bases.append((DeltaUpload.for_tensor(views.mask_bases[name]), mask.base))
        return DeltaUpload.for_tensor(views.masks[name])

    def _upload(self, full: np.ndarray | None, sliding: np.ndarray | None) -> None:
        for upload, image in self._bases:
            if not upload.knows_device:
                upload.upload(image)
        # (a mask image comes only for a mask the cache has, so with its upload)
        if full is not None and self._full is not None:
            self._full.upload(full)
        if sliding is not None and self._sliding is not None:
            self._sliding.upload(sliding)

    def noise_and_masks(self, slot_pos: np.ndarray, lo: int, committed: int) -> None:
        """Noise positions committed + j, and the masks of the window [lo, committed)."""
        np.add(committed, self._q_offsets, out=self._pos_q)
        self._pos_q_in.write(self._pos_q)
        self._upload(*self.masks.fill(slot_pos, lo, committed))
        self.idle = False

    def make_idle(self) -> None:
        """Masks that show this lane's noise rows none of its context: computed along with the
        lanes around it, the lane costs its rows' products, and its attention skips every context tile."""
        if not self.idle:
            self._upload(*self.masks.fill_idle())
            self.idle = True


class StepInputs:
    def __init__(self, mem: CacheMemory, geo: Geometry, fc_in: int, masks: list[StepMasks]) -> None:
        self.mem, self.geo = mem, geo
        rows = geo.a_step * geo.lanes
        self._feat = np.zeros((rows, fc_in), dtype=np.float32)
        self._pos = np.zeros(rows, dtype=np.int32)
        self._rows = np.full(rows, geo.trash_slot, dtype=np.int32)
        self.n_fold = 0  # fold-in rows packed for the next compute
        self.lanes = [LaneUploads(views, geo, lane_masks) for views, lane_masks in zip(mem.lane_inputs, masks)]
        # the staging arrays above have the inputs' storage dtypes: written without Tensor.set's per-call checks
        self._feat_in, self._pos_in, self._rows_in = (
            TensorWriter(mem.ap_feat),
            TensorWriter(mem.ap_pos),
            TensorWriter(mem.ap_rows),
        )

    def start_fold(self) -> None:
        """No fold-in rows yet for the next compute: every row pads (position 0, the trash slot),
        so the graph's shape never changes."""
        self.n_fold = 0
        self._pos.fill(0)
        self._rows.fill(self.geo.trash_slot)

    def fold_in(self, lane: int, ring: FeatureRing, positions: np.ndarray) -> None:
        """Pack the fold-in rows of `lane`'s `positions` (ascending, at most a_step) after those
        packed so far."""
        n, first = positions.size, self.n_fold
        if n:
            end = first + n
            self._pos[first:end] = positions
            self._rows[first:end] = positions % self.geo.cap + lane * self.geo.kv_total
            feat = self._feat[first:end]
            if positions[-1] - positions[0] == n - 1:
                ring.read_into(int(positions[0]), feat)
            else:  # a refill below and new rows above (after a rewind)
                feat[:] = read_rows(ring, positions)
            self._feat_in.write_rows_at(first, feat)  # only the real rows: padding reads stale, finite rows
            self.n_fold = end
        self._pos_in.write(self._pos)
        self._rows_in.write(self._rows)
