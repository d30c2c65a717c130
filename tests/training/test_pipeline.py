"""The training pipeline end to end on the real target (SmolLM2 through our llama.cpp host):

- data generation: shards hold what the host captures, greedy flags say which tokens are the
  target's argmax, generation resumes and refuses another recipe;
- a tiny drafter trained for about a minute: the loss falls and its replayed acceptance beats
  random weights; a run stopped and resumed equals the run done at once.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="data generation runs the target through llama-cpp-python")
torch = pytest.importorskip("torch", reason="training needs torch (pip install -e '.[torch]')")
pytest.importorskip("dflash", reason="training uses the dflash package's model class")

from pyggml_dkv import DraftWeights  # noqa: E402
from pyggml_dkv.hosts.llama_cpp import SMOLLM2_LAYER_IDS, LlamaTarget, smollm2_draft_config  # noqa: E402
from pyggml_dkv.training.config import TrainConfig  # noqa: E402
from pyggml_dkv.training.data import DataRecipe, generate, load_corpus  # noqa: E402
from pyggml_dkv.training.evaluate import offline_acceptance  # noqa: E402
from pyggml_dkv.training.model import load_weights, new_model  # noqa: E402
from pyggml_dkv.training.prompts import HELD_OUT_PROMPTS, training_prompts  # noqa: E402
from pyggml_dkv.training.train import frozen_from_gguf, train  # noqa: E402
from tests.hosts.hosts_helpers import THREADS, smollm2_path  # noqa: E402

pytestmark = pytest.mark.slow  # generates data through llama.cpp and trains: the slow tier

N_PROMPTS = 16
MAX_NEW = 40


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    recipe = DataRecipe(
        model=str(smollm2_path()), layer_ids=list(SMOLLM2_LAYER_IDS), max_new_tokens=MAX_NEW, shard_sequences=8
    )
    counts = generate(out, training_prompts()[:N_PROMPTS], recipe, kinds=("greedy", "warm"), n_threads=THREADS)
    assert counts["sequences"] == 2 * N_PROMPTS
    return out, recipe


def test_the_prompt_sets_are_disjoint_and_of_other_kinds():
    train_set = set(training_prompts())
    assert len(train_set) == len(training_prompts()) > 1500
    assert not train_set & set(HELD_OUT_PROMPTS)
    assert len(HELD_OUT_PROMPTS) >= 40
    assert training_prompts(0) != training_prompts(1) and sorted(training_prompts(0)) == sorted(training_prompts(1))


def test_shards_hold_what_the_host_captures_with_honest_greedy_flags(data_dir):
    out, recipe = data_dir
    corpus = load_corpus(out)
    assert corpus.n_sequences == 2 * N_PROMPTS
    assert corpus.features.dtype == np.float32 and corpus.features.shape == (corpus.tokens.size, 5 * 576)
    with LlamaTarget(smollm2_path(), n_ctx=512, n_threads=THREADS, capture_layers=SMOLLM2_LAYER_IDS) as t:
        for i in (0, N_PROMPTS):  # a greedy and a warm sequence
            tokens, feats, greedy, plen = corpus.sequence(i)
            assert not greedy[:plen].any()  # prompt tokens are never labels
            logits = t.decode(tokens, logits="all")  # one batch: other shapes than generation used
            argmax = np.argmax(logits[:-1], axis=1)
            gap = np.sort(logits[:-1], axis=1)[:, -1] - np.sort(logits[:-1], axis=1)[:, -2]
            flagged = greedy[1:]
            clear = gap > 0.5  # away from near-ties that batch-shape rounding may flip
            assert (argmax[flagged & clear] == tokens[1:][flagged & clear]).all()
            assert (argmax[~flagged & clear][plen:] != tokens[1:][~flagged & clear][plen:]).all()
            err = np.abs(t.capture.features() - feats).max() / np.abs(feats).max()
            assert err < 1e-2, err
            t.clear()
    warm = corpus.greedy[corpus.starts[N_PROMPTS] :]
    assert warm.sum() < warm.size  # the warm kind samples some tokens


def test_generation_resumes_and_refuses_another_recipe(data_dir):
    out, recipe = data_dir
    again = generate(out, training_prompts()[:N_PROMPTS], recipe, n_threads=THREADS)
    assert again["sequences"] == 0 and again["skipped_done"] == 2 * N_PROMPTS
    other = DataRecipe(**{**recipe.__dict__, "max_new_tokens": MAX_NEW + 1})
    with pytest.raises(ValueError, match="another recipe"):
        generate(out, training_prompts()[:N_PROMPTS], other, n_threads=THREADS)


def tiny_run(data, out, **changes) -> TrainConfig:
    draft = smollm2_draft_config(n_layer=1, block_size=6, mask_token_id=16).to_dict()
    fields = dict(
        data=[str(data)],
        out=str(out),
        model=str(smollm2_path()),
        draft=draft,
        epochs=12.0,
        seqs_per_step=4,
        anchors_per_seq=16,
        lr=2e-3,
        warmup_steps=5,
        threads=THREADS,
        log_every=4,
        save_every=1000,
    )
    fields.update(changes)
    return TrainConfig(**fields)


def test_a_tiny_drafter_learns_in_about_a_minute(data_dir, tmp_path):
    out, _ = data_dir
    cfg = tiny_run(out, tmp_path / "run")
    last = train(cfg)
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert losses[-1] < 0.6 * losses[0], losses
    frozen = frozen_from_gguf(cfg.model)
    corpus = load_corpus(out)
    trained = DraftWeights.from_pretrained(tmp_path / "run" / "drafter")
    model = new_model(trained.cfg, 0)
    load_weights(model, trained)
    ours = offline_acceptance(model, frozen, corpus)
    rand = offline_acceptance(new_model(trained.cfg, 1), frozen, corpus)
    print("trained", ours, "random", rand, "last", last)
    assert rand["tokens_per_round"] < 1.05
    assert ours["tokens_per_round"] > rand["tokens_per_round"] + 0.05


def test_a_stopped_and_resumed_run_equals_one_done_at_once(data_dir, tmp_path):
    out, _ = data_dir
    once = tiny_run(out, tmp_path / "once", epochs=1.0)
    train(once, max_steps=6)
    split = tiny_run(out, tmp_path / "split", epochs=1.0)
    train(split, max_steps=3)
    train(split, max_steps=3)
    a = torch.load(tmp_path / "once" / "state.pt", weights_only=False)
    b = torch.load(tmp_path / "split" / "state.pt", weights_only=False)
    assert a["step"] == b["step"] == 6
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    with pytest.raises(ValueError, match="another recipe"):
        train(tiny_run(out, tmp_path / "once", lr=1e-4), max_steps=1)


def test_the_command_line_generates_trains_evaluates_and_exports(tmp_path, capsys):
    from pyggml_dkv.training.__main__ import main

    data, run, gguf = tmp_path / "data", tmp_path / "run", tmp_path / "d.gguf"
    common = ["--model", str(smollm2_path()), "--threads", str(THREADS)]
    assert (
        main(["generate", "--out", str(data), "--prompts", "2", "--max-new-tokens", "8", "--kinds", "greedy", *common])
        == 0
    )
    assert json.loads((data / "data.json").read_text())["recipe"]["prompt_set"] == "training"
    assert (
        main(
            [
                "train",
                "--data",
                str(data),
                "--out",
                str(run),
                "--layers",
                "1",
                "--seqs-per-step",
                "2",
                "--epochs",
                "2",
                "--warmup",
                "1",
                "--save-every",
                "1",
                *common,
            ]
        )
        == 0
    )
    assert main(["export", "--drafter", str(run / "drafter"), "--out", str(gguf), "--model", str(smollm2_path())]) == 0
    capsys.readouterr()
    assert main(["evaluate", "--drafter", str(gguf), "--data", str(data), "--model", str(smollm2_path())]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["sequences"] == 2 and result["tokens_per_round"] >= 1.0
    assert DraftWeights.from_pretrained(gguf).cfg.n_layer == 1
