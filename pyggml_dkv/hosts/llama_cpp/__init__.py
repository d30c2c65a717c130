"""Speculative decoding in a llama-cpp-python host: llama.cpp runs the target, a DFlash drafter drafts.

Modules, one job each:
- `gguf`: read the target GGUF's metadata and a few tensors (token embedding / lm_head) in numpy;
- `capture`: the drafter's target features of every decoded token (native or cb_eval route);
- `target`: `LlamaTarget`, the target on llama-cpp-python's low-level API;
- `sampling`: the target's sampling distribution (temperature, top-k, top-p);
- `acceptance`: greedy acceptance and speculative rejection sampling;
- `drafters`: fit checks, the SmolLM2 drafter shape, oracle and numpy-reference drafters;
- `generate`: `SpeculativeGenerator` (the loop, streaming), plain greedy, the lossless comparison;
- `stats`: per-round statistics;
- `adapter`: `DFlashLlamaDraftModel` for `llama_cpp.Llama(draft_model=...)`;
- `coexist`: whether our ggml can share the process with llama.cpp's.

Requires llama-cpp-python (`pip install pyggml_dkv[llama]`).
"""

from __future__ import annotations

from .acceptance import accept_greedy, accept_sampled, top2_gap
from .adapter import DFlashLlamaDraftModel
from .capture import CallbackCapture, FeatureCapture, NativeCapture, make_capture
from .coexist import coexistence_problem
from .drafters import (SMOLLM2_LAYER_IDS, OracleDrafter, ReferenceDrafter, check_fits, check_fits_gguf,
                       ggml_drafter, random_smollm2_weights, smollm2_draft_config, target_embeddings)
from .errors import HostClosedError, HostError, IncompatibleDrafterError
from .generate import (GenerationConfig, GenerationResult, PlainResult, SpeculativeGenerator, compare_to_plain,
                       plain_greedy)
from .gguf import GGUFError, GGUFFile
from .stats import GenerationStats, RoundStats
from .target import LlamaTarget

__all__ = [
    "DFlashLlamaDraftModel", "accept_greedy", "accept_sampled", "top2_gap", "CallbackCapture", "FeatureCapture", "NativeCapture",
    "make_capture", "coexistence_problem", "SMOLLM2_LAYER_IDS", "OracleDrafter", "ReferenceDrafter", "check_fits",
    "check_fits_gguf", "ggml_drafter", "random_smollm2_weights", "smollm2_draft_config", "target_embeddings",
    "HostClosedError", "HostError", "IncompatibleDrafterError", "GenerationConfig", "GenerationResult",
    "PlainResult", "SpeculativeGenerator", "compare_to_plain", "plain_greedy", "GGUFError", "GGUFFile",
    "GenerationStats", "RoundStats", "LlamaTarget",
]
