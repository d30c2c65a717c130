"""Child side of test_gpu_path's stand-alone check (kept apart: the test module itself imports the
llama.cpp host, which would load our ggml extension before the child can block it)."""

from __future__ import annotations

import sys


def import_without_ggml_or_llama_cpp() -> None:
    """Block our ggml extension and llama.cpp, then import what gpu-run runs."""
    sys.modules["pyggml_dkv._ggml_cffi"] = None  # type: ignore[assignment]  # importing it now raises
    sys.modules["llama_cpp"] = None  # type: ignore[assignment]
    import pyggml_dkv.training.__main__  # noqa: F401
    import pyggml_dkv.training.batched  # noqa: F401
    import pyggml_dkv.training.gpu_run  # noqa: F401
    import pyggml_dkv.training.selfgen  # noqa: F401
    import pyggml_dkv.training.torch_target  # noqa: F401
    from pyggml_dkv.hosts.smollm2 import smollm2_draft_config

    assert smollm2_draft_config(n_layer=4).n_layer == 4
    assert "pyggml_dkv.ggml" not in sys.modules
    print("ok")
