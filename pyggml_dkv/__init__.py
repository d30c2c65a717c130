"""pyggml_dkv: Python bindings over ggml (cffi) and a DFlash drafter context-KV ring cache.

The public API, re-exported from the layers (docs/design.md, "Layers"). The pure-Python parts
(errors, config, weights, the reference) import without the compiled extension; everything that
touches ggml is loaded on first use.
"""

from __future__ import annotations

from .common.errors import PyggmlDkvError
from .common.lazy import lazy_exports
from .model.config import DraftConfig
from .model.errors import CheckpointError, CheckpointNotFoundError, ConfigError, WeightsError
from .model.weights import DraftWeights

__version__ = "0.1.0"

# public name -> module that defines it (imported lazily: these need the ggml extension)
_LAZY = {
    "available_backends": "ggml",
    "list_devices": "ggml",
    "cuda_graph_stats": "ggml",
    "amx_available": "ggml",
    "bf16_attention_supported": "ggml",
    "cpu_extra_buffer_types": "ggml",
    "Backend": "ggml",
    "BackendInfo": "ggml",
    "BackendUnavailableError": "ggml",
    "RemoteBackendError": "ggml",
    "Buffer": "ggml",
    "Context": "ggml",
    "Gallocr": "ggml",
    "GGMLError": "ggml",
    "Graph": "ggml",
    "Tensor": "ggml",
    "live_objects": "ggml",
    "BackendWeights": "model.backend_weights",
    "FeatureRing": "drafter.features",
    "DraftKvCache": "drafter.cache",
    "DraftKvState": "drafter.c_api",
    "draft_kv_init": "drafter.c_api",
    "draft_kv_reset": "drafter.c_api",
    "draft_kv_free": "drafter.c_api",
    "draft_kv_begin_step": "drafter.c_api",
    "OneShotDrafter": "drafter.oneshot",
    "Drafter": "drafter.drafter",
}

__all__ = ["CheckpointError", "CheckpointNotFoundError", "ConfigError", "DraftConfig", "DraftWeights", "PyggmlDkvError",
           "WeightsError", *_LAZY]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals(), __all__)
