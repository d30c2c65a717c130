"""The raw cffi `ffi` / `lib` pair, mirroring ggml's C headers one-to-one.

Everything above this module goes through the Pythonic layer in `pyggml_dkv.ggml`; use `lib`
directly only when you know ggml's C contracts (it aborts the process on misuse).
"""

from __future__ import annotations

import logging

from .._cffi.stamp import check_extension

try:
    from .._ggml_cffi import ffi, lib
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "pyggml_dkv's compiled ggml bindings are missing or cannot load "
        f"({exc}). Install the package with `pip install -e .` (it builds ggml through "
        "build_ggml.sh), or run ./build_ggml.sh and reinstall."
    ) from exc

# the extension must run the ggml recorded in pyggml_dkv/_libs (version, variant, build id)
check_extension(ffi, lib)

__all__ = ["ffi", "lib"]

_ggml_logger = logging.getLogger("pyggml_dkv.ggml")
_LEVELS = {
    lib.GGML_LOG_LEVEL_DEBUG: logging.DEBUG,
    lib.GGML_LOG_LEVEL_INFO: logging.INFO,
    lib.GGML_LOG_LEVEL_WARN: logging.WARNING,
    lib.GGML_LOG_LEVEL_ERROR: logging.ERROR,
}
_last_level = logging.INFO

# ggml's CUDA backend says in debug messages whether it replayed a captured CUDA graph; counted
# here so hosts and benchmarks can tell (see cuda_graph_stats()).
_CUDA_GRAPH_EVENTS = {
    "reused": "CUDA Graph id",  # "CUDA Graph id N reused": the step replayed a captured graph
    "warmup_complete": "CUDA graph warmup complete",
    "warmup_reset": "CUDA graph warmup reset",
    "update_failed": "CUDA graph update failed",
    "disabled": "disabling CUDA graphs",
}
cuda_graph_events = dict.fromkeys(_CUDA_GRAPH_EVENTS, 0)


def _count_cuda_graph_event(msg: str) -> None:
    if "CUDA" not in msg or "raph" not in msg:
        return
    for event, marker in _CUDA_GRAPH_EVENTS.items():
        if marker in msg and (event != "reused" or msg.endswith("reused")):
            cuda_graph_events[event] += 1


@ffi.def_extern()
def _pyggml_log_callback(level: int, text: ffi.CData, user_data: ffi.CData) -> None:
    # ggml's own messages go to the `pyggml_dkv.ggml` logger instead of stderr;
    # CONT lines continue the previous message at its level.
    global _last_level
    if level != lib.GGML_LOG_LEVEL_CONT:
        _last_level = _LEVELS.get(level, logging.INFO)
    msg = ffi.string(text).decode("utf-8", "replace").rstrip("\n")
    _count_cuda_graph_event(msg)
    if msg:
        _ggml_logger.log(_last_level, "%s", msg)


lib.ggml_log_set(lib._pyggml_log_callback, ffi.NULL)
