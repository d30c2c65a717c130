"""TextStream: a request's generated tokens as text, cut at its stop strings.

Text that could still become a stop string is held back until it cannot, so a streaming client
never receives part of a stop string; once one appears, the text ends before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TextStream:
    def __init__(self, text: Any, stops: Sequence[str]) -> None:
        """`text`: a LlamaText (its detokenizer); `stops`: the request's stop strings."""
        self._detok = text.detokenizer()
        self._stops = list(stops)
        self._pending = ""  # decoded, not yet released
        self.text = ""  # released so far
        self.stopped = False  # a stop string appeared

    def push(self, tokens: Sequence[int]) -> str:
        """The text these tokens release (nothing once stopped)."""
        if self.stopped:
            return ""
        self._pending += self._detok.push(tokens)
        return self._release(final=False)

    def finish(self) -> str:
        """Whatever is still held back (the generation ended)."""
        if self.stopped:
            return ""
        self._pending += self._detok.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        hits = [i for i in (self._pending.find(s) for s in self._stops) if i >= 0]
        if hits:
            out = self._pending[: min(hits)]
            self._pending = ""
            self.stopped = True
        elif final or not self._stops:
            out, self._pending = self._pending, ""
        else:  # keep a tail that is the start of a stop string
            hold = max((k for s in self._stops for k in range(1, len(s)) if self._pending.endswith(s[:k])), default=0)
            cut = len(self._pending) - hold
            out, self._pending = self._pending[:cut], self._pending[cut:]
        self.text += out
        return out
