"""Reading agent trace files (docs/replay.md, "Traces"): one ``Call`` per recorded LLM call.

A line is ``{"tenant": str, "session": str, "messages": [{"role": str, "content": str}, ...],
"calls": [int, ...]}``; every assistant message listed in ``calls`` (every assistant message when
``calls`` is absent) is a call whose prompt is the messages before it. Files are gzip (recognised by
their magic bytes, whatever their name) or plain UTF-8 text. Calls with an empty response are skipped.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from fileio.lines import bounded_lines

#: Where the project's trace files are kept: the ``shared/traces`` folder beside the checkout. They are
#: third-party recordings, not part of the repository; the benchmarks default to files there and the
#: tests that need them skip when the folder is absent.
TRACES_DIR = Path(__file__).resolve().parents[2] / "shared" / "traces"

_GZIP_MAGIC = b"\x1f\x8b"
_MAX_KEPT_ERRORS = 20
#: The longest trace line read (bytes, with its newline), and the variable that changes it. A line is one
#: whole trajectory: the longest in the shared traces is about 1 MB. A longer line is refused (or, with
#: ``skip_bad_lines``, skipped) once this much of it is read, never held whole.
MAX_LINE_BYTES = 64 << 20
MAX_LINE_BYTES_ENV = "REPRISE_TRACE_MAX_LINE_BYTES"


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message of a trajectory."""

    role: str
    content: str


@dataclass(frozen=True, slots=True)
class Call:
    """One recorded LLM call: the prompt it was given and the response it produced.

    ``index`` counts the calls of the file from 0 in file order (empty responses are not calls);
    ``line_no`` is the 1-based line of the file; ``message_index`` is the response's position in that
    line's ``messages``, so ``messages`` (the prompt) has exactly ``message_index`` entries.
    """

    tenant: str
    session: str
    messages: tuple[Message, ...]
    response: str
    path: str
    line_no: int
    index: int
    message_index: int


@dataclass(slots=True)
class TraceStats:
    """Counters filled while reading (pass one to ``iter_calls(stats=...)``)."""

    lines: int = 0
    calls: int = 0
    skipped_lines: int = 0
    skipped_empty_responses: int = 0
    errors: list[str] = field(default_factory=list)  # the first few "file:line: what" messages

    def record_error(self, message: str) -> None:
        self.skipped_lines += 1
        if len(self.errors) < _MAX_KEPT_ERRORS:
            self.errors.append(message)


class TraceError(ValueError):
    """A malformed trace line; the message reads ``file:line: what is wrong``."""


def _open(path: Path) -> IO[bytes]:
    """The file's bytes, gunzipped when it starts with the gzip magic (whatever its name says)."""
    with open(path, "rb") as probe:
        magic = probe.read(2)
    if magic == _GZIP_MAGIC:
        return gzip.GzipFile(path, "rb")  # type: ignore[return-value]  # a binary file object
    return open(path, "rb")


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _parse_line(obj: Any) -> tuple[str, str, list[Message], list[int]]:
    """Validate one decoded line; raise ValueError/TypeError (no location) naming what is wrong."""
    if not isinstance(obj, dict):
        raise TypeError(f"expected a JSON object, got {_type_name(obj)}")
    for key in ("tenant", "session", "messages"):
        if key not in obj:
            raise ValueError(f"missing field {key!r}")
    tenant, session, raw_messages = obj["tenant"], obj["session"], obj["messages"]
    if not isinstance(tenant, str) or not tenant:
        raise ValueError(f"'tenant' must be a non-empty string, got {tenant!r}")
    if not isinstance(session, str):
        raise TypeError(f"'session' must be a string, got {_type_name(session)}")
    if not isinstance(raw_messages, list):
        raise TypeError(f"'messages' must be a list, got {_type_name(raw_messages)}")
    messages: list[Message] = []
    for i, m in enumerate(raw_messages):
        if not isinstance(m, dict):
            raise TypeError(f"messages[{i}] must be an object, got {_type_name(m)}")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role must be a non-empty string, got {role!r}")
        if not isinstance(content, str):
            raise TypeError(f"messages[{i}].content must be a string, got {_type_name(content)}")
        messages.append(Message(role, content))
    if "calls" in obj:
        raw_calls = obj["calls"]
        if not isinstance(raw_calls, list):
            raise TypeError(f"'calls' must be a list of integers, got {_type_name(raw_calls)}")
        calls: list[int] = []
        for c in raw_calls:
            if not isinstance(c, int) or isinstance(c, bool):
                raise TypeError(f"'calls' entries must be integers, got {c!r}")
            if not 0 <= c < len(messages):
                raise ValueError(f"'calls' index {c} is out of range for {len(messages)} messages")
            if messages[c].role != "assistant":
                raise ValueError(f"'calls' index {c} is a {messages[c].role!r} message, not 'assistant'")
            calls.append(c)
        if len(set(calls)) != len(calls):
            raise ValueError(f"'calls' lists an index twice: {raw_calls!r}")
        calls.sort()  # arrival order is message order
    else:
        calls = [i for i, m in enumerate(messages) if m.role == "assistant"]
    return tenant, session, messages, calls


_BOM = b"\xef\xbb\xbf"


def max_line_bytes() -> int:
    """``$REPRISE_TRACE_MAX_LINE_BYTES`` if set, else ``MAX_LINE_BYTES``."""
    raw = os.environ.get(MAX_LINE_BYTES_ENV, "")
    try:
        value = int(raw) if raw else MAX_LINE_BYTES
    except ValueError:
        raise ValueError(f"{MAX_LINE_BYTES_ENV} must be a number of bytes, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"{MAX_LINE_BYTES_ENV} must be >= 1, got {value}")
    return value


def iter_calls(
    path: str | Path, *, skip_bad_lines: bool = False, stats: TraceStats | None = None,
    max_line: int | None = None,
) -> Iterator[Call]:
    """Yield the calls of one trace file in file order.

    A bad line (invalid JSON or UTF-8, a missing or mistyped field, a ``calls`` index out of range or
    not an assistant message) raises ``TraceError`` (a ``ValueError``) reading ``file:line: what is
    wrong``; with ``skip_bad_lines`` it is skipped and counted in ``stats`` instead. Blank lines and a
    UTF-8 byte-order mark at the start of the file are ignored. A missing file raises ``FileNotFoundError``.
    A line longer than ``max_line`` bytes (default ``max_line_bytes()``) is a bad line, found without
    reading it whole.
    """
    limit = max_line if max_line is not None else max_line_bytes()
    path = Path(path)
    stats = stats if stats is not None else TraceStats()
    name = str(path)
    index = 0
    line_no = 0
    with _open(path) as fh:
        lines = bounded_lines(fh, limit)
        while True:
            try:
                raw = next(lines)
            except StopIteration:
                break
            except (EOFError, OSError, zlib.error) as exc:  # truncated or corrupt gzip stream
                message = f"{name}:{line_no + 1}: unreadable compressed data ({exc})"
                if not skip_bad_lines:
                    raise TraceError(message) from exc
                stats.record_error(message)
                break
            line_no += 1
            if raw is None:
                message = (f"{name}:{line_no}: line longer than {limit} bytes (the limit of a trace line; "
                           f"set {MAX_LINE_BYTES_ENV} to raise it)")
                if not skip_bad_lines:
                    raise TraceError(message)
                stats.lines += 1
                stats.record_error(message)
                continue
            if line_no == 1 and raw.startswith(_BOM):  # written by tools that mark UTF-8 files
                raw = raw[len(_BOM):]
            if not raw.strip():
                continue
            stats.lines += 1
            try:
                tenant, session, messages, call_ids = _parse_line(json.loads(raw.decode("utf-8")))
            except (ValueError, TypeError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                what = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
                if isinstance(exc, json.JSONDecodeError):
                    what = f"invalid JSON ({what} at column {exc.colno})"
                elif isinstance(exc, UnicodeDecodeError):
                    what = f"invalid UTF-8 ({exc.reason} at byte {exc.start})"
                message = f"{name}:{line_no}: {what}"
                if not skip_bad_lines:
                    raise TraceError(message) from None
                stats.record_error(message)
                continue
            prompt = tuple(messages)
            for c in call_ids:
                response = messages[c].content
                if not response:
                    stats.skipped_empty_responses += 1
                    continue
                stats.calls += 1
                yield Call(tenant, session, prompt[:c], response, name, line_no, index, c)
                index += 1
