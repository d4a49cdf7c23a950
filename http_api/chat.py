"""OpenAI request bodies (``/v1/chat/completions``, ``/v1/completions``) into the one request record
(``serving.records.Request``), which the routes hand to ``ServingCore.prepare``.

Unknown parameters are ignored, as OpenAI-compatible servers do; a known one that no engine here can
honour (``logprobs``, ``audio``, ``store``, ... : ``UNSUPPORTED``) is a 400 when set, and one with a bad
value is a 400 whose message and ``param`` name it as sent (``messages[2].tool_calls[0].function.arguments``,
``max_completion_tokens``). Reprise's own extras, beside OpenAI's: ``top_k``, ``repetition_penalty``,
``min_tokens``, ``ignore_eos``, ``speculation`` (``auto`` / ``off``: the same output, off decodes one
token per step). The Responses API's bodies share these helpers (``http_api.responses``). The core's
errors name the record's fields; ``ApiCall.spelling`` words them as the body named them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from serving import errors
from serving.prepare import MAX_LOGIT_BIAS, MAX_SESSION_CHARS, check_id, check_message_count
from serving.records import (
    ChatMessage,
    GenerateParams,
    PromptInput,
    Request,
    ResponseFormat,
    Tool,
    ToolCall,
    ToolChoice,
)

# The request record's fields as the OpenAI API names them (``max_new_tokens`` is whichever of
# ``max_tokens`` and ``max_completion_tokens`` the body sent: ``spelling``).
FIELDS = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
          "response_format.schema": "response_format.json_schema.schema", "tools[{i}]": "tools[{i}].function",
          "session_id": "prompt_cache_key"}


def spelling(max_tokens_field: str, fields: Mapping[str, str] = FIELDS) -> errors.Spelling:
    """A body's ``Spelling`` of the record's fields (``max_tokens_field``: the name it gave max_new_tokens)."""
    return errors.spelling({**fields, "max_new_tokens": max_tokens_field})


@dataclass(frozen=True, slots=True)
class ApiCall:
    """A request as the body asked for it, with what the HTTP front needs to answer it: whether to
    stream, whether a stream ends with usage, how its errors name fields, and whether the reply may carry
    several tool calls (``parallel_tool_calls`` false: the first call only)."""

    request: Request
    stream: bool
    include_usage: bool
    spelling: errors.Spelling
    parallel_tool_calls: bool = True


def bad(field: str, message: str) -> errors.InvalidArgument:
    return errors.InvalidArgument(f"{field} {message}", field)


def opt(body: Mapping[str, Any], name: str, kinds: type | tuple[type, ...], what: str) -> Any:
    """``body[name]`` when present and of ``kinds`` (bools are not numbers), else None; a 400 otherwise."""
    value = body.get(name)
    if value is None:
        return None
    allowed = kinds if isinstance(kinds, tuple) else (kinds,)
    if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, allowed):
        raise bad(name, f"must be {what}, got {json.dumps(value)[:60]}")
    return value


def text_content(field: str, content: Any) -> str:
    """A message's content: a string, or a list of text parts (joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(field, "must be a string or a list of text parts")
    out = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            out.append(part)
            continue
        if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad(f"{field}[{j}].type", f"{json.dumps(kind)[:40]} is not supported: send text parts")
        if not isinstance(part.get("text"), str):
            raise bad(f"{field}[{j}].text", "must be a string")
        out.append(part["text"])
    return "".join(out)


def _message(i: int, m: Any) -> ChatMessage:
    field = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(field, "must be an object")
    role = m.get("role")
    if not isinstance(role, str):
        raise bad(f"{field}.role", "must be a string")
    calls = []
    raw_calls = m.get("tool_calls") or []
    if not isinstance(raw_calls, list):
        raise bad(f"{field}.tool_calls", "must be a list")
    for j, c in enumerate(raw_calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"{field}.tool_calls[{j}].function.name", "must be a string")
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            raise bad(f"{field}.tool_calls[{j}].function.arguments", "must be a string (JSON text)")
        calls.append(ToolCall(str(c.get("id") or ""), fn["name"], args))
    call_id = m.get("tool_call_id") or ""
    name = m.get("name") or ""
    if not isinstance(call_id, str):
        raise bad(f"{field}.tool_call_id", "must be a string")
    if not isinstance(name, str):
        raise bad(f"{field}.name", "must be a string")
    return ChatMessage(role, text_content(f"{field}.content", m.get("content")), tuple(calls), call_id, name)


def function_tool(field: str, name: Any, description: Any, parameters: Any) -> Tool:
    """One function tool; its schema is checked by the core."""
    if not isinstance(name, str):
        raise bad(f"{field}.name", "must be a string")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad(f"{field}.parameters", "must be a JSON Schema object")
    if description is not None and not isinstance(description, str):
        raise bad(f"{field}.description", "must be a string")
    return Tool(name, description or "", json.dumps(parameters or {}))


def _tools(body: Mapping[str, Any]) -> tuple[Tool, ...]:
    raw = body.get("tools") or []
    if not isinstance(raw, list):
        raise bad("tools", "must be a list")
    tools = []
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise bad(f"tools[{i}]", 'must be {"type": "function", "function": {...}}')
        tools.append(function_tool(f"tools[{i}].function", fn.get("name"), fn.get("description"), fn.get("parameters")))
    return tuple(tools)


def tool_choice(raw: Any, field: str = "tool_choice") -> ToolChoice:
    """``auto``, ``none``, ``required``, a named function (chat's ``{"type": "function", "function":
    {"name"}}`` or the Responses API's ``{"type": "function", "name"}``), or ``allowed_tools`` (chat's
    ``{"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}`` or the Responses API's
    ``{"type": "allowed_tools", "mode", "tools"}``)."""
    if raw is None or raw == "auto":
        return ToolChoice("auto")
    if raw in ("none", "required"):
        return ToolChoice(raw)
    if isinstance(raw, dict) and raw.get("type") == "function":
        fn: dict[str, Any] = raw["function"] if isinstance(raw.get("function"), dict) else raw
        if isinstance(fn.get("name"), str):
            return ToolChoice("function", fn["name"])
    if isinstance(raw, dict) and raw.get("type") == "allowed_tools":
        spec: dict[str, Any] = raw["allowed_tools"] if isinstance(raw.get("allowed_tools"), dict) else raw
        mode, listed = spec.get("mode", "auto"), spec.get("tools")
        if mode not in ("auto", "required"):
            raise bad(f"{field}.mode", f'must be "auto" or "required", got {json.dumps(mode)[:40]}')
        if not isinstance(listed, list):
            raise bad(f"{field}.tools", 'must be a list of {"type": "function", "function": {"name": ...}}')
        names = []
        for i, t in enumerate(listed):
            named = t.get("function") if isinstance(t, dict) and isinstance(t.get("function"), dict) else t
            if not isinstance(named, dict) or not isinstance(named.get("name"), str):
                raise bad(f"{field}.tools[{i}]", 'must name a function: {"type": "function", "function": {"name": ...}}')
            names.append(named["name"])
        return ToolChoice(mode, allowed=tuple(names))
    kind = raw.get("type") if isinstance(raw, dict) else raw
    raise bad(field, 'must be "auto", "none", "required", a function ({"type": "function", ...}) or '
                     f'{{"type": "allowed_tools", ...}}; got {json.dumps(kind)[:40]}')


def response_format(raw: Any, field: str = "response_format") -> ResponseFormat:
    """Chat's ``response_format`` (the Responses API's ``text.format`` has the schema one level up)."""
    if raw is None:
        return ResponseFormat()
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind in ("text", "json_object"):
        return ResponseFormat(kind)
    if kind == "json_schema":
        spec = raw.get("json_schema", raw)  # chat nests the schema's spec; Responses' text.format does not
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise bad(f"{field}.json_schema", 'must be {"name": ..., "schema": {...}}')
        return ResponseFormat("json_schema", json.dumps(spec.get("schema") or {}))
    raise bad(f"{field}.type", f"must be text, json_object or json_schema, got {json.dumps(kind)[:40]}")


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise bad("stop", "must be a string or a list of strings")


def logit_bias(body: Mapping[str, Any]) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token id as a string -> bias in [-100, 100]) as sorted pairs (the core
    checks the ids against the model's vocabulary)."""
    raw = opt(body, "logit_bias", dict, "an object of token id -> bias") or {}
    if len(raw) > MAX_LOGIT_BIAS:  # counted before any entry is read
        raise bad("logit_bias", f"has {len(raw)} entries; at most {MAX_LOGIT_BIAS}")
    pairs = []
    for key, value in raw.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise bad("logit_bias", f"keys must be token ids, got {str(key)!r:.40}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise errors.InvalidArgument(f"logit_bias[{key!r}] must be a number in [-100, 100], got {value!r:.40}",
                                         "logit_bias")
        pairs.append((token, float(value)))
    return tuple(sorted(pairs))


# Sampling values of a body: name -> (types, what a bad one is told it must be).
_SAMPLING: dict[str, tuple[type | tuple[type, ...], str]] = {
    "temperature": ((int, float), "a number"), "top_p": ((int, float), "a number"), "top_k": (int, "an integer"),
    "seed": (int, "an integer"), "repetition_penalty": ((int, float), "a number"),
    "presence_penalty": ((int, float), "a number"), "frequency_penalty": ((int, float), "a number")}


def sampling(body: Mapping[str, Any], max_tokens_field: str) -> GenerateParams:
    """Sampling and stopping values of a body (``max_tokens_field``: the name it gives max_new_tokens); a
    value left out keeps ``GenerateParams``' default."""
    speculation = body.get("speculation", "auto")
    if speculation not in ("auto", "off"):
        raise bad("speculation", f'must be "auto" or "off", got {json.dumps(speculation)[:40]}')
    given = {name: opt(body, name, kinds, what) for name, (kinds, what) in _SAMPLING.items()}
    return GenerateParams(
        **{name: value for name, value in given.items() if value is not None},
        logit_bias=logit_bias(body),
        max_new_tokens=opt(body, max_tokens_field, int, "an integer"),
        min_new_tokens=opt(body, "min_tokens", int, "an integer") or 0,
        stop=_stop(body),
        ignore_eos=bool(opt(body, "ignore_eos", bool, "a boolean")),
        speculate=speculation != "off",
    )


def session(body: Mapping[str, Any], header: str | None) -> str:
    """The agent session: header ``X-Session-Id``, else ``prompt_cache_key``."""
    value = header or opt(body, "prompt_cache_key", str, "a string") or ""
    return check_id("prompt_cache_key", value, MAX_SESSION_CHARS)


# What no engine of this server can honour, refused when set to anything but its default (the value
# that asks for nothing): name -> (defaults, what to do instead).
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "logprobs": ((None, False, 0), "this server returns no log probabilities"),
    "top_logprobs": ((None, 0), "this server returns no log probabilities"),
    "best_of": ((None, 1), "one completion per request"),
    "suffix": ((None, ""), "send the whole prompt"),
    "audio": ((None,), "the served model writes text only"),
    "modalities": ((None, ["text"]), "the served model writes text only"),
    "prediction": ((None,), "predicted outputs are not supported: Reprise drafts from the tenant's history"),
    "web_search_options": ((None,), "this server runs no web search"),
    "reasoning_effort": ((None,), "the served model does not reason in a separate channel"),
    "functions": ((None,), "send tools"),
    "function_call": ((None,), "send tools and tool_choice"),
    "store": ((None, False), "chat completions are not stored here; /v1/responses stores responses"),
}


def refuse_unsupported(body: Mapping[str, Any]) -> None:
    """A 400 naming the first parameter set that this server cannot honour (never silently ignored)."""
    for name, (defaults, instead) in UNSUPPORTED.items():
        value = body.get(name)
        if not any(value == d and type(value) is type(d) for d in defaults):
            raise bad(name, f"{json.dumps(value)[:40]} is not supported: {instead}")


def _common(body: Any) -> tuple[GenerateParams, errors.Spelling, bool, bool]:
    if not isinstance(body, dict):
        raise errors.InvalidArgument("the body must be a JSON object")
    refuse_unsupported(body)
    n = opt(body, "n", int, "an integer")
    if n is not None and n != 1:
        raise bad("n", f"must be 1 (one choice per request), got {n}")
    max_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    params = sampling(body, max_field)
    opt(body, "user", str, "a string")
    stream = bool(opt(body, "stream", bool, "a boolean"))
    options = opt(body, "stream_options", dict, "an object") or {}
    return params, spelling(max_field), stream, bool(options.get("include_usage")) and stream


def chat_request(body: Any, tenant: str, session_header: str | None) -> ApiCall:
    """A ``/v1/chat/completions`` body."""
    params, spell, stream, include_usage = _common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list")
    check_message_count("messages", len(messages))
    prompt = PromptInput(messages=tuple(_message(i, m) for i, m in enumerate(messages)), tools=_tools(body))
    choice, fmt = tool_choice(body.get("tool_choice")), response_format(body.get("response_format"))
    request = Request(tenant, prompt, params, session_id=session(body, session_header), tool_choice=choice,
                      response_format=fmt)
    parallel = opt(body, "parallel_tool_calls", bool, "a boolean") is not False
    return ApiCall(request, stream, include_usage, spell, parallel)


def completion_request(body: Any, tenant: str, session_header: str | None) -> ApiCall:
    """A ``/v1/completions`` body: one prompt, as text or token ids."""
    params, spell, stream, include_usage = _common(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        given = PromptInput(text=prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        given = PromptInput(token_ids=tuple(prompt))
    else:
        raise bad("prompt", "must be one non-empty string or one non-empty list of token ids")
    if body.get("echo"):
        raise bad("echo", "is not supported")
    return ApiCall(Request(tenant, given, params, session_id=session(body, session_header)), stream, include_usage,
                   spell)
