"""Can pyggml_dkv's ggml and llama.cpp's ggml live in one process?

Until the package links its ggml privately (statically, symbols hidden), it ships shared
libggml*.so with the same SONAMEs as llama-cpp-python's: whichever loads second binds to the
first one's ggml (a crash on undefined symbols, or, worse, our drafter silently running on
llama.cpp's ggml). Then the real `Drafter` must not be used in a process that runs llama_cpp;
the host still works with the numpy drafters (drafters.py).
"""

from __future__ import annotations

from pathlib import Path


def coexistence_problem() -> str | None:
    """None when our ggml is private; else why the real Drafter cannot share a process with llama_cpp."""
    libs = Path(__file__).resolve().parents[2] / "_libs" / "lib"
    shared = sorted(p.name for p in libs.glob("libggml*.so*")) if libs.is_dir() else []
    if shared:
        return (f"pyggml_dkv ships shared ggml libraries ({', '.join(shared[:3])}, ...) whose SONAMEs clash with "
                "llama-cpp-python's: the real Drafter cannot run in a process that loaded llama_cpp "
                "(needs the private static ggml build of issue 13)")
    return None
