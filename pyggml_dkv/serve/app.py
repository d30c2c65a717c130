"""The OpenAI-compatible HTTP front of a SpeculativeEngine (FastAPI).

    app = create_app(engine, text, model_id="smollm2", context_length=2048, api_key=None)

Routes: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions, streaming
(server-sent events, `data: [DONE]` at the end) or not. Every request body is validated before
the engine sees it (schema.py): bad input is a 4xx JSON error naming the field, never a 500. The
engine's own thread generates and hands each round's tokens to the event loop
(`RequestHandle.subscribe`), so the event loop never blocks and wakes once per round. A client
that goes away cancels its request, which frees its sequence and drafter lane before the next
round. A full queue is a 429 with Retry-After. /health also reports the engine's counters and,
when it speculates, its current cost model.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..serving.requests import EngineClosedError, QueueFullError, RequestHandle, RequestParams
from .schema import ChatCompletionRequest, CompletionRequest, SamplingFields, error_body
from .text_stream import TextStream

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1


class ApiError(Exception):
    """An error answered as OpenAI's JSON error body with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.body, self.headers = status, error_body(message, type_, param, code), headers


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        message, param = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    else:
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg", "invalid request"))
    return JSONResponse(error_body(message, param=param), status_code=400)


def create_app(
    engine: Any,
    text: Any,
    *,
    model_id: str,
    context_length: int,
    api_key: str | None = None,
    shutdown_timeout: float = 10.0,
    on_shutdown: Callable[[], None] | None = None,
) -> FastAPI:
    """The app serving `engine` (a SpeculativeEngine) with `text` (hosts.llama_cpp.text.LlamaText:
    tokenizer and chat template of the engine's model). `context_length`: positions one request
    may use (prompt + generated). `on_shutdown`: called after the engine shut down."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        log.info("shutting down: finishing the requests in flight (at most %.0f s)", shutdown_timeout)
        clean = await asyncio.to_thread(engine.shutdown, shutdown_timeout)
        log.info("engine stopped (%s)", "every request finished" if clean else "some requests were cancelled")
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="pyggml_dkv", lifespan=lifespan)
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), type_), status_code=exc.status_code)

    async def authorized(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        if header != f"Bearer {api_key}":
            raise ApiError(
                401, "missing or wrong API key (Authorization: Bearer <key>)", "invalid_api_key", code="invalid_api_key"
            )

    @app.get("/health")
    async def health() -> dict[str, Any]:
        out: dict[str, Any] = {
            "status": "ok",
            "active": engine.active,
            "waiting": engine.waiting,
            "engine": engine.stats.to_dict(),
        }
        if engine.cost_model is not None:
            out["cost_model"] = engine.cost_model.snapshot()
        return out

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": model_id, "object": "model", "created": created, "owned_by": "pyggml_dkv"}],
        }

    def params_of(body: SamplingFields, prompt_len: int) -> RequestParams:
        room = context_length - prompt_len
        if room <= 0:
            raise ApiError(
                400,
                f"the prompt has {prompt_len} tokens; the context holds {context_length}",
                param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                code="context_length_exceeded",
            )
        max_tokens = room if body.max_tokens is None else min(body.max_tokens, room)
        return RequestParams(
            max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed
        )

    def submit(prompt: list[int], params: RequestParams, rid: str) -> RequestHandle:
        try:
            return engine.submit(prompt, params, request_id=rid)
        except QueueFullError as e:
            raise ApiError(429, str(e), "rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineClosedError as e:
            raise ApiError(503, str(e), "server_error") from None
        except ValueError as e:  # what the engine refuses of a request (checked above; kept as a 400)
            raise ApiError(400, str(e)) from None

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request) -> Any:
        if isinstance(body.prompt, str):
            prompt = text.tokenize(body.prompt)
        else:
            prompt = list(body.prompt)
            bad = [t for t in prompt if not 0 <= t < text.n_vocab]
            if bad:
                raise ApiError(400, f"prompt token ids must lie in [0, {text.n_vocab}), got {bad[:5]}", param="prompt")
        return await run(body, prompt, request, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        try:
            prompt = text.chat_prompt([m.model_dump() for m in body.messages])
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        return await run(body, prompt, request, chat=True)

    async def run(body: SamplingFields, prompt: list[int], request: Request, chat: bool) -> Any:
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        handle = submit(prompt, params_of(body, len(prompt)), rid)
        stream = TextStream(text, body.stop or [])
        # a whole answer without stop strings needs its tokens only at the end: no text work on
        # the event loop's thread while the engine decodes (it would share the cores with ggml)
        every_round = bool(body.stream or body.stop)
        tokens = _pump(handle, every_round)
        meta = {"id": rid, "created": int(time.time()), "model": body.model or model_id}
        if body.stream:
            return EventSourceResponse(_sse(handle, tokens, stream, meta, chat, len(prompt)), ping=15)
        try:
            while True:
                try:
                    item = await asyncio.wait_for(tokens.get(), 0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        handle.cancel()
                        log.info("%s: the client went away; cancelled", rid)
                        return JSONResponse(error_body("client disconnected"), status_code=499)
                    continue
                if item is None:
                    break
                stream.push(item)
                if stream.stopped:
                    handle.cancel()
                    break
        finally:
            handle.cancel()  # no-op once it ended
        if not every_round:  # the tokens come at the end only
            stream.push(handle.tokens)
        stream.finish()
        return _final(handle, stream, stream.text, meta, chat, len(prompt))

    return app


def _pump(handle: RequestHandle, every_round: bool = True) -> asyncio.Queue[list[int] | None]:
    """The handle's tokens, one list per round, into an asyncio queue of the running loop (None at
    the end): the engine's thread hands them over itself, one wake-up of the loop per round
    (`every_round` False: only the end is handed over)."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue[list[int] | None] = asyncio.Queue()

    def hand_over(item: list[int] | None) -> None:
        if item is not None and not every_round:
            return
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the loop is closed (the server is going down): nobody listens
            pass

    handle.subscribe(hand_over)
    return q


def _finish_reason(handle: RequestHandle, stream: TextStream) -> str:
    if stream.stopped:
        return "stop"
    reason = handle.finish_reason
    if reason == "error":
        raise ApiError(500, f"generation failed: {handle.error!r}", "server_error")
    return "length" if reason == "length" else "stop"


def _usage(handle: RequestHandle, prompt_len: int) -> dict[str, Any]:
    n = len(handle.tokens)
    return {
        "prompt_tokens": prompt_len,
        "completion_tokens": n,
        "total_tokens": prompt_len + n,
        "prompt_tokens_details": {"cached_tokens": handle.stats.cached_tokens},
    }


def _final(
    handle: RequestHandle, stream: TextStream, out: str, meta: dict[str, Any], chat: bool, prompt_len: int
) -> dict[str, Any]:
    reason = _finish_reason(handle, stream)
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": out},
            "finish_reason": reason,
            "logprobs": None,
        }
    else:
        choice = {"index": 0, "text": out, "finish_reason": reason, "logprobs": None}
    return {
        **meta,
        "object": "chat.completion" if chat else "text_completion",
        "choices": [choice],
        "usage": _usage(handle, prompt_len),
        "speculation": handle.stats.to_dict(),
    }


async def _sse(
    handle: RequestHandle,
    tokens: asyncio.Queue[list[int] | None],
    stream: TextStream,
    meta: dict[str, Any],
    chat: bool,
    prompt_len: int,
) -> AsyncIterator[str]:
    """The request's chunks as SSE data lines; cancelled when the client goes away."""
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(piece: str | None, reason: str | None, first: bool = False) -> str:
        if chat:
            delta: dict[str, Any] = (
                {"role": "assistant", "content": piece or ""}
                if first
                else ({"content": piece} if piece is not None else {})
            )
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": piece or "", "finish_reason": reason, "logprobs": None}
        return json.dumps({**meta, "object": obj, "choices": [choice]})

    try:
        if chat:
            yield chunk("", None, first=True)
        while True:
            item = await tokens.get()
            if item is None:
                break
            piece = stream.push(item)
            if piece:
                yield chunk(piece, None)
            if stream.stopped:
                handle.cancel()
                break
        if handle.finish_reason == "error" and not stream.stopped:
            # the status line went out with the first chunk: the failure is told in the stream,
            # as OpenAI's API does (its client raises an APIError on a data line with "error")
            yield json.dumps(error_body(f"generation failed: {handle.error!r}", "server_error"))
            return
        rest = stream.finish()
        if rest:
            yield chunk(rest, None)
        final = json.loads(chunk(None, _finish_reason(handle, stream)))
        final["usage"] = _usage(handle, prompt_len)
        final["speculation"] = handle.stats.to_dict()
        yield json.dumps(final)
        yield "[DONE]"
    finally:
        if handle.cancel():
            log.info("%s: the stream's client went away; cancelled", handle.id)
