"""An OpenAI-compatible server that speculates for many clients at once.

    python -m pyggml_dkv.serve                     # SmolLM2 + the shipped drafter on 127.0.0.1:8000
    pyggml-dkv-serve --parallel 4 --api-key KEY    # the same as a console script

`app.create_app` is the HTTP front (FastAPI); `__main__` wires a llama.cpp target
(`hosts.llama_cpp.BatchedLlamaTarget`), a multi-lane drafter and the engine
(`serving.engine.SpeculativeEngine`) to it. Needs the `server` extra (`pip install -e ".[server]"`).
"""
