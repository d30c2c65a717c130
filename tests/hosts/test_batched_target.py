"""BatchedLlamaTarget: rows of several sequences in one decode give each sequence what it gets
alone (logits and captured features, row for row), with a unified KV cache and with one stream
per sequence; positions, seq ids and tokens are checked before llama.cpp sees them."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="the llama.cpp host needs llama-cpp-python (pip install -e '.[llama]')")

from pyggml_dkv.hosts.llama_cpp import HostError, LlamaTarget  # noqa: E402
from pyggml_dkv.hosts.llama_cpp.batched_target import BatchedLlamaTarget, Block  # noqa: E402
from pyggml_dkv.hosts.smollm2 import SMOLLM2_LAYER_IDS  # noqa: E402
from tests.hosts.hosts_helpers import PROMPTS, THREADS, smollm2_path  # noqa: E402

pytestmark = pytest.mark.slow  # loads SmolLM2 in llama.cpp: the slow tier (pytest -m 'not slow' skips it)

LAYERS = list(SMOLLM2_LAYER_IDS)


@pytest.fixture(scope="module")
def single() -> Iterator[LlamaTarget]:
    with LlamaTarget(smollm2_path(), n_ctx=512, n_threads=THREADS, capture_layers=LAYERS) as t:
        yield t


def alone(t: LlamaTarget, prompt: np.ndarray, step: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Logits and features of the prompt's last row, then of a block `step` after it."""
    t.clear()
    lp = np.array(t.decode(prompt, logits="last"))
    fp = t.capture.features().copy()
    ls = np.array(t.decode(step, logits="all"))
    return lp, fp, ls, t.capture.features().copy()


@pytest.mark.parametrize("kv_unified", [True, False])
def test_several_sequences_in_one_batch_match_each_alone(single: LlamaTarget, kv_unified: bool) -> None:
    with BatchedLlamaTarget(
        smollm2_path(), n_parallel=4, n_ctx=1024, n_threads=THREADS, capture_layers=LAYERS, kv_unified=kv_unified
    ) as bt:
        prompts = {s: bt.tokenize(bt.chat_prompt(PROMPTS[s])) for s in (3, 0, 1)}
        rows = bt.decode_blocks([Block(s, p, "last") for s, p in prompts.items()])  # seq 3 first, seq 2 absent
        got = {r.seq_id: (np.array(r.logits[-1]), bt.features(r).copy()) for r in rows}
        steps = {3: [100, 200, 300, 400], 0: [500], 1: [600, 700]}  # verify blocks of unequal lengths
        rows = bt.decode_blocks([(s, t, "all") for s, t in steps.items()])
        for r in rows:
            lp, fp, ls, fs = alone(single, prompts[r.seq_id], steps[r.seq_id])
            assert r.pos == prompts[r.seq_id].size and r.logits.shape == (len(steps[r.seq_id]), bt.n_vocab)
            np.testing.assert_allclose(got[r.seq_id][0], lp[-1], atol=2e-3)
            np.testing.assert_allclose(got[r.seq_id][1], fp, atol=2e-3)
            np.testing.assert_allclose(r.logits, ls, atol=2e-3)
            np.testing.assert_allclose(bt.features(r), fs, atol=2e-3)
            assert bt.n_past_of(r.seq_id) == prompts[r.seq_id].size + len(steps[r.seq_id])
        # reject the drafts of seq 3 past the first; it continues from there as if alone
        bt.truncate(3, prompts[3].size + 1)
        out = bt.decode([7, 8], [3, 3], positions=[prompts[3].size + 1, prompts[3].size + 2], logits=[False, True])
        single.clear()
        single.decode(prompts[3], logits="none")
        ref = single.decode([100, 7, 8], logits="last")
        np.testing.assert_allclose(out[-1], ref[-1], atol=2e-3)
        bt.clear_seq(0)
        assert bt.n_past_of(0) == 0 and bt.n_past_of(3) == prompts[3].size + 3


def test_inputs_are_checked() -> None:
    with BatchedLlamaTarget(
        smollm2_path(), n_parallel=2, n_ctx=256, n_batch=32, n_threads=THREADS, capture_layers=LAYERS
    ) as bt:
        assert bt.n_ctx_seq == 128
        bt.decode([1, 2, 3], [0, 0, 1])
        with pytest.raises(HostError, match="must continue at position 2"):
            bt.decode([4], [0], positions=[3])
        with pytest.raises(HostError, match="seq ids"):
            bt.decode([4], [2])
        with pytest.raises(HostError, match="token ids"):
            bt.decode([bt.n_vocab], [0])
        with pytest.raises(HostError, match="1..32 rows"):
            bt.decode(np.ones(33, dtype=np.int64), np.zeros(33, dtype=np.int64))
        with pytest.raises(HostError, match="booleans"):
            bt.decode([4], [0], logits=[True, False])
        with pytest.raises(HostError, match="exceed"):
            for _ in range(5):
                bt.decode(np.ones(30, dtype=np.int64), np.zeros(30, dtype=np.int64))
        with pytest.raises(HostError, match="truncate"):
            bt.truncate(1, 2)
        with pytest.raises(HostError, match="seq_id"):
            bt.clear_seq(-1)
        with pytest.raises(HostError, match="Block"):
            bt.decode_blocks([object()])  # type: ignore[list-item]
        assert bt.n_past_of(1) == 1  # nothing refused touched the cache
    with pytest.raises(HostError, match="kv_unified"):
        BatchedLlamaTarget(
            smollm2_path(),
            n_parallel=2,
            n_ctx=256,
            n_threads=THREADS,
            capture_layers=LAYERS,
            capture="callback",
            kv_unified=False,
        )


@pytest.mark.parametrize("route", ["native", "callback"])
def test_a_decode_without_capture_is_a_plain_decode(route: str) -> None:
    """capture=False: the same logits, no features; capture resumes at the next decode asking."""
    prompt = np.arange(300, 340, dtype=np.int64)
    with BatchedLlamaTarget(
        smollm2_path(), n_parallel=2, n_ctx=512, n_threads=THREADS, capture_layers=LAYERS, capture=route
    ) as bt:
        with_cap = bt.decode_blocks([(0, prompt, "all")])
        feats = bt.features(with_cap[0]).copy()
        logits = with_cap[0].logits.copy()
        without = bt.decode_blocks([(1, prompt, "all")], capture=False)
        np.testing.assert_array_equal(without[0].logits, logits)
        with pytest.raises(HostError, match="not captured"):
            bt.features(without[0])
        bt.clear()
        again = bt.decode_blocks([(1, prompt, "none")])
        np.testing.assert_array_equal(bt.features(again[0]), feats)
