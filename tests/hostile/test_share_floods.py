"""Issue 36's fair-share attacks against a real `reprise serve` with the default slots and per-tenant limit
(8 slots, 16 requests in flight per tenant): tenant A keeps 16 maximal completions running while tenant
B chats, and A floods the prefix cache with distinct prompts after B's prompt was cached
(reprise/benchmarks/fair_share.py). Its own server: the suite's shared one runs smaller limits, and
this one's prefix cache is small enough for A's flood to fill it many times over."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from reprise.benchmarks.fair_share import Flood, chat_latencies, health_now, percentile, prefix_survival
from reprise.benchmarks.hostile import Served, all_ok

# The tiny model's KV is 512 bytes a token in float32: 96 blocks of 16 tokens. B's prompt (about 220 byte
# tokens) takes 13 of them, and so does each of A's 14.
CACHE_BYTES = 96 * 16 * 512
DEFAULTS = ("--model-num-slots", "8", "--max-requests-per-tenant", "16", "--model-max-len", "1024",
            "--model-dtype", "float32", "--model-prefix-cache-bytes", str(CACHE_BYTES))


@pytest.fixture(scope="module")
def fair(tmp_path_factory, tiny_model_dir) -> Iterator[Served]:
    with Served.start(tmp_path_factory.mktemp("fair") / "home", tiny_model_dir, *DEFAULTS) as served:
        yield served


def test_a_tenant_keeping_16_maximal_requests_running_leaves_the_other_its_share(fair: Served) -> None:
    a, b = fair.create_tenant("flooder"), fair.create_tenant("chatter")
    chat_latencies(fair, b, 3)  # warm: B's history and cached prompt, as an agent's repeated call has
    idle = chat_latencies(fair, b, 20)
    # Sampled: the tiny random model's greedy output repeats itself, drafts would end A's requests early.
    with Flood(fair, a, num_requests=16, max_tokens=900, temperature=1.0) as flood:
        assert flood.wait_running(16), "the flood never had its 16 requests in flight"
        during = chat_latencies(fair, b, 20)
        health = health_now(fair)
        assert fair.metric("reprise_num_requests_running") >= 16  # A's flood was still going all along
        assert fair.metric("reprise_preemptions_total") >= 1
    assert health == ("200 serving", "SERVING")
    assert set(flood.answers) <= {200}  # none refused: A stayed within its own limit
    # Without preemption B waits for one of A's 900-token requests to end (seconds to minutes); with it,
    # for the next step. The bound is loose for a loaded 2-core machine (the docs' figure is 3x).
    assert percentile(during, 0.95) < 8 * percentile(idle, 0.95) + 1.0, (idle, during)
    assert all_ok(fair.normal_requests(b))


def test_a_flood_of_distinct_prompts_does_not_evict_another_tenants_cached_prefix(fair: Served) -> None:
    a, b = fair.create_tenant("evicter"), fair.create_tenant("agent")
    figures = prefix_survival(fair, a, b, num_words=40, num_prompts=14)
    assert figures["cached_before"] >= 160, figures  # B's repeat came from its cache
    assert figures["cached_after"] == figures["cached_before"], figures
    assert fair.metric("reprise_prefix_cache_evicted_blocks_total") > 0  # A's flood did fill the cache
    assert all_ok(fair.normal_requests(b))
