"""Prefix reuse through the whole service: a tenant's repeated prompt starts from its cached KV, another
tenant's identical prompt does not, usage and the admin plane and metrics report it, and deleting the
tenant drops its blocks."""

from __future__ import annotations

import json
import re
import time
import urllib.request

from testkit.service import byte_tokenizer

from grpc_api.client import AdminClient, RepriseClient

PROMPT_TEXT = "You are a careful agent. Tools: search(query), lookup(term), finish(answer). Question: "


def tenant_key(r, name: str) -> tuple[str, str]:
    with AdminClient(r.target, r.admin_key) as admin:
        tenant, key = admin.create_tenant(name)
    return tenant.tenant_id, key


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def metric(body: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", body, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def test_reuse_is_scoped_to_the_tenant_and_reported(running) -> None:
    tid_a, key_a = tenant_key(running, "a")
    tid_b, key_b = tenant_key(running, "b")
    prompt = byte_tokenizer().encode(PROMPT_TEXT + "who wrote it?", add_special_tokens=False)
    with RepriseClient(running.target, key_a) as a:
        first = a.generate(tokens=prompt, max_new_tokens=8)
        again = a.generate(tokens=prompt, max_new_tokens=8)
        longer = a.generate(tokens=prompt + list(first.token_ids) + prompt[:20], max_new_tokens=8)
    reusable = (len(prompt) - 1) // 16 * 16
    assert first.cached_tokens == 0 and again.cached_tokens == reusable > 0
    assert again.token_ids == first.token_ids
    assert longer.cached_tokens >= reusable  # the first call's output rows were cached too
    with RepriseClient(running.target, key_b) as b:
        other = b.generate(tokens=prompt, max_new_tokens=8)
    assert other.cached_tokens == 0 and other.token_ids == first.token_ids

    with AdminClient(running.target, running.admin_key) as admin:
        (sa,) = admin.index_stats(tid_a)
        (sb,) = admin.index_stats(tid_b)
    assert sa.prompt_tokens == 2 * len(prompt) + len(prompt) + len(first.token_ids) + 20
    assert sa.cached_prompt_tokens == again.cached_tokens + longer.cached_tokens
    assert sa.prefix_cache_hit_rate == sa.cached_prompt_tokens / sa.prompt_tokens
    assert sa.prefix_cache_bytes > sb.prefix_cache_bytes > 0 and sb.cached_prompt_tokens == 0

    body = running.metrics()
    assert metric(body, "reprise_prefix_cache_hits_total") == sa.cached_prompt_tokens
    assert metric(body, "reprise_prefix_cache_queries_total") == sa.prompt_tokens + sb.prompt_tokens
    assert metric(body, "reprise_prefix_cache_bytes") == sa.prefix_cache_bytes + sb.prefix_cache_bytes
    assert re.search(r'^reprise_step_cost_seconds\{extra_rows="0"\} \S+$', body, re.MULTILINE)  # the fitted model

    def dashboard_bytes() -> int | None:
        request = urllib.request.Request(running.http + "/dashboard/api/stats",
                                         headers={"Authorization": f"Bearer {running.admin_key}"})  # fmt: skip
        page = json.loads(urllib.request.urlopen(request, timeout=10).read())
        current = {t["tenant_id"]: t["current"] for t in page["tenants"]}
        return current[tid_a]["prefix_cache_bytes"] if tid_a in current else None

    assert wait_until(lambda: dashboard_bytes() == sa.prefix_cache_bytes)  # sampled every 0.2 s

    with AdminClient(running.target, running.admin_key) as admin:
        admin.delete_tenant(tid_a, confirm=tid_a)
    body = running.metrics()
    assert metric(body, "reprise_prefix_cache_bytes") == sb.prefix_cache_bytes
