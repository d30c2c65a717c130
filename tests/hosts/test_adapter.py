"""The drafter inside llama-cpp-python's own Llama.generate() (Llama(draft_model=...))."""

from __future__ import annotations

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
    plain_greedy,
    smollm2_draft_config,
)
from tests.hosts.hosts_helpers import PROMPTS, THREADS, smollm2_path  # noqa: E402

pytestmark = pytest.mark.slow  # loads SmolLM2 in llama.cpp: the slow tier (pytest -m 'not slow' skips it)

CFG = smollm2_draft_config()
N_NEW = 40
NEAR_TIE = 0.5


def greedy_tokens(llm, prompt: np.ndarray, n: int) -> list[int]:
    out = []
    for tok in llm.generate(prompt.tolist(), top_k=1, temp=0.0, repeat_penalty=1.0, min_p=0.0, top_p=1.0):
        if llama_cpp.llama_vocab_is_eog(llama_cpp.llama_model_get_vocab(llm.model), tok):
            break
        out.append(int(tok))
        if len(out) >= n:
            break
    return out


def test_llama_generate_with_the_adapter() -> None:
    path = smollm2_path()
    with LlamaTarget(path, n_ctx=512, n_threads=THREADS) as plain_target:
        # all four: which prompts meet a near-tie that batch and single-token decodes round apart
        # depends on the CPU (on a Zen 5 the first two diverge at gaps of 0.06 and 0.002)
        prompts = [plain_target.tokenize(plain_target.chat_prompt(p)) for p in PROMPTS]
        refs = [plain_greedy(plain_target, p, N_NEW) for p in prompts]
    drafter = OracleDrafter(CFG, 49152, [], seed=0)
    adapter = DFlashLlamaDraftModel(drafter)
    llm = llama_cpp.Llama(
        str(path),
        draft_model=adapter,
        logits_all=True,
        n_ctx=512,
        n_batch=64,
        n_threads=THREADS,
        n_threads_batch=THREADS,
        verbose=False,
    )
    try:
        with pytest.raises(HostError, match="call attach"):
            adapter(np.array([1, 2, 3], dtype=np.intc))
        adapter.attach(llm)
        identical = 0
        for prompt, ref in zip(prompts, refs):  # more prompts on the same Llama and adapter
            drafter.reference = np.concatenate([prompt, ref.tokens])
            decodes_before = adapter.decodes
            got = np.array(greedy_tokens(llm, prompt, N_NEW))
            n = min(got.size, ref.tokens.size)
            diff = np.nonzero(got[:n] != ref.tokens[:n])[0]
            # lossless up to batch-shape rounding: equal, or first divergence at a near-tie
            assert diff.size == 0 or ref.gaps[diff[0]] < NEAR_TIE, (diff[0], ref.gaps[diff[0]])
            assert got.size >= min(N_NEW, ref.tokens.size) or diff.size
            if diff.size == 0:
                # the drafts were used: far fewer decodes than tokens. (After a divergence the oracle,
                # which drafts the reference, has nothing to offer: on an AMX CPU llama.cpp verifies
                # batches on AMX and decodes single tokens on VNNI, and the first prompt's second token
                # is a 0.13 near-tie that the two round differently.)
                identical += 1
                assert adapter.decodes - decodes_before < 0.6 * got.size
        assert identical >= 1
        assert adapter.proposals > 0
        assert max(drafter.lengths) > 0
    finally:
        llm.close()


def test_attach_refuses_a_llama_it_cannot_serve() -> None:
    path = smollm2_path()
    adapter = DFlashLlamaDraftModel(OracleDrafter(CFG, 49152, []))
    llm = llama_cpp.Llama(
        str(path), draft_model=adapter, n_ctx=512, n_batch=64, n_threads=THREADS, n_threads_batch=THREADS, verbose=False
    )
    try:
        with pytest.raises(HostError, match="logits_all=True"):
            adapter.attach(llm)
        with pytest.raises(HostError, match="created with draft_model"):
            DFlashLlamaDraftModel(OracleDrafter(CFG, 49152, [])).attach(llm)
    finally:
        llm.close()
