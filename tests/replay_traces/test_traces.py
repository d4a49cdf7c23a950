"""Reading trace files: calls, gzip detection, and every kind of bad line (file:line messages)."""

from __future__ import annotations

import gzip
import json

import pytest
from testkit.replay import conversation, write_trace

from replay_traces.traces import Call, TraceError, TraceStats, iter_calls


def _line(**overrides):
    obj = conversation("acme", "s1", ("system", "be brief"), ("user", "hi"), ("assistant", "hello"),
                       ("user", "again"), ("assistant", "hello again"))
    obj.update(overrides)
    return obj


def test_every_assistant_message_is_a_call_when_calls_is_absent(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [_line(), _line(session="s2")])
    calls = list(iter_calls(path))
    assert [c.response for c in calls] == ["hello", "hello again"] * 2
    assert [c.index for c in calls] == [0, 1, 2, 3]
    assert [c.line_no for c in calls] == [1, 1, 2, 2]
    assert [c.session for c in calls] == ["s1", "s1", "s2", "s2"]
    first, second = calls[0], calls[1]
    assert isinstance(first, Call)
    assert [m.role for m in first.messages] == ["system", "user"]
    assert len(second.messages) == second.message_index == 4
    assert second.messages[2].content == "hello"
    with pytest.raises(AttributeError):
        first.response = "x"  # frozen


def test_calls_lists_only_some_assistant_messages(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [_line(calls=[4])])
    (call,) = iter_calls(path)
    assert call.response == "hello again" and call.message_index == 4


def test_empty_responses_are_skipped_and_counted(tmp_path):
    obj = conversation("acme", "s", ("user", "q"), ("assistant", ""), ("user", "q2"), ("assistant", "a2"))
    stats = TraceStats()
    calls = list(iter_calls(write_trace(tmp_path / "t.jsonl", [obj]), stats=stats))
    assert [c.response for c in calls] == ["a2"]
    assert calls[0].index == 0
    assert stats.skipped_empty_responses == 1 and stats.calls == 1 and stats.lines == 1


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz", "t.txt"])
def test_gzip_is_recognised_by_its_magic_bytes_not_the_name(tmp_path, name):
    path = write_trace(tmp_path / name, [_line()], compress=True)
    assert len(list(iter_calls(path))) == 2
    plain = write_trace(tmp_path / ("plain-" + name), [_line()], compress=False)
    assert len(list(iter_calls(plain))) == 2


def test_blank_lines_are_ignored(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", ["", _line(), "   ", _line()])
    calls = list(iter_calls(path))
    assert [c.line_no for c in calls] == [2, 2, 4, 4]


def test_a_byte_order_mark_and_crlf_line_ends_are_read(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(_line()).encode() + b"\r\n\r\n" + json.dumps(_line()).encode() + b"\r\n")
    calls = list(iter_calls(path))
    assert [c.line_no for c in calls] == [1, 1, 3, 3]
    assert calls[0].response == "hello" and calls[0].messages[0].content == "be brief"


def test_a_byte_order_mark_later_in_the_file_is_a_bad_line(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(json.dumps(_line()).encode() + b"\n\xef\xbb\xbf" + json.dumps(_line()).encode() + b"\n")
    with pytest.raises(TraceError, match=r"bom\.jsonl:2: invalid JSON"):
        list(iter_calls(path))


BAD_LINES = [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ({"session": "s", "messages": []}, "missing field 'tenant'"),
    ({"tenant": "t", "messages": []}, "missing field 'session'"),
    ({"tenant": "t", "session": "s"}, "missing field 'messages'"),
    ({"tenant": "", "session": "s", "messages": []}, "'tenant' must be a non-empty string"),
    ({"tenant": 3, "session": "s", "messages": []}, "'tenant' must be a non-empty string"),
    ({"tenant": "t", "session": None, "messages": []}, "'session' must be a string"),
    ({"tenant": "t", "session": "s", "messages": {}}, "'messages' must be a list"),
    ({"tenant": "t", "session": "s", "messages": ["hi"]}, "messages[0] must be an object"),
    ({"tenant": "t", "session": "s", "messages": [{"content": "x"}]}, "messages[0].role"),
    ({"tenant": "t", "session": "s", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (_line(calls="4"), "'calls' must be a list"),
    (_line(calls=[4.0]), "'calls' entries must be integers"),
    (_line(calls=[True]), "'calls' entries must be integers"),
    (_line(calls=[9]), "'calls' index 9 is out of range for 5 messages"),
    (_line(calls=[-1]), "'calls' index -1 is out of range"),
    (_line(calls=[1]), "'calls' index 1 is a 'user' message, not 'assistant'"),
    (_line(calls=[2, 2]), "'calls' lists an index twice"),
]


@pytest.mark.parametrize(("bad", "what"), BAD_LINES)
def test_a_bad_line_names_file_line_and_what(tmp_path, bad, what):
    path = write_trace(tmp_path / "bad.jsonl", [_line(), bad, _line()])
    with pytest.raises(TraceError) as info:
        list(iter_calls(path))
    message = str(info.value)
    assert message.startswith(f"{path}:2: ")
    assert what in message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(("bad", "what"), BAD_LINES)
def test_skip_bad_lines_counts_and_keeps_the_rest(tmp_path, bad, what):
    path = write_trace(tmp_path / "bad.jsonl", [_line(), bad, _line(), bad])
    stats = TraceStats()
    calls = list(iter_calls(path, skip_bad_lines=True, stats=stats))
    assert [c.line_no for c in calls] == [1, 1, 3, 3]
    assert [c.index for c in calls] == [0, 1, 2, 3]
    assert stats.skipped_lines == 2 and stats.lines == 4 and stats.calls == 4
    assert stats.errors[0].startswith(f"{path}:2: ") and what in stats.errors[0]
    assert stats.errors[1].startswith(f"{path}:4: ")


def test_invalid_utf8_is_a_bad_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"tenant": "t", "session": "\xff", "messages": []}\n')
    with pytest.raises(TraceError, match=rf"{path}:1: invalid UTF-8"):
        list(iter_calls(path))


def test_truncated_gzip_is_reported_or_skipped(tmp_path):
    data = gzip.compress(("\n".join(__import__("json").dumps(_line()) for _ in range(50)) + "\n").encode())
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match="unreadable compressed data"):
        list(iter_calls(path))
    stats = TraceStats()
    list(iter_calls(path, skip_bad_lines=True, stats=stats))
    assert stats.skipped_lines >= 1 and "unreadable compressed data" in stats.errors[-1]


def test_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        list(iter_calls(tmp_path / "nope.jsonl"))


def write_long_line_gzip(path, line_bytes: int, before: int = 1, after: int = 1) -> None:
    """A gzip trace: ``before`` good lines, one line of ``line_bytes`` (a JSON string that never ends),
    ``after`` good lines; written in chunks, never held whole."""
    good = (json.dumps(_line()) + "\n").encode()
    with gzip.open(path, "wb", compresslevel=1) as fh:
        fh.write(good * before)
        fh.write(b'{"tenant": "')
        chunk = b"a" * (1 << 20)
        for _ in range(line_bytes // len(chunk)):
            fh.write(chunk)
        fh.write(b"\n" + good * after)


@pytest.mark.parametrize("skip", [False, True])
def test_a_long_line_is_refused_without_reading_it_whole(tmp_path, skip):
    import tracemalloc

    path = tmp_path / "long.jsonl.gz"
    write_long_line_gzip(path, 64 << 20)
    stats = TraceStats()
    tracemalloc.start()
    try:
        if skip:
            calls = list(iter_calls(path, skip_bad_lines=True, stats=stats, max_line=1 << 20))
        else:
            with pytest.raises(TraceError) as exc:
                list(iter_calls(path, max_line=1 << 20))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20  # a few chunks of 1 MiB, never the 64 MiB line
    message = stats.errors[0] if skip else str(exc.value)
    assert message == (f"{path}:2: line longer than 1048576 bytes (the limit of a trace line; set "
                       "REPRISE_TRACE_MAX_LINE_BYTES to raise it)")
    if skip:
        assert [c.line_no for c in calls] == [1, 1, 3, 3] and stats.skipped_lines == 1


def test_the_line_limit_comes_from_the_environment(tmp_path, monkeypatch):
    path = write_trace(tmp_path / "t.jsonl", [_line()])
    size = path.stat().st_size
    monkeypatch.setenv("REPRISE_TRACE_MAX_LINE_BYTES", str(size - 1))
    with pytest.raises(TraceError, match=f"t.jsonl:1: line longer than {size - 1} bytes"):
        list(iter_calls(path))
    monkeypatch.setenv("REPRISE_TRACE_MAX_LINE_BYTES", str(size))  # the line with its newline fits exactly
    assert len(list(iter_calls(path))) == 2
    monkeypatch.setenv("REPRISE_TRACE_MAX_LINE_BYTES", "lots")
    with pytest.raises(ValueError, match="REPRISE_TRACE_MAX_LINE_BYTES must be a number of bytes, got 'lots'"):
        list(iter_calls(path))
