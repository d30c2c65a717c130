"""The C-style drop-in API of the original C++ header (`dflash_draft_kv.h`), over DraftKvCache,
for hosts ported from it: init / reset / free / begin_step on a `DraftKvState`.

With lanes (`draft_kv_init(..., lanes=N)`), the host begins every lane it drafts for
(`draft_kv_begin_step(..., lane=i)`), writes each lane's q_len rows of `st.inp_embed` (lane i's
block at rows i*q_len..), computes `st.gf` (all N lanes) and reads lane i's rows of
`st.hidden_states`. A lane not begun for a step computes on its last inputs (its rows are
meaningless); beginning a lane twice before a compute starts the step over."""

from __future__ import annotations

from typing import Any

from ..ggml import Backend, GGMLError
from .backend_weights import BackendWeights
from .cache import DraftKvCache
from .features import FeatureRing

_STATE_FIELDS = (
    "cap",
    "q_len",
    "kv_total",
    "a_step",
    "trash_slot",
    "fc_in",
    "any_full",
    "any_swa",
    "mem_ctx",
    "mem_buf",
    "k_cache",
    "v_cache",
    "inp_embed",
    "pos_q",
    "noise_rows",
    "mask_full",
    "mask_swa",
    "ap_feat",
    "ap_pos",
    "ap_rows",
    "g_ctx",
    "gf",
    "galloc",
    "hidden_states",
    "logits",
    "next_pos",
    "slot_pos",
    "inp_tokens",
    "draft_ids",
    "lanes",
)


class DraftKvState:
    """The header's `DraftKvState`: empty until draft_kv_init, then exposes the cache's fields."""

    def __init__(self) -> None:
        self.cache: DraftKvCache | None = None
        self.built_for: BackendWeights | None = None

    def __getattr__(self, name: str) -> Any:
        if name in _STATE_FIELDS:
            cache = self.__dict__.get("cache")
            if cache is None:
                raise GGMLError(f"DraftKvState.{name}: the state is not initialised (call draft_kv_init)")
            return getattr(cache, name)
        raise AttributeError(name)


def draft_kv_init(
    st: DraftKvState,
    dw: BackendWeights,
    backend: Backend,
    cap: int,
    lm_head: Any = None,
    cache_type: str = "f16",
    swa: str = "seed",
    lanes: int = 1,
) -> bool:
    """Allocate caches + inputs and build the step graphs. Raises on bad input; returns True."""
    if st.cache is not None:
        draft_kv_free(st)
    st.cache = DraftKvCache(dw, backend, cap, lm_head=lm_head, cache_type=cache_type, swa=swa, lanes=lanes)
    st.built_for = dw
    return True


def draft_kv_reset(st: DraftKvState, lane: int | None = None) -> None:
    """Forget lane `lane`'s rows (every lane's when None)."""
    if st.cache is not None:
        st.cache.reset(lane)


def draft_kv_free(st: DraftKvState) -> None:
    if st.cache is not None:
        st.cache.close()
    st.cache = None
    st.built_for = None


def draft_kv_begin_step(
    st: DraftKvState, dw: BackendWeights, backend: Backend, ring: FeatureRing, committed: int, lane: int = 0
) -> bool:
    """Bring lane `lane` of the cache up to `committed` and fill its step inputs; then the host
    sets `st.inp_embed`, computes `st.gf` on the backend and reads `st.hidden_states`."""
    if st.cache is None:
        raise GGMLError("draft_kv_begin_step: the state is not initialised (call draft_kv_init)")
    if dw is not st.built_for:
        raise ValueError("draft_kv_begin_step: these weights are not the ones the state was built for")
    if backend is not st.cache.backend:
        raise ValueError("draft_kv_begin_step: this backend is not the one the state was built on")
    st.cache.begin_step(ring, committed, lane)
    return True
