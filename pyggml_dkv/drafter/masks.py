"""The step masks: which keys each noise query row may see, as f16 0 / -inf images.

One statement of the masking rules for both the ring cache and the one-shot graph (the numpy
reference states them again, independently, as the oracle they are tested against). A mask has
one row per query row, repeated for every query head folded into the rows of a K/V head
(docs/design.md, "GQA folding"), and one column per key: context keys first (ring slots, or the
window in order), then the q_len noise keys, then padding nothing may see.

Rules (docs/design.md, "Masks"): full layers see every live context key and every noise key.
Sliding layers, `swa="seed"`: the context window is anchored at `committed` (the last
min(swa_window, win) positions, the same for every row) and noise keys are causal.
`swa="per_row"`: query row j at position committed + j sees key position k iff k <= committed + j
and committed + j - k < swa_window (the PyTorch reference's rule).
`swa="llama"`: llama.cpp's rule (non-causal DFlash attention, llama_hparams::is_masked_swa): query
row j sees key position k, context or noise, unless committed + j - k >= swa_window; noise keys
ahead of the row stay visible however far (docs/dflash2.md, section 4).
"""

from __future__ import annotations

import numpy as np

from ..common.checks import check_choice

SWA_MODES = ("seed", "per_row", "llama", "off")
# the flavours whose sliding-layer context columns differ from row to row
PER_ROW_MODES = ("per_row", "llama")
NEG_INF = np.float16(-np.inf)
ZERO = np.float16(0)


def noise_visible(q_len: int, sliding: bool, swa: str, window: int) -> np.ndarray:
    """bool (q_len, q_len): may query row j see noise key i?"""
    if not sliding:
        return np.ones((q_len, q_len), dtype=bool)
    dist = np.arange(q_len)[:, None] - np.arange(q_len)[None, :]  # j - i
    if swa == "per_row":
        return (dist >= 0) & (dist < window)
    if swa == "llama":  # non-causal: only the keys window or more rows behind drop out
        return dist < window
    return dist >= 0  # seed: causal


class MaskImage:
    """The host image of one mask, (groups * q_len, n_cols) f16, uploaded whole each step.

    The noise columns and the padding never change and are written once; each step writes the
    `n_ctx` context columns from a visibility that is either the same for every row (1, n_ctx)
    or per row (q_len, n_ctx).
    """

    def __init__(self, q_len: int, groups: int, n_ctx: int, n_cols: int, noise_col: int, noise_vis: np.ndarray) -> None:
        self.q_len, self.n_ctx = q_len, n_ctx
        self.image = np.full((groups * q_len, n_cols), NEG_INF, dtype=np.float16)
        # [groups, q_len, n_cols]: one query row's mask lands in all its folded copies at once
        self._rows = self.image.reshape(groups, q_len, n_cols)
        self._rows[:, :, noise_col : noise_col + q_len] = np.where(noise_vis, ZERO, NEG_INF)

    def set_context(self, visible: np.ndarray) -> np.ndarray:
        """Write the context columns (visible: (1 or q_len, n_ctx) bool); returns the image."""
        self._rows[:, :, : self.n_ctx] = np.where(visible, ZERO, NEG_INF)
        return self.image


class SplitMask:
    """A mask whose context columns are the same for every query row, in two parts the device adds:
    `base` (groups * q_len, n_cols), the noise columns' pattern, zero context columns and -inf
    padding, written once; and `row` (1, n_cols), the context columns' visibility, zero elsewhere,
    written each step. 0 + 0 = 0 and -inf + 0 = -inf: the sum is exactly the MaskImage.

    Why: a step makes a few context keys visible in every row; as one image that is one changed
    run per row, and over RPC each run costs a message (~313 bytes). As a row it is one run.
    """

    def __init__(self, q_len: int, groups: int, n_ctx: int, n_cols: int, noise_col: int, noise_vis: np.ndarray) -> None:
        self.q_len, self.n_ctx = q_len, n_ctx
        whole = MaskImage(q_len, groups, n_ctx, n_cols, noise_col, noise_vis)
        whole.set_context(np.ones((1, n_ctx), dtype=bool))
        self.base = whole.image
        self.row = np.zeros((1, n_cols), dtype=np.float16)

    def set_context(self, visible: np.ndarray) -> np.ndarray:
        """Write the context columns (visible: (1, n_ctx) bool); returns the row."""
        if visible.shape[0] != 1:
            raise ValueError("a SplitMask's context visibility is one row for every query row")
        self.row[:, : self.n_ctx] = np.where(visible, ZERO, NEG_INF)
        return self.row


class StepMasks:
    """The full-layer and sliding-layer masks of one drafter's step, over a given key layout.

    `key_pos` (passed each step) holds the absolute position of each context key column (-1: no
    key there); the caller guarantees that every position of the window [lo, committed) it
    passes is a valid key. With `split`, every mask whose context columns are the same for all
    rows (full layers; sliding layers under swa "seed") is a SplitMask: `fill` then returns its
    row, and the device adds it to the base.
    """

    def __init__(
        self,
        q_len: int,
        groups: int,
        n_ctx: int,
        n_cols: int,
        noise_col: int,
        any_full: bool,
        any_swa: bool,
        swa: str,
        swa_window: int,
        split: bool = False,
    ) -> None:
        self.swa = check_choice("swa", swa, SWA_MODES)
        self.window = swa_window
        self._q_offsets = np.arange(q_len, dtype=np.int64)[:, None]
        args = (q_len, groups, n_ctx, n_cols, noise_col)
        full_kind = SplitMask if split else MaskImage
        swa_kind = SplitMask if split and swa not in PER_ROW_MODES else MaskImage
        self.full = full_kind(*args, noise_visible(q_len, False, swa, swa_window)) if any_full else None
        self.sliding = swa_kind(*args, noise_visible(q_len, True, swa, swa_window)) if any_swa else None

    def fill_idle(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The (full, sliding) images of an idle lane: no context key visible (the noise keys
        stay, so no row's softmax is empty)."""
        some = self.full if self.full is not None else self.sliding
        assert some is not None, "a StepMasks has a full or a sliding mask"
        none = np.zeros((1, some.n_ctx), dtype=np.bool_)
        full = self.full.set_context(none) if self.full is not None else None
        sliding = self.sliding.set_context(none) if self.sliding is not None else None
        return full, sliding

    def fill(self, key_pos: np.ndarray, lo: int, committed: int) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The (full, sliding) images for a step at `committed` with window [lo, committed)."""
        live = ((key_pos >= lo) & (key_pos < committed))[None, :]
        full = self.full.set_context(live) if self.full is not None else None
        sliding = None
        if self.sliding is not None:
            if self.swa in PER_ROW_MODES:  # context keys lie behind every row: both flavours window them alike
                ahead = committed + self._q_offsets - key_pos[None, :]  # (q_len, n_ctx)
                sliding = self.sliding.set_context(live & (ahead < self.window))
            else:  # seed: one window for every row, anchored at committed
                win = committed - lo
                eff = self.window if 0 < self.window < win else win
                sliding = self.sliding.set_context(live & (key_pos >= committed - eff)[None, :])
        return full, sliding
