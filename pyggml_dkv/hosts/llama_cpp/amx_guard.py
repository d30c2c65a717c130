"""Does this llama-cpp-python build survive its own AMX kernels on this CPU?

llama-cpp-python builds llama.cpp natively. On a Xeon with AMX, GCC 12 drops the stores of llama.cpp's
tile configuration (ggml-cpu/amx/mmq.cpp, `ggml_tile_config_init`: `_tile_loadconfig` is declared to
read 8 of the config's 64 bytes), so the first batched product of weights in llama.cpp's AMX buffer
(q4_0, q4_1, q8_0, K-quants) kills the process with SIGILL. `scripts/install_llama_cpp.sh` builds it
with `-fno-dse`, which keeps them. For a build that was not made that way, this module finds out in a
child process (one batched decode of the model with llama.cpp's default buffers) and the host then
loads the model without llama.cpp's extra buffer types (`use_extra_bufts = False`: no AMX, no
repacking; slower prompt processing, correct results) instead of dying.

The probe runs only where it can matter (the CPU has AMX and llama.cpp was compiled with its AMX
kernels), once per model file and llama.cpp build; the verdict is kept in the cache directory.
Imports none of our ggml.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from ...ggml.capabilities import cpu_flags

log = logging.getLogger(__name__)

PROBE_TOKENS = 32  # llama.cpp's AMX path takes batches; a decode of 32 rows reaches it
INSTALL_HINT = (
    "bash scripts/install_llama_cpp.sh from pyggml_dkv's source tree, or by hand: CMAKE_ARGS="
    "'-DCMAKE_C_FLAGS=-fno-dse -DCMAKE_CXX_FLAGS=-fno-dse' pip install --no-cache-dir --force-reinstall "
    "llama-cpp-python==0.3.36"
)
_verdicts: dict[str, bool] = {}


def cpu_has_amx() -> bool:
    return "amx_tile" in cpu_flags()


def _llama_lib_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("llama_cpp")
    return Path(spec.origin).parent / "lib"


def llama_has_amx_kernels() -> bool:
    """Was llama.cpp's CPU backend compiled with its AMX kernels (its system info says AMX_INT8 = 1)?"""
    import llama_cpp

    return "AMX_INT8 = 1" in llama_cpp.llama_print_system_info().decode(errors="replace")


def llama_uses_amx_tiles() -> bool:
    """Can llama.cpp run AMX tile products here (an AMX CPU, llama.cpp compiled with its AMX kernels)?"""
    return cpu_has_amx() and llama_has_amx_kernels()


def _identity(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"


def _verdict_key(model_path: Path) -> str:
    lib_dir = _llama_lib_dir()
    libs = sorted(lib_dir.glob("libggml-cpu*.so*")) or [lib_dir]
    return "|".join([_identity(libs[0]), _identity(model_path)])


def _cache_file() -> Path:
    from ..smollm2 import cache_dir

    return cache_dir() / "llama_amx_probe.json"


def _probe_argv(model_path: Path) -> list[str]:
    return [sys.executable, "-m", __name__, str(model_path)]


def probe(model_path: Path, timeout: float = 300) -> bool:
    """Run one batched decode of `model_path` with llama.cpp's default buffers in a child process.
    False only when the child died of SIGILL (the AMX tile bug); any other failure is left to the
    caller's own load to report."""
    proc = subprocess.run(_probe_argv(model_path), capture_output=True, text=True, timeout=timeout)
    if proc.returncode == -signal.SIGILL:
        return False
    if proc.returncode != 0:
        log.debug(
            "llama.cpp AMX probe of %s exited %d (not SIGILL): %s", model_path, proc.returncode, proc.stderr[-1000:]
        )
    return True


def amx_kernels_work(model_path: str | os.PathLike) -> bool:
    """True unless llama.cpp's AMX kernels would kill this process on `model_path` (module docstring)."""
    path = Path(model_path)
    if not llama_uses_amx_tiles():
        return True
    key = _verdict_key(path)
    if key in _verdicts:
        return _verdicts[key]
    cache = _cache_file()
    try:
        stored: dict[str, Any] = json.loads(cache.read_text())
    except (OSError, ValueError):
        stored = {}
    if key not in stored:
        stored[key] = probe(path)
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(stored, indent=1))
        except OSError as e:
            log.debug("could not keep the AMX probe's verdict in %s: %s", cache, e)
    _verdicts[key] = bool(stored[key])
    return _verdicts[key]


def model_params(model_path: str | os.PathLike) -> Any:
    """llama.cpp's default model parameters, with its extra buffer types off where they would crash."""
    import llama_cpp

    params = llama_cpp.llama_model_default_params()
    if not amx_kernels_work(model_path):
        log.warning(
            "llama.cpp's AMX kernels die of SIGILL in this llama-cpp-python build (GCC 12 dropped its tile "
            "configuration); loading %s without llama.cpp's extra buffer types (no AMX, no repacking). "
            "Fix: %s",
            Path(model_path).name,
            INSTALL_HINT,
        )
        params.use_extra_bufts = False
    return params


def _probe_child(model_path: str) -> int:
    """The child: load with the defaults, decode PROBE_TOKENS tokens in one batch."""
    import llama_cpp

    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(model_path.encode(), llama_cpp.llama_model_default_params())
    if not model:
        return 2
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = PROBE_TOKENS
    cp.n_seq_max = 1
    cp.n_threads = cp.n_threads_batch = 1
    ctx = llama_cpp.llama_init_from_model(model, cp)
    if not ctx:
        return 3
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    batch = llama_cpp.llama_batch_init(PROBE_TOKENS, 0, 1)
    for i in range(PROBE_TOKENS):
        batch.token[i] = i % n_vocab
        batch.pos[i] = i
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = i == PROBE_TOKENS - 1
    batch.n_tokens = PROBE_TOKENS
    rc = llama_cpp.llama_decode(ctx, batch)
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return 0 if rc == 0 else 4


if __name__ == "__main__":
    sys.exit(_probe_child(sys.argv[1]))
