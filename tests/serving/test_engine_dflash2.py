"""SpeculativeEngine with a DFlash-2 drafter, loaded as the server loads one (a GGUF through
DraftWeights.from_pretrained): concurrent greedy requests in lanes equal each request decoded
alone, drafts are accepted, and sampled requests draw from the selector's lattice."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="the llama.cpp host needs llama-cpp-python (pip install -e '.[llama]')")
pytest.importorskip("gguf", reason="writing the DFlash-2 GGUF needs the gguf package")

from pyggml_dkv import Backend, DraftWeights  # noqa: E402
from pyggml_dkv.hosts.llama_cpp import LlamaTarget, compare_to_plain, ggml_drafter, plain_greedy  # noqa: E402
from pyggml_dkv.hosts.llama_cpp.batched_target import BatchedLlamaTarget  # noqa: E402
from pyggml_dkv.hosts.llama_cpp.drafters import lifted_smollm2_dflash2  # noqa: E402
from pyggml_dkv.model.gguf_write import save_gguf  # noqa: E402
from pyggml_dkv.serving.engine import RequestParams, SpeculativeEngine  # noqa: E402
from pyggml_dkv.serving.policy import FixedPolicy  # noqa: E402
from tests.hosts.hosts_helpers import PROMPTS, THREADS, smollm2_path  # noqa: E402

pytestmark = pytest.mark.slow  # loads SmolLM2 in llama.cpp: the slow tier (pytest -m 'not slow' skips it)

NEAR_TIE = 0.5
MAX = 24
PARALLEL = 4


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> DraftWeights:
    path = Path(tmp_path_factory.mktemp("dflash2")) / "smollm2-dflash2.gguf"
    save_gguf(lifted_smollm2_dflash2(seed=4), path, dtype="q8_0", vocab_from=smollm2_path())
    w = DraftWeights.from_pretrained(path)
    assert w.cfg.is_dflash2
    return w


@pytest.fixture(scope="module")
def target(weights: DraftWeights) -> Iterator[BatchedLlamaTarget]:
    with BatchedLlamaTarget(
        smollm2_path(), n_parallel=PARALLEL, n_ctx=1024, n_threads=THREADS, capture_layers=weights.cfg.target_layer_ids
    ) as t:
        yield t


@pytest.fixture(scope="module")
def drafter(weights: DraftWeights) -> Iterator[Any]:
    backend = Backend("cpu", n_threads=THREADS)
    d = ggml_drafter(weights, str(smollm2_path()), backend=backend, cap=256, lanes=PARALLEL)
    yield d
    d.close()
    backend.close()


def test_concurrent_greedy_requests_equal_each_alone(target: BatchedLlamaTarget, drafter: Any) -> None:
    prompts = [target.tokenize(target.chat_prompt(p)) for p in PROMPTS]
    with LlamaTarget(smollm2_path(), n_ctx=512, n_threads=THREADS) as alone:
        refs = [plain_greedy(alone, p, MAX) for p in prompts]
    engine = SpeculativeEngine(target, drafter, policy=FixedPolicy(7))
    try:
        results = [
            h.result(timeout=180)
            for h in [engine.submit(p, RequestParams(max_tokens=MAX, record_gaps=True)) for p in prompts]
        ]
    finally:
        assert engine.shutdown(10)
    for res, ref in zip(results, refs):
        cmp = compare_to_plain(res, ref, NEAR_TIE)
        assert cmp["lossless"], cmp
    assert sorted(r.stats.lane for r in results) == [0, 1, 2, 3]
    accepted = sum(sum(r.stats.accepted) for r in results)
    emitted = sum(sum(r.stats.emitted) for r in results)
    assert accepted > emitted // 4, (accepted, emitted)  # the drafts are good: a quarter of the tokens or more


def test_sampled_requests_run_in_lanes(target: BatchedLlamaTarget, drafter: Any) -> None:
    """Sampled requests beside a greedy one: each lane walks its own lattice at its own
    temperature; the same seeded workload gives the same tokens twice."""
    prompt = target.tokenize(target.chat_prompt(PROMPTS[0]))
    params = [RequestParams(max_tokens=12, temperature=0.8, top_k=20, seed=s) for s in (1, 2, 3)] + [
        RequestParams(max_tokens=12)
    ]
    runs = []
    for _ in range(2):
        engine = SpeculativeEngine(target, drafter, policy=FixedPolicy(5))
        try:
            runs.append([h.result(timeout=180) for h in [engine.submit(prompt, p) for p in params]])
        finally:
            assert engine.shutdown(10)
    for a, b in zip(*runs):
        assert np.array_equal(a.tokens, b.tokens)
    assert len({tuple(r.tokens) for r in runs[0][:3]}) == 3  # three seeds, three samples
    assert sum(sum(r.stats.draft_lengths) for r in runs[0]) > 0
