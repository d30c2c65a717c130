"""Speculative decoding in a llama-cpp-python host: llama.cpp runs the target, a DFlash drafter drafts.

Modules, one job each:
- `gguf`: read the target GGUF's metadata and a few tensors (token embedding / lm_head) in numpy;
- `capture`: the drafter's target features of every decoded token (native or cb_eval route);
- `target`: `LlamaTarget`, the target on llama-cpp-python's low-level API;
- `batched_target`: `BatchedLlamaTarget`, several sequences in one context (pyggml_dkv.serving.engine);
- `sampling`: the target's sampling distribution (temperature, top-k, top-p);
- `acceptance`: greedy acceptance and speculative rejection sampling;
- `drafters`: fit checks, the SmolLM2 drafter shape, oracle and numpy-reference drafters;
- `generate`: `SpeculativeGenerator` (the loop, streaming), plain greedy, the lossless comparison;
- `stats`: per-round statistics;
- `adapter`: `DFlashLlamaDraftModel` for `llama_cpp.Llama(draft_model=...)`;
- `remote`: `RemoteDrafter`, our Drafter in a child process of its own (features and drafts over a pipe);

Requires llama-cpp-python (`pip install pyggml_dkv[llama]`) for the target side; the numpy
parts import without it.
"""

from __future__ import annotations

from ...common.lazy import lazy_exports

# public name -> module (imported on first use: `target`, `capture`, `lowlevel` and `adapter` load
# llama_cpp; the others are numpy only, usable in a process that must not load llama.cpp)
_LAZY = {
    "accept_greedy": "acceptance", "accept_sampled": "acceptance", "top2_gap": "acceptance",
    "DFlashLlamaDraftModel": "adapter",
    "CallbackCapture": "capture", "FeatureCapture": "capture", "NativeCapture": "capture", "make_capture": "capture",
    "SMOLLM2_LAYER_IDS": "drafters", "OracleDrafter": "drafters", "ReferenceDrafter": "drafters",
    "check_fits": "drafters", "check_fits_gguf": "drafters", "ggml_drafter": "drafters",
    "random_smollm2_weights": "drafters", "smollm2_draft_config": "drafters", "target_embeddings": "drafters",
    "HostClosedError": "errors", "HostError": "errors", "IncompatibleDrafterError": "errors",
    "GenerationConfig": "generate", "GenerationResult": "generate", "PlainResult": "generate",
    "SpeculativeGenerator": "generate", "compare_to_plain": "generate", "plain_greedy": "generate",
    "GGUFError": "gguf", "GGUFFile": "gguf",
    "GenerationStats": "stats", "RoundStats": "stats",
    "LlamaTarget": "target",
    "BatchedLlamaTarget": "batched_target",
    "RemoteDrafter": "remote",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals(), __all__)
