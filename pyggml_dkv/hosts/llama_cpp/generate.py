"""The speculative generation loop: llama.cpp target verifies what a DFlash drafter proposes.

    gen = SpeculativeGenerator(target, drafter)
    result = gen.generate(prompt_tokens, GenerationConfig(max_tokens=128))
    for token in gen.stream(prompt_tokens, config): ...       # streaming

Round: the drafter proposes block_size-1 tokens after the last emitted token `last`; the target
decodes [last] + draft in one batch with logits for every row (capturing every row's features);
the longest accepted prefix plus one target token is emitted (greedy: argmax match; sampling:
rejection sampling); the features of [last] + accepted drafts are committed to the drafter and
the rejected rows are removed from the target's KV cache.

Invariant between rounds: target.n_past == drafter.committed == number of tokens whose features
the drafter has (prompt + emitted tokens except `last`). A drafter with an `observe(tokens)`
method is also told those tokens as they are committed (the prompt, then [last] + accepted drafts).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .acceptance import accept_greedy, accept_sampled, target_probs, top2_gap
from .drafters import DraftSource, check_fits_target
from .errors import HostClosedError, HostError
from .sampling import draw
from .stats import GenerationStats, RoundStats

if TYPE_CHECKING:  # the loop drives any LlamaTarget-like object; importing target loads llama_cpp
    from .target import LlamaTarget

log = logging.getLogger(__name__)


@dataclass
class GenerationConfig:
    max_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_tokens: Sequence[int] = ()  # besides the vocabulary's end-of-generation tokens
    stop_at_eog: bool = True
    record_logits: bool = False  # keep each emitted token's verifying logits row (tests)

    def validate(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise HostError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise HostError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise HostError(f"top_p must lie in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise HostError(f"top_k must be >= 0, got {self.top_k!r}")


@dataclass
class GenerationResult:
    tokens: np.ndarray  # emitted tokens (a stop token is not included)
    finish_reason: str  # "stop" (eog / stop token), "length" (max_tokens), "context" (n_ctx full)
    stats: GenerationStats
    gaps: np.ndarray  # per emitted token: top-2 logit gap of the row that produced it
    logits: list[np.ndarray] = field(default_factory=list)  # per emitted token, when record_logits


class SpeculativeGenerator:
    """Drives a LlamaTarget (with capture of the drafter's layers) and a drafter."""

    def __init__(self, target: LlamaTarget, drafter: DraftSource) -> None:
        if target.closed:
            raise HostClosedError("the target is closed")
        check_fits_target(target, drafter, "LlamaTarget")
        self.target = target
        self.drafter = drafter
        self.last_result: GenerationResult | None = None
        self.stats: GenerationStats | None = None

    def generate(
        self,
        prompt: Sequence[int] | np.ndarray,
        config: GenerationConfig | None = None,
        on_token: Callable[[int], None] | None = None,
    ) -> GenerationResult:
        """Run to completion; on_token(token) is called for each emitted token as it is accepted."""
        for token in self.stream(prompt, config):
            if on_token is not None:
                on_token(token)
        assert self.last_result is not None
        return self.last_result

    def stream(self, prompt: Sequence[int] | np.ndarray, config: GenerationConfig | None = None) -> Iterator[int]:
        """Yield emitted tokens as rounds accept them; `last_result` holds the result afterwards."""
        cfg = config or GenerationConfig()
        cfg.validate()
        target = self.target
        if target.closed:
            raise HostClosedError("the target is closed")
        toks = np.asarray(prompt, dtype=np.int64).reshape(-1)
        if toks.size == 0:
            raise HostError("the prompt is empty")
        if toks.size >= target.n_ctx:
            raise HostError(f"the prompt has {toks.size} tokens; n_ctx={target.n_ctx} leaves no room to generate")
        if toks.min() < 0 or toks.max() >= target.n_vocab:
            raise HostError(f"prompt token ids must lie in [0, {target.n_vocab})")
        return self._run(toks, cfg)

    def _run(self, prompt: np.ndarray, cfg: GenerationConfig) -> Iterator[int]:
        target, drafter, capture = self.target, self.drafter, self.target.capture
        assert capture is not None
        rng = np.random.default_rng(cfg.seed)
        greedy = cfg.temperature == 0
        stops = set(int(t) for t in cfg.stop_tokens)
        stats = GenerationStats(block_size=drafter.cfg.block_size, prompt_tokens=int(prompt.size))
        self.stats = stats  # live while streaming (progress displays)
        emitted: list[int] = []
        gaps: list[float] = []
        rows: list[np.ndarray] = []
        finish = "length"
        self.last_result = None

        def is_stop(token: int) -> bool:
            return token in stops or (cfg.stop_at_eog and target.is_eog(token))

        def pick(logits_rows: np.ndarray) -> int:
            if greedy:
                return int(np.argmax(logits_rows[-1]))
            p = target_probs(logits_rows[-1:], cfg.temperature, cfg.top_k, cfg.top_p)[0]
            return draw(p, rng)

        t_start = time.perf_counter()
        target.clear()
        drafter.reset()
        last_logits = target.prefill(prompt, on_chunk=drafter.add_features)
        observe = getattr(drafter, "observe", None)  # drafters that read the token history (n-gram)
        if observe is not None:
            observe(prompt)
        first = pick(last_logits[None, :])
        stats.prefill_s = time.perf_counter() - t_start
        if drafter.committed != target.n_past:
            raise HostError(f"prefill committed {drafter.committed} feature rows for {target.n_past} tokens")

        def finish_stats() -> None:
            stats.n_tokens = len(emitted)
            stats.total_s = time.perf_counter() - t_start
            self.last_result = GenerationResult(
                np.array(emitted, dtype=np.int64), finish, stats, np.array(gaps, dtype=np.float32), rows
            )

        if is_stop(first):
            finish = "stop"
            finish_stats()
            return
        emitted.append(first)
        gaps.append(float(top2_gap(last_logits)))
        if cfg.record_logits:
            rows.append(last_logits.copy())
        yield first
        last = first

        while len(emitted) < cfg.max_tokens:
            room = target.n_ctx - target.n_past  # positions left for [last] + drafts
            if room < 1:
                finish = "context"
                break
            t0 = time.perf_counter()
            if greedy:
                draft = np.asarray(drafter.propose(last), dtype=np.int64)
                draft_probs = None
            else:
                draft, draft_probs = drafter.propose(
                    last, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, rng=rng
                )
                draft = np.asarray(draft, dtype=np.int64)
            t1 = time.perf_counter()
            k = min(draft.size, room - 1, cfg.max_tokens - len(emitted) - 1)
            draft = draft[:k]
            cap_before = capture.seconds
            logits = target.decode(np.append(last, draft), logits="all")
            t2 = time.perf_counter()
            capture_s = capture.seconds - cap_before
            if greedy:
                n_acc, out = accept_greedy(draft, logits)
            else:
                p = target_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p)
                assert draft_probs is not None  # a sampled proposal comes with its probabilities
                n_acc, out = accept_sampled(draft, draft_probs[:k], p, rng)
            drafter.add_features(capture.features(n_acc + 1))
            if observe is not None:
                observe(np.append(last, draft[:n_acc]))
            target.truncate(target.n_past - (k - n_acc))
            n_out = 0
            for j, token in enumerate(out.tolist()):
                if is_stop(token):
                    finish = "stop"
                    break
                emitted.append(token)
                gaps.append(float(top2_gap(logits[j])))
                if cfg.record_logits:
                    rows.append(np.array(logits[j]))
                n_out += 1
                if len(emitted) >= cfg.max_tokens:
                    break
            t3 = time.perf_counter()
            stats.rounds.append(
                RoundStats(
                    n_draft=k,
                    n_accepted=n_acc,
                    n_emitted=n_out,
                    draft_s=t1 - t0,
                    verify_s=t2 - t1 - capture_s,
                    capture_s=capture_s,
                    host_s=t3 - t2,
                )
            )
            yield from out[:n_out].tolist()
            if finish == "stop":
                break
            last = int(out[-1])
        finish_stats()


@dataclass
class PlainResult:
    tokens: np.ndarray
    gaps: np.ndarray  # top-2 logit gap of each token's row
    seconds: float  # after the prefill
    prefill_s: float

    @property
    def tokens_per_s(self) -> float:
        return (self.tokens.size - 1) / self.seconds if self.seconds > 0 and self.tokens.size > 1 else 0.0


def plain_greedy(
    target: LlamaTarget, prompt: Sequence[int] | np.ndarray, max_tokens: int, stop_at_eog: bool = True
) -> PlainResult:
    """Plain one-token-at-a-time greedy decoding: the reference the speculative output is checked against."""
    toks = np.asarray(prompt, dtype=np.int64).reshape(-1)
    t0 = time.perf_counter()
    target.clear()
    logits = target.prefill(toks)
    t1 = time.perf_counter()
    out: list[int] = []
    gaps: list[float] = []
    while True:
        token = int(np.argmax(logits))
        if stop_at_eog and target.is_eog(token):
            break
        out.append(token)
        gaps.append(float(top2_gap(logits)))
        if len(out) >= max_tokens or target.n_past >= target.n_ctx:
            break
        logits = target.decode([token], logits="last")[-1]
    return PlainResult(
        np.array(out, dtype=np.int64), np.array(gaps, dtype=np.float32), time.perf_counter() - t1, t1 - t0
    )


def compare_to_plain(spec: GenerationResult, plain: PlainResult, near_tie: float) -> dict:
    """Lossless check (b): agreement up to the first divergence, and whether it is a near-tie
    (top-2 gap below `near_tie` in the plain or the speculative row at that position)."""
    a, b = spec.tokens, plain.tokens
    n = min(a.size, b.size)
    diff = np.nonzero(a[:n] != b[:n])[0]
    if diff.size == 0:  # one is a prefix of the other (max_tokens or n_ctx cut them differently)
        return {
            "identical": bool(a.size == b.size),
            "first_divergence": None,
            "agree_tokens": int(n),
            "near_tie": None,
            "gap_plain": None,
            "gap_spec": None,
            "lossless": True,
        }
    i = int(diff[0])
    gp, gs = float(plain.gaps[i]), float(spec.gaps[i])
    tie = min(gp, gs) < near_tie
    return {
        "identical": False,
        "first_divergence": i,
        "agree_tokens": i,
        "near_tie": bool(tie),
        "gap_plain": gp,
        "gap_spec": gs,
        "lossless": bool(tie),
    }
