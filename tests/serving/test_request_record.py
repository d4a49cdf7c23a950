"""The one request record: a front builds it, ``prepare`` validates it once, ``fit_to_prompt`` resolves
``max_new_tokens`` once; errors name the record's fields and each front words them in its caller's names."""

from __future__ import annotations

import dataclasses

import pytest

from grpc_api.decoding import SPELLING as GRPC
from http_api.chat import spelling as chat_spelling
from http_api.responses import SPELLING as RESPONSES
from serving import errors
from serving.prepare import ServingSettings, fit_to_prompt, prepare
from serving.records import ChatMessage, GenerateParams, ModelInfo, PromptInput, Request, ResponseFormat, Tool

INFO = ModelInfo("m", max_context_tokens=64, eos_token_ids=(0,), vocab_size=100, has_chat_template=True)
SETTINGS = ServingSettings(default_max_new_tokens=40, stream_chunk_tokens=3)
USER = (ChatMessage("user", "hi"),)


def test_prepare_returns_the_same_record_with_what_the_server_derives() -> None:
    asked = Request("t", PromptInput(messages=USER, tools=(Tool("f"),)), GenerateParams(temperature=1, stop=("x",)),
                    session_id="s", response_format=ResponseFormat("json_object"))
    request = prepare(INFO, SETTINGS, asked)
    assert request.request_id and request.stream_chunk_tokens == 3 and request.tool_format == "hermes"
    assert request.params.constraint is not None and request.params.constraint.name == "json_object"
    assert request.params.temperature == 1.0 and isinstance(request.params.temperature, float)
    same = dataclasses.replace(request, request_id="", stream_chunk_tokens=None, tool_format=None,
                               params=dataclasses.replace(request.params, constraint=None))
    assert same == asked  # nothing else changed shape or name on the way
    assert prepare(INFO, SETTINGS, dataclasses.replace(asked, stream_chunk_tokens=5)).stream_chunk_tokens == 5


def test_max_new_tokens_is_resolved_once_where_the_prompt_is_known() -> None:
    unset = prepare(INFO, SETTINGS, Request("t", PromptInput(token_ids=(1, 2, 3)), GenerateParams(min_new_tokens=50)))
    assert unset.params.max_new_tokens is None  # not given: nothing stands in for it until the prompt is rendered
    assert fit_to_prompt(unset, [1] * 10, INFO, SETTINGS).params.max_new_tokens == 40  # the server's default
    near_end = fit_to_prompt(unset, [1] * 60, INFO, SETTINGS).params
    assert (near_end.max_new_tokens, near_end.min_new_tokens) == (4, 4)  # the context left, min cut to it
    given = prepare(INFO, SETTINGS, Request("t", PromptInput(token_ids=(1,)), GenerateParams(max_new_tokens=7)))
    assert fit_to_prompt(given, [1] * 10, INFO, SETTINGS).params.max_new_tokens == 7
    with pytest.raises(errors.OutOfRange) as too_long:
        fit_to_prompt(given, [1] * 60, INFO, SETTINGS)
    assert too_long.value.message == "prompt (60 tokens) + max_new_tokens (7) = 67 exceeds the model's context of 64 tokens"
    too_long.value.spell(GRPC)
    assert too_long.value.message.startswith("prompt (60 tokens) + stopping.max_new_tokens (7)")
    assert too_long.value.param == "stopping.max_new_tokens"


@pytest.mark.parametrize(("spell", "param", "message"), [
    (chat_spelling("max_completion_tokens"), "min_tokens", "min_tokens (9) exceeds max_completion_tokens (8)"),
    (chat_spelling("max_tokens"), "min_tokens", "min_tokens (9) exceeds max_tokens (8)"),
    (RESPONSES, "min_tokens", "min_tokens (9) exceeds max_output_tokens (8)"),
    (GRPC, "stopping.min_new_tokens", "stopping.min_new_tokens (9) exceeds stopping.max_new_tokens (8)"),
])
def test_each_front_words_the_cores_errors_in_its_own_names(spell, param, message) -> None:
    with pytest.raises(errors.InvalidArgument) as bad:
        prepare(INFO, SETTINGS, Request("t", PromptInput(token_ids=(1,)), GenerateParams(max_new_tokens=8,
                                                                                         min_new_tokens=9)))
    assert (bad.value.param, bad.value.message) == ("min_new_tokens", "min_new_tokens (9) exceeds max_new_tokens (8)")
    with pytest.raises(errors.InvalidArgument) as worded, errors.spelled(spell):
        raise bad.value
    assert (worded.value.param, worded.value.message, str(worded.value)) == (param, message, message)


def test_a_spelling_maps_paths_by_their_longest_known_start() -> None:
    spell = errors.spelling({"messages": "input.messages", "tools[{i}]": "tools[{i}].function", "stop": "stopping.stop",
                             "response_format": "text.format", "response_format.schema": "text.format.schema"})
    assert spell("messages[2].tool_calls[0].function.name") == "input.messages[2].tool_calls[0].function.name"
    assert spell("tools[11].parameters") == "tools[11].function.parameters"
    assert spell("tools") == "tools"  # the key is one tool, by index
    assert spell("stop[3]") == "stopping.stop[3]" and spell("stop_token_ids") == "stop_token_ids"
    assert spell("response_format.schema") == "text.format.schema" and spell("response_format") == "text.format"


def test_errors_a_front_made_keep_their_words_and_a_core_error_is_worded_once() -> None:
    own = errors.InvalidArgument("tools[0].function.name must be a string", "tools[0].function.name")
    own.spell(chat_spelling("max_tokens"))  # already in the caller's names: left as it is
    assert (own.message, own.param) == ("tools[0].function.name must be a string", "tools[0].function.name")
    core = errors.bad_field("tools[0].name", "is bad")
    core.spell(chat_spelling("max_tokens"))
    core.spell(chat_spelling("max_tokens"))
    assert (core.message, core.param) == ("tools[0].function.name is bad", "tools[0].function.name")
    limit = errors.ResourceExhausted.about("content", "too many tokens")
    assert (limit.param, limit.retry_after_s) == ("content", 1.0)


def test_of_tokens_is_the_same_record_for_an_engine_without_the_service() -> None:
    request = Request.of_tokens([5, 6], tenant="a", max_new_tokens=3, stop=("x",), record=False)
    assert request.prompt_ids == request.prompt.token_ids == (5, 6)
    assert request.params == GenerateParams(max_new_tokens=3, stop=("x",), record=False)
