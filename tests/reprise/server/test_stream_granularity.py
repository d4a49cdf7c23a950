"""Stream events follow tokens, never verification steps: with speculation on, a repeated request whose
steps accept many drafted tokens streams exactly as many events, each with its own token's text, as a
first run that accepted few. Both fronts, a real service (tiny model)."""

from __future__ import annotations

import json

import httpx
import pytest
from testkit.service import start_service

from grpc_api.client import AdminClient, RepriseClient


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    r = start_service(tmp_path_factory.mktemp("granularity") / "home")
    with AdminClient(r.target, r.admin_key) as admin:
        r.tid, r.key = admin.create_tenant("acme")  # type: ignore[attr-defined]
    yield r
    r.stop()


def accepted_tokens(service) -> int:
    with AdminClient(service.target, service.admin_key) as admin:
        return next(s.num_accepted_tokens for s in admin.index_stats() if s.tenant_id == service.tid.tenant_id)


def test_grpc_chunks_carry_one_token_and_its_text_whatever_was_accepted(service) -> None:
    tokenizer = service.service.core.renderer.tokenizer
    runs = []
    with RepriseClient(service.target, service.key) as client:
        for _ in range(3):  # the later runs draft the first run's output from the tenant's history
            before = accepted_tokens(service)
            stream = client.generate_stream(text="the same prompt", max_new_tokens=60, ignore_eos=True,
                                            session_id="s", temperature=0)
            chunks = list(stream)
            runs.append((chunks, stream.completion, accepted_tokens(service) - before))
    first, _, _ = runs[0]
    for chunks, completion, _accepted in runs:
        tokens = [c for c in chunks if c.token_ids]
        assert [len(c.token_ids) for c in tokens] == [1] * completion.completion_tokens
        assert len(chunks) - len(tokens) <= 1  # text cut mid-character by the length limit comes last
        assert "".join(c.text for c in chunks) == completion.text
        # Greedy: the same tokens each run, so the same events, texts included, however the steps fell.
        assert [(c.token_ids, c.text) for c in chunks] == [(c.token_ids, c.text) for c in first]
        for c in tokens:  # a token's own text (an unfinished character's bytes come with the last of them)
            piece = tokenizer.decode(c.token_ids)
            assert c.text == piece or c.text == "" or c.text.endswith(piece) or "\ufffd" in piece
    assert runs[0][2] < runs[-1][2] and runs[-1][2] > 20, "the repeated request should have accepted drafts"


def test_sse_events_carry_one_token_each_with_speculation(service) -> None:
    body = {"model": "tiny-llama", "prompt": "another prompt", "max_tokens": 50, "ignore_eos": True,
            "stream": True, "temperature": 0, "prompt_cache_key": "s2", "stream_options": {"include_usage": True}}
    counts = []
    for _ in range(3):
        before = accepted_tokens(service)
        with httpx.stream("POST", service.http + "/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {service.key}"}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        texts = [e["choices"][0]["text"] for e in events if e["choices"] and e["choices"][0]["finish_reason"] is None]
        usage = events[-1]["usage"]
        counts.append((texts, usage["completion_tokens"], accepted_tokens(service) - before))
    for texts, tokens, _ in counts:
        # one event per token with text (a token ending mid-character has none of its own), the same
        # events each run however many drafted tokens each step accepted
        assert tokens == 50 and 0 < len(texts) <= 51 and texts == counts[0][0]
    assert counts[-1][2] > 20
