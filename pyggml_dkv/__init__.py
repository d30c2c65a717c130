"""pyggml_dkv: Python bindings over ggml (cffi) and a DFlash drafter context-KV ring cache.

The public API, re-exported from the layers (docs/design.md, "Layers"):

- the drafter: `Drafter` (propose / add_features / rewind), `DraftKvCache` + `FeatureRing` (the
  cache API underneath it), `OneShotDrafter` (the recompute-everything baseline);
- its model: `DraftConfig`, `DraftWeights`, `load_checkpoint` (a dflash checkpoint directory),
  `load_gguf` (a llama.cpp dflash .gguf; `DraftWeights.from_pretrained` takes either);
- `Backend` (cpu, cuda:N, rpc) and `PyggmlDkvError`, the base of every error raised on purpose;
- `speculative_llama` (`pyggml_dkv.llama`): a llama_cpp.Llama that drafts with a DFlash drafter.

The pure-Python parts (errors, config, weights) import without the compiled extension; the rest is
loaded on first use, so `import pyggml_dkv` loads neither ggml nor llama.cpp. The ggml layer has
its own public names (`pyggml_dkv.ggml`), so has the llama.cpp host (`pyggml_dkv.hosts.llama_cpp`).
"""

from __future__ import annotations

from .common.errors import PyggmlDkvError
from .common.lazy import lazy_exports
from .model.config import DraftConfig
from .model.errors import CheckpointError, CheckpointNotFoundError, ConfigError, WeightsError  # noqa: F401
from .model.weights import DraftWeights, load_checkpoint, load_gguf

__version__ = "0.1.0"

# public name -> module that defines it (imported lazily: these need the ggml extension, or llama.cpp)
_LAZY_PUBLIC = {
    "Backend": "ggml",
    "FeatureRing": "drafter.features",
    "DraftKvCache": "drafter.cache",
    "Drafter": "drafter.drafter",
    "OneShotDrafter": "drafter.oneshot",
    "speculative_llama": "llama",
}

__all__ = [
    "Backend",
    "DraftConfig",
    "DraftKvCache",
    "DraftWeights",
    "Drafter",
    "FeatureRing",
    "OneShotDrafter",
    "PyggmlDkvError",
    "load_checkpoint",
    "load_gguf",
    "speculative_llama",
]

# Not public (not in __all__, not in dir()), importable from here only because older tests and
# scripts import them from the package; new code imports them from their defining modules. The model's error classes above stay importable too: all derive from
# PyggmlDkvError.
_LAZY_COMPAT = {
    "available_backends": "ggml",
    "bf16_attention_supported": "ggml",
    "list_devices": "ggml",
    "live_objects": "ggml",
    "BackendUnavailableError": "ggml",
    "BackendWeights": "drafter.backend_weights",
    "DraftKvState": "drafter.c_api",
    "draft_kv_init": "drafter.c_api",
    "draft_kv_reset": "drafter.c_api",
    "draft_kv_free": "drafter.c_api",
    "draft_kv_begin_step": "drafter.c_api",
}

__getattr__, __dir__ = lazy_exports(__name__, {**_LAZY_PUBLIC, **_LAZY_COMPAT}, globals(), __all__)
