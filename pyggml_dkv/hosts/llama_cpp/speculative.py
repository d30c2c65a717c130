"""`speculative_llama`: a llama_cpp.Llama that drafts with a DFlash drafter, in one call.

    from pyggml_dkv.llama import speculative_llama

    llm = speculative_llama("SmolLM2-135M-Instruct.Q4_1.gguf", n_ctx=2048, n_threads=2)
    llm.create_chat_completion(messages=[...])   # speculates: the drafter drafts, the Llama verifies
    llm.close()                                   # frees the drafter too

What it does, in this order: checks every argument (before llama.cpp or ggml allocate anything);
loads the drafter's weights and checks that they fit the target GGUF's metadata; builds our
`Drafter` on the target's token embedding and head; builds the Llama with what the adapter needs
(`draft_model=`, `logits_all=True`, `n_threads_batch` = `n_threads`); attaches the adapter
(adapter.py, which hooks feature capture into the Llama's decodes); returns the Llama. Closing the
Llama (close(), or dropping the last reference to it) frees the drafter.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...common.checks import is_int, is_real
from ...model.weights import DraftWeights

DEFAULT_DRAFTER = "default"
# Drafter arguments that speculative_llama passes itself, not through drafter_options
_OWN_DRAFTER_ARGS = ("weights", "embed_tokens", "lm_head", "backend", "p_min", "lanes")


def _is_drafter_object(drafter: object) -> bool:
    return all(hasattr(drafter, a) for a in ("cfg", "vocab", "add_features", "propose", "rewind", "reset"))


def _check_arguments(
    model_path: Any,
    drafter: Any,
    draft_max: Any,
    p_min: Any,
    n_threads: Any,
    drafter_options: Any,
    llama_kwargs: dict[str, Any],
) -> Path:
    """Every argument, before anything is loaded; returns the target GGUF's path."""
    if not isinstance(model_path, (str, os.PathLike)):
        raise TypeError(f"model_path must be a path to the target's GGUF file, got {type(model_path).__name__}")
    path = Path(model_path)
    if not path.is_file():
        raise FileNotFoundError(f"model_path: no such GGUF file: {path}")
    if drafter is None or isinstance(drafter, DraftWeights):
        pass
    elif isinstance(drafter, (str, os.PathLike)):
        if drafter != DEFAULT_DRAFTER and not Path(drafter).exists():
            raise FileNotFoundError(f"drafter: no such dflash .gguf file or checkpoint directory: {drafter}")
    elif not _is_drafter_object(drafter):
        raise TypeError(
            "drafter must be None or 'default' (the shipped SmolLM2 drafter), a path to a dflash .gguf "
            "or checkpoint directory, a DraftWeights, or a drafter object (a pyggml_dkv Drafter, "
            f"RemoteDrafter, ...); got {type(drafter).__name__}"
        )
    if draft_max is not None and (not is_int(draft_max) or draft_max < 1):
        raise ValueError(f"draft_max must be a positive int or None (the drafter's block size - 1), got {draft_max!r}")
    if not is_real(p_min) or not 0.0 <= p_min < 1.0:
        raise ValueError(f"p_min must be a number in [0, 1), got {p_min!r}")
    if n_threads is not None and (not is_int(n_threads) or not 1 <= n_threads <= 512):
        raise ValueError(f"n_threads must be an int in [1, 512] or None, got {n_threads!r}")
    if drafter_options is not None and not isinstance(drafter_options, Mapping):
        raise TypeError(f"drafter_options must be a mapping of Drafter arguments, got {type(drafter_options).__name__}")
    if _is_drafter_object(drafter) and (p_min or drafter_options):
        raise ValueError(
            "p_min and drafter_options configure a drafter that speculative_llama builds; "
            "set them on the drafter object you pass instead"
        )
    if "draft_model" in llama_kwargs:
        raise TypeError(
            "draft_model: speculative_llama makes the Llama's draft model itself; pass the drafter as drafter="
        )
    if "logits_all" in llama_kwargs and llama_kwargs["logits_all"] is not True:
        raise ValueError(
            "logits_all must be True with a draft model (llama-cpp-python 0.3.36 sizes its score buffer "
            "by it); leave it out, speculative_llama sets it"
        )
    if "n_threads_batch" in llama_kwargs:
        value = llama_kwargs["n_threads_batch"]
        if value is not None and (not is_int(value) or value < 1):
            raise ValueError(f"n_threads_batch must be a positive int or None, got {value!r}")
    return path


def _check_llama_kwargs(llama_cls: Any, llama_kwargs: dict[str, Any]) -> None:
    """llama_cpp.Llama swallows unknown keyword arguments (**kwargs): a misspelt one would pass unseen."""
    params = inspect.signature(llama_cls.__init__).parameters
    known = {n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)} - {"self"}
    unknown = sorted(set(llama_kwargs) - known)
    if unknown:
        raise TypeError(f"unknown llama_cpp.Llama argument(s): {', '.join(unknown)}")


def _check_drafter_options(options: Mapping[str, Any]) -> None:
    from ...drafter.drafter import Drafter

    params = inspect.signature(Drafter.__init__).parameters
    allowed = {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY} - set(_OWN_DRAFTER_ARGS)
    bad = sorted(set(options) - allowed)
    if bad:
        raise TypeError(
            f"drafter_options: unknown or reserved Drafter argument(s) {', '.join(bad)} "
            f"(allowed: {', '.join(sorted(allowed))})"
        )


def _load_weights(drafter: Any, target: Path) -> tuple[DraftWeights, Any]:
    """The drafter's weights, checked against the target GGUF's metadata, and that GGUF (a GGUFFile)."""
    from .drafters import check_fits_gguf
    from .errors import IncompatibleDrafterError
    from .gguf import GGUFFile

    if isinstance(drafter, DraftWeights):
        weights, what = drafter, "drafter"
    elif drafter is None or (isinstance(drafter, str) and drafter == DEFAULT_DRAFTER):
        from ..pretrained import smollm2_drafter_path

        weights, what = DraftWeights.from_pretrained(smollm2_drafter_path()), "default"
    else:
        weights, what = DraftWeights.from_pretrained(drafter), "drafter"
    gguf = GGUFFile(target)
    vocab = weights.cfg.vocab
    if vocab is None:  # a drafter without a vocab of its own drafts over the target's (it shares its head)
        tokens = gguf.meta.get("tokenizer.ggml.tokens")
        vocab = gguf.arch_value("vocab_size", len(tokens) if tokens is not None else None)
    try:  # (check_fits_gguf names missing vocab metadata itself)
        check_fits_gguf(weights.cfg, int(vocab) if vocab is not None else 0, gguf)
    except IncompatibleDrafterError as e:
        if what == "default":
            raise IncompatibleDrafterError(
                f"drafter=None uses the drafter shipped for SmolLM2-135M-Instruct, which does not fit {target.name} "
                f"({e}); pass drafter= a dflash .gguf or checkpoint directory trained for this target"
            ) from e
        raise IncompatibleDrafterError(f"drafter: {e}") from e
    return weights, gguf


def speculative_llama(
    model_path: str | os.PathLike[str],
    drafter: Any = None,
    *,
    draft_max: int | None = None,
    p_min: float = 0.0,
    n_threads: int | None = None,
    drafter_options: Mapping[str, Any] | None = None,
    **llama_kwargs: Any,
) -> Any:
    """A `llama_cpp.Llama` for the target GGUF `model_path` whose generate(), create_completion()
    and create_chat_completion() speculate with a DFlash drafter (lossless: the Llama verifies
    every draft and keeps only what it would have sampled itself).

    - `drafter`: None or "default" (the drafter shipped for SmolLM2-135M-Instruct: the target
      must be that model); a path to a dflash .gguf or a dflash checkpoint directory; a
      DraftWeights; or a ready drafter object (a pyggml_dkv Drafter, RemoteDrafter,
      HybridDrafter, ...), which stays the caller's to close. A drafter that speculative_llama
      builds is closed with the Llama.
    - `draft_max`: at most this many drafted tokens per round (default: block size - 1, 15 for
      the shipped drafter);
    - `p_min`: cut each draft at the first token the drafter itself gives less than p_min
      (llama.cpp's --draft-p-min; 0 keeps whole drafts);
    - `n_threads`: CPU threads of the Llama (n_threads, and n_threads_batch unless given) and of
      the drafter (default: llama-cpp-python's and ggml's own defaults);
    - `drafter_options`: more arguments of `pyggml_dkv.Drafter` (cap, weight_dtype,
      lm_head_dtype, lm_head_screen, ...);
    - `**llama_kwargs`: llama_cpp.Llama's own (n_ctx, n_batch, seed, verbose, chat_format, ...);
      logits_all is set to True, as a draft model needs.

    Bad arguments raise TypeError / ValueError / FileNotFoundError naming the argument before
    llama.cpp or ggml allocate anything; a drafter that does not fit the target raises
    IncompatibleDrafterError (from the GGUF's metadata, before the model is loaded).
    """
    path = _check_arguments(model_path, drafter, draft_max, p_min, n_threads, drafter_options, llama_kwargs)
    try:
        import llama_cpp
    except ImportError as e:
        raise ImportError(
            "speculative_llama needs llama-cpp-python: pip install 'pyggml_dkv[llama]' "
            "(or bash scripts/install_llama_cpp.sh)"
        ) from e
    _check_llama_kwargs(llama_cpp.Llama, llama_kwargs)
    options = dict(drafter_options or {})
    if options:
        _check_drafter_options(options)

    from .adapter import DFlashLlamaDraftModel
    from .drafters import ggml_drafter

    owned = not _is_drafter_object(drafter)
    if owned:
        weights, gguf = _load_weights(drafter, path)
        source: Any = ggml_drafter(weights, gguf, p_min=float(p_min), **options)
    else:
        source = drafter
    try:
        if owned and n_threads is not None and getattr(source.backend, "is_cpu", False):
            source.backend.set_n_threads(int(n_threads))
        adapter = DFlashLlamaDraftModel(source, draft_max=draft_max, owns_drafter=owned)
    except BaseException:
        if owned:
            source.close()
        raise
    kwargs = dict(llama_kwargs)
    if n_threads is not None:
        kwargs["n_threads"] = int(n_threads)
        kwargs.setdefault("n_threads_batch", int(n_threads))
    kwargs["logits_all"] = True
    try:
        llm = llama_cpp.Llama(str(path), draft_model=adapter, **kwargs)
    except BaseException:
        adapter.close()
        raise
    try:
        adapter.attach(llm)
    except BaseException:
        adapter.close()
        llm.close()
        raise
    return llm
