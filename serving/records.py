"""The records that cross the serving core's seams, protocol-neutral (no gRPC, HTTP or torch here).

One request is one ``Request`` from a front to the engine: the fronts parse their wire into it, the core
validates it once (``ServingCore.prepare``), renders the prompt into ``prompt_ids`` and sets what depends
on it (``max_new_tokens`` when the caller left it out), and the backend decodes that same record.
A stream is a sequence of typed events (``Started``, ``TextDelta``, ``ToolCallDelta``, ``Finished``);
a backend's own stream is ``Tokens`` then ``Finished``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, get_args

# ---- who is calling --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: a tenant (data plane) or an admin (admin plane). ``id`` is the tenant id or the
    admin key id; it never comes from a request field."""

    kind: Literal["tenant", "admin"]
    id: str


class Authenticator(Protocol):
    def authenticate(self, key: str) -> Principal | None:
        """The principal a bearer key belongs to, or None if it is unknown or revoked. Called on the
        event loop for every call, so it must be fast (an in-memory lookup of a keyed hash)."""
        ...


# ---- what a request asks for -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call of one of the request's tools, as the model made it: ``arguments`` is a JSON object's text."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call: ``parameters`` is its JSON Schema as text (``{}`` when it takes none)."""

    name: str
    description: str = ""
    parameters: str = "{}"


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One chat message. An assistant message may carry ``tool_calls`` (its ``content`` may then be empty);
    a ``tool`` message answers the call ``tool_call_id`` (``name``: the tool's name, when known)."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""


@dataclass(frozen=True, slots=True)
class PromptInput:
    """Exactly one of ``token_ids``, ``text``, ``messages`` is set. ``tools`` are rendered with the
    messages (``serving.render``: the model's chat template, or the tool-call format's own prompt)."""

    token_ids: tuple[int, ...] | None = None
    text: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    tools: tuple[Tool, ...] = ()


@dataclass(frozen=True, slots=True)
class OutputConstraint:
    """A grammar the output must follow: the literal ``prefix``, then a JSON value valid under ``schema``
    (JSON Schema text), then the literal ``suffix``, then end of sequence. ``name`` says what asked for
    it (``json_object``, ``json_schema``, ``tool_calls``) and ``param`` the request field it came from
    (``response_format``, ``response_format.schema``, ``tool_choice``: error messages name it, and each
    front spells it, ``serving.errors``). ``alternative``: an output of that constraint is allowed instead (a tool
    call the model may make rather than the formatted answer: ``tool_choice`` auto with tools and a
    ``response_format``)."""

    schema: str
    prefix: str = ""
    suffix: str = ""
    name: str = "json_schema"
    param: str = "response_format"
    alternative: OutputConstraint | None = None


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


@dataclass(frozen=True, slots=True)
class GenerateParams:
    """Sampling and stopping parameters of one request; a field left out asks for its default.

    ``max_new_tokens`` None: not given (the serving core sets it once the prompt's length is known:
    ``serving.prepare.fit_to_prompt``; an engine decodes only a request where it is set).
    ``temperature`` 0 is greedy; ``min_new_tokens``: EOS and ``stop_token_ids`` are banned until that
    many tokens exist. EOS ends the request unless ``ignore_eos``; a ``stop_token_ids`` token ends it too;
    both stay in the output. ``stop`` strings are matched on the decoded text: the text ends before the
    first match (``include_stop_str_in_output`` keeps the match), and no token after the one completing
    it is emitted. ``speculate`` False decodes one token per step (the same output); ``record`` False
    keeps the turn out of the tenant's history. ``presence_penalty``, ``frequency_penalty`` (OpenAI's,
    0 = off) and ``logit_bias`` ((token id, bias) pairs) are applied by vLLM; the own engine refuses
    them when set (its ``check``). ``constraint`` is the serving core's, from the request's tools,
    ``tool_choice`` and ``response_format`` (``serving.prepare``).
    """

    max_new_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    speculate: bool = True
    record: bool = True
    constraint: OutputConstraint | None = None


@dataclass(frozen=True, slots=True)
class Request:
    """One generation request: the one record from a front to the engine that decodes it.

    A front builds it from its wire (what the caller sent; unvalidated), the serving core validates it
    once (``serving.prepare.prepare``: ``request_id`` made when empty, ``params.constraint`` and
    ``tool_format`` set from the tools, ``tool_choice`` and ``response_format``), renders ``prompt`` into
    ``prompt_ids`` and sets what depends on its length (``params.max_new_tokens`` when not given:
    ``serving.prepare.fit_to_prompt``); both engines decode that same record. ``tool_format`` is set
    when the reply is parsed for tool calls; ``stream_chunk_tokens`` is how many tokens each stream event
    carries (None: the server's default). ``Request.of_tokens`` makes one for an engine run without the
    service (offline replay, benchmarks, tests).
    """

    tenant: str
    prompt: PromptInput
    params: GenerateParams = field(default_factory=GenerateParams)
    request_id: str = ""
    session_id: str = ""
    tool_choice: ToolChoice = ToolChoice()
    response_format: ResponseFormat = ResponseFormat()
    stream_chunk_tokens: int | None = None
    tool_format: str | None = None
    prompt_ids: tuple[int, ...] = ()

    @classmethod
    def of_tokens(cls, prompt_ids: Sequence[int], *, tenant: str = "default", session_id: str = "",
                  request_id: str = "", max_new_tokens: int = 256, **params: Any) -> Request:
        """A request whose prompt is token ids, as the engine takes it (``params``: ``GenerateParams``'
        fields); not validated here: ``Engine.submit`` refuses what it cannot decode."""
        ids = tuple(int(t) for t in prompt_ids)
        return cls(tenant, PromptInput(token_ids=ids), GenerateParams(max_new_tokens=max_new_tokens, **params),
                   request_id=request_id, session_id=session_id, prompt_ids=ids)


FinishReason = Literal["stop", "eos", "length", "aborted", "error", "tool_calls"]
"""Why a request ended, in every layer (engine, backends, both fronts): ``stop`` a stop string or stop
token id, ``eos`` the model's end-of-sequence token, ``length`` max_new_tokens or the context, ``aborted``
cancelled (client gone, deadline, Abort), ``error`` the engine failed it, ``tool_calls`` the reply parsed
as tool calls (set by the serving core after parsing an output that ended with ``stop`` or ``eos``;
never by an engine)."""
FINISH_REASONS: tuple[FinishReason, ...] = get_args(FinishReason)


@dataclass(frozen=True, slots=True)
class Usage:
    """Token and step counts of one request. ``cached_tokens``: prompt tokens whose KV came from the
    tenant's prefix cache (not prefilled); ``steps``, ``drafted_tokens`` (draft nodes verified) and
    ``accepted_tokens`` (of those, committed) are the engine's, 0 where an engine does not report them."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def tokens_per_step(self) -> float:
        return self.completion_tokens / self.steps if self.steps else 0.0


@dataclass(frozen=True, slots=True)
class ModelInfo:
    model_name: str
    max_context_tokens: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    has_chat_template: bool
    tool_call_format: str = "hermes"
    """How the model writes tool calls (a name in ``serving.tool_calls.FORMATS``)."""
    max_token_chars: int = 64
    """The most characters one token decodes to: ``characters / max_token_chars`` bounds a text's token
    count from below before it is tokenized (request size checks)."""


# ---- stream events ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tokens:
    """A backend's event: tokens one step committed and the text they add (held back at a possible stop
    string, so the concatenated texts are the reply's text)."""

    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True, slots=True)
class Started:
    """The request passed admission and its prompt's checks; decoding begins. A front that must choose a
    status before streaming (HTTP) answers 200 from here on; earlier failures keep their own status."""

    request: Request


@dataclass(frozen=True, slots=True)
class TextDelta:
    """``stream_chunk_tokens`` committed tokens (the last chunk may be shorter) and exactly their text: event
    sizes follow tokens, never verification steps, so they do not show how much a draft was accepted.
    A front that asks for it (OpenAI chat) gets text that may be a tool call held back: it leaves parsed,
    as ``ToolCallDelta``."""

    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """One parsed tool call of the reply (``index`` in the reply's calls), sent when the reply ended."""

    index: int
    call: ToolCall


@dataclass(frozen=True, slots=True)
class Finished:
    """The end of a request: its finish reason (``tool_calls`` when the reply parsed as calls), the stop
    that matched, its usage, the reply's whole ``text`` (built once, by the serving core's stream),
    ``content`` (the text without its tool-call section when there are ``tool_calls``, else the text),
    and the output token ids when the engine keeps them."""

    finish_reason: FinishReason
    usage: Usage = field(default_factory=Usage)
    matched_stop: str | int | None = None
    text: str = ""
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    token_ids: tuple[int, ...] = ()


Event = Started | TextDelta | ToolCallDelta | Finished
"""What ``ServingCore.generate`` yields: one ``Started``, ``TextDelta``s, ``ToolCallDelta``s, one ``Finished``."""
BackendEvent = Tokens | Finished
"""What ``DecodeBackend.generate`` yields: ``Tokens`` as they commit, then one ``Finished``."""
