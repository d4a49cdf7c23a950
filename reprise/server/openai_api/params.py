"""OpenAI request bodies (``/v1/chat/completions``, ``/v1/completions``) into ``grpc_api.front`` records.

Unknown parameters are ignored, as OpenAI-compatible servers do; a known one with a bad value is a
400 whose message names it (``messages[2].tool_calls[0].function.arguments must be a string``).
Reprise's own extras, beside OpenAI's: ``top_k``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``speculation`` (``auto`` / ``off``: the same output, off decodes one token per step).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Mapping
from typing import Any

from grpc_api import errors
from grpc_api.backend import ChatMessage, PromptInput, Tool, ToolCall
from grpc_api.front import (
    MAX_SESSION_CHARS,
    DecodeFront,
    DecodeJob,
    RawParams,
    ResponseFormat,
    ToolChoice,
    check_id,
    check_messages,
    check_params,
    check_tools,
    output_constraint,
)

# RawParams' fields as the OpenAI API names them, for error messages.
FIELDS = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "tool_choice": "tool_choice",
          "response_format": "response_format", "json_schema": "response_format.json_schema.schema"}


@dataclasses.dataclass(frozen=True, slots=True)
class ApiRequest:
    """A validated request: the job, whether to stream, and whether to end a stream with usage."""

    job: DecodeJob
    stream: bool
    include_usage: bool


def _bad(message: str) -> errors.InvalidArgument:
    return errors.InvalidArgument(message)


def _opt(body: Mapping[str, Any], name: str, kinds: type | tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise _bad(f"{name} must be {what}, got {json.dumps(value)}")
    if not isinstance(value, kinds):
        raise _bad(f"{name} must be {what}, got {json.dumps(value)[:60]}")
    return value


def _text(field: str, content: Any) -> str:
    """A message's content: a string, or a list of text parts (joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{field} must be a string or a list of text parts")
    out = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            out.append(part)
            continue
        if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise _bad(f"{field}[{j}].type {kind!r} is not supported: send text parts")
        if not isinstance(part.get("text"), str):
            raise _bad(f"{field}[{j}].text must be a string")
        out.append(part["text"])
    return "".join(out)


def _message(i: int, m: Any) -> ChatMessage:
    field = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _bad(f"{field} must be an object")
    role = m.get("role")
    if not isinstance(role, str):
        raise _bad(f"{field}.role must be a string")
    calls = []
    raw_calls = m.get("tool_calls") or []
    if not isinstance(raw_calls, list):
        raise _bad(f"{field}.tool_calls must be a list")
    for j, c in enumerate(raw_calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"{field}.tool_calls[{j}].function.name must be a string")
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            raise _bad(f"{field}.tool_calls[{j}].function.arguments must be a string (JSON text)")
        calls.append(ToolCall(str(c.get("id") or ""), fn["name"], args))
    call_id = m.get("tool_call_id") or ""
    name = m.get("name") or ""
    if not isinstance(call_id, str) or not isinstance(name, str):
        raise _bad(f"{field}.tool_call_id and {field}.name must be strings")
    return ChatMessage(role, _text(f"{field}.content", m.get("content")), tuple(calls), call_id, name)


def _tools(body: Mapping[str, Any]) -> tuple[Tool, ...]:
    raw = body.get("tools") or []
    if not isinstance(raw, list):
        raise _bad("tools must be a list")
    tools = []
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise _bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        if not isinstance(fn.get("name"), str):
            raise _bad(f"tools[{i}].function.name must be a string")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _bad(f"tools[{i}].function.parameters must be a JSON Schema object")
        tools.append(Tool(fn["name"], str(fn.get("description") or ""), json.dumps(params or {})))
    return check_tools("tools", tools)


def _tool_choice(body: Mapping[str, Any]) -> ToolChoice:
    raw = body.get("tool_choice")
    if raw is None or raw == "auto":
        return ToolChoice("auto")
    if raw in ("none", "required"):
        return ToolChoice(raw)
    if isinstance(raw, dict) and isinstance(raw.get("function"), dict) and isinstance(raw["function"].get("name"), str):
        return ToolChoice("function", raw["function"]["name"])
    raise _bad('tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}, '
               f"got {json.dumps(raw)[:80]}")


def _response_format(body: Mapping[str, Any]) -> ResponseFormat:
    raw = body.get("response_format")
    if raw is None:
        return ResponseFormat()
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind in ("text", "json_object"):
        return ResponseFormat(kind)
    if kind == "json_schema":
        spec = raw.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise _bad("response_format.json_schema must be {\"name\": ..., \"schema\": {...}}")
        return ResponseFormat("json_schema", json.dumps(spec.get("schema") or {}))
    raise _bad(f"response_format.type must be text, json_object or json_schema, got {json.dumps(kind)}")


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise _bad("stop must be a string or a list of strings")


def _common(body: Mapping[str, Any], front: DecodeFront, session_header: str | None) -> tuple[RawParams, str, bool,
                                                                                              bool]:
    n = _opt(body, "n", int, "an integer")
    if n is not None and n != 1:
        raise _bad(f"n must be 1 (one choice per request), got {n}")
    max_tokens = _opt(body, "max_completion_tokens", int, "an integer")
    if max_tokens is None:
        max_tokens = _opt(body, "max_tokens", int, "an integer")
    speculation = body.get("speculation", "auto")
    if speculation not in ("auto", "off"):
        raise _bad(f'speculation must be "auto" or "off", got {json.dumps(speculation)[:40]}')
    raw = RawParams(
        temperature=_opt(body, "temperature", (int, float), "a number"),
        top_p=_opt(body, "top_p", (int, float), "a number"),
        top_k=_opt(body, "top_k", int, "an integer"),
        seed=_opt(body, "seed", int, "an integer"),
        repetition_penalty=_opt(body, "repetition_penalty", (int, float), "a number"),
        max_new_tokens=max_tokens,
        min_new_tokens=_opt(body, "min_tokens", int, "an integer") or 0,
        stop=_stop(body),
        ignore_eos=bool(_opt(body, "ignore_eos", bool, "a boolean")),
        speculate=speculation != "off",
    )
    session = session_header or _opt(body, "prompt_cache_key", str, "a string") or ""
    check_id("prompt_cache_key", session, MAX_SESSION_CHARS)
    _opt(body, "user", str, "a string")
    stream = bool(_opt(body, "stream", bool, "a boolean"))
    options = _opt(body, "stream_options", dict, "an object") or {}
    include_usage = bool(options.get("include_usage")) and stream
    return raw, session, stream, include_usage


def chat_request(body: Any, front: DecodeFront, session_header: str | None) -> ApiRequest:
    """A ``/v1/chat/completions`` body."""
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object")
    raw, session, stream, include_usage = _common(body, front, session_header)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list")
    front.check_chat()
    msgs = check_messages("messages", [_message(i, m) for i, m in enumerate(messages)])
    tools = _tools(body)
    choice = _tool_choice(body)
    fmt = front.info.tool_call_format
    constraint = output_constraint(tools, choice, _response_format(body), fmt, FIELDS)
    params, explicit = check_params(dataclasses.replace(raw, constraint=constraint), FIELDS, front.info)
    job = DecodeJob(uuid.uuid4().hex, session, PromptInput(messages=msgs, tools=tools), params, explicit,
                    front.chunk_tokens(0, "stream_chunk_tokens"), fmt if tools and choice.mode != "none" else None)
    return ApiRequest(job, stream, include_usage)


def completion_request(body: Any, front: DecodeFront, session_header: str | None) -> ApiRequest:
    """A ``/v1/completions`` body: one prompt, as text or token ids."""
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object")
    raw, session, stream, include_usage = _common(body, front, session_header)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        given = PromptInput(text=prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        given = PromptInput(token_ids=tuple(prompt))
    else:
        raise _bad("prompt must be one non-empty string or one non-empty list of token ids")
    if body.get("echo"):
        raise _bad("echo is not supported")
    params, explicit = check_params(raw, FIELDS, front.info)
    job = DecodeJob(uuid.uuid4().hex, session, given, params, explicit, front.chunk_tokens(0, "stream_chunk_tokens"))
    return ApiRequest(job, stream, include_usage)
