"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items`` (what the OpenAI Agents SDK calls by default).

A body's ``input`` (a string, or items: messages, ``function_call`` and ``function_call_output``) and
``instructions`` become chat messages for the serving core, the same path as Chat Completions: one
renderer, the same tools (``function`` tools; ``tool_choice`` auto / none / required / a function /
``allowed_tools``), ``text.format`` (json_object, json_schema) through the same grammar, the same
limits, metering and prefix cache (``prompt_cache_key`` or ``X-Session-Id`` is the session). The reply
comes back as output items: a ``message`` with its ``output_text``, then one ``function_call`` per
call; with ``stream`` as the semantic events the ``openai`` client and the Agents SDK consume
(``response.created``, ``response.output_text.delta``, ``response.function_call_arguments.done``,
``response.completed``, ...).

Stored responses (``store``, default true as on OpenAI): the response and the conversation it answered
are kept, sealed in the tenant's encrypted history store (``ResponseStore``, for
``server.response_retention_days``), so ``previous_response_id`` continues a conversation and GET
returns it. Ids are looked up within the caller's tenant only: another tenant's id is a 404, like an
unknown one. What this server cannot do is refused with a 400 that says so: ``background``,
``conversation``, ``prompt`` templates, ``reasoning``, ``truncation: "auto"``, tools other than functions.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping
from typing import Any, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from http_api.auth import principal
from http_api.body import read_json
from http_api.chat import (
    bad,
    function_tool,
    opt,
    response_format,
    sampling,
    session,
    spelling,
    text_content,
    tool_choice,
)
from http_api.errors import error_body
from http_api.routes import check_model, sse, unless_disconnected, until_started
from serving import errors
from serving.core import ServingCore
from serving.prepare import check_id, check_message_count
from serving.records import (
    Authenticator,
    ChatMessage,
    Event,
    Finished,
    PromptInput,
    TextDelta,
    Tool,
    ToolCall,
)
from serving.records import Request as DecodeRequest  # fastapi's Request is the HTTP request

# The request record's fields as the Responses API names them.
SPELLING = spelling("max_output_tokens", {
    "min_new_tokens": "min_tokens", "response_format": "text.format", "response_format.schema": "text.format.schema",
    "messages": "input", "prompt": "input", "session_id": "prompt_cache_key"})
MAX_ID_CHARS = 128


class ResponseStore(Protocol):
    """Stored responses, per tenant (``reprise.server.responses.StoredResponses`` over the history
    store). *Blocking* methods: the routes run them on a worker thread."""

    def put(self, tenant: str, response_id: str, record: dict[str, Any]) -> None: ...

    def get(self, tenant: str, response_id: str) -> dict[str, Any] | None: ...

    def delete(self, tenant: str, response_id: str) -> bool: ...


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- input items to chat messages ------------------------------------------------------------------


def input_items(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``input`` as a list of items (a string is one user message)."""
    raw = body.get("input")
    if isinstance(raw, str):
        if not raw:
            raise bad("input", "is empty")
        return [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad("input", "must be a non-empty string or a non-empty list of items")
    check_message_count("input", len(raw))
    return raw


def messages_of(items: list[dict[str, Any]], field: str = "input") -> list[ChatMessage]:
    """Items as chat messages: ``function_call`` items join the assistant message before them (or make
    one), ``function_call_output`` items become tool messages naming their call's function."""
    out: list[ChatMessage] = []
    names: dict[str, str] = {}
    for i, item in enumerate(items):
        where = f"{field}[{i}]"
        if not isinstance(item, dict):
            raise bad(where, "must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str):
                raise bad(f"{where}.role", "must be a string")
            out.append(ChatMessage(role, text_content(f"{where}.content", item.get("content"))))
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, str):
                raise bad(where, "must have call_id, name and arguments (JSON text) as strings")
            names[call_id] = name
            call = ToolCall(call_id, name, arguments)
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                out[-1] = ChatMessage("assistant", last.content, (*last.tool_calls, call))
            else:
                out.append(ChatMessage("assistant", "", (call,)))
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise bad(f"{where}.call_id", "must be a string")
            text = output if isinstance(output, str) else text_content(f"{where}.output", output)
            out.append(ChatMessage("tool", text, tool_call_id=call_id, name=names.get(call_id, "")))
        elif kind == "reasoning":
            continue  # another model's reasoning: this model has none to continue from
        else:
            raise bad(f"{where}.type", f"{json.dumps(kind)[:40]} is not supported: send messages, function_call "
                                       "and function_call_output items")
    return out


def _tools(body: Mapping[str, Any]) -> tuple[list[Tool], list[dict[str, Any]]]:
    """The function tools (for the core) and the tools as the response echoes them."""
    raw = body.get("tools") or []
    if not isinstance(raw, list):
        raise bad("tools", "must be a list")
    tools, echo = [], []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad(f"tools[{i}].type", f"{json.dumps(kind)[:40]} is not supported: this server runs function tools")
        tools.append(function_tool(f"tools[{i}]", t.get("name"), t.get("description"), t.get("parameters")))
        echo.append({"type": "function", "name": t.get("name"), "description": t.get("description"),
                     "parameters": t.get("parameters"), "strict": t.get("strict", True)})
    return tools, echo


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    if body.get("background"):
        raise bad("background", "is not supported: send the request and keep the connection (or stream)")
    for name in ("conversation", "prompt"):
        if body.get(name) is not None:
            raise bad(name, "is not supported: continue a conversation with previous_response_id")
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and any(v is not None for v in reasoning.values()):
        raise bad("reasoning", "is not supported: the served model does not reason in a separate channel")
    if body.get("truncation") not in (None, "disabled"):
        raise bad("truncation", 'must be "disabled": a prompt beyond the context is refused, never cut')
    if body.get("top_logprobs"):
        raise bad("top_logprobs", "is not supported")


# ---- the response object ---------------------------------------------------------------------------


def output_items(end: Finished, message_id: str, call_ids: list[str]) -> list[dict[str, Any]]:
    """A finished reply as output items: its message (when it has text), then its function calls."""
    items: list[dict[str, Any]] = []
    if end.content:
        items.append(message_item(message_id, end.content, "completed"))
    items.extend(call_item(call_ids[i], c, "completed") for i, c in enumerate(end.tool_calls))
    return items


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text or
            status == "completed" else []}


def call_item(item_id: str, call: ToolCall, status: str, arguments: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if arguments is None else arguments, "status": status}


def _status(end: Finished | None) -> tuple[str, dict[str, str] | None]:
    if end is None:
        return "in_progress", None
    if end.finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if end.finish_reason == "aborted":
        return "cancelled", None
    return "completed", None


class Turn:
    """One /v1/responses request: its echo of the parameters, its items and, at the end, its response."""

    def __init__(self, body: Mapping[str, Any], model: str, tools_echo: list[dict[str, Any]],
                 conversation: list[dict[str, Any]]) -> None:
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        self.model = model
        self.body = body
        self.tools_echo = tools_echo
        self.conversation = conversation  # every item this response answered (earlier responses' included)
        self.message_id = _new_id("msg")
        self.call_ids: list[str] = []
        self.parallel = body.get("parallel_tool_calls", True) is not False

    def response(self, end: Finished | None, output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        status, incomplete = _status(end)
        usage = None
        if end is not None:
            u = end.usage
            usage = {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
                     "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": u.total_tokens}
        b = self.body
        text = b.get("text") if isinstance(b.get("text"), dict) else {"format": {"type": "text"}}
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None, "incomplete_details": incomplete, "instructions": b.get("instructions"),
                "max_output_tokens": b.get("max_output_tokens"), "model": self.model, "output": output or [],
                "parallel_tool_calls": self.parallel, "previous_response_id": b.get("previous_response_id"),
                "reasoning": {"effort": None, "summary": None}, "store": b.get("store", True) is not False,
                "temperature": b.get("temperature"), "text": text, "tool_choice": b.get("tool_choice", "auto"),
                "tools": self.tools_echo, "top_p": b.get("top_p"), "truncation": "disabled", "usage": usage,
                "user": b.get("user"), "metadata": b.get("metadata") or {}}

    def finish(self, end: Finished) -> tuple[Finished, list[dict[str, Any]]]:
        """The reply (one call only when ``parallel_tool_calls`` is false) and its output items."""
        if not self.parallel and len(end.tool_calls) > 1:
            end = dataclasses.replace(end, tool_calls=end.tool_calls[:1])
        while len(self.call_ids) < len(end.tool_calls):
            self.call_ids.append(_new_id("fc"))
        return end, output_items(end, self.message_id, self.call_ids)


# ---- the routes ------------------------------------------------------------------------------------


def responses_router(core: ServingCore, authenticator: Authenticator, store: ResponseStore | None,
                     max_body_bytes: int) -> APIRouter:
    """The Responses API's routes over ``core``; ``store`` keeps responses (None: ``store`` is refused)."""
    router = APIRouter(prefix="/v1")
    info = core.info

    @router.post("/responses")
    async def create(request: Request) -> Response:
        who = principal(authenticator, request, "tenant")
        body = await read_json(request, max_body_bytes)
        if not isinstance(body, dict):
            raise errors.InvalidArgument("the body must be a JSON object")
        check_model(body, info)
        _refuse_unsupported(body)
        keep = body.get("store", True) is not False
        if keep and store is None:
            raise bad("store", "must be false: this server keeps no responses")
        earlier: list[dict[str, Any]] = []
        previous = opt(body, "previous_response_id", str, "a string")
        if previous:
            record = await _stored(store, who.id, previous, "previous_response_id")
            earlier = list(record.get("conversation", [])) + list(record["response"].get("output", []))
        conversation = [*earlier, *input_items(body)]
        messages = messages_of(conversation)
        instructions = opt(body, "instructions", str, "a string")
        if instructions:
            messages.insert(0, ChatMessage("system", instructions))
        tools, echo = _tools(body)
        text = opt(body, "text", dict, "an object") or {}
        choice, fmt = tool_choice(body.get("tool_choice")), response_format(text.get("format"), "text.format")
        asked = DecodeRequest(who.id, PromptInput(messages=tuple(messages), tools=tuple(tools)),
                              sampling(body, "max_output_tokens"),
                              session_id=session(body, request.headers.get("x-session-id")), tool_choice=choice,
                              response_format=fmt)
        turn = Turn(body, info.model_name, echo, conversation)
        save = (lambda response: _save(store, who.id, turn, response)) if keep and store is not None else None
        with errors.spelled(SPELLING):
            events = core.generate(core.prepare(asked), hold_tool_text=True)
            await until_started(events)
            if opt(body, "stream", bool, "a boolean"):
                return StreamingResponse(_stream(events, turn, save), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Request-Id": turn.id})
            return await unless_disconnected(request, _answer(events, turn, save))

    @router.get("/responses/{response_id}")
    async def get(response_id: str, request: Request) -> Response:
        who = principal(authenticator, request, "tenant")
        return JSONResponse((await _stored(store, who.id, response_id, "response_id"))["response"])

    @router.get("/responses/{response_id}/input_items")
    async def input_list(response_id: str, request: Request) -> Response:
        who = principal(authenticator, request, "tenant")
        items = (await _stored(store, who.id, response_id, "response_id")).get("conversation", [])
        data = [{"id": item.get("id") or f"item_{i}", **item} for i, item in enumerate(items)]
        return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                             "last_id": data[-1]["id"] if data else None, "has_more": False})

    @router.delete("/responses/{response_id}")
    async def delete(response_id: str, request: Request) -> Response:
        who = principal(authenticator, request, "tenant")
        check_id("response_id", response_id, MAX_ID_CHARS)
        gone = store is not None and await asyncio.get_running_loop().run_in_executor(
            None, store.delete, who.id, response_id)
        if not gone:
            raise errors.NotFound(f"no response {response_id!r:.80}", "response_id", what="response")
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    return router


async def _stored(store: ResponseStore | None, tenant: str, response_id: str, field: str) -> dict[str, Any]:
    """The tenant's stored response ``response_id`` (NotFound naming ``field`` when it has none)."""
    check_id(field, response_id, MAX_ID_CHARS)
    record = None
    if store is not None:
        record = await asyncio.get_running_loop().run_in_executor(None, store.get, tenant, response_id)
    if record is None:
        raise errors.NotFound(f"no response {response_id!r:.80} (never stored, expired, deleted, or not yours)",
                              field, what="response")
    return record


async def _answer(events: AsyncGenerator[Event, None], turn: Turn, save: Any) -> Response:
    """The whole response once the request has finished (``stream`` false)."""
    end: Finished | None = None
    async with contextlib.aclosing(events):
        async for event in events:
            if isinstance(event, Finished):
                end = event
    assert end is not None
    end, output = turn.finish(end)
    response = turn.response(end, output)
    if save is not None:
        await save(response)
    return JSONResponse(response, headers={"X-Request-Id": turn.id})


class _Events:
    """The stream's server-sent events, numbered in order (``sequence_number``)."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        doc = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(doc, kind)


async def _stream(events: AsyncGenerator[Event, None], turn: Turn, save: Any) -> AsyncIterator[bytes]:
    """The Responses API's semantic events: the message's text as it comes, its tool calls once the
    reply is known, and the finished response (``stream`` true)."""
    event = _Events()
    message_open, text = False, ""
    async with contextlib.aclosing(events):
        try:
            yield event("response.created", response=turn.response(None))
            yield event("response.in_progress", response=turn.response(None))
            end: Finished | None = None
            async for item in events:
                if isinstance(item, TextDelta) and item.text:
                    if not message_open:
                        message_open = True
                        yield event("response.output_item.added", output_index=0,
                                    item=message_item(turn.message_id, "", "in_progress"))
                        yield event("response.content_part.added", item_id=turn.message_id, output_index=0,
                                    content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                    text += item.text
                    yield event("response.output_text.delta", item_id=turn.message_id, output_index=0,
                                content_index=0, delta=item.text, logprobs=[])
                elif isinstance(item, Finished):  # tool calls leave below, in their own items
                    end = item
            assert end is not None
            end, output = turn.finish(end)
            for chunk in _closing_events(event, turn, end, message_open, text):
                yield chunk
            calls = [o for o in output if o["type"] != "message"]  # the streamed text is the message
            output = [message_item(turn.message_id, text, "completed"), *calls] if message_open else calls
            response = turn.response(end, output)
            if save is not None:
                await save(response)
            status = response["status"]
            yield event("response.completed" if status == "completed" else "response.incomplete"
                        if status == "incomplete" else "response.failed", response=response)
        except (errors.ServiceError, ValueError) as exc:  # the stream has begun: the error is an event
            _, doc, _ = error_body(exc, SPELLING)
            yield event("error", code=doc["error"]["code"], message=doc["error"]["message"],
                        param=doc["error"]["param"])


def _closing_events(event: _Events, turn: Turn, end: Finished, message_open: bool, text: str) -> Iterator[bytes]:
    """The message's closing events, then each tool call as an item of its own."""
    if message_open:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        yield event("response.output_text.done", item_id=turn.message_id, output_index=0, content_index=0,
                    text=text, logprobs=[])
        yield event("response.content_part.done", item_id=turn.message_id, output_index=0, content_index=0,
                    part=part)
        yield event("response.output_item.done", output_index=0, item=message_item(turn.message_id, text, "completed"))
    first = 1 if message_open else 0
    for k, call in enumerate(end.tool_calls):
        index, item_id = first + k, turn.call_ids[k]
        yield event("response.output_item.added", output_index=index, item=call_item(item_id, call, "in_progress", ""))
        yield event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                    delta=call.arguments)
        yield event("response.function_call_arguments.done", item_id=item_id, output_index=index, name=call.name,
                    arguments=call.arguments)
        yield event("response.output_item.done", output_index=index, item=call_item(item_id, call, "completed"))


async def _save(store: ResponseStore | None, tenant: str, turn: Turn, response: dict[str, Any]) -> None:
    """Keep a finished response and the conversation it answered (sealed, the tenant's)."""
    if store is None:
        return
    record = {"response": response, "conversation": turn.conversation}
    await asyncio.get_running_loop().run_in_executor(None, store.put, tenant, turn.id, record)
