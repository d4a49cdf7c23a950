"""Request validation and assembly, once for every front: ``prepare`` turns what a front parsed from its
wire into a ``Request`` or raises an error that names the field as the caller spelled it.

    request = prepare(info, settings, tenant=who.id, prompt=PromptInput(messages=...), raw=RawParams(...),
                      tools=tools, tool_choice=ToolChoice("required"), names=FIELDS)

Everything here is cheap and bounded by the input's size: untrusted input is measured (bytes, counts,
nesting, a lower bound on its tokens) before any work proportional to it begins, so a request that is
refused anyway never costs a chat-template rendering or a tokenization. ``names`` maps the neutral
field names used below (``temperature``, ``max_new_tokens``, ``tools``, ...) to the front's own; the
error's ``param`` carries that name too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from serving import errors
from serving.records import (
    ChatMessage,
    GenerateParams,
    ModelInfo,
    OutputConstraint,
    PromptInput,
    Request,
    Tool,
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
TOOL_PARAM = "tools[{i}]"  # a tool's parameters at fault, as engines name it; ``param_name`` spells it
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for function names (and '.')


@dataclass(frozen=True, slots=True)
class ServingSettings:
    """What request assembly and admission need of the server's configuration (``reprise.config.
    ServerConfig`` has these fields)."""

    default_max_new_tokens: int = 256
    stream_chunk_tokens: int = 1
    max_concurrent_requests: int = 64
    max_requests_per_tenant: int = 16
    append_calls_per_s: float = 20.0
    append_burst_calls: int = 100
    append_tokens_per_minute: int = 1_000_000


@dataclass(frozen=True, slots=True)
class RawParams:
    """Sampling and stopping values as a front received them (None: not given)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: Mapping[str, float] | None = None
    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    speculate: bool = True
    record: bool = True


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """``auto`` (the model decides), ``none`` (no calls are parsed), ``required`` (one call of any tool,
    forced by the grammar), ``function`` (one call of the tool ``name``, forced). ``allowed`` (OpenAI's
    ``allowed_tools``) keeps the request's tools to those named, with ``auto`` or ``required`` as ``mode``
    for them."""

    mode: Literal["auto", "none", "required", "function"] = "auto"
    name: str = ""
    allowed: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """``text`` (free), ``json_object`` (any JSON object) or ``json_schema`` (valid under ``schema``)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    schema: str = ""


AUTO = ToolChoice()
TEXT = ResponseFormat()


class _Names:
    def __init__(self, names: Mapping[str, str]) -> None:
        self._names = names

    def __call__(self, field: str) -> str:
        return self._names.get(field, field)

    def bad(self, field: str, message: str) -> errors.InvalidArgument:
        """An InvalidArgument about ``field``: ``message`` starts after the field's name."""
        name = self(field)
        return errors.InvalidArgument(f"{name} {message}", name)


def param_name(param: str | None, names: Mapping[str, str] | None) -> str | None:
    """An engine's neutral field name (``max_new_tokens``, ``tools[2]``) as the front spells it."""
    if param is None or not names:
        return param
    match = re.fullmatch(r"tools\[(\d+)\]", param)
    if match:
        tool = names.get("tool", "tools[{i}]").format(i=int(match.group(1)))
        return f"{tool}.parameters"
    return names.get(param, param)


# ---- small checks ----------------------------------------------------------------------------------


def check_id(name: str, value: str, limit: int) -> str:
    if len(value) > limit:
        raise errors.InvalidArgument(f"{name} has {len(value)} characters; at most {limit} are allowed", name)
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise errors.InvalidArgument(f"{name} {value[:40]!r} contains control characters", name)
    return value


def check_token_ids(name: str, ids: Sequence[int], vocab_size: int) -> None:
    if not ids:
        return
    low, high = min(ids), max(ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        index = list(ids).index(bad)
        raise errors.InvalidArgument(f"{name}[{index}] = {bad} is outside the vocabulary [0, {vocab_size})", name)


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
        raise errors.InvalidArgument(f"{field} has {len(text)} characters; at most {MAX_SCHEMA_CHARS}", field)
    try:
        value = json.loads(text)
    except RecursionError:
        raise errors.InvalidArgument(f"{field} is nested more than {MAX_JSON_DEPTH} levels deep", field) from None
    except ValueError as exc:
        raise errors.InvalidArgument(f"{field} is not valid JSON: {exc}", field) from None
    if not isinstance(value, dict):
        raise errors.InvalidArgument(f"{field} must be a JSON Schema object, got {type(value).__name__}", field)
    if json_depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise errors.InvalidArgument(f"{field} is nested more than {MAX_JSON_DEPTH} levels deep", field)
    return value


def check_message_count(field: str, count: int) -> None:
    """At most ``MAX_MESSAGES``: the fronts call this before converting a wire's messages, whose cost
    grows with their number (30,000 messages took 0.4 s of the event loop to convert, then were refused)."""
    if count > MAX_MESSAGES:
        raise errors.InvalidArgument(f"{field} has {count} messages; at most {MAX_MESSAGES}", field)


def check_messages(field: str, messages: Sequence[ChatMessage]) -> tuple[ChatMessage, ...]:
    """Roles known, tool messages answering a call; ``developer`` is read as ``system`` (OpenAI's rename)."""
    if not messages:
        raise errors.InvalidArgument(f"{field} is empty", field)
    check_message_count(field, len(messages))
    out = []
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise errors.InvalidArgument(
                f"{field}[{i}].role is {m.role!r:.40}; expected one of {', '.join(CHAT_ROLES)}", f"{field}[{i}].role")
        if m.tool_calls and m.role != "assistant":
            raise errors.InvalidArgument(f"{field}[{i}].tool_calls: only assistant messages carry tool calls",
                                         f"{field}[{i}].tool_calls")
        for j, call in enumerate(m.tool_calls):
            if not call.name:
                raise errors.InvalidArgument(f"{field}[{i}].tool_calls[{j}].function.name is empty",
                                             f"{field}[{i}].tool_calls[{j}].function.name")
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


def check_size(prompt: PromptInput, info: ModelInfo, field: str) -> None:
    """Refuse, before rendering, a prompt that cannot fit the context whatever the tokenizer does."""
    ctx = info.max_context_tokens
    if prompt.token_ids is not None:
        if len(prompt.token_ids) >= ctx:
            raise errors.OutOfRange(f"the prompt has {len(prompt.token_ids)} tokens; the model's context holds {ctx}",
                                    field)
        return
    at_least = prompt_chars(prompt) // max(1, info.max_token_chars)
    if at_least >= ctx:
        raise errors.OutOfRange(f"the prompt holds at least {at_least} tokens (by its length alone); the model's "
                                f"context holds {ctx}", field)


# ---- sampling and stopping -------------------------------------------------------------------------


def check_params(raw: RawParams, info: ModelInfo, names: Mapping[str, str] | None = None,
                 constraint: OutputConstraint | None = None) -> tuple[GenerateParams, bool]:
    """Validated parameters; the flag says whether max_new_tokens was given (else it is filled in once
    the prompt's length is known). Errors name the field as ``names`` spells it."""
    n = _Names(names or {})
    temperature = 0.0 if raw.temperature is None else float(raw.temperature)
    if not (math.isfinite(temperature) and 0.0 <= temperature <= MAX_TEMPERATURE):
        raise n.bad("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {temperature}")
    if temperature < MIN_TEMPERATURE:
        temperature = 0.0  # greedy: what such a temperature would pick, without dividing by ~0
    top_p = 1.0 if raw.top_p is None else float(raw.top_p)
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise n.bad("top_p", f"must be in (0, 1], got {top_p}")
    top_k = 0 if raw.top_k is None else int(raw.top_k)
    if not 0 <= top_k <= info.vocab_size:
        raise n.bad("top_k", f"must be in [0, {info.vocab_size}] (0 = no cut), got {top_k}")
    if raw.seed is not None and not 0 <= raw.seed < 2**63:
        raise n.bad("seed", f"must be in [0, 2^63), got {raw.seed}")
    penalty = 1.0 if raw.repetition_penalty is None else float(raw.repetition_penalty)
    low, high = REPETITION_PENALTY_RANGE
    if not (math.isfinite(penalty) and low <= penalty <= high):
        raise n.bad("repetition_penalty", f"must be in [{low:g}, {high:g}] (1 = off), got {penalty}")
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(raw, name)
        penalties[name] = 0.0 if value is None else float(value)
        if not (math.isfinite(penalties[name]) and -2.0 <= penalties[name] <= 2.0):
            raise n.bad(name, f"must be in [-2, 2] (0 = off), got {value}")
    bias = check_logit_bias(n("logit_bias"), raw.logit_bias or {}, info.vocab_size)
    explicit = raw.max_new_tokens is not None
    max_new = int(raw.max_new_tokens) if raw.max_new_tokens is not None else 0
    ctx = info.max_context_tokens
    if explicit and not 1 <= max_new < ctx:
        raise n.bad("max_new_tokens", f"must be in [1, {ctx - 1}] (the model's context is {ctx}), got {max_new}")
    if raw.min_new_tokens < 0:
        raise n.bad("min_new_tokens", f"must be >= 0, got {raw.min_new_tokens}")
    if explicit and raw.min_new_tokens > max_new:
        raise n.bad("min_new_tokens", f"({raw.min_new_tokens}) exceeds {n('max_new_tokens')} ({max_new})")
    if len(raw.stop) > MAX_STOP_STRINGS:
        raise n.bad("stop", f"has {len(raw.stop)} strings; at most {MAX_STOP_STRINGS}")
    for i, text in enumerate(raw.stop):
        if not isinstance(text, str) or not text or len(text) > MAX_STOP_CHARS:
            field = f"{n('stop')}[{i}]"
            raise errors.InvalidArgument(
                f"{field} must be a string of 1 to {MAX_STOP_CHARS} characters, got {text!r:.60}", field)
    if len(raw.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise n.bad("stop_token_ids", f"has {len(raw.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}")
    check_token_ids(n("stop_token_ids"), raw.stop_token_ids, info.vocab_size)
    params = GenerateParams(
        max_new_tokens=max_new, temperature=temperature, top_p=top_p, top_k=top_k,
        seed=None if raw.seed is None else int(raw.seed), repetition_penalty=penalty,
        presence_penalty=penalties["presence_penalty"], frequency_penalty=penalties["frequency_penalty"],
        logit_bias=bias,
        min_new_tokens=int(raw.min_new_tokens), stop=tuple(raw.stop), stop_token_ids=tuple(raw.stop_token_ids),
        ignore_eos=raw.ignore_eos, include_stop_str_in_output=raw.include_stop_str_in_output,
        speculate=raw.speculate, record=raw.record, constraint=constraint)
    return params, explicit


def check_logit_bias(field: str, raw: Mapping[str, float], vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token id as a string -> bias in [-100, 100]) as sorted pairs."""
    if len(raw) > MAX_LOGIT_BIAS:
        raise errors.InvalidArgument(f"{field} has {len(raw)} entries; at most {MAX_LOGIT_BIAS}", field)
    pairs = []
    for key, value in raw.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise errors.InvalidArgument(f"{field} keys must be token ids, got {str(key)!r:.40}", field) from None
        if not 0 <= token < vocab_size:
            raise errors.InvalidArgument(f"{field} token {token} is not in [0, {vocab_size})", field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise errors.InvalidArgument(f"{field}[{key!r}] must be a number in [-100, 100], got {value!r:.40}", field)
        pairs.append((token, float(value)))
    return tuple(sorted(pairs))


# ---- tools and structured output -------------------------------------------------------------------


def check_tools(tools: Sequence[Tool], names: Mapping[str, str] | None = None) -> tuple[Tool, ...]:
    """Names valid and unique, parameter schemas bounded JSON objects. ``names["tool"]`` is the front's
    path of one tool, with ``{i}`` for its index (``tools[{i}].function``)."""
    n = _Names(names or {})
    field = n("tools")
    if len(tools) > MAX_TOOLS:
        raise errors.InvalidArgument(f"{field} has {len(tools)} tools; at most {MAX_TOOLS}", field)
    seen: set[str] = set()
    for i, t in enumerate(tools):
        path = n("tool").format(i=i) if "tool" in (names or {}) else f"{field}[{i}]"
        if not _TOOL_NAME.match(t.name):
            raise errors.InvalidArgument(
                f"{path}.name {t.name!r:.70} must be 1 to 64 letters, digits, '_', '-' or '.'", f"{path}.name")
        if t.name in seen:
            raise errors.InvalidArgument(f"{path}.name {t.name!r} appears twice", f"{path}.name")
        seen.add(t.name)
        parse_schema(f"{path}.parameters", t.parameters or "{}")
    return tuple(tools)


def output_constraint(tools: Sequence[Tool], choice: ToolChoice, response_format: ResponseFormat,
                      tool_format: str, names: Mapping[str, str] | None = None) -> OutputConstraint | None:
    """The grammar a request's output must follow, if any: a forced tool call (``required``, a named
    function, or ``allowed`` tools with mode ``required``) in the model's own tool-call format, or the
    JSON of ``response_format``. A forced call wins over ``response_format``, as on OpenAI: the format
    shapes a text reply, and a forced turn has none (pydantic-ai sends its ``NativeOutput`` format with
    every request of a run, the forced tool-calling steps included). With ``auto`` and tools, the format's
    JSON or one tool call (an agent with tools and a typed output: the Agents SDK, pydantic-ai)."""
    n = _Names(names or {})
    forced = choice.mode in ("required", "function")
    if forced and not tools:
        raise n.bad("tool_choice", f"is {choice.mode!r} but the request has no tools")
    if response_format.type == "json_schema":  # a bad schema is refused even in a turn it does not shape
        parse_schema(n("json_schema"), response_format.schema)
    if choice.mode == "function":
        chosen = [t for t in tools if t.name == choice.name]
        if not chosen:
            raise n.bad("tool_choice", f"names the function {choice.name!r:.70}, which is not among the tools")
        return FORMATS[tool_format].constraint(chosen)
    if choice.mode == "required":
        return FORMATS[tool_format].constraint(tools)
    # With tools the model may call (auto), a call stays possible beside the formatted answer.
    call = FORMATS[tool_format].constraint(tools) if tools and choice.mode == "auto" else None
    if response_format.type == "json_object":
        return OutputConstraint('{"type": "object"}', name="json_object", param=n("response_format"),
                                alternative=call)
    if response_format.type == "json_schema":
        return OutputConstraint(response_format.schema, name="json_schema", param=n("json_schema"), alternative=call)
    return None


def allowed_tools(tools: Sequence[Tool], choice: ToolChoice, names: Mapping[str, str] | None = None) -> tuple[Tool, ...]:
    """The tools a request offers the model: all of them, or those ``allowed_tools`` names."""
    if choice.allowed is None:
        return tuple(tools)
    n = _Names(names or {})
    known = {t.name for t in tools}
    unknown = [name for name in choice.allowed if name not in known]
    if unknown:
        raise n.bad("tool_choice", f"allows {unknown[0]!r:.70}, which is not among the tools")
    if not choice.allowed:
        raise n.bad("tool_choice", "allows no tools: name at least one, or send tool_choice \"none\"")
    return tuple(t for t in tools if t.name in choice.allowed)


# ---- one request -----------------------------------------------------------------------------------


def prepare(info: ModelInfo, settings: ServingSettings, *, tenant: str, prompt: PromptInput,
            raw: RawParams, tools: Sequence[Tool] = (), tool_choice: ToolChoice = AUTO,
            response_format: ResponseFormat = TEXT, request_id: str = "", session_id: str = "",
            chunk_tokens: int = 0, names: Mapping[str, str] | None = None) -> Request:
    """A validated ``Request`` (its prompt not yet rendered); see the module docstring."""
    n = _Names(names or {})
    check_id(n("request_id"), request_id, MAX_ID_CHARS)
    check_id(n("session_id"), session_id, MAX_SESSION_CHARS)
    if prompt.messages is not None:
        if not info.has_chat_template:
            raise errors.FailedPrecondition("the served model has no chat template: send text or tokens",
                                            n("messages"))
        prompt = dataclasses.replace(prompt, messages=check_messages(n("messages"), prompt.messages))
    elif prompt.token_ids is not None:
        if not prompt.token_ids:
            raise n.bad("prompt", "is empty")
        check_token_ids(n("prompt"), prompt.token_ids, info.vocab_size)
    elif not prompt.text:
        raise n.bad("prompt", "is empty")
    tools = check_tools(tools, names)
    if tools and prompt.messages is None:
        raise n.bad("tools", f"need chat messages as the input ({n('messages')})")
    offered = allowed_tools(tools, tool_choice, names)
    prompt = dataclasses.replace(prompt, tools=offered)
    check_size(prompt, info, n("messages") if prompt.messages is not None else n("prompt"))
    constraint = output_constraint(offered, tool_choice, response_format, info.tool_call_format, names)
    params, explicit = check_params(raw, info, names, constraint)
    chunk = chunk_tokens or settings.stream_chunk_tokens
    if not 1 <= chunk <= MAX_CHUNK_TOKENS:
        raise n.bad("stream_chunk_tokens", f"must be in [1, {MAX_CHUNK_TOKENS}], got {chunk}")
    parse = info.tool_call_format if offered and tool_choice.mode != "none" else None
    return Request(request_id=request_id or uuid.uuid4().hex, tenant=tenant, prompt=prompt, params=params,
                   session_id=session_id, explicit_max=explicit, tool_format=parse, chunk_tokens=chunk)


def fit_to_prompt(request: Request, prompt_ids: Sequence[int], info: ModelInfo, settings: ServingSettings,
                  names: Mapping[str, str] | None = None) -> Request:
    """The request with its rendered prompt: the context checked, the default ``max_new_tokens`` filled in."""
    n = _Names(names or {})
    count, ctx = len(prompt_ids), info.max_context_tokens
    if count >= ctx:
        raise errors.OutOfRange(f"the prompt has {count} tokens; the model's context holds {ctx}",
                                n("messages") if request.prompt.messages is not None else n("prompt"))
    params = request.params
    if request.explicit_max and count + params.max_new_tokens > ctx:
        raise errors.OutOfRange(
            f"prompt ({count} tokens) + {n('max_new_tokens')} ({params.max_new_tokens}) = "
            f"{count + params.max_new_tokens} exceeds the model's context of {ctx} tokens", n("max_new_tokens"))
    if not request.explicit_max:
        budget = min(settings.default_max_new_tokens, ctx - count)
        params = dataclasses.replace(params, max_new_tokens=budget, min_new_tokens=min(params.min_new_tokens, budget))
    return dataclasses.replace(request, prompt_ids=tuple(int(t) for t in prompt_ids), params=params)
