"""Start-up measurement of a round's costs for the draft-length policy (policy.CostModel).

The target's decode time by rows in the batch: `points` row counts (1, 2, 4, ... up to the most
rows a verify batch may have), the rows spread over the engine's sequences as verify blocks
(each sequence first given `context` tokens), `reps` decodes each, the median kept. The drafter
step by lane graph (1, 2, 4, ... lanes): lanes fed the features captured from those contexts,
`reps` greedy steps after a warm-up one (which folds the context in), the median kept. Shapes
are measured in turn, one sample of each per pass, after an untimed warm-up pass. Every
sequence and lane is empty again afterwards.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

import numpy as np

from ..drafter.step_graph import lane_counts
from .policy import CostModel

log = logging.getLogger(__name__)


def row_points(max_rows: int) -> list[int]:
    """1, 2, 4, ... below max_rows, and max_rows."""
    pts, r = {max_rows}, 1
    while r < max_rows:
        pts.add(r)
        r *= 2
    return sorted(pts)


def calibrate(
    target: Any, drafter: Any, parallel: int, max_rows: int, *, reps: int = 5, context: int = 32
) -> CostModel:
    """Measure a CostModel on `target` (a BatchedLlamaTarget) and `drafter` (lanes >= parallel)."""
    t_start = time.perf_counter()
    seqs = list(range(parallel))
    context = max(1, min(context, target.n_ctx_seq - max_rows - 1))
    # filler tokens: ids past the special ones; the cost does not depend on what they say
    ctx = (np.arange(context, dtype=np.int64) * 7919 + 1000) % (target.n_vocab - 1000) + 500
    for s in seqs:
        target.clear_seq(s)
    feats: dict[int, np.ndarray] = {}
    for s in seqs:  # context per sequence, features kept for the drafter
        rows = target.decode_blocks([(s, ctx, "none")])
        if target.capture is not None:
            feats[s] = target.features(rows[0]).copy()
    # every shape once to warm up (a new batch shape builds its graph), then the shapes in turn,
    # `reps` times: a machine that slows down for a moment slows one sample of each, not one shape
    points = row_points(max_rows)
    verify_times: dict[int, list[float]] = {r: [] for r in points}
    for rep in range(reps + 1):
        for r in points:
            per = [r // parallel + (1 if i < r % parallel else 0) for i in range(parallel)]
            blocks = [(s, ctx[:n], "all") for s, n in zip(seqs, per) if n > 0]
            t0 = time.perf_counter()
            target.decode_blocks(blocks)
            if rep > 0:
                verify_times[r].append(time.perf_counter() - t0)
            for s, _, _ in blocks:
                target.truncate(s, context)
    verify = {r: statistics.median(t) for r, t in verify_times.items()}
    draft: dict[int, float] = {}
    if drafter is not None and feats:
        graphs = lane_counts(parallel)
        for lane in range(max(graphs)):
            drafter.reset(lane)
            drafter.add_features(feats[lane], lane=lane)
        draft_times: dict[int, list[float]] = {g: [] for g in graphs}
        for rep in range(reps + 1):  # the first step of each graph folds the contexts in: not timed
            for g in graphs:
                tokens: list[int | None] = [int(ctx[-1]) if lane < g else None for lane in range(drafter.lanes)]
                t0 = time.perf_counter()
                drafter.propose_lanes(tokens)
                if rep > 0:
                    draft_times[g].append(time.perf_counter() - t0)
        draft = {g: statistics.median(t) for g, t in draft_times.items()}
        drafter.reset()
    for s in seqs:
        target.clear_seq(s)
    model = CostModel(verify, draft)
    log.info(
        "calibrated in %.2f s: verify ms by rows %s, draft step ms by lanes %s",
        time.perf_counter() - t_start,
        {r: round(1e3 * t, 2) for r, t in verify.items()},
        {g: round(1e3 * t, 2) for g, t in draft.items()},
    )
    return model
