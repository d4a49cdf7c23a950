"""JSON schemas that admit no value, found before a grammar is built from them.

xgrammar's converter does not fail on every schema that admits nothing: an empty ``anyOf`` or ``oneOf``
becomes a rule matching the empty string (the output is then empty, not JSON), ``"type": []`` becomes
any value, a ``const`` or ``enum`` of another type than ``type`` is emitted anyway, and a ``required``
property that ``additionalProperties: false`` forbids is left out. A model decoding under such a
grammar writes something the schema refuses. ``find_empty`` walks every subschema of a schema and
names the first one that admits no value for a reason visible in the subschema itself:

- ``anyOf``, ``oneOf``, ``enum`` or ``type`` that is an empty list;
- ``const`` not among ``enum``, or ``const`` / every ``enum`` value of a type ``type`` does not allow;
- a ``required`` property that neither ``properties`` nor ``patternProperties`` names while
  ``additionalProperties`` is ``false``.

Such a subschema is refused wherever it is, even where the schema's other branches would admit values:
the converter would still let the model write the empty branch. (A ``false`` subschema, min > max and
the like are refused by the converter itself.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# keys whose value is one subschema, a list of them, or a map of them
_ONE = ("additionalProperties", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "items")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def find_empty(schema: Any) -> tuple[str, str] | None:
    """(JSON pointer, why) of the first subschema of ``schema`` that admits no value (module
    docstring), or None. ``schema`` is parsed JSON (its nesting already bounded)."""
    for pointer, node in _subschemas(schema, "#"):
        why = _why_empty(node)
        if why is not None:
            return pointer, why
    return None


def _subschemas(node: Any, pointer: str) -> Iterator[tuple[str, dict]]:
    if not isinstance(node, dict):
        return
    yield pointer, node
    for key in _ONE:
        if isinstance(node.get(key), dict):
            yield from _subschemas(node[key], f"{pointer}/{key}")
    for key in _LIST:
        if isinstance(node.get(key), list):
            for i, child in enumerate(node[key]):
                yield from _subschemas(child, f"{pointer}/{key}/{i}")
    for key in _MAP:
        if isinstance(node.get(key), dict):
            for name, child in node[key].items():
                yield from _subschemas(child, f"{pointer}/{key}/{_escape(str(name))}")


def _why_empty(node: dict) -> str | None:
    for key in ("anyOf", "oneOf", "enum", "type"):
        if node.get(key) == []:
            return f"its {key} is an empty list"
    types = node.get("type")
    allowed = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else None
    if "const" in node:
        if isinstance(node.get("enum"), list) and not any(_same(node["const"], v) for v in node["enum"]):
            return "its const is not among its enum"
        if allowed is not None and not _fits(node["const"], allowed):
            return f"its const {_preview(node['const'])} is not of its type {types}"
    elif isinstance(node.get("enum"), list) and allowed is not None and not any(_fits(v, allowed) for v in node["enum"]):
        return f"none of its enum values is of its type {types}"
    required = node.get("required")
    if node.get("additionalProperties") is False and isinstance(required, list) and not node.get("patternProperties"):
        properties = node.get("properties")
        named: dict[str, Any] = properties if isinstance(properties, dict) else {}
        missing = [name for name in required if isinstance(name, str) and name not in named]
        if missing:
            return f"it requires {missing[0]!r}, which its properties do not name and additionalProperties forbids"
    return None


def _fits(value: Any, types: set[Any]) -> bool:
    """Whether ``value`` (parsed JSON) is of one of the JSON schema ``types``."""
    if isinstance(value, bool):
        return "boolean" in types
    if isinstance(value, int):
        return bool(types & {"integer", "number"})
    if isinstance(value, float):
        return "number" in types or ("integer" in types and value.is_integer())
    kind = {str: "string", list: "array", dict: "object", type(None): "null"}.get(type(value))
    return kind in types


def _same(a: Any, b: Any) -> bool:
    """JSON equality (``1 == True`` in Python, not in JSON)."""
    return type(a) is type(b) and a == b if isinstance(a, bool) or isinstance(b, bool) else a == b


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."
