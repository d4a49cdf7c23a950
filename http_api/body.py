"""Request bodies, measured before they are worked on: bytes first (the declared length, then what
arrives), then JSON whose nesting is bounded (a body nested deeper than ``MAX_JSON_DEPTH`` is a 400,
never a recursion error) and whose strings are Unicode (JSON may escape a lone UTF-16 surrogate,
``"\ud800"``, which no tokenizer, grammar compiler or store accepts: a 400 naming where it is)."""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.requests import Request

from serving import errors
from serving.prepare import MAX_JSON_DEPTH, json_depth


class BodyTooLarge(errors.ServiceError):
    """A request body beyond ``server.max_message_bytes`` (HTTP 413)."""


async def read_json(request: Request, max_bytes: int) -> Any:
    """The body as JSON, or a 413 / 400 that says what is wrong with it."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > max_bytes:
        raise BodyTooLarge(f"the body has {size} bytes; at most {max_bytes} are accepted")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > max_bytes:
            raise BodyTooLarge(f"the body has more than {max_bytes} bytes; at most {max_bytes} are accepted")
        chunks.append(chunk)
    return parse_json(b"".join(chunks))


def parse_json(raw: bytes) -> Any:
    try:
        value = json.loads(raw)
    except RecursionError:
        raise errors.InvalidArgument(f"the body is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError as exc:
        raise errors.InvalidArgument(f"the body is not valid JSON: {exc}") from None
    if json_depth(value, MAX_JSON_DEPTH + 8) > MAX_JSON_DEPTH + 8:  # schemas inside may use MAX_JSON_DEPTH
        raise errors.InvalidArgument(f"the body is nested more than {MAX_JSON_DEPTH + 8} levels deep")
    if _SURROGATE_ESCAPE.search(raw):  # only such an escape can put a surrogate in a parsed string
        check_unicode(value)
    return value


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def check_unicode(value: Any) -> None:
    """InvalidArgument naming the first string (key or value) of ``value`` that is not valid Unicode."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            _encodable(node, path or "the body")
        elif isinstance(node, dict):
            for key, child in node.items():
                _encodable(key, f"a key of {path or 'the body'}")
                stack.append((child, f"{path}.{key}" if path else key))
        elif isinstance(node, list):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(node))


def _encodable(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise errors.InvalidArgument(
            f"{where} is not valid Unicode: it holds a lone surrogate (U+{ord(text[exc.start]):04X})",
            where if not where.startswith("a key") else None) from None
