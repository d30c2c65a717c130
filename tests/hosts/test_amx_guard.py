"""The AMX guard: a llama-cpp-python build that would die of SIGILL in its own AMX kernels is found
by a child-process probe, and the host then loads the model without llama.cpp's extra buffers (or,
for a Llama the user made, attach() refuses it) instead of dying. The probe's child is swapped for
one that dies the same way, so the logic is checked on every CPU; the real probe runs on AMX CPUs."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

llama_cpp = pytest.importorskip(
    "llama_cpp", reason="the llama.cpp host needs llama-cpp-python (pip install -e '.[llama]')"
)

from pyggml_dkv.hosts.llama_cpp import (  # noqa: E402
    DFlashLlamaDraftModel,
    HostError,
    LlamaTarget,
    OracleDrafter,
    amx_guard,
    smollm2_draft_config,
)
from tests.hosts.hosts_helpers import THREADS, smollm2_path  # noqa: E402

pytestmark = pytest.mark.slow  # loads SmolLM2 in llama.cpp: the slow tier (pytest -m 'not slow' skips it)

DIES_OF_SIGILL = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"]


@pytest.fixture
def guard(monkeypatch, tmp_path):
    """The guard with an empty verdict cache of its own, on a CPU that (it is told) has AMX."""
    monkeypatch.setattr(amx_guard, "_verdicts", {})
    monkeypatch.setattr(amx_guard, "_cache_file", lambda: tmp_path / "verdicts.json")
    monkeypatch.setattr(amx_guard, "cpu_has_amx", lambda: True)
    monkeypatch.setattr(amx_guard, "llama_has_amx_kernels", lambda: True)
    return tmp_path / "verdicts.json"


def _no_child(_path):
    raise AssertionError("the probe ran again although its verdict was known")


def test_a_build_that_dies_of_sigill_is_loaded_without_extra_buffers(guard, monkeypatch) -> None:
    path = smollm2_path()
    monkeypatch.setattr(amx_guard, "_probe_argv", lambda _p: DIES_OF_SIGILL)
    assert amx_guard.amx_kernels_work(path) is False
    assert amx_guard.model_params(path).use_extra_bufts is False
    assert list(json.loads(guard.read_text()).values()) == [False]  # kept on disk
    # a later process reads the verdict instead of probing again
    monkeypatch.setattr(amx_guard, "_verdicts", {})
    monkeypatch.setattr(amx_guard, "_probe_argv", _no_child)
    assert amx_guard.amx_kernels_work(path) is False
    # the host loads it that way and decodes a batch (llama.cpp's CPU kernels, no AMX buffer)
    with LlamaTarget(path, n_ctx=128, n_batch=64, n_threads=THREADS) as target:
        toks = target.tokenize("The quick brown fox jumps over the lazy dog. " * 3)[:48]
        logits = target.decode(toks, logits="all")
        assert logits.shape == (toks.size, target.n_vocab) and np.isfinite(logits).all()


def test_other_probe_failures_are_not_taken_for_the_amx_bug(guard, monkeypatch) -> None:
    path = smollm2_path()
    monkeypatch.setattr(amx_guard, "_probe_argv", lambda _p: [sys.executable, "-c", "raise SystemExit(3)"])
    assert amx_guard.amx_kernels_work(path) is True
    assert amx_guard.model_params(path).use_extra_bufts is True


def test_no_probe_where_llama_cpp_has_no_amx(guard, monkeypatch) -> None:
    monkeypatch.setattr(amx_guard, "_probe_argv", _no_child)
    monkeypatch.setattr(amx_guard, "llama_has_amx_kernels", lambda: False)
    assert amx_guard.amx_kernels_work(smollm2_path()) is True
    monkeypatch.setattr(amx_guard, "llama_has_amx_kernels", lambda: True)
    monkeypatch.setattr(amx_guard, "cpu_has_amx", lambda: False)
    assert amx_guard.amx_kernels_work(smollm2_path()) is True
    assert not guard.exists()


def test_attach_refuses_a_llama_that_would_die(guard, monkeypatch) -> None:
    path = smollm2_path()
    monkeypatch.setattr(amx_guard, "_probe_argv", lambda _p: DIES_OF_SIGILL)
    adapter = DFlashLlamaDraftModel(OracleDrafter(smollm2_draft_config(), 49152, []))
    # the Llama itself loads (its loader never touches AMX tiles); only its batched decodes would die
    llm = llama_cpp.Llama(
        str(path),
        draft_model=adapter,
        logits_all=True,
        n_ctx=256,
        n_batch=64,
        n_threads=THREADS,
        n_threads_batch=THREADS,
        verbose=False,
    )
    try:
        with pytest.raises(HostError, match="SIGILL.*install_llama_cpp.sh"):
            adapter.attach(llm)
    finally:
        llm.close()


@pytest.mark.skipif(not amx_guard.cpu_has_amx(), reason="the real probe matters on CPUs with AMX only")
def test_the_installed_build_survives_its_amx_kernels() -> None:
    """On an AMX CPU the build scripts/install_llama_cpp.sh makes (what .ci/run installs) runs
    llama.cpp's AMX kernels: the real probe decodes a batch of the Q4_1 model in a child."""
    if not amx_guard.llama_has_amx_kernels():
        pytest.skip("this llama.cpp was compiled without its AMX kernels")
    assert amx_guard.probe(smollm2_path()) is True


def test_a_llama_cpp_child_dying_of_sigill_is_reported_with_the_fix(monkeypatch, tmp_path) -> None:
    """llama.cpp's own DFlash drafter runs in a child (native_dflash.py); its SIGILL is named as such."""
    import os

    from pyggml_dkv.hosts.llama_cpp import native_dflash

    (tmp_path / "dies_of_sigill.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGILL)\n")
    monkeypatch.setattr(native_dflash, "CHILD_MODULE", "dies_of_sigill")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    with pytest.raises(native_dflash.LlamaCppError, match="SIGILL.*install_llama_cpp.sh"):
        native_dflash._run(dict(mode="meta"), {}, 60, env)
