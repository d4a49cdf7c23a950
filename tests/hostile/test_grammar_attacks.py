"""Issue 22, items 1 and 2, from outside: grammar requests that once ended the engine for every tenant
(a grammar that ends before ``min_tokens``, that admits no token, ``allOf`` of ``$ref #``) or grew a
string without bound on the engine thread (schemas that recurse through a required field). Each ends
alone, as a 400 naming the field or a finished answer, on both fronts; the process's peak memory
stays small; and the next tenant is served."""

from __future__ import annotations

import json

import grpc
import pytest
from testkit.hostile import assert_unharmed

from grpc_api.client import RepriseClient, RepriseError
from reprise.benchmarks.hostile import http_call

MiB = 1 << 20
RECURSIVE = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
USER = [{"role": "user", "content": "hi"}]


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


# (body, what may come back: 200 with these finish reasons, or 400 naming a field starting so)
CASES = {
    "grammar_ends_before_min_tokens": (
        {"max_tokens": 40, "min_tokens": 30, "response_format": schema_format({"type": "boolean"})}, "response_format"),
    "required_tool_before_min_tokens": (
        {"max_tokens": 120, "min_tokens": 90, "tools": [tool({"type": "object", "properties": {}})],
         "tool_choice": "required"}, "tools"),
    "all_of_ref_root": ({"max_tokens": 40, "response_format": schema_format({"allOf": [{"$ref": "#"}]})},
                        "response_format"),
    "no_token_at_all": ({"max_tokens": 40, "response_format": schema_format({"type": "string", "enum": []})},
                        "response_format"),
    "false_schema": ({"max_tokens": 40, "response_format": schema_format({"not": {}})}, "response_format"),
    "recursive_required_field": ({"max_tokens": 200, "response_format": schema_format(RECURSIVE)}, "response_format"),
    "tool_parameters_ref_root": ({"max_tokens": 200, "tools": [tool({"$ref": "#"})], "tool_choice": "required"},
                                 "tools"),
    "mutual_recursion_in_defs": (
        {"max_tokens": 200, "response_format": schema_format(
            {"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                       "b": {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 1}},
             "$ref": "#/$defs/a"})}, "response_format"),
    "min_items_beyond_max_tokens": (
        {"max_tokens": 30, "response_format": schema_format({"type": "array", "items": {"type": "integer"},
                                                              "minItems": 100000})}, "response_format"),
}


def check_answer(status: int, doc: dict, field: str) -> None:
    if status == 200:
        assert doc["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls"), doc
    else:
        assert status == 400, (status, doc)
        # the schema or tool at fault, or the token budget it cannot fit in
        assert doc["error"]["type"] == "invalid_request_error", doc
        assert doc["error"]["param"].startswith((field, "max_tokens", "min_tokens")), doc


@pytest.mark.parametrize("name", sorted(CASES))
def test_grammar_requests_end_alone_on_http(served, tenant, attacker, name) -> None:
    extra, field = CASES[name]
    served.reset_peak()
    before = served.rss()
    status, _, doc = http_call(served.http, "POST", "/v1/chat/completions", {"messages": USER, **extra},
                               key=attacker, timeout=60)
    check_answer(status, doc, field)
    assert served.peak_rss() - before < 200 * MiB
    assert_unharmed(served, tenant)


@pytest.mark.parametrize("name", ["grammar_ends_before_min_tokens", "all_of_ref_root", "recursive_required_field",
                                  "tool_parameters_ref_root", "no_token_at_all"])
def test_grammar_requests_end_alone_on_grpc(served, tenant, attacker, name) -> None:
    extra, _ = CASES[name]
    kwargs = {"max_new_tokens": extra["max_tokens"], "min_new_tokens": extra.get("min_tokens", 0)}
    if "response_format" in extra:
        kwargs["response_format"] = extra["response_format"]
    if "tools" in extra:
        kwargs["tools"] = extra["tools"]
        kwargs["tool_choice"] = extra["tool_choice"]
    served.reset_peak()
    before = served.rss()
    with RepriseClient(served.grpc_target, attacker) as client:
        try:
            done = client.generate(messages=USER, timeout=60, **kwargs)
        except RepriseError as exc:
            assert exc.code == grpc.StatusCode.INVALID_ARGUMENT, exc
        else:
            assert done.finish_reason in ("stop", "eos", "length", "tool_calls")
    assert served.peak_rss() - before < 200 * MiB
    assert_unharmed(served, tenant)


def test_many_grammar_attacks_at_once_leave_others_served(served, tenant, attacker) -> None:
    """Every case above in flight together, while a normal tenant asks: the engine goes on."""
    from concurrent.futures import ThreadPoolExecutor

    def one(name: str) -> tuple[int, dict, str]:
        extra, field = CASES[name]
        status, _, doc = http_call(served.http, "POST", "/v1/chat/completions", {"messages": USER, **extra},
                                   key=attacker, timeout=90)
        return status, doc, field

    with ThreadPoolExecutor(len(CASES)) as pool:
        answers = list(pool.map(one, sorted(CASES)))
        seen = assert_unharmed(served, tenant)
    for status, doc, field in answers:
        if status == 429:  # more than the tenant's limit at once: refused with a retry hint
            assert doc["error"]["type"] == "rate_limit_error"
            continue
        check_answer(status, doc, field)
    assert json.dumps(seen)
