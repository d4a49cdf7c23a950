"""The OpenAI-compatible routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``.

Each request is authenticated by its bearer key (a tenant's API key; an admin key is refused), parsed
and validated (``params``), then decoded through the shared front (``grpc_api.front.DecodeFront``) with
the same admission, limits and metering as the gRPC data plane. Streams are server-sent events with
one event per chunk of ``server.stream_chunk_tokens`` tokens (the side-channel rule of the gRPC
stream); with tools, text that may start a tool call is held back and the calls leave, parsed, at the
end. Errors are OpenAI error objects (``errors.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from grpc_api import errors
from grpc_api.backend import Authenticator, Generation, Principal
from grpc_api.front import DecodeFront, parse_reply
from grpc_api.interceptors import bearer_key
from grpc_api.tool_calls import ParsedReply, StreamingToolText
from reprise.server.openai_api.errors import BodyTooLarge, error_body
from reprise.server.openai_api.params import ApiRequest, chat_request, completion_request

FINISH = {"stop": "stop", "eos": "stop", "length": "length", "tool_calls": "tool_calls", "aborted": "abort"}


def openai_router(front: DecodeFront, authenticator: Authenticator, max_body_bytes: int) -> APIRouter:
    """The ``/v1`` routes over ``front``."""
    router = APIRouter(prefix="/v1")
    info = front.info
    created = int(time.time())
    model_card = {"id": info.model_name, "object": "model", "created": created, "owned_by": "reprise",
                  "max_model_len": info.max_context_tokens}

    def principal(request: Request) -> Principal:
        header = request.headers.get("authorization")
        key = bearer_key([("authorization", header)] if header is not None else [])
        if not key:
            raise errors.Unauthenticated("send your API key as 'Authorization: Bearer rpk_...'")
        who = authenticator.authenticate(key)
        if who is None:
            raise errors.Unauthenticated("the API key is unknown or revoked")
        if who.kind != "tenant":
            raise errors.PermissionDenied("an admin key cannot decode: use a tenant's API key")
        return who

    async def body_of(request: Request) -> Any:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > max_body_bytes:
            raise BodyTooLarge(f"the body has {size} bytes; at most {max_body_bytes} are accepted")
        raw = await request.body()
        if len(raw) > max_body_bytes:
            raise BodyTooLarge(f"the body has {len(raw)} bytes; at most {max_body_bytes} are accepted")
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise errors.InvalidArgument(f"the body is not valid JSON: {exc}") from None

    def check_model(body: Any) -> None:
        model = body.get("model") if isinstance(body, dict) else None
        if model is not None and model != info.model_name:
            raise errors.NotFound(f"the model {model!r} does not exist; this server serves {info.model_name!r}")

    @router.get("/models")
    async def models(request: Request) -> Response:
        principal(request)
        return JSONResponse({"object": "list", "data": [model_card]})

    @router.get("/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> Response:
        principal(request)
        if model_id != info.model_name:
            raise errors.NotFound(f"the model {model_id!r} does not exist; this server serves {info.model_name!r}")
        return JSONResponse(model_card)

    @router.post("/chat/completions")
    async def chat(request: Request) -> Response:
        who = principal(request)
        body = await body_of(request)
        check_model(body)
        api = chat_request(body, front, request.headers.get("x-session-id"))
        return await unless_disconnected(request, respond(who, api, chat=True))

    @router.post("/completions")
    async def completions(request: Request) -> Response:
        who = principal(request)
        body = await body_of(request)
        check_model(body)
        api = completion_request(body, front, request.headers.get("x-session-id"))
        return await unless_disconnected(request, respond(who, api, chat=False))

    async def respond(who: Principal, api: ApiRequest, chat: bool) -> Response:
        items = front.decode(who.id, api.job)
        # Admission and the prompt's checks happen before the first token: run up to it, so that their
        # errors still get their own status (429, 400) instead of an event in a 200 stream.
        first: list[Any] = []
        try:
            async for item in items:
                first.append(item)
                if not isinstance(item, str):
                    break
        except BaseException:
            await items.aclose()
            raise
        ident = ("chatcmpl-" if chat else "cmpl-") + api.job.request_id
        if api.stream:
            return StreamingResponse(stream(items, first, api, ident, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": ident})
        async with contextlib.aclosing(items):
            texts: list[str] = []
            generation: Generation | None = None
            for item in [*first, *[x async for x in items]]:
                if isinstance(item, Generation):
                    generation = item
                elif not isinstance(item, str):
                    texts.append(item[1])
        assert generation is not None
        text = "".join(texts)
        generation, reply = parse_reply(api.job, text, generation)
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
            if reply is not None:
                message["content"] = reply.content or None
                message["tool_calls"] = tool_calls(reply)
            choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None,
                                      "finish_reason": FINISH.get(generation.finish_reason, "stop")}
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": FINISH.get(generation.finish_reason, "stop")}
        return JSONResponse({"id": ident, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": info.model_name, "choices": [choice],
                             "usage": usage(generation), "system_fingerprint": None},
                            headers={"X-Request-Id": ident})

    async def stream(items: AsyncGenerator[Any, None], first: list[Any], api: ApiRequest, ident: str,
                     chat: bool) -> AsyncIterator[bytes]:
        created_at = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list[dict], **extra: Any) -> bytes:
            doc = {"id": ident, "object": kind, "created": created_at, "model": info.model_name,
                   "choices": choices, "system_fingerprint": None, **extra}
            return b"data: " + json.dumps(doc, ensure_ascii=False).encode() + b"\n\n"

        def delta(text: str = "", finish: str | None = None, calls: list[dict] | None = None) -> bytes:
            if not chat:
                return event([{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}])
            d: dict[str, Any] = {}
            if text:
                d["content"] = text
            if calls:
                d["tool_calls"] = calls
            return event([{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}])

        held = StreamingToolText() if api.job.tool_format is not None else None
        texts: list[str] = []
        async with contextlib.aclosing(items):
            try:
                if chat:
                    yield event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
                generation: Generation | None = None
                async for item in _chain(first, items):
                    if isinstance(item, str):
                        continue
                    if isinstance(item, Generation):
                        generation = item
                        break
                    texts.append(item[1])
                    out = held.feed(item[1]) if held is not None else item[1]
                    if out:
                        yield delta(out)
                assert generation is not None
                generation, reply = parse_reply(api.job, "".join(texts), generation)
                rest = held.finish() if held is not None else ""
                if reply is not None:
                    yield delta(calls=[{"index": i, **c} for i, c in enumerate(tool_calls(reply))])
                elif rest:
                    yield delta(rest)
                yield delta(finish=FINISH.get(generation.finish_reason, "stop"))
                if api.include_usage:
                    yield event([], usage=usage(generation))
            except (errors.ServiceError, ValueError) as exc:  # the stream has begun: the error is an event
                yield b"data: " + json.dumps(error_body(exc)[1]).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

    return router


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


async def _chain(first: list[Any], rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    for item in first:
        yield item
    async for item in rest:
        yield item


def tool_calls(reply: ParsedReply) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in reply.tool_calls]


def usage(g: Generation) -> dict[str, Any]:
    return {"prompt_tokens": g.prompt_tokens, "completion_tokens": g.completion_tokens,
            "total_tokens": g.prompt_tokens + g.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": getattr(g, "cached_tokens", 0)}}
