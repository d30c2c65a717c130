"""SpeculativeEngine: continuous batching with speculative decoding for many clients at once.

    target = BatchedLlamaTarget(gguf, n_parallel=4, n_ctx=4096, capture_layers=weights.cfg.target_layer_ids)
    drafter = ggml_drafter(weights, gguf, lanes=4)           # or None: no speculation
    with SpeculativeEngine(target, drafter) as engine:
        handle = engine.submit(prompt_tokens, RequestParams(max_tokens=128, temperature=0.7, seed=1))
        for token in handle: ...                              # as rounds commit them
        handle.finish_reason, handle.stats.tokens_per_round, handle.stats.draft_lengths

One thread runs the rounds; the target and the drafter belong to it. Up to `parallel` requests
are active, request i on sequence i of the target and lane i of the drafter (a joining request
takes the lowest free one); beyond that a bounded queue waits (`QueueFullError` past it).
Requests join and leave between rounds; a cancelled request's sequence and lane are freed
before the next round.

A round:
1. prefill: the prompts of joined requests, packed into one decode of at most `prefill_chunk`
   rows (a longer prompt continues next round); a prompt's last row gives its first token, its
   rows' features go to its lane;
2. draft lengths: the policy picks k in 0..draft_max per request (policy.py: the split of draft
   rows that maximises expected tokens per second, from each request's acceptance so far and the
   measured costs of the decode by rows and of the drafter step);
3. one drafter step (`propose_lanes`) for the requests with k > 0, none if no one drafts;
4. one target decode verifying every request's [last token + k drafts] block (each request's
   rows contiguous, logits for every row);
5. per request, acceptance as `hosts/llama_cpp/generate.py` does it (greedy: the longest prefix
   equal to the target's argmax, then its next token; sampling: rejection sampling with the
   draft distributions); commit: the features of [last] + accepted drafts to the request's lane,
   the rejected positions removed from its sequence (`llama_memory_seq_rm`), the tokens to its
   handle; stop tokens and end-of-generation give "stop", max_tokens or a full sequence "length".

Plain requests. Capturing the target's features costs every decode some time (llama.cpp copies
the captured layers' rows out: 4-8% of a 1-row SmolLM2 decode on a 2-core Zen 4), and only
requests that may draft need them. A request that, after `give_up_rounds` verify rounds, drafted
in fewer than a quarter of them (probes included) stops speculating: its lane is emptied, its
rows are no longer captured. The engine remembers, decayed over the requests that ran that long
speculatively, the share of them that drafted in at least a quarter of their rounds; while that
is under 10%, a new request starts plain, except every `explore_every`-th, which keeps the
estimate current. A decode in which no request speculates captures nothing: where drafting does
not pay, the server settles into plain decoding. (SpeedPolicy only: a fixed draft length is
drafted as told.)

The engine lives in the serving layer, which may not import the hosts layer: it drives the
target through the target's own methods (`decode_blocks`, `features`, `truncate`, `clear_seq`,
`is_eog`) and the verification rule the target exposes (`accept_greedy`, `accept_sampled`,
`target_probs`, `top2_gap`, `draw`: hosts/llama_cpp/acceptance.py, sampling.py).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..common.checks import is_int
from .calibration import calibrate
from .policy import AcceptanceEstimate, CostModel, DraftPolicy, PolicyRequest, SpeedPolicy, graph_lanes
from .requests import (
    EngineClosedError,
    EngineError,
    QueueFullError,
    RequestHandle,
    RequestParams,
    RequestResult,
    RequestStats,
)

log = logging.getLogger(__name__)

__all__ = [
    "EngineClosedError",
    "EngineError",
    "QueueFullError",
    "RequestHandle",
    "RequestParams",
    "RequestResult",
    "RequestStats",
    "SpeculativeEngine",
]

_ids = itertools.count(1)
DRAFT_SHARE = 0.25  # a request that drafts in fewer of its rounds is not worth its capture
MERIT_FLOOR = 0.1  # below: recent speculative requests (nearly) never drafted that often
MERIT_DECAY = 0.7  # per request that ran give_up_rounds rounds speculatively


@dataclass
class _Active:
    """A request holding a sequence / lane (`slot`)."""

    handle: RequestHandle
    prompt: np.ndarray
    slot: int
    rng: np.random.Generator
    stops: frozenset[int]
    prefilled: int = 0  # prompt tokens decoded (or kept from the slot's previous request)
    in_kv: list[int] = field(default_factory=list)  # the tokens at positions 0, 1, ... of its sequence
    last: int = -1  # the last emitted token, not yet decoded (-1: none yet)
    generated: int = 0
    idle_rounds: int = 0  # verify rounds since it last drafted
    probes: int = 0  # drafting rounds after idle ones since it last drafted twice in a row
    speculative: bool = False  # its features are captured, its lane kept: it may draft
    drafting_rounds: int = 0  # verify rounds in which it drafted
    est: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)

    @property
    def params(self) -> RequestParams:
        return self.handle.params

    @property
    def decoding(self) -> bool:
        return self.prefilled == self.prompt.size and self.last >= 0


@dataclass
class EngineStats:
    rounds: int = 0  # verify rounds
    draft_steps: int = 0
    prefill_decodes: int = 0
    plain_decodes: int = 0  # decodes without feature capture (no request in them speculated)
    tokens: int = 0  # tokens committed to requests
    verify_s: float = 0.0
    draft_s: float = 0.0
    prefill_s: float = 0.0
    busy_s: float = 0.0  # time spent in rounds

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["tokens_per_s"] = self.tokens / self.busy_s if self.busy_s > 0 else 0.0
        return d


class SpeculativeEngine:
    """Continuous batching over one BatchedLlamaTarget and one multi-lane Drafter (or None).

    parallel: active requests at once (default: the target's n_parallel; the drafter needs at
    least that many lanes). max_queue: requests that may wait beyond the free sequences.
    draft_max: most drafts per request and round (default block_size - 1). policy: SpeedPolicy()
    by default (FixedPolicy(k) forces k). cost_model: a CostModel to start from (another
    engine's), else measured at start-up when the policy needs one. prefill_chunk: most prompt
    rows per round (default n_batch). seed: the draws of requests that bring no seed of their
    own. reuse_prefix: a request starts on the free sequence whose previous request's tokens share the longest prefix with its
    prompt and keeps those positions (the target's KV cells and the drafter lane's features), as
    llama-server's prompt cache does; False: every request starts from an empty sequence.
    give_up_rounds, explore_every: when a request stops speculating and when new ones start
    without (the module docstring, "Plain requests"); give_up_rounds=0: never.
    The engine does not own the target or the drafter (it leaves them empty at shutdown).
    """

    def __init__(
        self,
        target: Any,
        drafter: Any = None,
        *,
        parallel: int | None = None,
        max_queue: int = 16,
        draft_max: int | None = None,
        policy: DraftPolicy | None = None,
        cost_model: CostModel | None = None,
        prefill_chunk: int | None = None,
        seed: int = 0,
        reuse_prefix: bool = True,
        give_up_rounds: int = 32,
        explore_every: int = 8,
        name: str = "spec-engine",
    ) -> None:
        if getattr(target, "closed", True):
            raise EngineError("the target is closed (or not a BatchedLlamaTarget)")
        self.target = target
        self.drafter = drafter
        if parallel is None:
            parallel = int(target.n_parallel)
        if not is_int(parallel) or not 1 <= parallel <= target.n_parallel:
            raise ValueError(
                f"parallel must be an int in [1, {target.n_parallel}] (the target's sequences), got {parallel!r}"
            )
        self.parallel = int(parallel)
        if target.n_batch < self.parallel:
            raise ValueError(
                f"the target's n_batch {target.n_batch} cannot verify {self.parallel} requests in one decode"
            )
        if not is_int(max_queue) or max_queue < 0:
            raise ValueError(f"max_queue must be an int >= 0, got {max_queue!r}")
        self.max_queue = int(max_queue)
        block = 1
        if drafter is not None:
            target.check_drafter(drafter, lanes=self.parallel)
            block = int(drafter.cfg.block_size)
        if draft_max is None:
            draft_max = block - 1
        if not is_int(draft_max) or not 0 <= draft_max <= block - 1:
            raise ValueError(
                f"draft_max must be an int in [0, {block - 1}] (the drafter's block size - 1), got {draft_max!r}"
            )
        self.draft_max = int(draft_max)
        self.max_rows = min(target.n_batch, self.parallel * (1 + self.draft_max))
        if prefill_chunk is None:
            prefill_chunk = target.n_batch
        if not is_int(prefill_chunk) or not 1 <= prefill_chunk <= target.n_batch:
            raise ValueError(f"prefill_chunk must be an int in [1, {target.n_batch}], got {prefill_chunk!r}")
        self.prefill_chunk = int(prefill_chunk)
        self.policy: DraftPolicy = policy if policy is not None else SpeedPolicy()
        self.name = name
        for s in range(self.parallel):
            target.clear_seq(s)
        if drafter is not None:
            drafter.reset()
        self.speculating = drafter is not None and self.draft_max > 0
        self._calibrate = cost_model is None and self.speculating and getattr(self.policy, "needs_costs", True)
        for name, value, lo in (("give_up_rounds", give_up_rounds, 0), ("explore_every", explore_every, 1)):
            if not is_int(value) or value < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
        # only a policy that weighs costs can find that drafting does not pay
        self.give_up_rounds = int(give_up_rounds) if getattr(self.policy, "needs_costs", True) else 0
        self.explore_every = int(explore_every)
        self.cost_model = cost_model
        self.stats = EngineStats()
        self._accept = AcceptanceEstimate(decay=0.99)  # engine-wide: the prior of a new request
        # engine-wide: how often recent speculative requests drafted often enough (decayed per
        # request), and new requests started plain since the last speculative one (docs/server.md)
        self._merit = 1.0
        self._plain_starts = 0
        self._rng = np.random.default_rng(seed)
        self._cv = threading.Condition()
        self._waiting: deque[tuple[RequestHandle, np.ndarray]] = deque()
        self._slots: list[_Active | None] = [None] * self.parallel
        # per free slot: the tokens its sequence and lane still hold from the request that left it
        # (a later prompt that starts with them skips their prefill: chat templates, system prompts)
        self._kept: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * self.parallel
        self.reuse_prefix = bool(reuse_prefix)
        self._accepting = True
        self._stop = False
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            self._thread.join()
            raise self._start_error

    # --- client API ------------------------------------------------------------------------

    def submit(
        self,
        prompt_tokens: Sequence[int] | np.ndarray,
        params: RequestParams | None = None,
        *,
        request_id: str | None = None,
    ) -> RequestHandle:
        """Queue a request; returns its handle at once. QueueFullError when every sequence is busy
        and `max_queue` requests already wait; EngineClosedError after shutdown."""
        params = params if params is not None else RequestParams()
        if not isinstance(params, RequestParams):
            raise TypeError(f"params must be a RequestParams, got {type(params).__name__}")
        params.validate(self.target.n_vocab)
        toks = np.asarray(prompt_tokens)
        if toks.ndim != 1 or toks.size == 0 or toks.dtype.kind not in "iu":
            raise ValueError("prompt_tokens must be a non-empty 1-D sequence of token ids")
        toks = toks.astype(np.int64)
        if toks.min() < 0 or toks.max() >= self.target.n_vocab:
            raise ValueError(f"prompt token ids must lie in [0, {self.target.n_vocab})")
        if toks.size >= self.target.n_ctx_seq:
            raise ValueError(
                f"the prompt has {toks.size} tokens; a sequence holds {self.target.n_ctx_seq} "
                "positions, which leaves no room to generate"
            )
        rid = request_id or f"req-{next(_ids)}"
        with self._cv:
            if not self._accepting:
                raise EngineClosedError(f"{self.name} is shut down")
            free = sum(a is None or a.handle.done for a in self._slots)  # a cancelled one is freed next round
            if len(self._waiting) >= free + self.max_queue:
                raise QueueFullError(
                    f"{self.name}: {self.parallel} requests active and {len(self._waiting)} waiting "
                    f"(max_queue={self.max_queue})"
                )
            handle = RequestHandle(rid, int(toks.size), params, self._on_cancel)
            self._waiting.append((handle, toks))
            self._cv.notify_all()
        log.debug(
            "%s: %s queued (%d prompt tokens, max_tokens %d, temperature %g)",
            self.name,
            rid,
            toks.size,
            params.max_tokens,
            params.temperature,
        )
        return handle

    def generate(
        self,
        prompt_tokens: Sequence[int] | np.ndarray,
        params: RequestParams | None = None,
        timeout: float | None = None,
    ) -> RequestResult:
        """submit() and wait for the result."""
        return self.submit(prompt_tokens, params).result(timeout)

    @property
    def active(self) -> int:
        with self._cv:
            return sum(a is not None for a in self._slots)

    @property
    def waiting(self) -> int:
        with self._cv:
            return len(self._waiting)

    def lanes_in_use(self) -> dict[int, str]:
        """slot (sequence and lane) -> request id of the active requests."""
        with self._cv:
            return {a.slot: a.handle.id for a in self._slots if a is not None}

    def shutdown(self, timeout: float | None = 30.0) -> bool:
        """Stop taking requests; let those in flight and queued finish for up to `timeout` seconds
        (None: no bound), then cancel what is left. Returns after the round in progress ends;
        True when every request finished by itself."""
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        with self._cv:
            self._accepting = False
            self._cv.notify_all()
            clean = self._cv.wait_for(
                lambda: not self._waiting and all(a is None for a in self._slots) or not self._thread.is_alive(),
                None if deadline is None else max(0.0, deadline - time.monotonic()),
            )
            left = [
                h
                for h in [h for h, _ in self._waiting] + [a.handle for a in self._slots if a is not None]
                if not h.done
            ]
        for h in left:
            h.cancel()
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join()
        return bool(clean) and not left

    def close(self) -> None:
        """shutdown(0): cancel everything now."""
        self.shutdown(0.0)

    def __enter__(self) -> SpeculativeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown(0.0 if exc[0] is not None else 30.0)

    # --- the loop --------------------------------------------------------------------------

    def _on_cancel(self, handle: RequestHandle) -> None:
        with self._cv:
            for item in self._waiting:
                if item[0] is handle:
                    self._waiting.remove(item)
                    log.info("%s: %s cancelled while queued", self.name, handle.id)
                    break
            self._cv.notify_all()

    def _start(self) -> bool:
        """On the engine's thread, before the first round: measure the costs if needed. Every
        ggml compute of the target and the drafter happens on this one thread, calibration
        included: ggml's CPU backend synchronises its threads with OpenMP barriers, and each
        thread that ever starts a parallel region keeps a pool of OpenMP workers; once the pools
        hold more threads than there are cores, libgomp stops spin-waiting at barriers and puts
        threads to sleep at every one (measured on a 2-core Zen 4: a 1-row decode 10 -> 17 ms
        after a calibration on the constructing thread)."""
        try:
            if self._calibrate:
                self.cost_model = calibrate(self.target, self.drafter, self.parallel, self.max_rows)
        except BaseException as exc:
            self._start_error = exc
            return False
        finally:
            self._started.set()
        return True

    def _run(self) -> None:
        if not self._start():
            return
        try:
            while True:
                with self._cv:
                    self._reap_locked()
                    self._admit_locked()
                    if all(a is None for a in self._slots):
                        if self._stop:
                            break
                        self._cv.notify_all()
                        self._cv.wait()
                        continue
                t0 = time.perf_counter()
                try:
                    self._round()
                except Exception as exc:  # a failed decode: fail the active requests, keep serving
                    log.exception("%s: round failed; failing the active requests", self.name)
                    self._fail_active(exc)
                self.stats.busy_s += time.perf_counter() - t0
                with self._cv:
                    self._cv.notify_all()
        except BaseException as exc:  # pragma: no cover - a bug in the loop itself
            log.exception("%s: the engine loop died", self.name)
            self._fail_active(exc)
            with self._cv:
                for h, _ in self._waiting:
                    h._finish("error", exc)
                self._waiting.clear()
        finally:
            with self._cv:
                self._accepting = False
                self._clear_kept_locked()
                self._cv.notify_all()

    def _clear_kept_locked(self) -> None:
        """Empty the free slots' kept positions (the engine leaves the target and drafter empty)."""
        for slot, a in enumerate(self._slots):
            if a is None and self._kept[slot].size:
                self._kept[slot] = np.zeros(0, dtype=np.int64)
                try:
                    self.target.clear_seq(slot)
                    if self.drafter is not None:
                        self.drafter.reset(slot)
                except Exception:  # pragma: no cover - a closed target: nothing left to empty
                    log.debug("%s: could not empty slot %d at shutdown", self.name, slot, exc_info=True)

    def _reap_locked(self) -> None:
        for a in self._slots:
            if a is not None and a.handle.done:  # cancelled by its client
                self._free_locked(a)

    def _admit_locked(self) -> None:
        while self._waiting and None in self._slots:
            handle, toks = self._waiting.popleft()
            if handle.done:
                continue
            speculative = self._starts_speculative()
            slot, keep = self._pick_slot_locked(toks, speculative)
            p = handle.params
            # a request's draws (its drafts' and the target's) come from its own generator: a seeded
            # request gives the same tokens whatever else runs; unseeded ones follow the engine's seed
            rng = np.random.default_rng(p.seed if p.seed is not None else int(self._rng.integers(2**63)))
            a = _Active(handle, toks, slot, rng, frozenset(int(t) for t in p.stop_token_ids))
            a.speculative = speculative
            self._start_on_slot(a, keep)
            self._slots[slot] = a
            handle.stats.started_at = time.perf_counter()
            handle.stats.lane = slot
            log.debug("%s: %s joins on sequence/lane %d", self.name, handle.id, slot)

    def _pick_slot_locked(self, prompt: np.ndarray, speculative: bool) -> tuple[int, int]:
        """The free slot for `prompt` and the positions it keeps: the longest common prefix with
        what a free slot holds (at most all but the prompt's last token, whose logits are needed),
        the lowest free slot on a tie (lower lanes keep the drafter's graph small). A speculative
        request keeps a prefix only where the slot's lane holds its features too (a slot a plain
        request left holds none): another slot that does saves it the prefill."""
        best, keep = -1, 0
        for slot, a in enumerate(self._slots):
            if a is not None:
                continue
            n = 0
            if self.reuse_prefix:
                held = self._kept[slot]
                m = min(held.size, prompt.size - 1)
                diff = np.nonzero(held[:m] != prompt[:m])[0]
                n = int(diff[0]) if diff.size else m
                if n and speculative and not self.drafter.can_rewind(n, lane=slot):
                    n = 0
            if best < 0 or n > keep:
                best, keep = slot, n
        return best, keep

    def _starts_speculative(self) -> bool:
        """Whether a new request captures features (and may draft): yes while recent speculative
        requests drafted often enough now and then; else only every `explore_every`-th new request,
        which keeps the engine's knowledge current (the text its clients send may change)."""
        if not self.speculating:
            return False
        if self.give_up_rounds <= 0 or self._merit >= MERIT_FLOOR or self._plain_starts + 1 >= self.explore_every:
            self._plain_starts = 0
            return True
        self._plain_starts += 1
        return False

    def _stop_speculating(self, a: _Active) -> None:
        """The request drafts no more: its lane is emptied, its rows are no longer captured."""
        a.speculative = False
        a.handle.stats.stopped_speculating_at = a.handle.stats.rounds
        if self.drafter is not None:
            self.drafter.reset(a.slot)
        log.debug(
            "%s: %s stops speculating: drafted in %d of %d rounds",
            self.name,
            a.handle.id,
            a.drafting_rounds,
            a.handle.stats.rounds,
        )

    def _start_on_slot(self, a: _Active, keep: int) -> None:
        """Empty the slot's sequence and lane past `keep` positions (their tokens equal the prompt's)."""
        self._kept[a.slot] = np.zeros(0, dtype=np.int64)
        if keep > 0 and a.speculative and not self.drafter.can_rewind(keep, lane=a.slot):
            keep = 0  # the lane does not hold those rows' features (no longer, or never did)
        if keep > 0:
            self.target.truncate(a.slot, keep)
            if self.drafter is not None:
                if a.speculative:
                    self.drafter.rewind(keep, lane=a.slot)
                else:
                    self.drafter.reset(a.slot)
        else:
            self.target.clear_seq(a.slot)
            if self.drafter is not None:
                self.drafter.reset(a.slot)
        a.prefilled = keep
        a.in_kv = [int(t) for t in a.prompt[:keep]]
        a.handle.stats.cached_tokens = keep
        a.handle.stats.speculative = a.speculative
        if keep:
            log.debug("%s: %s keeps %d prompt positions of sequence %d", self.name, a.handle.id, keep, a.slot)

    def _free_locked(self, a: _Active, *, keep: bool = True) -> None:
        """Free the request's slot; its sequence and lane keep their positions for a later prompt
        that starts with the same tokens (unless `keep` is False or the engine reuses no prefix)."""
        if self._slots[a.slot] is a:
            self._slots[a.slot] = None
        if a.handle.stats.speculative and self.give_up_rounds > 0 and a.handle.stats.rounds >= self.give_up_rounds:
            # a request that ran long enough teaches whether drafting paid for it
            often = a.speculative and a.drafting_rounds >= DRAFT_SHARE * a.handle.stats.rounds
            self._merit = MERIT_DECAY * self._merit + (1 - MERIT_DECAY) * float(often)
        try:
            held = self.target.n_past_of(a.slot)
            if keep and self.reuse_prefix and held == len(a.in_kv):
                self._kept[a.slot] = np.asarray(a.in_kv, dtype=np.int64)
            else:
                self._kept[a.slot] = np.zeros(0, dtype=np.int64)
                self.target.clear_seq(a.slot)
                if self.drafter is not None:
                    self.drafter.reset(a.slot)
        finally:
            self._log_done(a)

    def _free(self, a: _Active) -> None:
        with self._cv:
            self._free_locked(a)
            self._cv.notify_all()

    def _fail_active(self, exc: BaseException) -> None:
        with self._cv:
            for a in self._slots:
                if a is not None:
                    a.handle._finish("error", exc)
                    try:
                        self._free_locked(a, keep=False)
                    except Exception:  # the target itself is broken: nothing more to free
                        self._slots[a.slot] = None

    def _log_done(self, a: _Active) -> None:
        st = a.handle.stats
        mode = (
            "plain"
            if not st.speculative
            else "speculative"
            if st.stopped_speculating_at is None
            else f"speculative until round {st.stopped_speculating_at}"
        )
        log.info(
            "%s: %s %s: %d tokens (%d prompt, %d cached), %d rounds, %.2f tokens/round, draft lengths %s, %s, "
            "%.3f s (queued %.3f s, %.1f tokens/s)",
            self.name,
            a.handle.id,
            a.handle.finish_reason,
            st.n_tokens,
            st.prompt_tokens,
            st.cached_tokens,
            st.rounds,
            st.tokens_per_round,
            dict(sorted(Counter(st.draft_lengths).items())),
            mode,
            st.total_s,
            st.queue_s,
            st.tokens_per_s,
        )

    # --- a round ---------------------------------------------------------------------------

    def _round(self) -> None:
        t0 = time.perf_counter()
        active = [a for a in self._slots if a is not None]
        pre = [a for a in active if a.prefilled < a.prompt.size]
        prefill_s = self._prefill(pre) if pre else 0.0
        dec = [a for a in self._slots if a is not None and a.decoding]
        if not dec:
            return
        ks = self._choose(dec)
        draft_s, drafts, probs = self._draft(dec, ks)
        verify_s = self._verify(dec, ks, drafts, probs)
        if self.cost_model is not None:
            self.cost_model.observe_host(time.perf_counter() - t0 - prefill_s - draft_s - verify_s)

    def _pick(self, a: _Active, row: np.ndarray) -> int:
        p = a.params
        if p.greedy:
            return int(np.argmax(row))
        return int(self.target.draw(self.target.target_probs(row[None, :], p.temperature, p.top_k, p.top_p)[0], a.rng))

    def _prefill(self, pre: list[_Active]) -> float:
        budget = self.prefill_chunk
        blocks: list[tuple[int, np.ndarray, str]] = []
        owners: list[tuple[_Active, int, bool]] = []
        for a in pre:
            if budget <= 0:
                break
            n = min(a.prompt.size - a.prefilled, budget)
            done = a.prefilled + n == a.prompt.size
            blocks.append((a.slot, a.prompt[a.prefilled : a.prefilled + n], "last" if done else "none"))
            owners.append((a, n, done))
            budget -= n
        t0 = time.perf_counter()
        rows = self.target.decode_blocks(blocks, capture=self._captures([a for a, _, _ in owners]))
        dt = time.perf_counter() - t0
        self.stats.prefill_decodes += 1
        self.stats.prefill_s += dt
        for (a, n, done), r in zip(owners, rows):
            if a.speculative:
                self.drafter.add_features(self.target.features(r), lane=a.slot)
            a.in_kv.extend(int(t) for t in a.prompt[a.prefilled : a.prefilled + n])
            a.prefilled += n
            if done:
                row = r.logits[-1]
                token = self._pick(a, row)
                a.last = token
                self._emit(a, [token], row[None, :])
        return dt

    def _captures(self, requests: list[_Active]) -> bool:
        """Whether a decode of these requests' rows captures features (someone may draft)."""
        on = any(a.speculative for a in requests)
        if not on:
            self.stats.plain_decodes += 1
        return on

    def _choose(self, dec: list[_Active]) -> list[int]:
        if self.drafter is None or self.draft_max == 0:
            return [0] * len(dec)
        prior = self._accept.rate(0.5, 4.0)
        n_ctx_seq = self.target.n_ctx_seq
        reqs = []
        for a in dec:
            room = n_ctx_seq - self.target.n_past_of(a.slot)  # positions left for [last] + drafts
            k_max = max(0, min(self.draft_max, room - 1, a.params.max_tokens - a.generated - 1))
            if not a.speculative:
                k_max = 0
            reqs.append(PolicyRequest(a.est.rate(prior, 4.0), k_max, a.slot, a.idle_rounds, a.probes))
        ks = self.policy.choose(reqs, self.cost_model, self.drafter.lanes, self.max_rows)
        if (
            len(ks) != len(dec)
            or any(not is_int(k) or not 0 <= k <= r.k_max for k, r in zip(ks, reqs))
            or len(dec) + sum(ks) > self.max_rows
        ):
            raise EngineError(
                f"the policy chose draft lengths {ks} for limits {[r.k_max for r in reqs]} and {self.max_rows} rows"
            )
        return [int(k) for k in ks]

    def _draft(self, dec: list[_Active], ks: list[int]) -> tuple[float, list[np.ndarray], list[np.ndarray | None]]:
        empty = np.zeros(0, dtype=np.int64)
        drafts: list[np.ndarray] = [empty] * len(dec)
        probs: list[np.ndarray | None] = [None] * len(dec)
        if not any(ks):
            return 0.0, drafts, probs
        lanes = self.drafter.lanes
        tokens: list[int | None] = [None] * lanes
        temp, top_k, top_p = [0.0] * lanes, [0] * lanes, [1.0] * lanes
        rngs: list[np.random.Generator | None] = [None] * lanes
        for a, k in zip(dec, ks):
            if k > 0:
                tokens[a.slot] = a.last
                temp[a.slot], top_k[a.slot], top_p[a.slot] = a.params.temperature, a.params.top_k, a.params.top_p
                rngs[a.slot] = a.rng
        t0 = time.perf_counter()
        out = self.drafter.propose_lanes(tokens, temperature=temp, top_k=top_k, top_p=top_p, rng=rngs)
        dt = time.perf_counter() - t0
        self.stats.draft_steps += 1
        self.stats.draft_s += dt
        if self.cost_model is not None:
            top = max(a.slot for a, k in zip(dec, ks) if k > 0)
            self.cost_model.observe_draft(graph_lanes(top, lanes), dt)
        for i, (a, k) in enumerate(zip(dec, ks)):
            if k == 0:
                continue
            res = out[a.slot]
            if a.params.greedy:
                drafts[i] = np.asarray(res, dtype=np.int64)[:k]  # may be shorter (the drafter's p_min)
            else:
                drafts[i] = np.asarray(res[0], dtype=np.int64)[:k]
                probs[i] = res[1][:k]
            ks[i] = int(drafts[i].size)
        return dt, drafts, probs

    def _verify(
        self, dec: list[_Active], ks: list[int], drafts: list[np.ndarray], probs: list[np.ndarray | None]
    ) -> float:
        target = self.target
        blocks = [(a.slot, np.append(np.int64(a.last), d), "all") for a, d in zip(dec, drafts)]
        n_rows = sum(1 + d.size for d in drafts)
        t0 = time.perf_counter()
        rows = target.decode_blocks(blocks, capture=self._captures(dec))
        dt = time.perf_counter() - t0
        self.stats.rounds += 1
        self.stats.verify_s += dt
        if self.cost_model is not None:
            self.cost_model.observe_verify(n_rows, dt)
        for a, k, d, q, r in zip(dec, ks, drafts, probs, rows):
            seg = r.logits
            p = a.params
            if p.greedy:
                n_acc, out = target.accept_greedy(d, seg)
            else:
                pt = target.target_probs(seg, p.temperature, p.top_k, p.top_p)
                n_acc, out = target.accept_sampled(d, q if q is not None else np.zeros((0, seg.shape[1])), pt, a.rng)
            if a.speculative:
                self.drafter.add_features(target.features(r)[: n_acc + 1], lane=a.slot)
            target.truncate(a.slot, r.pos + n_acc + 1)
            a.in_kv.append(a.last)
            a.in_kv.extend(int(t) for t in d[:n_acc])
            a.est.observe(k, n_acc)
            self._accept.observe(k, n_acc)
            if k > 0:  # drafting after idle rounds: a probe (or a change of mind)
                a.drafting_rounds += 1
                a.probes = a.probes + 1 if a.idle_rounds > 0 else 0
                a.idle_rounds = 0
            else:
                a.idle_rounds += 1
                if (
                    a.speculative
                    and 0 < self.give_up_rounds <= a.handle.stats.rounds + 1
                    and a.drafting_rounds < DRAFT_SHARE * (a.handle.stats.rounds + 1)
                ):
                    self._stop_speculating(a)
            st = a.handle.stats
            st.draft_lengths.append(k)
            st.accepted.append(n_acc)
            tokens = [int(t) for t in out]
            n_out = self._emit(a, tokens, seg)
            st.emitted.append(n_out)
            a.last = tokens[-1]
        return dt

    def _emit(self, a: _Active, tokens: list[int], rows: np.ndarray) -> int:
        """Commit `tokens` (row j of `rows` produced token j) to the request, up to a stop token or
        max_tokens; ends and frees the request when it is done. Returns the tokens committed."""
        p = a.params
        out: list[int] = []
        gaps: list[float] = []
        finish: str | None = None
        for j, token in enumerate(tokens):
            if token in a.stops or (p.stop_at_eog and self.target.is_eog(token)):
                finish = "stop"
                break
            out.append(token)
            if p.record_gaps:
                gaps.append(float(self.target.top2_gap(rows[j])))
            if a.generated + len(out) >= p.max_tokens:
                finish = "length"
                break
        if finish is None and self.target.n_past_of(a.slot) >= self.target.n_ctx_seq:
            finish = "length"  # no position left for the next token
        alive = a.handle._push(out, gaps) if out else not a.handle.done
        a.generated += len(out)
        self.stats.tokens += len(out)
        if finish is not None or not alive:
            if alive:
                a.handle._finish(finish or "length")
            self._free(a)
        return len(out)
