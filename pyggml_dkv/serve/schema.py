"""The OpenAI API's request bodies as this server takes them, and its error bodies.

Validation happens here, before anything reaches the engine: a malformed body, a missing or
wrong-typed field, an out-of-range value is a 400 whose `error.param` names the field, in the
shape the `openai` client parses ({"error": {"message", "type", "param", "code"}}).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

MAX_STOP_STRINGS = 4


class SamplingFields(BaseModel):
    """What completions and chat completions share. Unknown fields are ignored, as OpenAI's
    client sends some this server does not use (e.g. `user`)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(0, ge=0)
    seed: StrictInt | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    stream: StrictBool = False
    n: StrictInt = Field(1, ge=1, le=1)  # one choice per request

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(s == "" for s in stops):
            raise ValueError("a stop string may not be empty")
        return stops


class CompletionRequest(SamplingFields):
    prompt: str | list[StrictInt] | list[str]
    max_tokens: StrictInt | None = Field(16, ge=1)  # OpenAI's default for completions

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError("the prompt is empty")
            if isinstance(v[0], str):
                if len(v) != 1:
                    raise ValueError("one prompt per request (a list of one string, a string, or token ids)")
                return v[0]
        if isinstance(v, str) and not v:
            raise ValueError("the prompt is empty")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
