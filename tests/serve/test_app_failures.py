"""The app when generation fails after a stream started: the failure arrives as an OpenAI error
line in the stream (the real `openai` client raises an APIError naming it), never a broken
connection; a whole answer that fails is a 500 JSON error. A stub engine fails on purpose."""

from __future__ import annotations

import threading
from typing import Any

import pytest

for module in ("fastapi", "sse_starlette", "openai", "llama_cpp"):
    pytest.importorskip(module, reason='the server tests need the server extra: pip install -e ".[server]"')

import openai  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from pyggml_dkv.hosts.llama_cpp.text import LlamaText  # noqa: E402
from pyggml_dkv.serve.app import create_app  # noqa: E402
from pyggml_dkv.serving.engine import EngineStats  # noqa: E402
from pyggml_dkv.serving.requests import RequestHandle, RequestParams  # noqa: E402
from tests.hosts.hosts_helpers import smollm2_path  # noqa: E402


class FailingEngine:
    """Commits `tokens`, then fails the request as a broken decode would."""

    active = waiting = 0
    cost_model = None

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.stats = EngineStats()

    def submit(self, prompt: Any, params: RequestParams, request_id: str = "r") -> RequestHandle:
        handle = RequestHandle(request_id, len(prompt), params, lambda _: None)

        def run() -> None:
            handle._push(self.tokens)
            handle._finish("error", RuntimeError("llama_decode failed with -3"))

        threading.Timer(0.05, run).start()
        return handle

    def shutdown(self, timeout: float | None = None) -> bool:
        return True


@pytest.fixture(scope="module")
def client() -> Any:
    text = LlamaText(smollm2_path())
    app = create_app(FailingEngine(text.tokenize("Hello there, friend")), text, model_id="m", context_length=512)
    with TestClient(app) as c:
        yield c


def test_a_stream_that_fails_ends_with_an_error_line(client: Any) -> None:
    oa = openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key="x", http_client=client, max_retries=0)
    pieces: list[str] = []
    with pytest.raises(openai.APIError, match="generation failed.*llama_decode failed"):
        for ev in oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True):
            pieces.append(ev.choices[0].delta.content or "")
    assert "".join(pieces).startswith("Hello")  # what came before the failure was delivered


def test_a_whole_answer_that_fails_is_a_500_json_error(client: Any) -> None:
    r = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 8})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error" and "llama_decode failed" in r.json()["error"]["message"]
