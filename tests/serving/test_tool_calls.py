"""Tool-call formats: parsing each family's output, rendering calls back, the forced-call grammar's shape,
the streaming hold-back of a tool-call marker, and the front's validation of tools and formats."""

from __future__ import annotations

import json

import pytest

from http_api.chat import spelling
from serving import errors
from serving.prepare import check_tools, output_constraint
from serving.records import ModelInfo, ResponseFormat, Tool, ToolCall, ToolChoice
from serving.tool_calls import FORMATS, StreamingToolText, format_for

CHAT = spelling("max_tokens")  # how the chat front words the core's errors
ADD = Tool("add", "Add two numbers", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))


def test_hermes_parses_one_block_per_call() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "mul", "arguments": {"b": 2}}\n</tool_call>')
    parsed = FORMATS["hermes"].parse(text)
    assert parsed is not None and parsed.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("add", {"a": 1}), ("mul", {"b": 2})]
    assert all(c.id.startswith("call_") for c in parsed.tool_calls)
    assert len({c.id for c in parsed.tool_calls}) == 2


def test_smollm2_parses_a_list_and_an_unclosed_block() -> None:
    parsed = FORMATS["smollm2"].parse('<tool_call>[{"name": "add", "arguments": {"a": 3}}, '
                                      '{"name": "add", "arguments": {"a": 4}}]</tool_call>')
    assert parsed is not None and [json.loads(c.arguments)["a"] for c in parsed.tool_calls] == [3, 4]
    unclosed = FORMATS["smollm2"].parse('<tool_call>[{"name": "add", "arguments": {"a": 5}}]')
    assert unclosed is not None and unclosed.tool_calls[0].name == "add"


@pytest.mark.parametrize("text", ["plain answer", "<tool_call>not json</tool_call>", '<tool_call>{"x": 1}</tool_call>'])
def test_text_without_a_parseable_call_is_content(text: str) -> None:
    assert FORMATS["hermes"].parse(text) is None


@pytest.mark.parametrize("name", ["hermes", "smollm2"])
def test_rendered_calls_parse_back(name: str) -> None:
    fmt = FORMATS[name]
    calls = (ToolCall("call_1", "add", '{"a": 1}'), ToolCall("call_2", "add", '{"a": 2}'))
    parsed = fmt.parse(fmt.render_calls(calls))
    assert parsed is not None and [(c.name, c.arguments) for c in parsed.tool_calls] == [
        ("add", '{"a": 1}'), ("add", '{"a": 2}')]
    constraint = fmt.constraint([ADD])
    assert constraint.prefix.startswith("<tool_call>") and constraint.suffix.endswith("</tool_call>")
    schema = json.loads(constraint.schema)
    assert schema["properties"]["name"] == {"const": "add"} and schema["required"] == ["name", "arguments"]
    assert "<tools>" in fmt.system_prompt([ADD]) and '"name": "add"' in fmt.system_prompt([ADD])


def test_format_per_model_family() -> None:
    assert format_for("SmolLM2-135M-Instruct", "{{ 'You are SmolLM' }}") == "smollm2"
    assert format_for("Qwen2.5-0.5B-Instruct", "{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert format_for("tiny", "{{ messages }}") == "hermes"


def test_streaming_holds_back_a_possible_marker() -> None:
    s = StreamingToolText()
    assert s.feed("Hello <to") == "Hello "
    assert s.feed("ol") == ""
    assert s.feed("bar") == "<toolbar"  # not a marker after all
    assert s.feed("x <tool_") == "x "
    assert s.feed('call>{"name"') == "" and s.in_call
    assert s.finish() == '<tool_call>{"name"'


def test_front_validates_tools_and_formats() -> None:
    with pytest.raises(errors.InvalidArgument, match=r"tools\[0\].name 'bad name'") as bad_name:
        check_tools([Tool("bad name")])
    bad_name.value.spell(CHAT)
    assert bad_name.value.message.startswith("tools[0].function.name 'bad name'")
    assert bad_name.value.param == "tools[0].function.name"
    with pytest.raises(errors.InvalidArgument, match="appears twice"):
        check_tools([ADD, ADD])
    with pytest.raises(errors.InvalidArgument, match="not valid JSON"):
        check_tools([Tool("x", parameters="{")])
    with pytest.raises(errors.InvalidArgument, match="not among the tools"):
        output_constraint([ADD], ToolChoice("function", "mul"), ResponseFormat(), "hermes")
    # A forced call wins over response_format (which shapes text; a forced turn has none), as on OpenAI;
    # a bad schema is refused all the same.
    forced_call = output_constraint([ADD], ToolChoice("required"), ResponseFormat("json_object"), "hermes")
    assert forced_call is not None and forced_call.name == "tool_calls"
    with pytest.raises(errors.InvalidArgument, match="response_format.schema") as bad_schema:
        output_constraint([ADD], ToolChoice("required"), ResponseFormat("json_schema", "{"), "hermes")
    bad_schema.value.spell(CHAT)
    assert bad_schema.value.param == "response_format.json_schema.schema" in bad_schema.value.message
    assert output_constraint([ADD], ToolChoice("auto"), ResponseFormat(), "hermes") is None
    plain = output_constraint([], ToolChoice(), ResponseFormat("json_object"), "hermes")
    assert plain is not None and plain.name == "json_object" and plain.alternative is None
    # With tools the model may call, a call stays possible beside the format; with "none" it does not.
    either = output_constraint([ADD], ToolChoice("auto"), ResponseFormat("json_object"), "hermes")
    assert either is not None and either.name == "json_object" and either.alternative is not None
    assert either.alternative.name == "tool_calls" and either.alternative.prefix == "<tool_call>\n"
    assert output_constraint([ADD], ToolChoice("none"), ResponseFormat("json_object"), "hermes").alternative is None
    forced = output_constraint([ADD], ToolChoice("function", "add"), ResponseFormat(), "smollm2")
    assert forced is not None and forced.prefix == "<tool_call>[" and forced.name == "tool_calls"
    assert ModelInfo("m", 10, (), 10, True).tool_call_format == "hermes"


def test_tool_parameters_with_references_keep_their_meaning_inside_the_call() -> None:
    """pydantic writes nested models as ``$defs`` with ``#/$defs/X`` references; inside the call object
    ``#`` is not the parameters' root any more, so they are rebased (and hoisted to the schema's root)."""
    import jsonschema
    import xgrammar as xgr

    params = {"type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"],
              "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"},
                                                                "near": {"anyOf": [{"$ref": "#/$defs/Loc"},
                                                                                   {"type": "null"}]}},
                                "required": ["city"]}}}
    tools = [Tool("where", parameters=json.dumps(params)), ADD]
    for fmt in ("hermes", "smollm2"):
        constraint = FORMATS[fmt].constraint(tools)
        schema = json.loads(constraint.schema)
        xgr.Grammar.from_json_schema(constraint.schema, any_whitespace=False)  # compiles
        good = {"name": "where", "arguments": {"loc": {"city": "Oslo", "near": {"city": "Bergen", "near": None}}}}
        jsonschema.validate(good, schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"name": "where", "arguments": {"loc": {"near": None}}}, schema)
