"""LlamaText: a GGUF's tokenizer and chat template, for a server that speaks text.

The vocabulary alone is loaded (llama-cpp-python's `Llama(vocab_only=True)`: no weights), so a
server keeps it beside its target at little cost. `Detokenizer` turns a growing list of token ids
into text increments that never split a UTF-8 character.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:  # pragma: no cover
    from llama_cpp.llama_types import ChatCompletionRequestMessage

log = logging.getLogger(__name__)


class LlamaText:
    """Tokenize, detokenize and apply the chat template of the GGUF at `model_path`."""

    def __init__(self, model_path: str | os.PathLike) -> None:
        import llama_cpp
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        self._llm = llama_cpp.Llama(str(model_path), vocab_only=True, verbose=False)
        self.n_vocab = int(self._llm.n_vocab())
        self.eos = int(self._llm.token_eos())
        self.bos = int(self._llm.token_bos())
        template = self._llm.metadata.get("tokenizer.chat_template")
        self._chat = None
        if template:
            self._chat = Jinja2ChatFormatter(
                template=template, eos_token=self.token_text(self.eos), bos_token=self.token_text(self.bos)
            )

    def token_text(self, token: int) -> str:
        """A token's text, special tokens spelled out (e.g. "<|im_end|>")."""
        return self._llm._model.token_get_text(int(token))

    @property
    def has_chat_template(self) -> bool:
        return self._chat is not None

    def tokenize(self, text: str, *, add_bos: bool = True) -> list[int]:
        """Text -> token ids; special tokens in the text (a chat template's markers) are parsed."""
        return list(self._llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True))

    def chat_prompt(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """The chat template applied to `messages` ({"role", "content"} each), as token ids."""
        if self._chat is None:
            raise ValueError("this model's GGUF has no chat template (tokenizer.chat_template): use /v1/completions")
        # (llama-cpp-python types them as OpenAI's messages; the template reads the dicts as they are)
        prompt = self._chat(messages=cast("list[ChatCompletionRequestMessage]", list(messages))).prompt
        # the template writes the BOS text itself where the model wants one
        return self.tokenize(prompt, add_bos=False)

    def detokenize_bytes(self, tokens: Sequence[int]) -> bytes:
        return bytes(self._llm.detokenize(list(tokens)))

    def detokenizer(self) -> Detokenizer:
        return Detokenizer(self)


class Detokenizer:
    """Text increments of a growing token list: `push(tokens)` returns the text they complete
    (bytes of a character still incomplete wait for the next push); `flush()` the rest."""

    def __init__(self, text: LlamaText) -> None:
        self._text = text
        self._tokens: list[int] = []
        self._emitted = 0  # bytes of the detokenized text already returned

    def push(self, tokens: Sequence[int]) -> str:
        self._tokens.extend(int(t) for t in tokens)
        raw = self._text.detokenize_bytes(self._tokens)
        end = len(raw)
        # hold back a trailing incomplete UTF-8 sequence (at most 3 bytes)
        for back in range(1, min(4, end - self._emitted) + 1):
            lead = raw[end - back]
            if lead & 0xC0 == 0x80:  # a continuation byte: look further back
                continue
            need = 2 if lead & 0xE0 == 0xC0 else 3 if lead & 0xF0 == 0xE0 else 4 if lead & 0xF8 == 0xF0 else 1
            if need > back:
                end -= back
            break
        out = raw[self._emitted : end].decode("utf-8", errors="replace")
        self._emitted = end
        return out

    def flush(self) -> str:
        raw = self._text.detokenize_bytes(self._tokens)
        out = raw[self._emitted :].decode("utf-8", errors="replace")
        self._emitted = len(raw)
        return out
