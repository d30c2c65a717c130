"""llama.cpp's native DFlash drafter with several sequences in one context, as llama.cpp's server
drafts its slots (one common_speculative, n_seq = n_parallel): one packed inject and one packed
noise decode per step must keep the sequences apart (each equals its single-sequence run), and
the packed step benchmark runs."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="the llama.cpp host needs llama-cpp-python (pip install -e '.[llama]')")
pytest.importorskip("gguf", reason="writing a GGUF drafter needs the gguf package")

from pyggml_dkv.hosts.llama_cpp.native_dflash import (  # noqa: E402
    llama_dflash_bench,
    llama_dflash_trajectory,
    llama_dflash_trajectory_seqs,
)
from pyggml_dkv.model.config import DraftConfig  # noqa: E402
from pyggml_dkv.model.weights import DraftWeights  # noqa: E402
from tests.hosts.hosts_helpers import smollm2_path  # noqa: E402

pytestmark = pytest.mark.slow  # loads SmolLM2 in llama.cpp: the slow tier (pytest -m 'not slow' skips it)

log = logging.getLogger(__name__)

N_VOCAB = 49152  # SmolLM2's vocabulary: the GGUF takes its tokenizer from the target
TINY = dict(hidden=64, n_layer=2, n_head=4, n_head_kv=2, head_dim=32, ffn=96, block_size=4, n_target_layers=2)
TOL = 1e-3  # max|packed - single| / max|single|: the same arithmetic on differently shaped batches


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, DraftConfig]:
    """A tiny dflash GGUF (random f16 weights, SmolLM2 vocabulary) that llama.cpp loads."""
    target = smollm2_path()
    cfg = DraftConfig(**TINY, vocab=N_VOCAB, mask_token_id=2, target_layer_ids=[1, 5])
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((N_VOCAB, cfg.hidden), dtype=np.float32)
    head = rng.standard_normal((N_VOCAB, cfg.hidden), dtype=np.float32) / np.float32(np.sqrt(cfg.hidden))
    w = DraftWeights(cfg, dict(DraftWeights.random(cfg, seed=0)), embed_tokens=emb, lm_head=head)
    path = w.save_pretrained(
        tmp_path_factory.mktemp("dflash") / "tiny.gguf", format="gguf", dtype="f16", vocab_from=target
    )
    return Path(path), cfg


def commits_trajectory(rng: np.random.Generator, cap: int, q_len: int, n: int, first: int) -> list[int]:
    """Committed counts over n steps: small accepts, rewinds (rejected drafts), long jumps past the window."""
    c, out = first, []
    for _ in range(n):
        out.append(c)
        r = rng.random()
        if r < 0.2 and c > q_len:
            c -= int(rng.integers(1, q_len))
        elif r < 0.35:
            c += int(rng.choice([2 * q_len + 3, cap + 5]))
        else:
            c += int(rng.integers(1, q_len + 1))
    return out


@pytest.mark.parametrize("flash_attn", [False, True])
def test_packed_sequences_equal_single_runs(tiny_gguf: tuple[Path, DraftConfig], flash_attn: bool) -> None:
    """Three sequences (own features, own commits with rewinds and jumps, own noise tokens)
    drafted together: each one's logits equal those of a context that holds it alone."""
    path, cfg = tiny_gguf
    n_seq, steps, cap, q_len = 3, 12, 24, cfg.block_size
    rng = np.random.default_rng(7)
    commits = np.array([commits_trajectory(rng, cap, q_len, steps, first=3 + 4 * s) for s in range(n_seq)]).T
    feats = rng.standard_normal((n_seq, int(commits.max()) + 1, cfg.fc_in)).astype(np.float32)
    tokens = np.full((steps, n_seq, q_len), cfg.mask_token_id, dtype=np.int32)
    tokens[:, :, 0] = rng.integers(0, N_VOCAB, size=(steps, n_seq))

    packed = llama_dflash_trajectory_seqs(path, feats, commits, tokens, cap, flash_attn=flash_attn)
    assert packed.shape == (steps, n_seq, q_len, N_VOCAB)
    worst = 0.0
    for s in range(n_seq):
        single = llama_dflash_trajectory(
            path, feats[s], [int(c) for c in commits[:, s]], tokens[:, s], cap, flash_attn=flash_attn
        )
        err = float(np.max(np.abs(packed[:, s] - single)) / np.max(np.abs(single)))
        log.info("sequence %d: packed vs single max|a-b|/max|b| = %.3g", s, err)
        worst = max(worst, err)
    assert np.isfinite(packed).all()
    # the sequences are really different drafts (not one sequence's result copied to all)
    assert np.max(np.abs(packed[:, 0] - packed[:, 1])) > 100 * TOL * np.max(np.abs(packed[:, 0]))
    assert worst <= TOL, worst


def test_packed_bench(tiny_gguf: tuple[Path, DraftConfig]) -> None:
    path, cfg = tiny_gguf
    times = llama_dflash_bench(
        path, [16, 48], fc_in=cfg.fc_in, q_len=cfg.block_size, n_new=3, reps=2, warmup=1, threads=1, n_seq=2
    )
    assert sorted(times) == [16, 48]
    assert all(len(t) == 2 and all(np.isfinite(x) and x > 0 for x in t) for t in times.values()), times


@pytest.mark.parametrize("n_seq", [0, -1, 1.5, True])
def test_bench_refuses_bad_n_seq(n_seq: object) -> None:
    with pytest.raises(ValueError, match="n_seq"):
        llama_dflash_bench("unused.gguf", [8], fc_in=128, q_len=4, n_seq=n_seq)  # type: ignore[arg-type]
