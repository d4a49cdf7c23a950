"""The OpenAI-compatible routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``
(the Responses API is ``http_api.responses``).

Each request is authenticated by its bearer key (a tenant's API key; an admin key is refused), parsed
(``http_api.chat``) and run through the serving core with the same admission, limits and metering as
the gRPC data plane. Streams are server-sent events, one per ``TextDelta`` of the core: each carries the
text of ``server.stream_chunk_tokens`` tokens (default one token per event), never a verification step's
worth; in chat, text that may start a tool call is held back and the calls leave, parsed, at the end.
Errors are OpenAI error objects (``http_api.errors``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from http_api.auth import principal
from http_api.body import read_json
from http_api.chat import ApiCall, chat_request, completion_request
from http_api.errors import error_body
from serving import errors
from serving.core import ServingCore
from serving.records import (
    Authenticator,
    Event,
    Finished,
    ModelInfo,
    Started,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    Usage,
)

FINISH = {"stop": "stop", "eos": "stop", "length": "length", "tool_calls": "tool_calls", "aborted": "abort",
          "error": "error"}


def model_card(info: ModelInfo, created: int) -> dict[str, Any]:
    return {"id": info.model_name, "object": "model", "created": created, "owned_by": "reprise",
            "max_model_len": info.max_context_tokens}


def check_model(body: Any, info: ModelInfo) -> None:
    model = body.get("model") if isinstance(body, dict) else None
    if model is not None and model != info.model_name:
        raise errors.NotFound(f"the model {model!r:.80} does not exist; this server serves {info.model_name!r}",
                              "model", what="model")


async def until_started(events: AsyncGenerator[Event, None]) -> Started:
    """Run a request up to ``Started``: admission and the prompt's checks raise here, so their errors
    keep their own status (429, 400) instead of becoming an event in a 200 stream."""
    try:
        first = await events.__anext__()
    except BaseException:
        await events.aclose()
        raise
    assert isinstance(first, Started)
    return first


def openai_router(core: ServingCore, authenticator: Authenticator, max_body_bytes: int) -> APIRouter:
    """The ``/v1`` routes over ``core``."""
    router = APIRouter(prefix="/v1")
    info = core.info
    card = model_card(info, int(time.time()))

    @router.get("/models")
    async def models(request: Request) -> Response:
        principal(authenticator, request, "tenant")
        return JSONResponse({"object": "list", "data": [card]})

    @router.get("/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> Response:
        principal(authenticator, request, "tenant")
        if model_id != info.model_name:
            raise errors.NotFound(f"the model {model_id!r:.80} does not exist; this server serves {info.model_name!r}",
                                  what="model")
        return JSONResponse(card)

    @router.post("/chat/completions")
    async def chat(request: Request) -> Response:
        who = principal(authenticator, request, "tenant")
        body = await read_json(request, max_body_bytes)
        check_model(body, info)
        call = chat_request(body, who.id, request.headers.get("x-session-id"))
        return await unless_disconnected(request, respond(call, chat=True))

    @router.post("/completions")
    async def completions(request: Request) -> Response:
        who = principal(authenticator, request, "tenant")
        body = await read_json(request, max_body_bytes)
        check_model(body, info)
        call = completion_request(body, who.id, request.headers.get("x-session-id"))
        return await unless_disconnected(request, respond(call, chat=False))

    async def respond(call: ApiCall, chat: bool) -> Response:
        with errors.spelled(call.spelling):
            prepared = core.prepare(call.request)
            events = core.generate(prepared, hold_tool_text=chat)
            await until_started(events)
            reply = _Reply(("chatcmpl-" if chat else "cmpl-") + prepared.request_id, info.model_name, chat, call)
            if call.stream:
                return StreamingResponse(reply.stream(events), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Request-Id": reply.id})
            end: Finished | None = None
            async with contextlib.aclosing(events):
                async for event in events:
                    if isinstance(event, Finished):
                        end = event
        assert end is not None
        return reply.whole(end)

    return router


class _Reply:
    """One Chat Completions (``chat``) or Completions answer: whole, or as chunks of server-sent events."""

    def __init__(self, ident: str, model: str, chat: bool, call: ApiCall) -> None:
        self.id, self.model, self.chat, self.call = ident, model, chat, call
        self.created = int(time.time())

    def whole(self, end: Finished) -> Response:
        if not self.call.parallel_tool_calls and len(end.tool_calls) > 1:
            end = dataclasses.replace(end, tool_calls=end.tool_calls[:1])
        choice: dict[str, Any]
        if self.chat:
            content = (end.content or None) if end.tool_calls else end.content
            message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
            if end.tool_calls:
                message["tool_calls"] = tool_calls(end.tool_calls)
            choice = {"index": 0, "message": message, "logprobs": None,
                      "finish_reason": FINISH.get(end.finish_reason, "stop")}
        else:
            choice = {"index": 0, "text": end.text, "logprobs": None, "finish_reason": FINISH.get(end.finish_reason, "stop")}
        return JSONResponse({"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                             "created": int(time.time()), "model": self.model, "choices": [choice],
                             "usage": usage(end.usage), "system_fingerprint": None},
                            headers={"X-Request-Id": self.id})

    async def stream(self, events: AsyncGenerator[Event, None]) -> AsyncIterator[bytes]:
        async with contextlib.aclosing(events):
            try:
                if self.chat:
                    yield self._event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                        "finish_reason": None}])
                async for item in events:
                    if isinstance(item, TextDelta):
                        if item.text:
                            yield self._delta(item.text)
                    elif isinstance(item, ToolCallDelta):
                        if item.index and not self.call.parallel_tool_calls:
                            continue  # parallel_tool_calls false: the first call only
                        yield self._delta(calls=[{"index": item.index, **tool_calls((item.call,))[0]}])
                    elif isinstance(item, Finished):
                        yield self._delta(finish=FINISH.get(item.finish_reason, "stop"))
                        if self.call.include_usage:
                            yield self._event([], usage=usage(item.usage))
            except (errors.ServiceError, ValueError) as exc:  # the stream has begun: the error is an event
                yield sse(error_body(exc, self.call.spelling)[1])
            yield b"data: [DONE]\n\n"

    def _event(self, choices: list[dict], **extra: Any) -> bytes:
        return sse({"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                    "created": self.created, "model": self.model, "choices": choices, "system_fingerprint": None,
                    **extra})

    def _delta(self, text: str = "", finish: str | None = None, calls: list[dict] | None = None) -> bytes:
        if not self.chat:
            return self._event([{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}])
        d: dict[str, Any] = {}
        if text:
            d["content"] = text
        if calls:
            d["tool_calls"] = calls
        return self._event([{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}])


def sse(doc: dict[str, Any], name: str | None = None) -> bytes:
    """One server-sent event (with an ``event:`` line when ``name`` is given)."""
    head = f"event: {name}\n".encode() if name else b""
    return head + b"data: " + json.dumps(doc, ensure_ascii=False).encode() + b"\n\n"


async def unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """``work``'s response, or, when the client goes away first, ``work`` cancelled (its request stops
    decoding at the engine's next step and frees its place) and a 499 nobody reads. A streamed response
    is watched by the stream itself once it has begun."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)
    return task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def tool_calls(calls: tuple[ToolCall, ...]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def usage(u: Usage) -> dict[str, Any]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "total_tokens": u.total_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


