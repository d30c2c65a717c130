"""Bad input gets a clear exception before any decode."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="the llama.cpp host needs llama-cpp-python (pip install -e '.[llama]')")

from pyggml_dkv.hosts.llama_cpp import (  # noqa: E402
    GenerationConfig,
    GGUFFile,
    HostClosedError,
    HostError,
    IncompatibleDrafterError,
    LlamaTarget,
    OracleDrafter,
    SpeculativeGenerator,
    check_fits_gguf,
    smollm2_draft_config,
)
from pyggml_dkv.hosts.llama_cpp.gguf import GGUFError  # noqa: E402
from tests.hosts.hosts_helpers import THREADS, smollm2_path  # noqa: E402

pytestmark = pytest.mark.slow  # loads SmolLM2 in llama.cpp: the slow tier (pytest -m 'not slow' skips it)

CFG = smollm2_draft_config()


@pytest.fixture(scope="module")
def target():
    t = LlamaTarget(smollm2_path(), n_ctx=128, n_batch=32, n_threads=THREADS, capture_layers=CFG.target_layer_ids)
    yield t
    t.close()


def no_decode_since(target: LlamaTarget, before: float) -> bool:
    return target.decode_seconds == before and target.n_past == 0


def test_drafter_that_does_not_fit_the_gguf() -> None:
    gguf = GGUFFile(smollm2_path())
    check_fits_gguf(CFG, 49152, gguf)  # the shipped shape fits
    with pytest.raises(IncompatibleDrafterError, match="hidden size 512.*has 576"):
        check_fits_gguf(smollm2_draft_config(hidden=512, head_dim=64, n_head=8, n_head_kv=4), 49152, gguf)
    with pytest.raises(IncompatibleDrafterError, match=r"\[30, 40\] are out of range.*30 layers"):
        check_fits_gguf(smollm2_draft_config(target_layer_ids=[1, 8, 15, 30, 40]), 49152, gguf)
    with pytest.raises(IncompatibleDrafterError, match="vocab has 32000 tokens.*49152"):
        check_fits_gguf(CFG, 32000, gguf)


def test_generator_refuses_before_any_decode(target) -> None:
    target.clear()
    before = target.decode_seconds
    wrong_hidden = smollm2_draft_config(hidden=512, n_head=8, n_head_kv=4)
    with pytest.raises(IncompatibleDrafterError, match="hidden size"):
        SpeculativeGenerator(target, OracleDrafter(wrong_hidden, target.n_vocab, []))
    with pytest.raises(IncompatibleDrafterError, match="vocab"):
        SpeculativeGenerator(target, OracleDrafter(CFG, 32000, []))
    with pytest.raises(IncompatibleDrafterError, match="out of range"):
        SpeculativeGenerator(
            target, OracleDrafter(smollm2_draft_config(target_layer_ids=[1, 8, 15, 22, 31]), target.n_vocab, [])
        )
    with pytest.raises(HostError, match="must capture the drafter's layers"):
        SpeculativeGenerator(
            target, OracleDrafter(smollm2_draft_config(target_layer_ids=[1, 8, 15, 22, 27]), target.n_vocab, [])
        )
    gen = SpeculativeGenerator(target, OracleDrafter(CFG, target.n_vocab, []))
    for prompt, match in (([], "empty"), ([5, 49152], "token ids"), (np.ones(400, int), "n_ctx")):
        with pytest.raises(HostError, match=match):
            gen.generate(prompt)
    with pytest.raises(HostError, match="max_tokens"):
        gen.generate([1, 2, 3], GenerationConfig(max_tokens=0))
    with pytest.raises(HostError, match="temperature"):
        gen.generate([1, 2, 3], GenerationConfig(temperature=-1.0))
    assert no_decode_since(target, before)


def test_target_refuses_bad_layers_and_files(tmp_path) -> None:
    with pytest.raises(HostError, match=r"\[30\] are out of range.*30 layers"):
        LlamaTarget(smollm2_path(), n_ctx=64, capture_layers=(5, 30))
    with pytest.raises(HostError, match="no such model file"):
        LlamaTarget(tmp_path / "missing.gguf")
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(bogus)


def test_closed_host() -> None:
    t = LlamaTarget(smollm2_path(), n_ctx=64, n_batch=32, n_threads=THREADS, capture_layers=CFG.target_layer_ids)
    gen = SpeculativeGenerator(t, OracleDrafter(CFG, t.n_vocab, []))
    t.close()
    t.close()  # idempotent
    with pytest.raises(HostClosedError):
        t.decode([1, 2])
    with pytest.raises(HostError, match="closed"):
        gen.generate([1, 2, 3])
    with pytest.raises(HostError, match="closed"):
        SpeculativeGenerator(t, OracleDrafter(CFG, 49152, []))
