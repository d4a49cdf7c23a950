"""How a model family writes tool calls: the prompt that shows it the tools, how a call of its own reads
back in a later prompt, the parser of its output, and the grammar that forces a call.

Two formats, chosen per model from its name and chat template (``format_for``, ``ModelInfo.tool_call_format``):

* ``hermes`` (Hermes, Qwen2.5 and most instruction models with tool support): each call is one JSON
  object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>\\n`` and ``\\n</tool_call>``.
* ``smollm2`` (SmolLM2-Instruct, the default model): one ``<tool_call>[...]</tool_call>`` block holding a
  JSON list of such objects, after a system prompt that lists the tools in ``<tools>`` (the prompt the
  SmolLM2 authors trained function calling with; SmolLM2's chat template itself ignores tools).

Both parsers read either shape inside the tags, so a model that mixes them still parses. Text before
the first ``<tool_call>`` is the reply's content. Pure Python (json, re): the serving core parses every
reply with it, whichever front and engine.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from serving.records import OutputConstraint, Tool, ToolCall

START = "<tool_call>"
END = "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
# JSON as the grammar writes it and as calls are rendered back: json.dumps' default separators, so a
# call the model made and the same call sent back in the next request's history are the same tokens.
_SEPARATORS = (", ", ": ")


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def dumps(value: object) -> str:
    return json.dumps(value, separators=_SEPARATORS, ensure_ascii=False)


def tool_schema(tool: Tool, defs: dict | None = None) -> dict:
    """The JSON Schema of one call's object: the tool's name as a constant, its parameters' schema.

    A parameters schema with references (``$ref``: ``#`` itself, ``#/$defs/X``, as pydantic writes them)
    is moved into ``defs`` under the tool's name, and its local references are rebased onto it, since
    inside the call object ``#`` is no longer the parameters' root; ``defs`` becomes the root's ``$defs``."""
    params = json.loads(tool.parameters) if tool.parameters else {}
    if not params:
        params = {"type": "object", "properties": {}}
    if defs is not None and '"$ref"' in tool.parameters:
        defs[tool.name] = _rebase(params, f"#/$defs/{tool.name}")
        params = {"$ref": f"#/$defs/{tool.name}"}
    return {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": params},
            "required": ["name", "arguments"]}


def _rebase(node: object, root: str) -> object:
    """``node`` with every local reference (``#...``) made relative to ``root`` instead of ``#``."""
    if isinstance(node, dict):
        out = {k: _rebase(v, root) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out["$ref"] = root + ref[1:]
        return out
    if isinstance(node, list):
        return [_rebase(v, root) for v in node]
    return node


@dataclass(frozen=True, slots=True)
class ParsedReply:
    """A reply split into its content (text before the first call) and its tool calls."""

    content: str
    tool_calls: tuple[ToolCall, ...]


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """One family's way of writing tool calls (see the module docstring)."""

    name: str
    list_in_block: bool  # one block with a JSON list (smollm2) or one block per call (hermes)

    def system_prompt(self, tools: Sequence[Tool]) -> str:
        """The tools as a system prompt, for chat templates that do not render ``tools`` themselves."""
        listed = "\n".join(dumps({"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": json.loads(t.parameters or "{}")}})
            for t in tools)
        if self.list_in_block:
            return ("You are an expert in composing functions. You are given a question and a set of possible "
                    "functions. Based on the question, you will need to make one or more function/tool calls to "
                    "achieve the purpose. If none of the functions can be used, point it out and refuse to answer. "
                    "If the given question lacks the parameters required by the function, also point it out.\n\n"
                    f"You have access to the following tools:\n<tools>{listed}</tools>\n\n"
                    "The output MUST strictly adhere to the following format, and NO other text MUST be included.\n"
                    "The example format is as follows. Please make sure the parameter type is correct. If no "
                    "function call is needed, please make the tool calls an empty list '[]'.\n"
                    '<tool_call>[\n{"name": "func_name1", "arguments": {"argument1": "value1", "argument2": '
                    '"value2"}},\n... (more tool calls as required)\n]</tool_call>')
        return ("You are a function calling AI model. You may call one or more functions to assist with the user "
                f"query. The functions are listed in <tools></tools>:\n<tools>\n{listed}\n</tools>\n"
                "For each function call, return a JSON object with the function name and arguments within "
                "<tool_call></tool_call> tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def render_calls(self, calls: Sequence[ToolCall]) -> str:
        """An assistant's calls as the model writes them (for templates without ``tool_calls`` support)."""
        objs = [{"name": c.name, "arguments": _arguments(c.arguments)} for c in calls]
        if self.list_in_block:
            return f"{START}[{', '.join(dumps(o) for o in objs)}]{END}"
        return "\n".join(f"{START}\n{dumps(o)}\n{END}" for o in objs)

    def constraint(self, tools: Sequence[Tool]) -> OutputConstraint:
        """The grammar of exactly one call of one of ``tools``, as this format writes it."""
        defs: dict = {}
        call = {"anyOf": [tool_schema(t, defs) for t in tools]} if len(tools) > 1 else tool_schema(tools[0], defs)
        if defs:
            call["$defs"] = defs
        if self.list_in_block:
            return OutputConstraint(json.dumps(call), prefix=f"{START}[", suffix=f"]{END}", name="tool_calls",
                                    param="tool_choice")
        return OutputConstraint(json.dumps(call), prefix=f"{START}\n", suffix=f"\n{END}", name="tool_calls",
                                param="tool_choice")

    def parse(self, text: str) -> ParsedReply | None:
        """Content and calls of ``text``; None when it holds no parseable call (then it is plain content)."""
        start = text.find(START)
        if start < 0:
            return None
        calls: list[ToolCall] = []
        for body in _BLOCK.findall(text, start):
            try:
                value = json.loads(body.strip(), strict=False)  # control characters inside strings pass
            except ValueError:
                continue
            for obj in value if isinstance(value, list) else [value]:
                if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                    args = obj.get("arguments", obj.get("parameters", {}))
                    calls.append(ToolCall(new_call_id(), obj["name"], dumps(args if args is not None else {})))
        if not calls:
            return None
        return ParsedReply(text[:start].strip(), tuple(calls))


FORMATS = {f.name: f for f in (ToolCallFormat("hermes", False), ToolCallFormat("smollm2", True))}


def format_for(model_name: str, chat_template: str | None) -> str:
    """The tool-call format of a model: ``hermes`` when its template writes ``<tool_call>`` tags or knows
    no tools at all, ``smollm2`` for the SmolLM2 family."""
    template = chat_template or ""
    if START in template:
        return "hermes"
    if "smollm" in model_name.lower() or "SmolLM" in template:
        return "smollm2"
    return "hermes"


def _arguments(text: str) -> object:
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return text


class StreamingToolText:
    """Splits streamed text into content that may leave now and a held tool-call section.

    Text is let out until ``<tool_call>`` appears; a tail that could be the start of that marker is held
    back until the next piece decides it. From the marker on everything is kept for ``finish``.
    """

    def __init__(self) -> None:
        self._pending = ""
        self.in_call = False

    def feed(self, text: str) -> str:
        """The part of ``text`` (with what was held) that is content for sure."""
        if self.in_call:
            self._pending += text
            return ""
        buf = self._pending + text
        at = buf.find(START)
        if at >= 0:
            self.in_call = True
            self._pending = buf[at:]
            return buf[:at]
        keep = 0
        for k in range(min(len(START) - 1, len(buf)), 0, -1):
            if START.startswith(buf[-k:]):
                keep = k
                break
        self._pending = buf[len(buf) - keep:]
        return buf[: len(buf) - keep]

    def finish(self) -> str:
        """What is still held (the call section, or a tail that never became a marker)."""
        rest, self._pending = self._pending, ""
        return rest
