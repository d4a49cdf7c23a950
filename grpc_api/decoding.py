"""The data plane: ``reprise.v1.DecodingService``.

The servicer translates protobuf messages to the records of ``grpc_api.front`` and back; validation,
admission, the worker thread, fixed-size chunks and tool-call parsing are the shared front's
(``DecodeFront``), the same for the OpenAI-compatible HTTP API.
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from typing import Any

from grpc_api import errors
from grpc_api.backend import ChatMessage, Generation, PromptInput, Tool, ToolCall
from grpc_api.front import (
    MAX_ID_CHARS,
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
    parse_reply,
)
from grpc_api.interceptors import current_principal
from grpc_api.tool_calls import ParsedReply
from grpc_api.v1 import common_pb2, decoding_pb2, decoding_pb2_grpc

FINISH = {
    "stop": decoding_pb2.FINISH_REASON_STOP,
    "length": decoding_pb2.FINISH_REASON_LENGTH,
    "eos": decoding_pb2.FINISH_REASON_EOS,
    "aborted": decoding_pb2.FINISH_REASON_ABORTED,
    "tool_calls": decoding_pb2.FINISH_REASON_TOOL_CALLS,
}
# RawParams' fields as GenerateRequest names them, for error messages.
FIELDS = {"temperature": "sampling.temperature", "top_p": "sampling.top_p", "top_k": "sampling.top_k",
          "seed": "sampling.seed", "repetition_penalty": "sampling.repetition_penalty",
          "max_new_tokens": "stopping.max_new_tokens", "min_new_tokens": "stopping.min_new_tokens",
          "stop": "stopping.stop", "stop_token_ids": "stopping.stop_token_ids", "tool_choice": "tool_choice",
          "response_format": "response_format", "json_schema": "response_format.json_schema"}
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
        raise errors.InvalidArgument(f"{field} is empty: set one of tokens, text or messages")
    if which == "tokens":
        if not message.tokens.ids:
            raise errors.InvalidArgument(f"{field}.tokens is empty")
        return PromptInput(token_ids=tuple(message.tokens.ids))
    if which == "text":
        if not message.text:
            raise errors.InvalidArgument(f"{field}.text is empty")
        return PromptInput(text=message.text)
    msgs = check_messages(f"{field}.messages", [chat_message(m) for m in message.messages.messages])
    return PromptInput(messages=msgs)


def raw_params(request: decoding_pb2.GenerateRequest) -> RawParams:
    s, st = request.sampling, request.stopping
    if request.speculation not in (decoding_pb2.SPECULATION_MODE_UNSPECIFIED, decoding_pb2.SPECULATION_MODE_AUTO,
                                   decoding_pb2.SPECULATION_MODE_OFF):
        raise errors.InvalidArgument(f"speculation mode {request.speculation} is not a SpeculationMode")
    return RawParams(
        temperature=s.temperature if s.HasField("temperature") else None,
        top_p=s.top_p if s.HasField("top_p") else None,
        top_k=s.top_k if s.HasField("top_k") else None,
        seed=s.seed if s.HasField("seed") else None,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else None,
        max_new_tokens=st.max_new_tokens if st.HasField("max_new_tokens") else None,
        min_new_tokens=st.min_new_tokens, stop=tuple(st.stop), stop_token_ids=tuple(st.stop_token_ids),
        ignore_eos=st.ignore_eos, include_stop_str_in_output=st.include_stop_str_in_output,
        speculate=request.speculation != decoding_pb2.SPECULATION_MODE_OFF, record=not request.do_not_record)


def tool_choice(request: decoding_pb2.GenerateRequest) -> ToolChoice:
    which = request.tool_choice.WhichOneof("choice")
    if which == "function":
        return ToolChoice("function", request.tool_choice.function)
    mode = request.tool_choice.mode if which == "mode" else decoding_pb2.TOOL_CHOICE_MODE_UNSPECIFIED
    if mode not in _TOOL_CHOICE:
        raise errors.InvalidArgument(f"tool_choice.mode {mode} is not a ToolChoiceMode")
    return ToolChoice(_TOOL_CHOICE[mode])  # type: ignore[arg-type]


def response_format(request: decoding_pb2.GenerateRequest) -> ResponseFormat:
    kind = request.response_format.type
    if kind not in _RESPONSE_FORMAT:
        raise errors.InvalidArgument(f"response_format.type {kind} is not a ResponseFormatType")
    return ResponseFormat(_RESPONSE_FORMAT[kind], request.response_format.json_schema)  # type: ignore[arg-type]


class DecodingServicer(decoding_pb2_grpc.DecodingServiceServicer):
    def __init__(self, front: DecodeFront, version: str = "") -> None:
        self._front = front
        self._info = front.info
        self._version = version

    # ---- generation ------------------------------------------------------------------------------

    def _prepare(self, request: decoding_pb2.GenerateRequest) -> DecodeJob:
        check_id("request_id", request.request_id, MAX_ID_CHARS)
        check_id("session_id", request.session_id, MAX_SESSION_CHARS)
        prompt = prompt_input(request, "input")
        tools = check_tools("tools", [Tool(t.name, t.description, t.parameters or "{}") for t in request.tools])
        if prompt.messages is not None:
            self._front.check_chat()
            prompt = PromptInput(messages=prompt.messages, tools=tools)
        elif tools:
            raise errors.InvalidArgument("tools need chat messages as the input (input.messages)")
        choice = tool_choice(request)
        constraint = output_constraint(tools, choice, response_format(request), self._info.tool_call_format, FIELDS)
        raw = raw_params(request)
        params, explicit = check_params(dataclasses.replace(raw, constraint=constraint), FIELDS, self._info)
        chunk = self._front.chunk_tokens(request.stream_chunk_tokens, "stream_chunk_tokens")
        parse = self._info.tool_call_format if tools and choice.mode != "none" else None
        return DecodeJob(request.request_id or uuid.uuid4().hex, request.session_id, prompt, params, explicit, chunk,
                         parse)

    async def _decode(self, request: decoding_pb2.GenerateRequest):
        """Yield the request id, (token_ids, text) chunks, then the ``Generation`` and its parsed reply."""
        job = self._prepare(request)
        texts: list[str] = []
        async with contextlib.aclosing(self._front.decode(current_principal().id, job)) as items:
            async for item in items:
                if isinstance(item, Generation):
                    yield parse_reply(job, "".join(texts), item)
                else:
                    if not isinstance(item, str):
                        texts.append(item[1])
                    yield item

    async def GenerateStream(self, request, context):
        request_id = ""
        async with contextlib.aclosing(self._decode(request)) as items:
            async for item in items:
                if isinstance(item, str):
                    request_id = item
                elif isinstance(item, tuple) and isinstance(item[0], Generation):
                    yield decoding_pb2.GenerateStreamResponse(request_id=request_id, complete=_complete(*item))
                else:
                    ids, text = item
                    yield decoding_pb2.GenerateStreamResponse(
                        request_id=request_id, chunk=decoding_pb2.Chunk(token_ids=ids, text=text))

    async def Generate(self, request, context):
        request_id, ids, texts = "", [], []
        end = None
        async with contextlib.aclosing(self._decode(request)) as items:
            async for item in items:
                if isinstance(item, str):
                    request_id = item
                elif isinstance(item[0], Generation):
                    end = item
                else:
                    ids.extend(item[0])
                    texts.append(item[1])
        assert end is not None
        return decoding_pb2.GenerateResponse(request_id=request_id, token_ids=ids, text="".join(texts),
                                             complete=_complete(*end))

    # ---- the rest ----------------------------------------------------------------------------------

    async def Abort(self, request, context):
        principal = current_principal()
        if not request.request_id:
            raise errors.InvalidArgument("request_id is empty: name the request to abort")
        check_id("request_id", request.request_id, MAX_ID_CHARS)  # as Generate caps it: ids echo in statuses
        if not self._front.admission.abort(principal.id, request.request_id):
            raise errors.NotFound(f"no request {request.request_id!r} in flight")
        return decoding_pb2.AbortResponse()

    async def GetModelInfo(self, request, context):
        info = self._info
        return decoding_pb2.ModelInfo(model_name=info.model_name, max_context_tokens=info.max_context_tokens,
                                      eos_token_ids=info.eos_token_ids, vocab_size=info.vocab_size,
                                      has_chat_template=info.has_chat_template, server_version=self._version)

    async def AppendTrajectory(self, request, context):
        check_id("session_id", request.session_id, MAX_SESSION_CHARS)
        content = prompt_input(request, "content")
        if content.messages is not None:
            self._front.check_chat()
        num = await self._front.append_trajectory(current_principal().id, request.session_id, content, "content")
        return decoding_pb2.AppendTrajectoryResponse(num_tokens=num)


def _complete(g: Generation, reply: ParsedReply | None) -> decoding_pb2.Complete:
    complete = decoding_pb2.Complete(
        finish_reason=FINISH.get(g.finish_reason, decoding_pb2.FINISH_REASON_UNSPECIFIED),
        usage=decoding_pb2.Usage(prompt_tokens=g.prompt_tokens, completion_tokens=g.completion_tokens,
                                 total_tokens=g.prompt_tokens + g.completion_tokens, cached_tokens=g.cached_tokens),
    )
    if reply is not None:
        complete.content = reply.content
        complete.tool_calls.extend(common_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments)
                                   for c in reply.tool_calls)
    if isinstance(g.matched_stop, str):
        complete.stop_str = g.matched_stop
    elif isinstance(g.matched_stop, int):
        complete.stop_token_id = g.matched_stop
    return complete


__all__ = ["DecodingServicer", "chat_message", "prompt_input"]
