"""The service with the real default model, SmolLM2-135M-Instruct (slow: run with `make test-slow`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from testkit.service import LoopThread, free_port

from grpc_api.client import AdminClient, RepriseClient
from reprise.config import load_config
from reprise.service import Service
from verifier.models import load_default_model
from verifier.testing import hf_greedy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol_service(tmp_path_factory):
    home = tmp_path_factory.mktemp("smol") / "home"
    config = load_config({"home": str(home), "server.grpc_port": "0", "server.http_port": str(free_port()),
                          "model.num_slots": "4", "model.max_len": "1024"}, env={})
    loop = LoopThread()

    async def make():
        return Service(config)

    service = loop.call(make())
    loop.call(service.start(), timeout=300)
    target = f"127.0.0.1:{service.grpc_port}"
    with AdminClient(target, (Path(home) / "admin.key").read_text().strip()) as admin:
        tenant, key = admin.create_tenant("smol")
    yield target, key, tenant.tenant_id, (Path(home) / "admin.key").read_text().strip()
    loop.call(service.stop(0))
    loop.close()


def test_chat_stream_equals_transformers_greedy(smol_service) -> None:
    target, key, _, _ = smol_service
    reference = load_default_model()
    chat = [{"role": "user", "content": "List three colors of the rainbow, comma separated."}]
    ids = reference.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    with RepriseClient(target, key) as client:
        stream = client.generate_stream(messages=chat, max_new_tokens=40)
        text = "".join(c.text for c in stream)
    done = stream.completion
    expected = hf_greedy(reference.model, ids, len(done.token_ids), eos=True)
    assert done.token_ids == expected
    assert text == reference.tokenizer.decode(done.token_ids, skip_special_tokens=True)


def test_second_trial_drafts_from_the_first(smol_service) -> None:
    target, key, tid, admin_key = smol_service
    task = [{"role": "system", "content": "You are a travel agent. Answer with a JSON tool call."},
            {"role": "user", "content": "Book a flight from Paris to Lisbon on 3 May for Ana Lima."}]
    with RepriseClient(target, key) as client:
        first = client.generate(messages=task, max_new_tokens=64, session_id="trial-1")
        with AdminClient(target, admin_key) as admin:
            before = admin.index_stats(tid)[0]
        second = client.generate(messages=task, max_new_tokens=64, session_id="trial-2")
    assert second.token_ids == first.token_ids  # greedy: the same task, the same answer
    with AdminClient(target, admin_key) as admin:
        after = admin.index_stats(tid)[0]
    steps = after.num_steps - before.num_steps
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    assert accepted >= len(second.token_ids) // 2  # most of trial 2 came from trial 1's history
    assert steps < len(second.token_ids) / 2
