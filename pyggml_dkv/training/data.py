"""Self-distilled training data: the target's own continuations, with the features our host captures.

For each prompt the target (a `LlamaTarget` capturing the drafter's layers, exactly as the
speculative loop captures them) prefills the chat-templated prompt and decodes a continuation one
token at a time. Two kinds of continuation:

- "greedy": every token is the target's argmax, the tokens a greedy verifier accepts;
- "warm": the first `warm_tokens` tokens are sampled (temperature `warm_temperature`), the rest
  greedy. The sampled start sends the greedy tail down another path, so one prompt yields
  several distinct greedy continuations.

Each token is stored with its captured features (float32, as captured) and a flag `greedy`
telling whether it is the target's argmax after its prefix: only such tokens are labels for the
drafter (a sampled token, or a prompt token, is context only).

A data directory holds shards `shard-NNNNN.npz` (tokens int32, features float32 (n, fc_in),
greedy bool, starts/prompt_lengths per sequence, the prompt indices and kinds) and `data.json`
(the recipe). Generation resumes: prompts whose (index, kind) already lie in a shard are skipped.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

KINDS = ("greedy", "warm")


@dataclass
class DataRecipe:
    model: str
    layer_ids: list[int]
    max_new_tokens: int = 256
    warm_tokens: int = 4
    warm_temperature: float = 0.8
    seed: int = 0
    prompt_seed: int = 0
    prompt_set: str = "training"  # "training" or "held-out" (pyggml_dkv.training.prompts)
    shard_sequences: int = 32


@dataclass
class GeneratedSequence:
    """One generated sequence: prompt + continuation, features of every token."""

    prompt_index: int
    kind: str
    tokens: np.ndarray  # (n,) int32
    features: np.ndarray  # (n, fc_in) float32
    greedy: np.ndarray  # (n,) bool: the token is the target's argmax after its prefix
    prompt_length: int


def generate_sequence(
    target,
    prompt_tokens: np.ndarray,
    max_new: int,
    kind: str,
    rng: np.random.Generator,
    warm_tokens: int,
    warm_temperature: float,
    prompt_index: int,
) -> GeneratedSequence:
    """Prefill `prompt_tokens`, decode a continuation of up to `max_new` tokens (ends after the
    first end-of-generation token, which is kept and decoded so that it has features too)."""
    cap = target.capture
    target.clear()
    feats = [np.empty((0, cap.fc_in), np.float32)]
    logits = target.prefill(prompt_tokens, on_chunk=lambda f: feats.append(np.array(f)))
    tokens = list(int(t) for t in prompt_tokens)
    greedy = [False] * len(tokens)
    room = target.n_ctx - len(tokens)
    for i in range(min(max_new, room)):
        if kind == "warm" and i < warm_tokens:
            z = (logits - logits.max()) / warm_temperature
            p = np.exp(z.astype(np.float64))
            token = int(rng.choice(p.size, p=p / p.sum()))
            is_greedy = token == int(np.argmax(logits))
        else:
            token, is_greedy = int(np.argmax(logits)), True
        tokens.append(token)
        greedy.append(is_greedy)
        logits = np.array(target.decode([token], logits="last")[-1])
        feats.append(np.array(cap.features(1)))
        if target.is_eog(token):
            break
    return GeneratedSequence(
        prompt_index,
        kind,
        np.array(tokens, np.int32),
        np.concatenate(feats),
        np.array(greedy, bool),
        int(prompt_tokens.size),
    )


def write_shard(path: Path, seqs: Sequence[GeneratedSequence]) -> None:
    lengths = np.array([s.tokens.size for s in seqs], np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    tmp = path.with_suffix(".tmp.npz")
    np.savez(
        tmp,
        tokens=np.concatenate([s.tokens for s in seqs]),
        features=np.concatenate([s.features for s in seqs]),
        greedy=np.concatenate([s.greedy for s in seqs]),
        starts=starts,
        lengths=lengths,
        prompt_lengths=np.array([s.prompt_length for s in seqs], np.int64),
        prompt_index=np.array([s.prompt_index for s in seqs], np.int64),
        kind=np.array([KINDS.index(s.kind) for s in seqs], np.int8),
    )
    tmp.rename(path)


def shard_paths(data_dir: Path) -> list[Path]:
    return sorted(Path(data_dir).glob("shard-*.npz"))


def done_jobs(data_dir: Path) -> set[tuple[int, str]]:
    done: set[tuple[int, str]] = set()
    for p in shard_paths(data_dir):
        with np.load(p) as z:
            done.update((int(i), KINDS[int(k)]) for i, k in zip(z["prompt_index"], z["kind"]))
    return done


def generate(
    data_dir: str | Path,
    prompts: Sequence[str],
    recipe: DataRecipe,
    *,
    kinds: Sequence[str] = KINDS,
    minutes: float | None = None,
    n_threads: int = 2,
    on_progress=None,
) -> dict:
    """Generate (or continue generating) the data set into `data_dir`; stop after `minutes`.

    Jobs run kind by kind (every prompt greedy first, then every prompt warm). One process per
    data directory (shards are numbered in order); several directories can be generated in
    parallel and trained on together. Returns counts."""
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ValueError(f"unknown kinds {bad}; expected some of {KINDS}")
    from ..hosts.llama_cpp.target import LlamaTarget

    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    recipe_file = data_dir / "data.json"
    if recipe_file.exists():
        old = json.loads(recipe_file.read_text())
        if old["recipe"] != asdict(recipe):
            raise ValueError(f"{data_dir} holds data of another recipe: {old['recipe']}")
    else:
        recipe_file.write_text(json.dumps({"recipe": asdict(recipe), "n_prompts": len(prompts)}, indent=2))
    done = done_jobs(data_dir)
    jobs = [(i, kind) for kind in kinds for i in range(len(prompts)) if (i, kind) not in done]
    deadline = None if minutes is None else time.monotonic() + 60 * minutes
    counts = {"sequences": 0, "tokens": 0, "skipped_done": len(done)}
    with LlamaTarget(
        recipe.model, n_ctx=1024, n_batch=512, n_threads=n_threads, capture_layers=recipe.layer_ids
    ) as target:
        pending: list[GeneratedSequence] = []
        index = len(shard_paths(data_dir))
        t0 = time.monotonic()
        for prompt_index, kind in jobs:
            if deadline is not None and time.monotonic() > deadline:
                break
            rng = np.random.default_rng([recipe.seed, prompt_index, KINDS.index(kind)])
            toks = target.tokenize(target.chat_prompt(prompts[prompt_index]))
            seq = generate_sequence(
                target,
                toks,
                recipe.max_new_tokens,
                kind,
                rng,
                recipe.warm_tokens,
                recipe.warm_temperature,
                prompt_index,
            )
            pending.append(seq)
            counts["sequences"] += 1
            counts["tokens"] += int(seq.tokens.size - seq.prompt_length)
            if len(pending) >= recipe.shard_sequences:
                write_shard(data_dir / f"shard-{index:05d}.npz", pending)
                index += 1
                pending = []
                rate = counts["tokens"] / (time.monotonic() - t0)
                log.info("%d sequences, %d new tokens, %.0f tokens/s", counts["sequences"], counts["tokens"], rate)
                if on_progress is not None:
                    on_progress(counts)
        if pending:
            write_shard(data_dir / f"shard-{index:05d}.npz", pending)
    return counts


@dataclass
class Corpus:
    """Every shard of a data directory in memory: flat arrays plus per-sequence spans."""

    tokens: np.ndarray
    features: np.ndarray
    greedy: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    prompt_lengths: np.ndarray
    prompt_index: np.ndarray

    @property
    def n_sequences(self) -> int:
        return int(self.starts.size)

    def sequence(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(tokens, features, greedy, prompt_length) of sequence i (views)."""
        a, n = int(self.starts[i]), int(self.lengths[i])
        return self.tokens[a : a + n], self.features[a : a + n], self.greedy[a : a + n], int(self.prompt_lengths[i])

    def iter_sequences(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, int]]:
        for i in range(self.n_sequences):
            yield self.sequence(i)


def load_corpus(data_dirs: str | Path | Sequence[str | Path], max_shards: int | None = None) -> Corpus:
    """Every shard of one or several data directories (the first max_shards of each), in memory.
    The features are copied shard by shard into one preallocated array (peak memory: the data
    plus one shard)."""
    dirs = [data_dirs] if isinstance(data_dirs, (str, Path)) else list(data_dirs)
    paths = [p for d in dirs for p in shard_paths(Path(d))[:max_shards]]
    if not paths:
        raise FileNotFoundError(f"no shards in {dirs}")
    small: dict[str, list[np.ndarray]] = {
        k: [] for k in ("tokens", "greedy", "starts", "lengths", "prompt_lengths", "prompt_index")
    }
    widths = set()
    for p in paths:  # first pass: everything but the features, and their sizes
        with np.load(p) as z:
            for k in small:
                small[k].append(z[k])
            widths.add(int(z["features"].shape[1]) if z["features"].ndim == 2 else -1)
    if len(widths) != 1:
        raise ValueError(f"the shards' features have different widths {sorted(widths)}")
    sizes = [t.size for t in small["tokens"]]
    features = np.empty((sum(sizes), widths.pop()), dtype=np.float32)
    offset = 0
    for p, n, starts in zip(paths, sizes, small["starts"]):
        with np.load(p) as z:
            features[offset : offset + n] = z["features"]
        starts += offset
        offset += n
    return Corpus(features=features, **{k: np.concatenate(v) for k, v in small.items()})
