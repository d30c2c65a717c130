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
- `ngram`: `HybridDrafter`, n-gram (prompt lookup) drafts where the context repeats, DFlash otherwise;
- `speculative`: `speculative_llama`, a llama_cpp.Llama with the drafter attached in one call
  (`pyggml_dkv.llama`).

The public names (`__all__`) are what a host user needs: the target, the generator and its config
and result, the drafters and the adapter, the lossless check, the fit checks, the host's errors,
and the SmolLM2 target with its shipped drafter. The rest (acceptance math, feature capture,
statistics types) stays in its module.

Requires llama-cpp-python (`pip install pyggml_dkv[llama]`) for the target side; the numpy
parts import without it.
"""

from __future__ import annotations

from ...common.lazy import lazy_exports

# public name -> module (imported on first use: `target`, `capture`, `lowlevel`, `adapter` and
# `speculative` load llama_cpp; the others are numpy only, usable in a process that must not load
# llama.cpp)
_LAZY_PUBLIC = {
    "DFlashLlamaDraftModel": "adapter",
    "HybridDrafter": "ngram",
    "OracleDrafter": "drafters",
    "ReferenceDrafter": "drafters",
    "check_fits_gguf": "drafters",
    "ggml_drafter": "drafters",
    "random_smollm2_weights": "drafters",
    "smollm2_draft_config": "drafters",
    "target_embeddings": "drafters",
    "HostClosedError": "errors",
    "HostError": "errors",
    "IncompatibleDrafterError": "errors",
    "GenerationConfig": "generate",
    "GenerationResult": "generate",
    "SpeculativeGenerator": "generate",
    "compare_to_plain": "generate",
    "plain_greedy": "generate",
    "GGUFFile": "gguf",
    "LlamaTarget": "target",
    "RemoteDrafter": "remote",
    # (relative to this package with one dot more: pyggml_dkv.hosts.smollm2, pyggml_dkv.hosts.pretrained)
    "smollm2_gguf": ".smollm2",
    "smollm2_drafter_path": ".pretrained",
}

__all__ = sorted(_LAZY_PUBLIC)

# Not public: importable from the package only because code outside this change imports it from
# here today (tests/training/); new code imports it from its module.
_LAZY_COMPAT = {
    "SMOLLM2_LAYER_IDS": "drafters",
}

__getattr__, __dir__ = lazy_exports(__name__, {**_LAZY_PUBLIC, **_LAZY_COMPAT}, globals(), __all__)
