"""What every hostile-client test checks after its attack (tests/hostile)."""

from __future__ import annotations

from reprise.benchmarks.hostile import Served, all_ok


def assert_unharmed(served: Served, tenant: str) -> dict:
    """The process lives, a normal tenant's gRPC Generate and HTTP chat succeed, both health checks say
    SERVING (each within 30 s); what was seen."""
    assert served.alive(), served.log()[-3000:]
    seen = served.normal_requests(tenant)
    assert all_ok(seen), seen
    return seen
