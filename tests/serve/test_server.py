"""The OpenAI-compatible server, live on a loopback port, driven by the real `openai` client."""

from __future__ import annotations

import concurrent.futures as cf
import json
import signal
import threading
import time

import httpx
import numpy as np
import pytest

from tests.serve.conftest import API_KEY, Server, start_server

pytestmark = pytest.mark.slow  # a live server on SmolLM2: the slow tier

PROMPTS = (
    "Write a short poem about the sea.",
    "List three prime numbers and explain why they are prime.",
    "What is the capital of France? Answer in one sentence.",
    "Explain what a hash table is to a child.",
)


def chat(client, prompt: str, max_tokens: int = 32, **kw):
    return client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0, **kw
    )


def post(server: Server, path: str, body, key: str | None = API_KEY, raw: bool = False) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    content = body if raw else json.dumps(body)
    return httpx.post(server.base_url + path, content=content, headers=headers, timeout=120)


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct.Q4_1"]
    health = httpx.get(server.base_url + "/health").json()
    assert health["status"] == "ok" and health["active"] == 0
    assert health["engine"]["rounds"] >= 0 and set(health["cost_model"]) >= {"verify_s", "draft_s", "scale"}


def test_a_second_turn_reuses_the_first_turns_positions(client):
    """A conversation's next request starts with the whole previous one: its usage says how many
    prompt tokens were kept from it (OpenAI's prompt_tokens_details.cached_tokens)."""
    messages = [{"role": "user", "content": PROMPTS[1]}]
    first = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And in one word?"},
    ]
    second = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens


def test_completion_and_chat_streamed_or_not_agree(client):
    done = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=16, temperature=0)
    text = done.choices[0].text
    assert text and done.usage.completion_tokens == 16 and done.choices[0].finish_reason == "length"
    pieces = [
        c.choices[0].text
        for c in client.completions.create(
            model="smollm2", prompt="The capital of France is", max_tokens=16, temperature=0, stream=True
        )
    ]
    assert "".join(pieces) == text

    answer = chat(client, PROMPTS[2])
    content = answer.choices[0].message.content
    assert "Paris" in content and answer.usage.prompt_tokens > 10
    stream = chat(client, PROMPTS[2], stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == content
    assert chunks[-1].choices[0].finish_reason == answer.choices[0].finish_reason


NEAR_TIE = 0.5  # logits: a divergence where plain decoding's top two are closer is a near-tie


@pytest.fixture(scope="module")
def plain_greedy_of():
    """Plain greedy decoding of a chat prompt alone, on a single-sequence LlamaTarget in this
    process: the tokens and each one's top-2 logit gap (as compare_to_plain reads them)."""
    from pyggml_dkv.hosts.llama_cpp import LlamaTarget, plain_greedy
    from pyggml_dkv.hosts.llama_cpp.text import LlamaText
    from tests.hosts.hosts_helpers import smollm2_path

    text = LlamaText(smollm2_path())
    with LlamaTarget(smollm2_path(), n_ctx=512, n_threads=1) as target:
        yield lambda prompt, n: (plain_greedy(target, text.chat_prompt([{"role": "user", "content": prompt}]), n), text)


def divergence(answer: str, plain, text) -> int | None:
    """The index of plain decoding's first token the answer does not continue with (None: none)."""
    for i in range(plain.tokens.size):
        if not answer.startswith(text.detokenize_bytes(plain.tokens[: i + 1]).decode("utf-8", errors="ignore")):
            return i
    return None


def test_concurrent_requests_equal_each_alone(client, plain_greedy_of):
    """Four requests at once, and each alone: both equal plain greedy decoding token for token,
    up to near-ties (a batch of other requests changes llama.cpp's float sums a little)."""
    alone = [chat(client, p).choices[0].message.content for p in PROMPTS]
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: chat(client, p).choices[0].message.content, PROMPTS))
    ties = []
    for prompt, a, b in zip(PROMPTS, alone, together):
        plain, text = plain_greedy_of(prompt, 32)
        for answer in (a, b):
            i = divergence(answer, plain, text)
            if i is not None:
                # texts compare a token late where a token was split otherwise (" 2" vs " " + "2"):
                # the tokens diverged at one of the last few the texts still shared
                gap = float(plain.gaps[max(0, i - 2) : i + 1].min())
                assert gap < NEAR_TIE, f"{prompt!r}: diverges at token {i}, gaps {plain.gaps[max(0, i - 2) : i + 1]}"
                ties.append((prompt[:20], i, round(gap, 3)))
    print(f"\nconcurrent vs alone vs plain greedy: {len(ties)} near-tie divergences {ties}")


def test_stop_strings_and_speculation_stats(server):
    r = post(
        server, "/v1/completions", {"prompt": "Count: 1, 2, 3, 4,", "max_tokens": 24, "temperature": 0, "stop": [" 7"]}
    )
    body = r.json()
    assert r.status_code == 200 and body["choices"][0]["finish_reason"] == "stop"
    assert " 7" not in body["choices"][0]["text"] and body["choices"][0]["text"].rstrip().endswith("6,")
    spec = body["speculation"]
    assert spec["rounds"] >= 1 and sum(spec["draft_length_histogram"].values()) == spec["rounds"]


@pytest.mark.parametrize(
    "body, status, param",
    [
        ('{"messages": [', 400, None),  # malformed JSON
        ("[1, 2]", 400, None),  # not an object
        ({"model": "m"}, 400, "messages"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "user"}]}, 400, "messages.0.content"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, 400, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2.5}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "stream"),
        ({"messages": [{"role": "user", "content": "word " * 600}]}, 400, "messages"),  # longer than the context
    ],
)
def test_bad_chat_requests_are_4xx_naming_the_field(server, body, status, param):
    r = post(server, "/v1/chat/completions", body, raw=isinstance(body, str))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param


@pytest.mark.parametrize(
    "body, param",
    [
        ({"max_tokens": 4}, "prompt"),
        ({"prompt": "", "max_tokens": 4}, "prompt"),
        ({"prompt": [1, 2, 10**9], "max_tokens": 4}, "prompt"),
        ({"prompt": ["a", "b"], "max_tokens": 4}, "prompt"),
        ({"prompt": "hi", "seed": -1}, "seed"),
        ({"prompt": "hi", "top_k": -1}, "top_k"),
    ],
)
def test_bad_completion_requests_are_400(server, body, param):
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_api_key_is_required(server):
    for key in (None, "wrong"):
        r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.base_url + "/v1/models").status_code == 401
    assert httpx.get(server.base_url + "/v1/nowhere").json()["error"]["type"] == "invalid_request_error"


def wait_idle(server: Server, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = httpx.get(server.base_url + "/health").json()
        if h["active"] == 0 and h["waiting"] == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"the server still has requests after {timeout} s: {h}")


def test_a_client_that_disconnects_mid_stream_frees_its_request(server):
    body = {
        "messages": [{"role": "user", "content": "Tell me a very long story about dragons."}],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream(
        "POST",
        server.base_url + "/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {API_KEY}"},
        timeout=60,
    ) as r:
        lines = 0
        for line in r.iter_lines():
            lines += line.startswith("data:")
            if lines >= 3:
                break
    wait_idle(server)  # cancelled, not generating its 400 tokens
    assert "cancelled" in server.log_text() or "went away" in server.log_text()


def test_load_200_requests_from_16_clients(server, client):
    """Bounded: 200 requests, 16 at a time: none fails, none is lost, and every answer belongs to
    its prompt (no other prompt's number in it, and its own number or its answer alone)."""
    numbers = [str(1000 + n * 7919 % 9000) for n in range(1, 11)]
    assert len(set(numbers)) == len(numbers)
    alone = {
        n: chat(client, f"Repeat this number exactly: {n}", max_tokens=12).choices[0].message.content for n in numbers
    }
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        mine = numbers[i % len(numbers)]
        t0 = time.perf_counter()
        try:
            got = chat(client, f"Repeat this number exactly: {mine}", max_tokens=12).choices[0].message.content
        except Exception as e:  # every failure counts
            with lock:
                errors.append(f"{i}: {e!r}")
            return
        with lock:
            latencies.append(time.perf_counter() - t0)
            others = [n for n in numbers if n != mine and n in got]
            if others or (mine not in got and got != alone[mine]):
                errors.append(f"{i}: mixed up: asked for {mine}, got {got!r}")

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(200), timeout=600))
    wall = time.perf_counter() - t0
    lat = np.array(latencies)
    print(
        f"\nload: 200 requests, 16 clients, {wall:.1f} s: {len(lat)} answered, p50 {np.median(lat):.2f} s, "
        f"p99 {np.percentile(lat, 99):.2f} s"
    )
    assert not errors, errors[:5]
    assert len(lat) == 200


def test_queue_full_is_429_with_retry_after(tmp_path):
    srv = start_server(tmp_path, "--parallel", "1", "--max-queue", "0", "--ctx-size", "512", "--drafter", "none")
    try:
        body = {
            "messages": [{"role": "user", "content": "Tell me a very long story about dragons."}],
            "max_tokens": 400,
            "temperature": 0,
            "stream": True,
        }
        with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()  # kept: a dropped iterator closes the stream (the request is cancelled)
            first = next(lines)  # the one sequence is busy now
            health = httpx.get(srv.base_url + "/health").json()
            assert health["active"] == 1, (first, health, srv.log_text()[-2000:])
            busy = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
            assert busy.status_code == 429, (busy.text, srv.log_text()[-1500:])
            assert busy.headers["retry-after"] == "1"
            assert busy.json()["error"]["type"] == "rate_limit_error"
    finally:
        assert srv.stop() == 0


def test_sigterm_finishes_requests_in_flight_and_exits_0(tmp_path):
    srv = start_server(tmp_path, "--parallel", "2", "--ctx-size", "512", "--shutdown-timeout", "20")
    result: dict = {}

    def long_request() -> None:
        r = httpx.post(
            srv.base_url + "/v1/completions",
            json={"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0},
            timeout=60,
        )
        result["status"], result["body"] = r.status_code, r.json()

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 20
    while httpx.get(srv.base_url + "/health").json()["active"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(30) == 0, srv.log_text()[-3000:]
    t.join(30)
    assert time.monotonic() - t0 < 25
    assert result.get("status") == 200 and result["body"]["usage"]["completion_tokens"] == 48
    with pytest.raises(httpx.HTTPError):
        httpx.get(srv.base_url + "/health", timeout=2)
