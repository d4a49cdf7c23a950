"""Issue 22, items 5, 6a and 9, from outside: a 15 MB chat of 30,000 messages refused before it is
rendered (peak RSS bounded), on both fronts; /metrics refused without an admin key, and with one it
names no tenant; JSON nested 100,000 deep and out-of-range sampling values refused as 400 error
objects that name the field."""

from __future__ import annotations

import grpc
import pytest
from testkit.hostile import assert_unharmed

from grpc_api.client import RepriseClient, RepriseError
from reprise.benchmarks.hostile import MiB, http_call, huge_chat

USER = [{"role": "user", "content": "hi"}]


def test_huge_chat_is_refused_before_rendering(served, tenant, attacker) -> None:
    body = huge_chat(30_000, 15_000_000)
    served.reset_peak()
    before = served.rss()
    status, _, doc = http_call(served.http, "POST", "/v1/chat/completions", body, key=attacker, timeout=60)
    assert status == 400 and doc["error"]["param"] == "messages", doc
    http_peak = served.peak_rss() - before
    # the 15 MB body and its parsed JSON, and nothing rendered: well under the 2.3 GB one chat once cost
    assert http_peak < 250 * MiB, http_peak / MiB
    served.reset_peak()
    before = served.rss()
    with RepriseClient(served.grpc_target, attacker) as client, pytest.raises(RepriseError) as refused:
        client.generate(messages=body["messages"], max_new_tokens=4, timeout=60)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and "messages" in refused.value.message
    assert served.peak_rss() - before < 250 * MiB
    assert_unharmed(served, tenant)


def test_few_huge_messages_are_refused_by_length_before_rendering(served, tenant, attacker) -> None:
    body = {"messages": [{"role": "user", "content": "x" * 15_000_000}], "max_tokens": 4}
    served.reset_peak()
    before = served.rss()
    status, _, doc = http_call(served.http, "POST", "/v1/chat/completions", body, key=attacker, timeout=60)
    assert status == 400 and doc["error"]["code"] == "context_length_exceeded", doc
    assert served.peak_rss() - before < 250 * MiB
    assert_unharmed(served, tenant)


def test_body_beyond_the_limit_is_413(served, tenant, attacker) -> None:
    status, _, doc = http_call(served.http, "POST", "/v1/chat/completions", raw=b"[" + b"0," * (9 << 20) + b"0]",
                               key=attacker, timeout=60)
    assert status == 413 and doc["error"]["code"] == "request_too_large", doc
    assert_unharmed(served, tenant)


def test_metrics_need_an_admin_key_and_name_no_tenant(served, tenant, attacker) -> None:
    for key in (None, attacker, "rpk_made_up"):
        status, _, doc = http_call(served.http, "GET", "/metrics", key=key)
        assert status in (401, 403), (key, status, doc)
        assert "# TYPE" not in str(doc) and "_total" not in str(doc), doc  # no figure of any kind
    status, _, text = http_call(served.http, "GET", "/metrics", key=served.admin_key)
    assert status == 200 and "# TYPE reprise_" in text
    assert tenant not in text and attacker not in text and served.admin_key not in text  # no secret either
    assert_unharmed(served, tenant)


def test_deep_json_is_a_400_error_object(served, tenant, attacker) -> None:
    for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
                b'{"messages": ' + b"[" * 40 + b"]" * 40 + b"}"):
        status, _, doc = http_call(served.http, "POST", "/v1/chat/completions", raw=raw, key=attacker)
        assert status == 400 and doc["error"]["type"] == "invalid_request_error", (status, str(doc)[:200])
        assert "nested" in doc["error"]["message"]
    assert_unharmed(served, tenant)


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", 5), ("temperature", -1), ("temperature", 1e309), ("repetition_penalty", 1e-45),
    ("repetition_penalty", 0), ("repetition_penalty", 100), ("top_p", 0), ("top_p", 1.5), ("top_k", -1),
    ("seed", -1), ("seed", 2**64), ("max_tokens", 0), ("max_tokens", 10**12), ("min_tokens", -5),
    ("n", 2), ("n", 10**9),
])
def test_out_of_range_values_are_refused_by_name(served, attacker, field, value) -> None:
    status, _, doc = http_call(served.http, "POST", "/v1/chat/completions",
                               {"messages": USER, "max_tokens": 8, field: value}, key=attacker)
    assert status == 400 and doc["error"]["param"] == field, (status, doc)


def test_tiny_temperature_is_greedy_not_garbage(served, tenant, attacker) -> None:
    answers = []
    for temperature in (1e-45, 0):
        status, _, doc = http_call(served.http, "POST", "/v1/chat/completions",
                                   {"messages": USER, "max_tokens": 12, "temperature": temperature}, key=attacker)
        assert status == 200, doc
        answers.append(doc["choices"][0]["message"]["content"])
    assert answers[0] == answers[1]
    assert_unharmed(served, tenant)
