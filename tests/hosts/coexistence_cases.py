"""Child-process cases for tests/test_llama_host.py: pyggml_dkv and llama.cpp in one process.

Each case runs in a fresh interpreter (`python -c "...; run(case, out_path)"`), loads the two
libraries in the order the case names, and writes what it computed as JSON to `out_path`:
a DraftKvCache trajectory (sha256 of its raw output bytes), llama.cpp's greedy tokens and the
sha256 of its logits, and what pyggml_dkv's ggml answers at run time. The test compares every
mixed case with the isolated ones, byte for byte.

Not collected by pytest (no test_ prefix); run by the children through tests.child.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

# the trajectory: a toy drafter with random weights, q8_0 weights and an f16 ring cache (the
# patched flash-attention and matmul kernels), then the opt-in bf16 attention (old patch 0009),
# with commits that append single rows, bulk-append, and rewind
TOY = dict(hidden=64, n_layer=2, n_head=2, n_head_kv=1, head_dim=64, ffn=128, block_size=8, n_target_layers=2)
COMMITS = (5, 6, 9, 30, 31, 24, 60)
CAP = 37

# llama.cpp: greedy decoding of a short prompt on one thread, with every position's logits kept
PROMPT = b"The capital of France is"
N_NEW = 16
N_CTX = 64

CASES = (
    "isolated_pyggml",  # pyggml_dkv alone (the reference trajectory)
    "isolated_llama",  # llama_cpp alone (the reference generation)
    "pyggml_then_llama",  # import pyggml_dkv, then llama_cpp
    "llama_then_pyggml",  # import llama_cpp, then pyggml_dkv
    "llama_ggml_global_first",  # llama.cpp's libggml*.so loaded RTLD_GLOBAL before both
    "pyggml_global_first",  # our extension loaded RTLD_GLOBAL before llama_cpp
)


def import_pyggml() -> Any:
    import pyggml_dkv
    import pyggml_dkv.ggml  # loads the extension now, not lazily mid-case
    from pyggml_dkv.ggml import _lowlevel

    return pyggml_dkv, _lowlevel


def import_pyggml_global() -> Any:
    """Load the extension with RTLD_GLOBAL, so anything it exported would be visible to llama.cpp."""
    flags = sys.getdlopenflags()
    sys.setdlopenflags(os.RTLD_NOW | os.RTLD_GLOBAL)
    try:
        return import_pyggml()
    finally:
        sys.setdlopenflags(flags)


def llama_lib_dir() -> Path:
    """llama_cpp's bundled libraries (libllama.so, libggml*.so), found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise RuntimeError("llama_cpp is not installed")
    return Path(spec.origin).parent / "lib"


def load_llama_ggml_global() -> list[str]:
    """dlopen llama.cpp's ggml libraries RTLD_GLOBAL, as a host embedding llama.cpp might."""
    lib_dir = llama_lib_dir()
    loaded = []
    for name in ("libggml-base.so", "libggml-cpu.so", "libggml.so"):
        path = lib_dir / name
        if path.exists():
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            loaded.append(name)
    if not loaded:
        raise RuntimeError(f"no libggml*.so in {lib_dir}")
    return loaded


def trajectory(pyggml_dkv: Any) -> dict[str, Any]:
    """sha256 of every step's output of two caches over COMMITS, plus the ops the graph holds."""
    import numpy as np

    from pyggml_dkv import Backend, DraftConfig, DraftKvCache, DraftWeights, FeatureRing

    cfg = DraftConfig(**TOY)
    weights = DraftWeights.random(cfg, seed=0)
    rng = np.random.default_rng(1)
    feats = rng.standard_normal((max(COMMITS), cfg.fc_in)).astype(np.float32)
    noise = rng.standard_normal((cfg.block_size, cfg.hidden)).astype(np.float32)
    ring = FeatureRing(max(COMMITS), cfg.fc_in)
    ring.append(feats)
    digest = hashlib.sha256()
    ops: dict[str, str] = {}
    with Backend("cpu", n_threads=1) as cpu, weights.to_backend(cpu, "q8_0") as bw:
        # the opt-in bf16 attention where this build has it (the refused choice is tested elsewhere)
        attentions = ("f32", "bf16") if pyggml_dkv.ggml.capabilities.bf16_attention_supported() else ("f32",)
        for attention in attentions:
            with DraftKvCache(bw, cpu, CAP, cache_type="f16", attention=attention) as cache:
                for committed in COMMITS:
                    digest.update(np.ascontiguousarray(cache.step(ring, committed, noise)).tobytes())
                # the op numbers the running ggml put in the graph, with its names for them
                for node in cache.gf.nodes():
                    ops[str(int(node.ptr.op))] = node.op
    return {"sha256": digest.hexdigest(), "ops": ops}


def ggml_answers(pyggml_dkv: Any, lowlevel: Any) -> dict[str, Any]:
    """What pyggml_dkv's ggml says at run time: version, type names for our enum values, backends."""
    ffi, lib = lowlevel.ffi, lowlevel.lib
    types = {name: ffi.string(lib.ggml_type_name(value)).decode() for name, value in pyggml_dkv.ggml.TYPES.items()}
    return {
        "ggml_version": ffi.string(lib.ggml_version()).decode(),
        # llama.cpp's ggml reports the same version; our build id (ggml's commit string) tells them apart
        "ggml_commit": ffi.string(lib.ggml_commit()).decode(),
        "type_names": types,
        "bf16_attention_supported": pyggml_dkv.ggml.capabilities.bf16_attention_supported(),
        "backends": [(b.name, b.available) for b in pyggml_dkv.ggml.available_backends()],
        "devices": [(d["name"], d["registry"]) for d in pyggml_dkv.ggml.list_devices()],
    }


def load_llama(model_path: str) -> Any:
    import llama_cpp

    return llama_cpp.Llama(
        model_path=model_path,
        n_ctx=N_CTX,
        n_batch=N_CTX,
        n_threads=1,
        n_threads_batch=1,
        seed=1234,
        logits_all=True,
        verbose=False,
    )


def greedy(llm: Any) -> dict[str, Any]:
    """N_NEW greedy tokens after PROMPT, and the sha256 of the logits of every evaluated position."""
    import numpy as np

    llm.reset()
    prompt = llm.tokenize(PROMPT)
    tokens = []
    for token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        tokens.append(int(token))
        if len(tokens) == N_NEW:
            break
    scores = np.ascontiguousarray(llm.scores[: llm.n_tokens])
    return {"tokens": tokens, "logits_sha256": hashlib.sha256(scores.tobytes()).hexdigest()}


def mapped_ggml_libraries() -> list[str]:
    """The ggml shared libraries mapped into this process (/proc/self/maps)."""
    found = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if "libggml" in os.path.basename(path):
            found.add(path)
    return sorted(found)


def run(case: str, out_path: str, model_path: str = "") -> None:
    """Run one case and write its results to out_path (JSON)."""
    if case not in CASES:
        raise ValueError(f"unknown case {case!r}; one of {CASES}")
    result: dict[str, Any] = {"case": case}
    pyggml = lowlevel = llm = None
    if case == "llama_ggml_global_first":
        result["preloaded"] = load_llama_ggml_global()
    if case == "pyggml_global_first":
        pyggml, lowlevel = import_pyggml_global()
    elif case in ("isolated_pyggml", "pyggml_then_llama", "llama_ggml_global_first"):
        pyggml, lowlevel = import_pyggml()
    if case != "isolated_pyggml":
        import llama_cpp  # noqa: F401  (the import itself is one of the orders under test)

        llm = load_llama(model_path)
    if case == "llama_then_pyggml":
        pyggml, lowlevel = import_pyggml()
    # compute with both, interleaved: each must be unaffected by the other's kernels and state
    if pyggml is not None:
        result["ggml"] = ggml_answers(pyggml, lowlevel)
        result["trajectory"] = trajectory(pyggml)
    if llm is not None:
        result["llama"] = greedy(llm)
    if pyggml is not None and llm is not None:
        result["trajectory_again"] = trajectory(pyggml)
        result["llama_again"] = greedy(llm)
    result["mapped_ggml_libraries"] = mapped_ggml_libraries()
    Path(out_path).write_text(json.dumps(result, indent=1))


def tiles_after_attention(out_path: str, model_path: str) -> None:
    """llama.cpp's batched decode (its AMX products on AMX CPUs), a drafter step with our bf16 attention
    (AMX tiles there), the decode again, a step with bf16 weights (their products on AMX tiles), the
    decode again: the logits' sha256 to `out_path`. llama_cpp.Llama's own eval, as a host that drives
    llama.cpp itself would (LlamaTarget reloads the tiles before each decode anyway). One thread, so
    both run on this one; 40 tokens, since llama.cpp takes AMX for batches only (one token: VNNI)."""
    import numpy as np

    from pyggml_dkv import Backend, DraftConfig, DraftKvCache, DraftWeights, FeatureRing

    llm = load_llama(model_path)
    tokens = llm.tokenize(b"The quick brown fox jumps over the lazy dog. " * 4)[:40]

    def logits_sha256() -> str:
        llm.reset()
        llm.eval(tokens)
        return hashlib.sha256(np.ascontiguousarray(llm.scores[: len(tokens)]).tobytes()).hexdigest()

    before = logits_sha256()
    cfg = DraftConfig(**TOY)
    rng = np.random.default_rng(1)
    ring = FeatureRing(max(COMMITS), cfg.fc_in)
    ring.append(rng.standard_normal((max(COMMITS), cfg.fc_in)).astype(np.float32))
    noise = rng.standard_normal((cfg.block_size, cfg.hidden)).astype(np.float32)
    after = {}
    # bf16 attention on AMX tiles (0009 / 0028), then bf16 weights' products on them (0029)
    from pyggml_dkv.ggml.capabilities import bf16_attention_supported

    runs = (("f16", "bf16"), ("bf16", "f32")) if bf16_attention_supported() else (("bf16", "f32"),)
    for weights, attention in runs:
        with (
            Backend("cpu", n_threads=1) as cpu,
            DraftWeights.random(cfg, seed=0).to_backend(cpu, weights) as bw,
            DraftKvCache(bw, cpu, CAP, attention=attention) as cache,
        ):
            cache.step(ring, COMMITS[0], noise)
        after[f"{weights} weights, {attention} attention"] = logits_sha256()
    llm.close()
    Path(out_path).write_text(json.dumps({"before": before, "after": after}))


def tiles_after_torch(out_path: str, model_path: str) -> None:
    """llama.cpp's batched decode, a PyTorch bf16 matmul on this thread (oneDNN on AMX-BF16 where the
    CPU has it, which releases the tiles after), the same decode again: both logits' sha256."""
    import numpy as np
    import torch

    from pyggml_dkv.hosts.llama_cpp import LlamaTarget

    torch.set_num_threads(1)
    with LlamaTarget(model_path, n_ctx=N_CTX, n_batch=N_CTX, n_threads=1) as target:
        tokens = target.tokenize("The quick brown fox jumps over the lazy dog. " * 4)[:40]

        def logits_sha256() -> str:
            target.clear()
            return hashlib.sha256(np.ascontiguousarray(target.decode(tokens, logits="all")).tobytes()).hexdigest()

        before = logits_sha256()
        x = torch.randn(64, 512, dtype=torch.bfloat16)
        float((x @ x.T).float().sum())
        Path(out_path).write_text(json.dumps({"before": before, "after": logits_sha256()}))
