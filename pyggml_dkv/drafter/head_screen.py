"""The lm_head's q8_0 screen: exact draft ids without the whole product in the head's own type.

A step's draft ids are argmax_t (lm_head_t . out) per row. Over a large vocabulary that product is
a large share of a step when the head is f16 / bf16 / f32 on a CPU (~40% of an f16 step at small
windows), while a q8_0 copy of the head multiplies in a third of the time on VNNI / AMX. With a
screen, the step graph multiplies the q8_0 copy, and ggml's `screened_argmax` op
(pyggml_dkv/ggml/ops_screen.py) multiplies exactly only the tokens whose q8_0 score is within a
proven error bound of the best: the ids are those of the exact head (docs/design.md, "Exact draft
ids from a screened head"). Steps that want logits run a second set of graphs with the full
product (DraftKvCache.logit_graphs).
"""

from __future__ import annotations

import logging

from ..ggml import Backend, Buffer, Context, Tensor
from ..ggml.screen import SCREEN_TYPE, screen_bounds
from ..model.config import DraftConfig
from .backend_weights import matrix_in_own_buffer

log = logging.getLogger(__name__)

LM_HEAD_SCREENS = (SCREEN_TYPE,)


class HeadScreen:
    """The q8_0 screen of an uploaded lm_head and its error bounds, on the (CPU) backend."""

    def __init__(self, backend: Backend, lm_head: Tensor, cfg: DraftConfig) -> None:
        check_screenable(backend, lm_head, cfg)
        vocab, hidden = lm_head.ne[1], lm_head.ne[0]
        self._owned: list = []
        try:
            screen = screen_bounds(lm_head.numpy())  # the exact values the op multiplies
            self.scores_matrix, buf = matrix_in_own_buffer(
                backend, SCREEN_TYPE, (vocab, hidden), "lm_head.screen", matmul_only=True
            )
            self._owned += [self.scores_matrix.ctx, buf]
            self.scores_matrix.set_bytes(screen.raw)
            ctx = Context(n_tensors=1)
            self._owned.append(ctx)
            self.bounds = ctx.new_tensor("f32", 2, vocab + 1, name="lm_head.screen_bounds")
            self._owned.append(Buffer.alloc_ctx_tensors(ctx, backend))
            self.bounds.set(screen.bounds)
        except BaseException:
            self.close()
            raise
        log.debug("lm_head screen: %d x %d q8_0, repacked=%s", vocab, hidden, self.scores_matrix.is_repacked)

    def close(self) -> None:
        """Free the screen's buffers and contexts. Idempotent."""
        while self._owned:
            self._owned.pop().close()


def check_screenable(backend: Backend, lm_head: Tensor, cfg: DraftConfig) -> None:
    """Why this head cannot be screened, as a ValueError (nothing when it can)."""
    if not backend.is_cpu:
        raise ValueError(f"lm_head_screen needs the CPU backend (the screened argmax is a CPU op), got {backend.kind}")
    if lm_head.type not in ("f32", "f16", "bf16"):
        raise ValueError(
            f"lm_head_screen screens an f32 / f16 / bf16 lm_head, this one is {lm_head.type} "
            "(a q8_0 head is already as cheap as its screen)"
        )
    if lm_head.ne[0] % 32:
        raise ValueError(
            f"lm_head_screen needs a hidden size that is a multiple of 32 (q8_0 blocks), got {lm_head.ne[0]}"
        )
    if lm_head.is_repacked:
        raise ValueError(f"lm_head {lm_head.name!r} is stored repacked; the screened argmax reads plain rows")
    if cfg.output_multiplier <= 0:
        # draft ids are the argmax of the raw product, which is the logits' only when scaling keeps the order
        raise ValueError(f"lm_head_screen needs output_multiplier > 0 (the logits' order), got {cfg.output_multiplier}")
