"""Drafter: what a llama.cpp-style Python host needs to draft with a DFlash model.

It owns the drafter weights on the backend, a FeatureRing of the target's captured features, the
ring cache (whose step graph also looks up the noise block's token embeddings and takes the
argmax), and the target's token embedding + lm_head.

    drafter = Drafter(weights, embed_tokens=target_embed, lm_head=target_head, cap=4096)
    drafter.add_features(prompt_features)         # (n_prompt, fc_in)
    draft = drafter.propose(last_token)           # block_size - 1 token ids, one graph compute
    ... verify with the target, accept k tokens + a bonus ...
    drafter.rewind(n_before + k)                  # drop what verification rejected
    drafter.add_features(features_of_accepted)    # and continue

With `lanes=N` it drafts for N requests at once: each lane has its own ring of features, and
`propose_lanes([tok0, None, tok2, ...])` drafts for every lane given a token in one graph compute.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..common.checks import check_int, is_int, is_real
from ..common.sampling import sampling_probs
from ..ggml import Backend
from ..model.weights import DraftWeights
from .backend_weights import BackendWeights
from .cache import DraftKvCache
from .features import FeatureRing
from .selector_walk import greedy_walk, sampled_walk

log = logging.getLogger(__name__)


def sample_rows(p: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One categorical draw per row of p."""
    u = rng.random(int(p.shape[0]))[:, None]
    ids = (np.cumsum(p, axis=1) < u).sum(axis=1)
    return np.minimum(ids, p.shape[1] - 1).astype(np.int64)


def confident_prefix(logits: np.ndarray, p_min: float) -> np.ndarray:
    """The argmax of each row, up to (not including) the first row whose top probability < p_min."""
    z = np.asarray(logits, dtype=np.float32)
    top = z.max(axis=1, keepdims=True)
    p_top = 1.0 / np.exp(z - top).sum(axis=1)  # softmax probability of the argmax
    unsure = np.nonzero(p_top < p_min)[0]
    n = int(unsure[0]) if unsure.size else z.shape[0]
    return np.argmax(z[:n], axis=1).astype(np.int64)


class Drafter:
    """A DFlash drafter for a host: features in, block_size-1 draft tokens out.

    `weight_dtype` is the drafter's matrices' type ("auto": by backend and CPU); the lm_head is
    uploaded in that type too unless `lm_head_dtype` says otherwise (DraftKvCache).
    `lm_head_screen="q8_0"`: greedy drafts (temperature 0, p_min 0) come from the screened argmax,
    the exact head's ids at about a q8_0 head's cost; sampling and p_min still read the full head's
    logits (DraftKvCache, drafter.head_screen).
    `lanes`: requests drafted in one compute, each with its own feature ring (`lane=` on
    add_features / rewind / reset / propose; `propose_lanes` for several at once).
    """

    def __init__(
        self,
        weights: DraftWeights | BackendWeights,
        *,
        embed_tokens: np.ndarray,
        lm_head: np.ndarray,
        backend: Backend | None = None,
        cap: int = 4096,
        ring_cap: int | None = None,
        weight_dtype: str = "auto",
        cache_type: str = "f16",
        swa: str = "seed",
        ring_dtype: str = "f32",
        p_min: float = 0.0,
        lm_head_dtype: str | None = None,
        lm_head_screen: str | None = None,
        lanes: int = 1,
    ) -> None:
        # greedy drafts stop at the first token the drafter itself gives less than p_min (llama.cpp's
        # --draft-p-min): a short draft is cheaper to verify where the drafter is unsure anyway
        if not is_real(p_min) or not 0.0 <= p_min < 1.0:
            raise ValueError(f"p_min must be a number in [0, 1), got {p_min!r}")
        self.p_min = float(p_min)
        self._owns_backend = backend is None
        self.backend = backend or Backend("cpu")
        try:
            if isinstance(weights, DraftWeights):
                self.weights = weights.to_backend(self.backend, weight_dtype)
                self._owns_weights = True
            elif isinstance(weights, BackendWeights):
                self.weights = weights
                self._owns_weights = False
            else:
                raise TypeError(f"weights must be DraftWeights or BackendWeights, got {type(weights).__name__}")
            self.cfg = self.weights.cfg
            embed = np.asarray(embed_tokens)
            head = np.asarray(lm_head)
            if (
                embed.ndim != 2
                or head.ndim != 2
                or embed.shape[1] != self.cfg.hidden
                or head.shape[1] != self.cfg.hidden
            ):
                raise ValueError(
                    f"embed_tokens and lm_head must be (vocab, hidden={self.cfg.hidden}), "
                    f"got {embed.shape} and {head.shape}"
                )
            if embed.shape[0] != head.shape[0]:
                raise ValueError(f"embed_tokens has {embed.shape[0]} rows but lm_head has {head.shape[0]}")
            self.vocab = int(head.shape[0])
            self.embed_tokens, self.lm_head = embed, head  # host copies (e.g. for noise_embed())
            if not 0 <= self.cfg.mask_token_id < self.vocab:
                raise ValueError(
                    f"mask_token_id {self.cfg.mask_token_id} is outside the target's vocab of {self.vocab}"
                )
            self.q_len = self.cfg.block_size
            self.lanes = check_int("lanes", lanes, 1)
            self.rings = [
                FeatureRing(ring_cap or cap + 2 * self.q_len, self.cfg.fc_in, ring_dtype) for _ in range(self.lanes)
            ]
            self.ring = self.rings[0]
            self.cache = DraftKvCache(
                self.weights,
                self.backend,
                cap,
                lm_head=head,
                cache_type=cache_type,
                swa=swa,
                embed_tokens=embed,
                lm_head_dtype=lm_head_dtype,
                lm_head_screen=lm_head_screen,
                lanes=self.lanes,
            )
        except BaseException:
            self.close()
            raise
        self._tokens = [np.full(self.q_len, self.cfg.mask_token_id, dtype=np.int32) for _ in range(self.lanes)]

    def _ring_of(self, lane: Any) -> FeatureRing:
        if not is_int(lane) or not 0 <= int(lane) < self.lanes:
            raise ValueError(f"lane must be an int in [0, {self.lanes}), got {lane!r}")
        return self.rings[int(lane)]

    @property
    def committed(self) -> int:
        """Number of tokens whose target features the drafter has (lane 0's)."""
        return self.ring.written

    def committed_of(self, lane: int) -> int:
        """Number of tokens whose target features lane `lane` has."""
        return self._ring_of(lane).written

    def add_features(self, rows: Any, *, lane: int = 0) -> None:
        """Captured target features `(n, fc_in)` of the next n committed tokens of `lane`."""
        self._ring_of(lane).append(rows)

    def rewind(self, n_committed: int, *, lane: int = 0) -> None:
        """Keep only the first n_committed tokens' features of `lane` (verification rejected the rest)."""
        self._ring_of(lane).truncate(n_committed)

    def can_rewind(self, n_committed: int, *, lane: int = 0) -> bool:
        """Whether rewind(n_committed, lane=lane) keeps those tokens' features (the ring still
        holds them: n_committed lies between its oldest readable position and its last)."""
        ring = self._ring_of(lane)
        return is_int(n_committed) and ring.oldest <= int(n_committed) <= ring.written

    def reset(self, lane: int | None = None) -> None:
        """Start a new request on `lane` (every lane when None)."""
        if lane is not None:
            self._ring_of(lane)  # checks the index
        for i in range(self.lanes) if lane is None else [int(lane)]:
            self.rings[i].clear()
            self.cache.reset(i)

    def noise_embed(self, last_token: int) -> np.ndarray:
        """The noise block's embeddings (q_len, hidden): [last_token, mask, mask, ...], scaled.
        (What propose() looks up inside the graph; for graphs that take embeddings.)"""
        ids = np.full(self.q_len, self.cfg.mask_token_id, dtype=np.int64)
        ids[0] = last_token
        return self.embed_tokens[ids].astype(np.float32) * np.float32(self.cfg.input_embedding_scale)

    def move_lane(self, src: int, dst: int) -> None:
        """Move request `src` (its features and cached rows) to lane `dst`, dropping what dst
        held; src is left empty. Keeping the active requests in the lowest lanes keeps each
        step's graph small (DraftKvCache.move_lane)."""
        self._ring_of(src)
        self._ring_of(dst)
        self.cache.move_lane(src, dst)
        self.rings[int(dst)], self.rings[int(src)] = self.rings[int(src)], self.rings[int(dst)]
        self.rings[int(src)].clear()
        self.ring = self.rings[0]

    def _check_sampling(self, temperature: Any, top_k: Any, top_p: Any) -> None:
        if not is_real(temperature) or not np.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if not is_real(top_p) or not 0 < top_p <= 1.0:
            raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")
        if not is_int(top_k) or top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {top_k!r}")

    def _check_token(self, lane: int, last_token: Any) -> None:
        if self.rings[lane].written <= 0:
            where = f" on lane {lane}" if self.lanes > 1 else ""
            raise ValueError(
                f"propose() needs the features of at least one committed token{where} (add_features first)"
            )
        if not is_int(last_token) or not 0 <= last_token < self.vocab:
            raise ValueError(f"last_token must be a token id in [0, {self.vocab}), got {last_token!r}")

    def propose(
        self,
        last_token: int,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        rng: np.random.Generator | None = None,
        lane: int = 0,
    ) -> Any:
        """Draft block_size-1 tokens after `last_token` (the last accepted token) in one graph compute.

        Greedy (temperature 0): returns the token ids (cut before the first one the drafter gives
        less than `p_min`). Sampling: returns `(ids, probs)` where probs[i] is the distribution
        draft token i was drawn from, for the host's rejection sampling (never cut).
        With lanes, drafts for `lane` alone (the other lanes idle for this compute).
        """
        self._ring_of(lane)
        tokens: list[int | None] = [None] * self.lanes
        tokens[int(lane)] = last_token
        return self.propose_lanes(tokens, temperature=temperature, top_k=top_k, top_p=top_p, rng=rng)[int(lane)]

    def propose_lanes(
        self,
        last_tokens: Sequence[int | None],
        *,
        temperature: float | Sequence[float] = 0.0,
        top_k: int | Sequence[int] = 0,
        top_p: float | Sequence[float] = 1.0,
        rng: np.random.Generator | Sequence[np.random.Generator | None] | None = None,
    ) -> list[Any]:
        """Draft for every lane whose `last_tokens` entry is a token (None: idle) in one graph
        compute; returns one result per lane as propose() gives it (None for idle lanes). The
        sampling settings, and the random generator sampled lanes draw from, are one for all
        lanes or one per lane (a request's own generator: its draws then do not depend on the
        other lanes')."""
        if (
            isinstance(last_tokens, (str, bytes, np.ndarray))
            or not isinstance(last_tokens, Sequence)
            or len(last_tokens) != self.lanes
        ):
            raise ValueError(
                f"last_tokens must be a list of {self.lanes} entries (a token id, or None for an idle lane)"
            )
        settings = {
            name: self._per_lane(name, value)
            for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("rng", rng))
        }
        if any(r is not None and not isinstance(r, np.random.Generator) for r in settings["rng"]):
            raise ValueError("rng must be a numpy Generator, None, or one of those per lane")
        rngs = settings["rng"]  # a lane that samples without one gets a fresh generator
        given = {lane: tok for lane, tok in enumerate(last_tokens) if tok is not None}
        active = list(given)
        if not active:
            raise ValueError("last_tokens has no token: every lane is idle")
        for lane in active:
            try:
                self._check_token(lane, last_tokens[lane])
                self._check_sampling(settings["temperature"][lane], settings["top_k"][lane], settings["top_p"][lane])
            except ValueError as e:
                raise ValueError(f"lane {lane}: {e}" if self.lanes > 1 else str(e)) from None
        for lane, tok in given.items():
            self._tokens[lane][0] = tok
        greedy_ids = self.p_min == 0.0 and all(settings["temperature"][lane] == 0 for lane in active)
        rings = [self.rings[i] if i in active else None for i in range(self.lanes)]
        committed = [self.rings[i].written if i in active else None for i in range(self.lanes)]
        tokens = [self._tokens[i] if i in active else None for i in range(self.lanes)]
        # the cache's arguments: one lane's own, or a list of every lane's
        lane_args: tuple[Any, Any, Any] = (
            (rings[0], committed[0], tokens[0]) if self.lanes == 1 else (rings, committed, tokens)
        )
        if self.cfg.is_dflash2:
            return self._propose_dflash2(*lane_args, active, greedy_ids, settings["temperature"], rngs)
        out = self.cache.step_tokens(*lane_args, output="ids" if greedy_ids else "logits")
        per_lane = out if self.lanes > 1 else [out]
        results: list[Any] = [None] * self.lanes
        for lane in active:
            rows = per_lane[lane][1:]
            t = settings["temperature"][lane]
            if greedy_ids:
                results[lane] = rows.astype(np.int64)
            elif t == 0:
                results[lane] = confident_prefix(rows, self.p_min)
            else:
                probs = sampling_probs(rows, t, settings["top_k"][lane], settings["top_p"][lane])
                results[lane] = (sample_rows(probs, rngs[lane] or np.random.default_rng()), probs)
        return results

    def _propose_dflash2(
        self,
        rings: Any,
        committed: Any,
        tokens: Any,
        active: list[int],
        greedy_ids: bool,
        temperatures: list[float],
        rngs: list[np.random.Generator | None],
    ) -> list[Any]:
        """DFlash-2 drafts come from the candidate selector's walk (docs/dflash2.md): greedy ids
        from the graph's own walk; a p_min cut-off or a sampled path from the block's lattice.
        Sampling returns (ids, probs) with probs[i] the distribution over the vocabulary that id i
        was drawn from (its support: position i's top-k candidates); the user's top-k / top-p
        apply to the target's distribution, not to these."""
        out = self.cache.step_tokens(rings, committed, tokens, output="ids" if greedy_ids else "lattice")
        per_lane = out if self.lanes > 1 else [out]
        results: list[Any] = [None] * self.lanes
        for lane in active:
            t = temperatures[lane]
            if greedy_ids:
                results[lane] = per_lane[lane][1:].astype(np.int64)
            elif t == 0:
                results[lane] = greedy_walk(per_lane[lane], self.p_min)
            else:
                results[lane] = sampled_walk(per_lane[lane], t, self.vocab, rngs[lane] or np.random.default_rng())
        return results

    def _per_lane(self, name: str, value: Any) -> list[Any]:
        if self.lanes > 1 and isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            if len(value) != self.lanes:
                raise ValueError(f"{name} must be one value or {self.lanes} (one per lane), got {len(value)}")
            return list(value)
        return [value] * self.lanes

    def close(self) -> None:
        """Free everything this drafter created. Idempotent."""
        if getattr(self, "cache", None) is not None:
            self.cache.close()
        if getattr(self, "_owns_weights", False):
            self.weights.close()
        if self._owns_backend and getattr(self, "backend", None) is not None:
            self.backend.close()

    def __enter__(self) -> Drafter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
