"""Request validation, once for every front: ``prepare`` takes the ``Request`` a front built from its
wire and returns it validated, with what the server derives from it, or raises an error about the field
at fault.

    request = prepare(info, settings, Request(who.id, PromptInput(messages=...), GenerateParams(...),
                                              tool_choice=ToolChoice("required")))
    request = fit_to_prompt(request, prompt_ids, info, settings)      # once the prompt is rendered

Everything here is cheap and bounded by the input's size: untrusted input is measured (bytes, counts,
nesting, a lower bound on its tokens) before any work proportional to it begins, so a request that is
refused anyway never costs a chat-template rendering or a tokenization. Errors name fields by the
record's own names (``max_new_tokens``, ``messages[2].role``, ``tools[1].name``,
``response_format.schema``); each front words them in its caller's names (``serving.errors``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from serving import errors
from serving.errors import bad_field
from serving.records import (
    ChatMessage,
    GenerateParams,
    ModelInfo,
    OutputConstraint,
    PromptInput,
    Request,
    ResponseFormat,
    Tool,
    ToolChoice,
)
from serving.tool_calls import FORMATS

MAX_ID_CHARS = 128
MAX_SESSION_CHARS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300  # as OpenAI
MAX_CHUNK_TOKENS = 4096
MAX_TOOLS = 128
MAX_SCHEMA_CHARS = 64 * 1024
MAX_JSON_DEPTH = 32  # nesting of one schema; and of a whole request body (http_api)
MAX_MESSAGES = 2048
MAX_TEMPERATURE = 2.0  # OpenAI's range: [0, 2]
MIN_TEMPERATURE = 1e-5  # below this a temperature is greedy (vLLM's rule): 1e-45 would overflow the logits
REPETITION_PENALTY_RANGE = (0.1, 10.0)
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_PARAM = "tools[{i}].parameters"  # a tool's parameters at fault, as engines name it
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for function names (and '.')


@dataclass(frozen=True, slots=True)
class ServingSettings:
    """What request assembly and admission need of the server's configuration: ``reprise.config.
    ServerConfig`` has fields of the same names and defaults, and the service builds this from them
    (``ServerConfig.settings_for``)."""

    default_max_new_tokens: int = 256
    stream_chunk_tokens: int = 1
    max_concurrent_requests: int = 64
    max_requests_per_tenant: int = 16
    append_calls_per_s: float = 20.0
    append_burst_calls: int = 100
    append_tokens_per_minute: int = 1_000_000


# ---- small checks ----------------------------------------------------------------------------------


def check_id(name: str, value: str, limit: int) -> str:
    if len(value) > limit:
        raise bad_field(name, f"has {len(value)} characters; at most {limit} are allowed")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise bad_field(name, f"{value[:40]!r} contains control characters")
    return value


def check_token_ids(name: str, ids: Sequence[int], vocab_size: int) -> None:
    if not ids:
        return
    low, high = min(ids), max(ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        index = list(ids).index(bad)
        raise errors.InvalidArgument.about(
            name, lambda n: f"{n(name)}[{index}] = {bad} is outside the vocabulary [0, {vocab_size})")


def json_depth(value: Any, limit: int) -> int:
    """Nesting depth of a parsed JSON value, walked iteratively; stops counting past ``limit``."""
    if not isinstance(value, (dict, list)):
        return 0
    depth, stack = 0, [(value, 1)]
    while stack:  # only containers are pushed: a body of many strings costs one isinstance each
        node, d = stack.pop()
        depth = max(depth, d)
        if depth > limit:
            return depth
        children = node.values() if isinstance(node, dict) else node
        stack.extend([(child, d + 1) for child in children if isinstance(child, (dict, list))])
    return depth


def parse_schema(field: str, text: str) -> dict:
    """A JSON Schema given as text: bounded in size and nesting, an object."""
    if len(text) > MAX_SCHEMA_CHARS:
        raise bad_field(field, f"has {len(text)} characters; at most {MAX_SCHEMA_CHARS}")
    try:
        value = json.loads(text)
    except RecursionError:
        raise bad_field(field, f"is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError as exc:
        raise bad_field(field, f"is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise bad_field(field, f"must be a JSON Schema object, got {type(value).__name__}")
    if json_depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise bad_field(field, f"is nested more than {MAX_JSON_DEPTH} levels deep")
    return value


def check_message_count(field: str, count: int) -> None:
    """At most ``MAX_MESSAGES``: the fronts call this before converting a wire's messages, whose cost
    grows with their number (30,000 messages took 0.4 s of the event loop to convert, then were refused)."""
    if count > MAX_MESSAGES:
        raise bad_field(field, f"has {count} messages; at most {MAX_MESSAGES}")


def check_messages(field: str, messages: Sequence[ChatMessage]) -> tuple[ChatMessage, ...]:
    """Roles known, tool messages answering a call; ``developer`` is read as ``system`` (OpenAI's rename)."""
    if not messages:
        raise bad_field(field, "is empty")
    check_message_count(field, len(messages))
    out = []
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise bad_field(f"{field}[{i}].role", f"is {m.role!r:.40}; expected one of {', '.join(CHAT_ROLES)}")
        if m.tool_calls and m.role != "assistant":
            raise bad_field(f"{field}[{i}].tool_calls", "only assistant messages carry tool calls", sep=": ")
        for j, call in enumerate(m.tool_calls):
            if not call.name:
                raise bad_field(f"{field}[{i}].tool_calls[{j}].function.name", "is empty")
        out.append(dataclasses.replace(m, role="system") if m.role == "developer" else m)
    return tuple(out)


def prompt_chars(prompt: PromptInput) -> int:
    """Characters the prompt's text carries (contents, tool calls, tool schemas): at least
    ``chars / ModelInfo.max_token_chars`` tokens once rendered."""
    if prompt.text is not None:
        return len(prompt.text)
    n = sum(len(t.name) + len(t.description) + len(t.parameters) for t in prompt.tools)
    for m in prompt.messages or ():
        n += len(m.content) + sum(len(c.name) + len(c.arguments) for c in m.tool_calls)
    return n


def prompt_field(prompt: PromptInput) -> str:
    """The request field that holds ``prompt``: ``messages``, else ``prompt`` (token ids or text)."""
    return "messages" if prompt.messages is not None else "prompt"


def check_size(prompt: PromptInput, info: ModelInfo, field: str) -> None:
    """Refuse, before rendering, a prompt that cannot fit the context whatever the tokenizer does."""
    ctx = info.max_context_tokens
    if prompt.token_ids is not None:
        if len(prompt.token_ids) >= ctx:
            raise errors.OutOfRange.about(
                field, f"the prompt has {len(prompt.token_ids)} tokens; the model's context holds {ctx}")
        return
    at_least = prompt_chars(prompt) // max(1, info.max_token_chars)
    if at_least >= ctx:
        raise errors.OutOfRange.about(field, f"the prompt holds at least {at_least} tokens (by its length alone); "
                                             f"the model's context holds {ctx}")


# ---- sampling and stopping -------------------------------------------------------------------------


def check_params(params: GenerateParams, info: ModelInfo) -> GenerateParams:
    """``params`` with every value in its range (a temperature below ``MIN_TEMPERATURE`` is greedy)."""
    return check_stopping(check_sampling(params, info), info)


def check_sampling(params: GenerateParams, info: ModelInfo) -> GenerateParams:
    temperature = float(params.temperature)
    if not (math.isfinite(temperature) and 0.0 <= temperature <= MAX_TEMPERATURE):
        raise bad_field("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {temperature}")
    if temperature < MIN_TEMPERATURE:
        temperature = 0.0  # greedy: what such a temperature would pick, without dividing by ~0
    top_p = float(params.top_p)
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise bad_field("top_p", f"must be in (0, 1], got {top_p}")
    if not 0 <= params.top_k <= info.vocab_size:
        raise bad_field("top_k", f"must be in [0, {info.vocab_size}] (0 = no cut), got {params.top_k}")
    if params.seed is not None and not 0 <= params.seed < 2**63:
        raise bad_field("seed", f"must be in [0, 2^63), got {params.seed}")
    penalty = float(params.repetition_penalty)
    low, high = REPETITION_PENALTY_RANGE
    if not (math.isfinite(penalty) and low <= penalty <= high):
        raise bad_field("repetition_penalty", f"must be in [{low:g}, {high:g}] (1 = off), got {penalty}")
    presence, frequency = float(params.presence_penalty), float(params.frequency_penalty)
    for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not (math.isfinite(value) and -2.0 <= value <= 2.0):
            raise bad_field(name, f"must be in [-2, 2] (0 = off), got {getattr(params, name)}")
    check_logit_bias(params.logit_bias, info.vocab_size)
    return dataclasses.replace(params, temperature=temperature, top_p=top_p, repetition_penalty=penalty,
                               presence_penalty=presence, frequency_penalty=frequency)


def check_stopping(params: GenerateParams, info: ModelInfo) -> GenerateParams:
    ctx, max_new, min_new = info.max_context_tokens, params.max_new_tokens, params.min_new_tokens
    if max_new is not None and not 1 <= max_new < ctx:
        raise bad_field("max_new_tokens", f"must be in [1, {ctx - 1}] (the model's context is {ctx}), got {max_new}")
    if min_new < 0:
        raise bad_field("min_new_tokens", f"must be >= 0, got {min_new}")
    if max_new is not None and min_new > max_new:
        raise errors.InvalidArgument.about(
            "min_new_tokens", lambda n: f"{n('min_new_tokens')} ({min_new}) exceeds {n('max_new_tokens')} ({max_new})")
    if len(params.stop) > MAX_STOP_STRINGS:
        raise bad_field("stop", f"has {len(params.stop)} strings; at most {MAX_STOP_STRINGS}")
    for i, text in enumerate(params.stop):
        if not isinstance(text, str) or not text or len(text) > MAX_STOP_CHARS:
            raise bad_field(f"stop[{i}]", f"must be a string of 1 to {MAX_STOP_CHARS} characters, got {text!r:.60}")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise bad_field("stop_token_ids", f"has {len(params.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}")
    check_token_ids("stop_token_ids", params.stop_token_ids, info.vocab_size)
    return params


def check_logit_bias(pairs: Sequence[tuple[int, float]], vocab_size: int) -> None:
    """(token id, bias) pairs: at most ``MAX_LOGIT_BIAS``, ids in the vocabulary, biases in [-100, 100]
    (the HTTP front parses OpenAI's object of them: ``http_api.chat.logit_bias``)."""
    if len(pairs) > MAX_LOGIT_BIAS:
        raise bad_field("logit_bias", f"has {len(pairs)} entries; at most {MAX_LOGIT_BIAS}")
    for token, bias in pairs:
        if not 0 <= token < vocab_size:
            raise bad_field("logit_bias", f"token {token} is not in [0, {vocab_size})")
        if not -100 <= bias <= 100:
            raise bad_field("logit_bias", f"must be a number in [-100, 100], got {bias}", sep=f"[{token}] ")


# ---- tools and structured output -------------------------------------------------------------------


def check_tools(tools: Sequence[Tool]) -> tuple[Tool, ...]:
    """Names valid and unique, parameter schemas bounded JSON objects (a tool at fault: ``tools[i]``)."""
    if len(tools) > MAX_TOOLS:
        raise bad_field("tools", f"has {len(tools)} tools; at most {MAX_TOOLS}")
    seen: set[str] = set()
    for i, t in enumerate(tools):
        if not _TOOL_NAME.match(t.name):
            raise bad_field(f"tools[{i}].name", f"{t.name!r:.70} must be 1 to 64 letters, digits, '_', '-' or '.'")
        if t.name in seen:
            raise bad_field(f"tools[{i}].name", f"{t.name!r} appears twice")
        seen.add(t.name)
        parse_schema(TOOL_PARAM.format(i=i), t.parameters or "{}")
    return tuple(tools)


def output_constraint(tools: Sequence[Tool], choice: ToolChoice, response_format: ResponseFormat,
                      tool_format: str) -> OutputConstraint | None:
    """The grammar a request's output must follow, if any: a forced tool call (``required``, a named
    function, or ``allowed`` tools with mode ``required``) in the model's own tool-call format, or the
    JSON of ``response_format``. A forced call wins over ``response_format``, as on OpenAI: the format
    shapes a text reply, and a forced turn has none (pydantic-ai sends its ``NativeOutput`` format with
    every request of a run, the forced tool-calling steps included). With ``auto`` and tools, the format's
    JSON or one tool call (an agent with tools and a typed output: the Agents SDK, pydantic-ai)."""
    forced = choice.mode in ("required", "function")
    if forced and not tools:
        raise bad_field("tool_choice", f"is {choice.mode!r} but the request has no tools")
    if response_format.type == "json_schema":  # a bad schema is refused even in a turn it does not shape
        parse_schema("response_format.schema", response_format.schema)
    if choice.mode == "function":
        chosen = [t for t in tools if t.name == choice.name]
        if not chosen:
            raise bad_field("tool_choice", f"names the function {choice.name!r:.70}, which is not among the tools")
        return FORMATS[tool_format].constraint(chosen)
    if choice.mode == "required":
        return FORMATS[tool_format].constraint(tools)
    # With tools the model may call (auto), a call stays possible beside the formatted answer.
    call = FORMATS[tool_format].constraint(tools) if tools and choice.mode == "auto" else None
    if response_format.type == "json_object":
        return OutputConstraint('{"type": "object"}', name="json_object", param="response_format", alternative=call)
    if response_format.type == "json_schema":
        return OutputConstraint(response_format.schema, name="json_schema", param="response_format.schema",
                                alternative=call)
    return None


def allowed_tools(tools: Sequence[Tool], choice: ToolChoice) -> tuple[Tool, ...]:
    """The tools a request offers the model: all of them, or those ``allowed_tools`` names."""
    if choice.allowed is None:
        return tuple(tools)
    known = {t.name for t in tools}
    unknown = [name for name in choice.allowed if name not in known]
    if unknown:
        raise bad_field("tool_choice", f"allows {unknown[0]!r:.70}, which is not among the tools")
    if not choice.allowed:
        raise bad_field("tool_choice", "allows no tools: name at least one, or send tool_choice \"none\"")
    return tuple(t for t in tools if t.name in choice.allowed)


# ---- one request -----------------------------------------------------------------------------------


def check_prompt(prompt: PromptInput, info: ModelInfo) -> PromptInput:
    """Exactly what the prompt needs before it is rendered: messages the model can take, or token ids
    in its vocabulary, or text; its tools' names and schemas."""
    if prompt.messages is not None:
        if not info.has_chat_template:
            raise errors.FailedPrecondition.about("messages",
                                                  "the served model has no chat template: send text or tokens")
        prompt = dataclasses.replace(prompt, messages=check_messages("messages", prompt.messages))
    elif prompt.token_ids is not None:
        if not prompt.token_ids:
            raise bad_field("prompt", "is empty")
        check_token_ids("prompt", prompt.token_ids, info.vocab_size)
    elif not prompt.text:
        raise bad_field("prompt", "is empty")
    tools = check_tools(prompt.tools)
    if tools and prompt.messages is None:
        raise errors.InvalidArgument.about("tools", lambda n: f"{n('tools')} need chat messages as the input "
                                                              f"({n('messages')})")
    return prompt


def prepare(info: ModelInfo, settings: ServingSettings, request: Request) -> Request:
    """``request`` validated, with what the server derives from it: its id (when it has none), the tools
    offered, the output's constraint, the tool-call format its reply is parsed in, its stream's chunk
    size (see the module docstring)."""
    check_id("request_id", request.request_id, MAX_ID_CHARS)
    check_id("session_id", request.session_id, MAX_SESSION_CHARS)
    prompt = check_prompt(request.prompt, info)
    choice = request.tool_choice
    offered = allowed_tools(prompt.tools, choice)
    prompt = dataclasses.replace(prompt, tools=offered)
    check_size(prompt, info, prompt_field(prompt))
    constraint = output_constraint(offered, choice, request.response_format, info.tool_call_format)
    params = dataclasses.replace(check_params(request.params, info), constraint=constraint)
    chunk = settings.stream_chunk_tokens if request.stream_chunk_tokens is None else request.stream_chunk_tokens
    if not 1 <= chunk <= MAX_CHUNK_TOKENS:
        raise bad_field("stream_chunk_tokens", f"must be in [1, {MAX_CHUNK_TOKENS}], got {chunk}")
    return dataclasses.replace(
        request, request_id=request.request_id or uuid.uuid4().hex, prompt=prompt, params=params,
        stream_chunk_tokens=chunk, tool_format=info.tool_call_format if offered and choice.mode != "none" else None)


def fit_to_prompt(request: Request, prompt_ids: Sequence[int], info: ModelInfo,
                  settings: ServingSettings) -> Request:
    """The request with its rendered prompt: the context checked, ``max_new_tokens`` set when the caller
    left it out (the server's default, within the context left): the one place it is resolved."""
    count, ctx = len(prompt_ids), info.max_context_tokens
    if count >= ctx:
        raise errors.OutOfRange.about(prompt_field(request.prompt),
                                      f"the prompt has {count} tokens; the model's context holds {ctx}")
    params = request.params
    max_new = params.max_new_tokens
    if max_new is None:
        budget = min(settings.default_max_new_tokens, ctx - count)
        params = dataclasses.replace(params, max_new_tokens=budget, min_new_tokens=min(params.min_new_tokens, budget))
    elif count + max_new > ctx:
        raise errors.OutOfRange.about("max_new_tokens", lambda n: (
            f"prompt ({count} tokens) + {n('max_new_tokens')} ({max_new}) = {count + max_new} exceeds the model's "
            f"context of {ctx} tokens"))
    return dataclasses.replace(request, prompt_ids=tuple(int(t) for t in prompt_ids), params=params)
