"""llama-cpp-python with a DFlash drafter, in one call: `speculative_llama` builds the
llama_cpp.Llama, loads the drafter and attaches it; create_completion / create_chat_completion then
speculate (the Llama verifies every draft: the output is what it would generate alone).

    pip install -e ".[llama]"
    python examples/llama_cpp_quickstart.py

examples/llama_cpp_spec.py is the long version: other drafters, sampling, the lossless check, timings.
"""

from pyggml_dkv.hosts.llama_cpp import smollm2_gguf
from pyggml_dkv.llama import speculative_llama

# SmolLM2-135M-Instruct (fetched once) and the drafter trained for it, which ships with pyggml_dkv
llm = speculative_llama(smollm2_gguf(), n_ctx=2048, n_threads=2, verbose=False)
out = llm.create_chat_completion(
    messages=[{"role": "user", "content": "Name three primes."}], max_tokens=64, temperature=0.0
)
print(out["choices"][0]["message"]["content"])
print(f"{out['usage']['completion_tokens']} tokens from {llm.draft_model.decodes} llama.cpp decodes")
llm.close()  # frees the drafter too
