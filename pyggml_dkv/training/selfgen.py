"""Self-generated training prompts and their continuations, on the PyTorch target (torch_target.py).

Our hand-written prompts (prompts.py) are 16 templates: a drafter trained on their answers learns
those kinds of answer and generalises poorly to others. With a GPU the target can write its own
prompts: fed only the opening of a user turn of its chat template, an instruction-tuned model
samples a plausible user request and closes the turn (the "Magpie" method, Xu et al. 2024);
answered greedily, those requests give data as varied as the target's own idea of a user. A
135M-parameter target left alone at temperature 1 writes mostly noise, so each request starts with
one of our `REQUEST_OPENERS` ("Write", "Compare", "How", ...), is sampled at temperature 0.7 and
ends at its first line break (small models rarely close the turn themselves).

The prompt pack (`prompt_pack`, built once with the llama.cpp host's tokenizer, so that prompts are
token ids exactly as the host makes them) holds the template prompts, the held-out prompts, the
user-turn opening, the request openers, the turn closing + assistant opening, the end-of-generation
ids and the ids of every token whose text holds a line break.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from .torch_target import TorchLlama, generate

log = logging.getLogger(__name__)

USER_OPEN = "<|im_start|>user\n"
USER_CLOSE = "<|im_end|>\n<|im_start|>assistant\n"


def prompt_pack(model_path: str, out: str | Path, prompt_seed: int = 0) -> Path:
    """Tokenize every prompt the GPU run needs with the llama.cpp host (needs llama-cpp-python)."""
    from ..hosts.llama_cpp.target import LlamaTarget
    from .prompts import HELD_OUT_PROMPTS, REQUEST_OPENERS, training_prompts

    with LlamaTarget(model_path, n_ctx=512, n_threads=1) as target:

        def chat(texts: list[str] | tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
            toks = [target.tokenize(target.chat_prompt(t)) for t in texts]
            return np.concatenate(toks).astype(np.int32), np.array([t.size for t in toks], np.int64)

        train_flat, train_len = chat(training_prompts(prompt_seed))
        held_flat, held_len = chat(HELD_OUT_PROMPTS)
        user_open = target.tokenize(USER_OPEN).astype(np.int32)
        user_close = target.tokenize(USER_CLOSE, add_special=False).astype(np.int32)
        openers = [target.tokenize(o, add_special=False) for o in REQUEST_OPENERS]
        eog = np.array([t for t in range(target.n_vocab) if target.is_eog(t)], np.int32)
        newline = np.array([t for t in range(target.n_vocab) if b"\n" in target.piece(t)], np.int32)
    out = Path(out)
    with open(out, "wb") as f:  # (np.savez on a name would append .npz to any other suffix)
        np.savez(
            f,
            train_flat=train_flat,
            train_len=train_len,
            held_flat=held_flat,
            held_len=held_len,
            user_open=user_open,
            user_close=user_close,
            eog=eog,
            newline=newline,
            openers_flat=np.concatenate(openers).astype(np.int32),
            openers_len=np.array([o.size for o in openers]),
        )
    return out


def unpack(flat: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    """The token arrays a pack stores flat (int64)."""
    return np.split(flat.astype(np.int64), np.cumsum(lengths)[:-1])


def self_prompts(
    model: TorchLlama,
    pack,
    n: int,
    *,
    batch: int,
    max_len: int = 48,
    temperature: float = 0.7,
    seed: int = 0,
    deadline: float | None = None,
) -> list[np.ndarray]:
    """Up to `n` distinct chat prompts whose user request the target wrote: user_open, an opener
    and what the target sampled after it, up to its first line break or end of turn (at least 3
    tokens; a request still open after max_len tokens is dropped), then user_close."""
    user_open, user_close = pack["user_open"].astype(np.int64), pack["user_close"].astype(np.int64)
    openers = unpack(pack["openers_flat"], pack["openers_len"])
    stop = set(int(t) for t in pack["eog"]) | set(int(t) for t in pack["newline"])
    gen = torch.Generator(device=model.device).manual_seed(seed)
    rng = np.random.default_rng(seed)
    seen: set[bytes] = set()
    prompts: list[np.ndarray] = []
    while len(prompts) < n and (deadline is None or time.monotonic() < deadline):
        heads = [np.concatenate([user_open, openers[i]]) for i in rng.integers(len(openers), size=batch)]
        outs = generate(model, heads, max_len, stop, temperature=temperature, generator=gen)
        for head, o in zip(heads, outs):
            if o.size < 4 or int(o[-1]) not in stop:
                continue
            request = np.concatenate([head, o[:-1]])
            key = request.astype(np.int32).tobytes()
            if key in seen:
                continue
            seen.add(key)
            prompts.append(np.concatenate([request, user_close]))
        log.info("self-prompts: %d of %d", len(prompts), n)
    return prompts[:n]


def continue_prompts(
    model: TorchLlama,
    prompts: list[np.ndarray],
    eog: set[int],
    *,
    batch: int,
    max_new: int,
    warm_tokens: int | None = None,
    warm_temperature: float = 0.8,
    seed: int = 0,
    deadline: float | None = None,
) -> tuple[list[np.ndarray], list[int]]:
    """(prompt + continuation, prompt length) for each prompt for each prompt (greedy, or `warm`: the first warm_tokens sampled),
    in batches of similar prompt length; stops starting batches after `deadline`."""
    gen = torch.Generator(device=model.device).manual_seed(seed)
    order = np.argsort([p.size for p in prompts], kind="stable")
    result: dict[int, np.ndarray] = {}
    for lo in range(0, len(order), batch):
        if deadline is not None and time.monotonic() > deadline:
            log.info("continuations: deadline after %d of %d", len(result), len(prompts))
            break
        idx = order[lo : lo + batch]
        outs = generate(
            model,
            [prompts[i] for i in idx],
            max_new,
            eog,
            temperature=0.0 if warm_tokens is None else warm_temperature,
            sample_first=warm_tokens,
            generator=gen,
        )
        for i, o in zip(idx, outs):
            result[int(i)] = np.concatenate([prompts[i], o])
    return [result[i] for i in sorted(result)], [int(prompts[i].size) for i in sorted(result)]
