"""The data plane: ``reprise.v1.DecodingService``, a thin adapter over the serving core.

The servicer translates a protobuf message into the one request record (``serving.records.Request``)
and the core's events (``serving.records``: Started, TextDelta, ToolCallDelta, Finished) back into
messages; validation, admission, rendering, chunking and tool-call parsing are the core's, the same for
the HTTP API. The core's errors name the record's fields; they leave here named as GenerateRequest
names them (``SPELLING``: ``stopping.max_new_tokens``, ``input.messages[2].role``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from grpc_api.interceptors import current_principal
from grpc_api.v1 import common_pb2, decoding_pb2, decoding_pb2_grpc
from serving import errors
from serving.core import ServingCore
from serving.prepare import MAX_ID_CHARS, check_id, check_message_count
from serving.records import (
    ChatMessage,
    Finished,
    GenerateParams,
    PromptInput,
    Request,
    ResponseFormat,
    TextDelta,
    Tool,
    ToolCall,
    ToolChoice,
)

FINISH = {
    "stop": decoding_pb2.FINISH_REASON_STOP,
    "length": decoding_pb2.FINISH_REASON_LENGTH,
    "eos": decoding_pb2.FINISH_REASON_EOS,
    "aborted": decoding_pb2.FINISH_REASON_ABORTED,
    "tool_calls": decoding_pb2.FINISH_REASON_TOOL_CALLS,
}
# The request record's fields as GenerateRequest (and AppendTrajectoryRequest) name them, for errors.
SPELLING = errors.spelling({
    "temperature": "sampling.temperature", "top_p": "sampling.top_p", "top_k": "sampling.top_k",
    "seed": "sampling.seed", "repetition_penalty": "sampling.repetition_penalty",
    "max_new_tokens": "stopping.max_new_tokens", "min_new_tokens": "stopping.min_new_tokens",
    "stop": "stopping.stop", "stop_token_ids": "stopping.stop_token_ids",
    "response_format.schema": "response_format.json_schema", "messages": "input.messages",
    "prompt": "input.tokens.ids", "content.token_ids": "content.tokens.ids"})
_TOOL_CHOICE = {decoding_pb2.TOOL_CHOICE_MODE_UNSPECIFIED: "auto", decoding_pb2.TOOL_CHOICE_MODE_AUTO: "auto",
                decoding_pb2.TOOL_CHOICE_MODE_NONE: "none", decoding_pb2.TOOL_CHOICE_MODE_REQUIRED: "required"}
_RESPONSE_FORMAT = {decoding_pb2.RESPONSE_FORMAT_TYPE_UNSPECIFIED: "text", decoding_pb2.RESPONSE_FORMAT_TYPE_TEXT: "text",
                    decoding_pb2.RESPONSE_FORMAT_TYPE_JSON_OBJECT: "json_object",
                    decoding_pb2.RESPONSE_FORMAT_TYPE_JSON_SCHEMA: "json_schema"}


def chat_message(m: common_pb2.ChatMessage) -> ChatMessage:
    return ChatMessage(m.role, m.content, tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls),
                       m.tool_call_id, m.name)


def prompt_input(message: Any, field: str) -> PromptInput:
    """The prompt of a GenerateRequest (oneof ``input``) or AppendTrajectoryRequest (``content``)."""
    which = message.WhichOneof(field)
    if which is None:
        raise errors.InvalidArgument(f"{field} is empty: set one of tokens, text or messages", field)
    if which == "tokens":
        if not message.tokens.ids:
            raise errors.InvalidArgument(f"{field}.tokens is empty", f"{field}.tokens")
        return PromptInput(token_ids=tuple(message.tokens.ids))
    if which == "text":
        if not message.text:
            raise errors.InvalidArgument(f"{field}.text is empty", f"{field}.text")
        return PromptInput(text=message.text)
    check_message_count(f"{field}.messages", len(message.messages.messages))
    return PromptInput(messages=tuple(chat_message(m) for m in message.messages.messages))


def generate_params(request: decoding_pb2.GenerateRequest) -> GenerateParams:
    """Sampling and stopping as sent: a field left unset keeps ``GenerateParams``' default."""
    s, st = request.sampling, request.stopping
    if request.speculation not in (decoding_pb2.SPECULATION_MODE_UNSPECIFIED, decoding_pb2.SPECULATION_MODE_AUTO,
                                   decoding_pb2.SPECULATION_MODE_OFF):
        raise errors.InvalidArgument(f"speculation mode {request.speculation} is not a SpeculationMode", "speculation")
    given = {name: getattr(s, name) for name in ("temperature", "top_p", "top_k", "seed", "repetition_penalty")
             if s.HasField(name)}
    return GenerateParams(
        **given, max_new_tokens=st.max_new_tokens if st.HasField("max_new_tokens") else None,
        min_new_tokens=st.min_new_tokens, stop=tuple(st.stop), stop_token_ids=tuple(st.stop_token_ids),
        ignore_eos=st.ignore_eos, include_stop_str_in_output=st.include_stop_str_in_output,
        speculate=request.speculation != decoding_pb2.SPECULATION_MODE_OFF, record=not request.do_not_record)


def tool_choice(request: decoding_pb2.GenerateRequest) -> ToolChoice:
    which = request.tool_choice.WhichOneof("choice")
    if which == "function":
        return ToolChoice("function", request.tool_choice.function)
    mode = request.tool_choice.mode if which == "mode" else decoding_pb2.TOOL_CHOICE_MODE_UNSPECIFIED
    if mode not in _TOOL_CHOICE:
        raise errors.InvalidArgument(f"tool_choice.mode {mode} is not a ToolChoiceMode", "tool_choice.mode")
    return ToolChoice(_TOOL_CHOICE[mode])  # type: ignore[arg-type]


def response_format(request: decoding_pb2.GenerateRequest) -> ResponseFormat:
    kind = request.response_format.type
    if kind not in _RESPONSE_FORMAT:
        raise errors.InvalidArgument(f"response_format.type {kind} is not a ResponseFormatType",
                                     "response_format.type")
    return ResponseFormat(_RESPONSE_FORMAT[kind], request.response_format.json_schema)  # type: ignore[arg-type]


class DecodingServicer(decoding_pb2_grpc.DecodingServiceServicer):
    def __init__(self, core: ServingCore, version: str = "") -> None:
        self._core = core
        self._info = core.info
        self._version = version

    # ---- generation ------------------------------------------------------------------------------

    def _request(self, request: decoding_pb2.GenerateRequest) -> Request:
        """The request record of a GenerateRequest (validated by the core)."""
        tools = tuple(Tool(t.name, t.description, t.parameters or "{}") for t in request.tools)
        prompt = dataclasses.replace(prompt_input(request, "input"), tools=tools)
        return Request(current_principal().id, prompt, generate_params(request), request_id=request.request_id,
                       session_id=request.session_id, tool_choice=tool_choice(request),
                       response_format=response_format(request),
                       stream_chunk_tokens=request.stream_chunk_tokens or None)  # 0: the server's default

    async def GenerateStream(self, request, context):
        asked = self._request(request)
        with errors.spelled(SPELLING):
            prepared = self._core.prepare(asked)
            request_id = prepared.request_id
            async with contextlib.aclosing(self._core.generate(prepared)) as events:
                async for event in events:
                    if isinstance(event, TextDelta):
                        chunk = decoding_pb2.Chunk(token_ids=event.token_ids, text=event.text)
                        yield decoding_pb2.GenerateStreamResponse(request_id=request_id, chunk=chunk)
                    elif isinstance(event, Finished):
                        yield decoding_pb2.GenerateStreamResponse(request_id=request_id, complete=_complete(event))

    async def Generate(self, request, context):
        asked = self._request(request)
        ids: list[int] = []
        end: Finished | None = None
        with errors.spelled(SPELLING):
            prepared = self._core.prepare(asked)
            async with contextlib.aclosing(self._core.generate(prepared)) as events:
                async for event in events:
                    if isinstance(event, TextDelta):
                        ids.extend(event.token_ids)
                    elif isinstance(event, Finished):
                        end = event
        assert end is not None
        return decoding_pb2.GenerateResponse(request_id=prepared.request_id, token_ids=ids, text=end.text,
                                             complete=_complete(end))

    # ---- the rest ----------------------------------------------------------------------------------

    async def Abort(self, request, context):
        principal = current_principal()
        if not request.request_id:
            raise errors.InvalidArgument("request_id is empty: name the request to abort", "request_id")
        check_id("request_id", request.request_id, MAX_ID_CHARS)  # as Generate caps it: ids echo in statuses
        if not self._core.abort(principal.id, request.request_id):
            raise errors.NotFound(f"no request {request.request_id!r} in flight", "request_id", what="request")
        return decoding_pb2.AbortResponse()

    async def GetModelInfo(self, request, context):
        info = self._info
        return decoding_pb2.ModelInfo(model_name=info.model_name, max_context_tokens=info.max_context_tokens,
                                      eos_token_ids=info.eos_token_ids, vocab_size=info.vocab_size,
                                      has_chat_template=info.has_chat_template, server_version=self._version)

    async def AppendTrajectory(self, request, context):
        content = prompt_input(request, "content")
        with errors.spelled(SPELLING):
            num = await self._core.append_trajectory(current_principal().id, request.session_id, content)
        return decoding_pb2.AppendTrajectoryResponse(num_tokens=num)


def _complete(g: Finished) -> decoding_pb2.Complete:
    u = g.usage
    complete = decoding_pb2.Complete(
        finish_reason=FINISH.get(g.finish_reason, decoding_pb2.FINISH_REASON_UNSPECIFIED),
        usage=decoding_pb2.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                 total_tokens=u.total_tokens, cached_tokens=u.cached_tokens),
    )
    if g.tool_calls:
        complete.content = g.content
        complete.tool_calls.extend(common_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments)
                                   for c in g.tool_calls)
    if isinstance(g.matched_stop, str):
        complete.stop_str = g.matched_stop
    elif isinstance(g.matched_stop, int):
        complete.stop_token_id = g.matched_stop
    return complete


__all__ = ["DecodingServicer", "chat_message", "prompt_input"]
