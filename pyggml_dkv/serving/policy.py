"""Draft lengths that never lose: per request and per round, the draft length k in 0..draft_max
that maximises the batch's expected tokens per second.

The rule (`SpeedPolicy`):

- Request r accepts each next draft token with probability a_r (a geometric model of its own
  rounds: a_r = (accepted + c a0) / (accepted + rejections + c), where a round of k > 0 drafts
  that accepted n counts n acceptances and one rejection when n < k; counts decay by 0.9 per
  round; a0 is the engine-wide rate, c = 4 pseudo-trials). With k drafts the round returns
  E_r(k) = 1 + a_r + ... + a_r^k tokens of r: the j-th draft adds a_r^j.
- A round over the requests R with m draft rows in all costs C(m) = T(|R| + m) + [m > 0] D + H:
  T the target's decode time by the number of rows in the batch (measured at start-up at a few
  row counts, interpolated linearly), D the drafter step (by the lane graph it runs, measured the
  same way), H the host's own time per round. Every observed round keeps them current: a shared
  factor follows the machine's speed, the anchors follow their own observations more slowly.
- The policy returns the split with the largest sum_r E_r / C(m). For a given m and drafter
  graph g (the requests on lanes < g may draft) the best split is the m largest marginal gains
  a_r^j among those requests (each request's gains decrease with j), so one greedy pass per g
  (1, 2, 4, ... lanes) over m = 0, 1, ... finds the optimum. m = 0 is plain decoding for
  everyone (and no drafter step), chosen whenever drafting does not pay.
- A request that drafted nothing for `probe_every` rounds drafts at least one token, so that its
  a_r follows the text; after each such probe that the next round did not follow with drafts the
  wait doubles (16, 32, ... 256 rounds), so where drafting never pays probing costs ~nothing.
  The other way round, after `probe_every` rounds in a row in which someone drafted, one round is
  plain for everyone, so that the cost of not drafting is observed too (the costs are learned
  from the rounds the policy runs: a plain round overestimated at start-up would never be
  corrected while the policy keeps drafting).

`FixedPolicy(k)` drafts min(k, room) for every request (k = 0: plain decoding).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..drafter.step_graph import lane_counts


def graph_lanes(highest_lane: int, lanes: int) -> int:
    """The lane count of the drafter graph a step whose highest active lane is `highest_lane` runs."""
    return min(c for c in lane_counts(lanes) if c >= highest_lane + 1)


class CostModel:
    """Seconds per round: the target's decode by rows in the batch (`verify_s`), the drafter step
    by lane graph (`draft_s`), the host's time (`host_s`).

    Start-up measurements give the curves' shapes; a shared `scale` follows the machine. Each
    observed decode or step moves `scale` by `alpha` of the (clipped) ratio observed / predicted,
    and the anchors it falls between by `alpha / 2`: a CPU that slows down (other load, clock
    changes: +-30% over minutes on shared machines) slows every prediction at once, so the
    comparison between drafting (rows that are rarely observed) and not drafting (rows observed
    every round) stays fair, while a curve whose shape was mismeasured still converges."""

    def __init__(
        self,
        verify_points: Mapping[int, float],
        draft_points: Mapping[int, float] | None = None,
        *,
        host_s: float = 0.0,
        alpha: float = 0.2,
    ) -> None:
        if not verify_points:
            raise ValueError("verify_points needs at least one (rows, seconds) point")
        pts = sorted((int(r), float(s)) for r, s in verify_points.items())
        if pts[0][0] < 1 or any(s <= 0 for _, s in pts):
            raise ValueError(f"verify points must have rows >= 1 and seconds > 0, got {pts}")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must lie in (0, 1], got {alpha}")
        self._rows = [r for r, _ in pts]
        self._secs = [s for _, s in pts]
        self._draft = {int(g): float(s) for g, s in (draft_points or {}).items()}
        self.host_s = float(host_s)
        self.alpha = float(alpha)
        self.scale = 1.0

    def _bracket(self, rows: int) -> tuple[int, int, float]:
        """Anchors i, j around `rows` and the weight of j in the linear interpolation."""
        r = self._rows
        if len(r) == 1:
            return 0, 0, 0.0
        j = min(max(bisect.bisect_left(r, rows), 1), len(r) - 1)
        i = j - 1
        return i, j, (rows - r[i]) / (r[j] - r[i])

    def _shape_verify(self, rows: int) -> float:
        if len(self._rows) == 1:
            return self._secs[0] * rows / self._rows[0]
        i, j, w = self._bracket(rows)
        return max(1e-6, (1 - w) * self._secs[i] + w * self._secs[j])

    def _shape_draft(self, graph: int) -> float:
        if graph in self._draft:
            return self._draft[graph]
        if not self._draft:
            return 0.0
        known = sorted(self._draft)  # unknown sizes: the nearest measured one above, else scale the largest
        above = [g for g in known if g >= graph]
        return self._draft[above[0]] if above else self._draft[known[-1]] * graph / known[-1]

    def verify_s(self, rows: int) -> float:
        """Predicted seconds of a decode of `rows` rows (extrapolated linearly past the anchors)."""
        return self.scale * self._shape_verify(rows)

    def draft_s(self, graph: int) -> float:
        """Predicted seconds of a drafter step running the graph of `graph` lanes."""
        return self.scale * self._shape_draft(graph)

    def _follow(self, ratio: float) -> float:
        """Move the shared scale towards an observation; returns the ratio clipped."""
        ratio = min(4.0, max(0.25, ratio))
        self.scale *= 1 + self.alpha * (ratio - 1)
        return ratio

    def observe_verify(self, rows: int, seconds: float) -> None:
        ratio = self._follow(seconds / self.verify_s(rows))
        i, j, w = self._bracket(rows)
        w = min(1.0, max(0.0, w))
        for k, wk in ((i, 1 - w), (j, w)) if i != j else ((i, 1.0),):
            self._secs[k] *= 1 + self.alpha / 2 * wk * (ratio - 1)

    def observe_draft(self, graph: int, seconds: float) -> None:
        if graph not in self._draft:
            self._draft[graph] = float(seconds) / self.scale
            return
        ratio = self._follow(seconds / self.draft_s(graph))
        self._draft[graph] *= 1 + self.alpha / 2 * (ratio - 1)

    def observe_host(self, seconds: float) -> None:
        self.host_s += self.alpha * (max(0.0, seconds) - self.host_s)

    def snapshot(self) -> dict[str, object]:
        """The current predictions at the anchors (scale included)."""
        return {
            "verify_s": {r: self.verify_s(r) for r in self._rows},
            "draft_s": {g: self.draft_s(g) for g in self._draft},
            "host_s": self.host_s,
            "scale": self.scale,
        }


class AcceptanceEstimate:
    """Decayed counts of accepted drafts and of rejections (one per round that rejected one)."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = float(decay)
        self.accepted = 0.0
        self.rejected = 0.0

    def observe(self, k: int, n_accepted: int) -> None:
        if k <= 0:
            return  # no draft, no evidence
        self.accepted = self.decay * self.accepted + n_accepted
        self.rejected = self.decay * self.rejected + (1.0 if n_accepted < k else 0.0)

    def rate(self, prior: float = 0.5, weight: float = 4.0) -> float:
        """The per-token acceptance probability, shrunk towards `prior` by `weight` pseudo-trials."""
        a = (self.accepted + weight * prior) / (self.accepted + self.rejected + weight)
        return min(0.99, max(0.0, a))


@dataclass(frozen=True)
class PolicyRequest:
    """What the policy knows of one request this round."""

    accept_rate: float  # a_r
    k_max: int  # the most drafts this round (draft_max, context room, tokens left)
    lane: int  # its drafter lane (the drafter graph depends on the highest drafting lane)
    idle_rounds: int = 0  # verify rounds since it last drafted
    probes: int = 0  # probes since it last drafted in two rounds in a row (the wait doubles per probe)


class DraftPolicy(Protocol):
    needs_costs: bool  # whether the engine must measure costs (calibrate) for it

    def choose(
        self, requests: Sequence[PolicyRequest], costs: CostModel | None, lanes: int, max_rows: int
    ) -> list[int]:
        """One draft length per request, 0 <= k <= k_max, with len(requests) + sum(k) <= max_rows.
        `costs` is None unless the policy needs_costs (or the engine was handed a CostModel)."""
        ...


def expected_tokens(a: float, k: int) -> float:
    """E(k) = 1 + a + ... + a^k."""
    return float(sum(a**j for j in range(k + 1)))


def round_cost(costs: CostModel, ks: Sequence[int], lanes_of: Sequence[int], lanes: int) -> float:
    """C: the decode of len(ks) + sum(ks) rows, the drafter step if anyone drafts, the host."""
    drafting = [lane for lane, k in zip(lanes_of, ks) if k > 0]
    draft = costs.draft_s(graph_lanes(max(drafting), lanes)) if drafting else 0.0
    return costs.verify_s(len(ks) + sum(ks)) + draft + costs.host_s


class SpeedPolicy:
    """The module's rule: the draft lengths of the largest expected tokens per second."""

    needs_costs = True

    def __init__(self, probe_every: int = 16) -> None:
        self.probe_every = int(probe_every)
        self._drafting_streak = 0  # rounds in a row in which someone drafted

    def choose(
        self, requests: Sequence[PolicyRequest], costs: CostModel | None, lanes: int, max_rows: int
    ) -> list[int]:
        n = len(requests)
        if n == 0:
            return []
        if costs is None:
            raise ValueError("SpeedPolicy needs a CostModel (needs_costs: the engine measures one)")
        lanes_of = [r.lane for r in requests]
        forced = [0] * n
        for i, r in enumerate(requests):  # probes: one draft for a request that has not drafted for long
            due = r.idle_rounds >= self.probe_every << min(r.probes, 4)
            if self.probe_every > 0 and due and r.k_max > 0 and n + sum(forced) < max_rows:
                forced[i] = 1
        best_ks, best = list(forced), -1.0
        # one pass per drafter graph g: only requests on lanes < g draft, so the drafter step costs
        # at most D(g) and the benefit is concave in the rows: the best m-prefix of the marginal
        # gains, largest first, is the best split of m rows; the best over all passes is exact
        for g in lane_counts(lanes):
            if any(f and r.lane >= g for f, r in zip(forced, requests)):
                continue
            ks = list(forced)
            rows = n + sum(ks)
            benefit = sum(expected_tokens(r.accept_rate, k) for r, k in zip(requests, ks))
            speed = benefit / round_cost(costs, ks, lanes_of, lanes)
            if speed > best:
                best_ks, best = list(ks), speed
            heap = [
                (-(r.accept_rate ** (ks[i] + 1)), i) for i, r in enumerate(requests) if r.lane < g and ks[i] < r.k_max
            ]
            heapq.heapify(heap)
            while heap and rows < max_rows:
                gain, i = heapq.heappop(heap)
                ks[i] += 1
                rows += 1
                benefit -= gain
                if ks[i] < requests[i].k_max:
                    heapq.heappush(heap, (-(requests[i].accept_rate ** (ks[i] + 1)), i))
                speed = benefit / round_cost(costs, ks, lanes_of, lanes)
                if speed > best:
                    best_ks, best = list(ks), speed
        if not any(best_ks):
            self._drafting_streak = 0
        elif self.probe_every > 0 and self._drafting_streak >= self.probe_every:
            # a plain round now and then keeps the cost of not drafting measured: a start-up
            # estimate that made plain rounds look dear would otherwise never be corrected
            self._drafting_streak = 0
            return [0] * n
        else:
            self._drafting_streak += 1
        return best_ks


class FixedPolicy:
    """Every request drafts min(k, k_max) tokens (k = 0: plain decoding), within max_rows."""

    needs_costs = False

    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        self.k = int(k)

    def choose(
        self, requests: Sequence[PolicyRequest], costs: CostModel | None, lanes: int, max_rows: int
    ) -> list[int]:
        left = max_rows - len(requests)
        out = []
        for r in requests:
            k = max(0, min(self.k, r.k_max, left))
            left -= k
            out.append(k)
        return out
