"""Issue 22, item 6b, from outside: with speculation on, a stream's events follow tokens, not
verification steps, so their sizes do not reveal how many drafted tokens a step accepted. A request
is repeated until the tenant's history drafts it; every run streams one event per token on both
fronts, the same events every run."""

from __future__ import annotations

import json
import urllib.request

from testkit.hostile import assert_unharmed

from grpc_api.client import AdminClient, RepriseClient


def accepted(served, key_name: str) -> int:
    with AdminClient(served.grpc_target, served.admin_key) as admin:
        tenant = next(t for t in admin.list_tenants() if t.name == key_name)
        return sum(s.num_accepted_tokens for s in admin.index_stats(tenant.tenant_id))


def sse_texts(served, key: str, body: dict) -> tuple[list[str], int]:
    request = urllib.request.Request(served.http + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.read().decode().splitlines() if line.startswith("data: {")]
    texts = [e["choices"][0]["delta"].get("content", "") for e in events
             if e["choices"] and e["choices"][0]["finish_reason"] is None]
    return [t for t in texts if t], events[-1]["usage"]["completion_tokens"]


def test_events_carry_one_token_each_with_speculation_on_both_fronts(served, tenant) -> None:
    key = served.create_tenant("streamer")
    body = {"messages": [{"role": "user", "content": "repeat after me"}], "max_tokens": 40, "ignore_eos": True,
            "stream": True, "temperature": 0, "prompt_cache_key": "s", "stream_options": {"include_usage": True}}
    runs, grpc_runs = [], []
    for _ in range(3):
        runs.append(sse_texts(served, key, body))
        with RepriseClient(served.grpc_target, key) as client:
            stream = client.generate_stream(text="repeat after me", max_new_tokens=40, ignore_eos=True,
                                            session_id="g", temperature=0)
            chunks = list(stream)
        grpc_runs.append(([len(c.token_ids) for c in chunks if c.token_ids], stream.completion.completion_tokens))
    assert accepted(served, "streamer") > 20, "the repeats should have been drafted from history"
    for texts, tokens in runs:
        assert tokens == 40 and 0 < len(texts) <= 40 and texts == runs[0][0]  # one event per token with text
    for sizes, tokens in grpc_runs:
        assert sizes == [1] * tokens  # one chunk per token, never a step's worth
    assert_unharmed(served, tenant)
