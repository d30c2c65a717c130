"""One-call llama-cpp-python integration: a `llama_cpp.Llama` that speculates with a DFlash drafter.

    from pyggml_dkv.llama import speculative_llama

    llm = speculative_llama(model_path, n_ctx=2048, n_threads=2)   # + drafter=, draft_max=, p_min=
    print(llm.create_completion("The capital of France is", max_tokens=32, temperature=0.0)["choices"][0]["text"])
    llm.close()                                                    # frees the drafter too

Importing this module does not import llama_cpp; calling speculative_llama does. The pieces it
wires together (the `DFlashLlamaDraftModel` adapter, `ggml_drafter`, the fit checks) are public in
`pyggml_dkv.hosts.llama_cpp` for hosts that build their Llama themselves.
"""

from __future__ import annotations

from .hosts.llama_cpp.speculative import speculative_llama

__all__ = ["speculative_llama"]
