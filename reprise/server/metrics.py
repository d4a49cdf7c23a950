"""Prometheus metrics with vLLM-compatible names under ``reprise_``.

vLLM's PromQL ports by renaming ``vllm:`` to ``reprise_``:

- acceptance rate = rate(reprise_spec_decode_num_accepted_tokens_total)
  / rate(reprise_spec_decode_num_draft_tokens_total)
- mean acceptance length = 1 + rate(..._num_accepted_tokens_total) / rate(..._num_drafts_total)
- acceptance at position i = rate(..._num_accepted_tokens_per_pos_total{position="i"})
  / rate(..._num_drafts_total)

No label ever carries a tenant, user, request or session id: per-tenant figures go through the admin
plane (``reprise index stats``) and the dashboard page only. Every metric lives in the registry given to
``ServiceMetrics`` (a fresh one per service), so tests and several services in one process do not mix.
Hot path: ``observe_step`` bumps pre-bound counter children once per verification step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from serving.records import FINISH_REASONS
from serving.savings import RequestCost

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                   0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
FAST_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2)
TOKEN_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
LOOKUP_RESULTS = ("match", "no_match", "skipped")


class ServiceMetrics:
    """All of the service's metrics, in one registry."""

    def __init__(self, registry: CollectorRegistry | None = None, max_positions: int = 64) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.max_positions = max_positions
        self._decoding_metrics(r)
        self._index_metrics(r)
        self._request_metrics(r)
        self._transport_metrics(r)

    def _decoding_metrics(self, r: CollectorRegistry) -> None:
        """Speculative decoding (vLLM v1's names) and what Reprise saves."""
        self.num_drafts = Counter("reprise_spec_decode_num_drafts", "Verification steps that carried a draft",
                                  registry=r)
        self.num_draft_tokens = Counter("reprise_spec_decode_num_draft_tokens", "Draft tokens verified",
                                        registry=r)
        self.num_accepted_tokens = Counter("reprise_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                           registry=r)
        per_pos = Counter("reprise_spec_decode_num_accepted_tokens_per_pos",
                          "Draft tokens accepted at each draft position (0 = first after the prefix)",
                          ["position"], registry=r)
        self._per_pos = [per_pos.labels(position=str(i)) for i in range(self.max_positions)]
        self.num_steps = Counter("reprise_verify_steps", "Verification steps (model forward passes)", registry=r)
        # What Reprise saves (serving/savings.py): measured seconds against the estimate without it.
        spent = Counter("reprise_engine_seconds", "Engine seconds spent on requests (the cost model's clock)",
                        ["phase"], registry=r)
        plain = Counter("reprise_engine_plain_seconds",
                        "Estimated engine seconds for the same work without drafts and the prefix cache",
                        ["phase"], registry=r)
        self._spent = {phase: spent.labels(phase=phase) for phase in ("decode", "prefill")}
        self._plain = {phase: plain.labels(phase=phase) for phase in ("decode", "prefill")}

    def _index_metrics(self, r: CollectorRegistry) -> None:
        """The retrieval indexes, their memory, history quarantine, AppendTrajectory quotas."""
        lookups = Counter("reprise_index_lookups", "Draft lookups by result", ["result"], registry=r)
        self._lookups = {name: lookups.labels(result=name) for name in LOOKUP_RESULTS}
        self.match_length = Histogram("reprise_index_match_length_tokens", "Matched suffix length of a lookup",
                                      buckets=TOKEN_BUCKETS, registry=r)
        self.lookup_seconds = Histogram("reprise_index_lookup_seconds", "Time to propose one draft",
                                        buckets=FAST_BUCKETS, registry=r)
        self.draft_length = Histogram("reprise_draft_length_tokens", "Nodes in a proposed draft tree",
                                      buckets=TOKEN_BUCKETS, registry=r)
        self.index_memory_bytes = Gauge("reprise_index_memory_bytes", "Memory held by in-memory indexes",
                                        registry=r)
        self.index_evictions = Counter("reprise_index_evictions", "Tenant indexes evicted from memory",
                                       registry=r)
        self.index_memory_budget_bytes = Gauge("reprise_index_memory_budget_bytes",
                                               "Memory budget of all tenants' in-memory indexes (0: none)",
                                               registry=r)
        self.quarantined_records = Gauge("reprise_history_quarantined_records",
                                         "Stored records skipped at index load over all tenants: they failed "
                                         "authentication or parsing (`reprise index verify` names them)",
                                         registry=r)
        self.append_refused = Counter("reprise_append_trajectory_refused",
                                      "AppendTrajectory calls refused by a per-tenant quota, by quota",
                                      ["quota"], registry=r)
        self.speculation_disabled = Counter("reprise_speculation_disabled",
                                            "Requests or steps decoded without speculation, by reason",
                                            ["reason"], registry=r)

    def _request_metrics(self, r: CollectorRegistry) -> None:
        """Generation requests: latencies, tokens, finish reasons."""
        self.ttft = Histogram("reprise_request_ttft_seconds", "Time to first token, from request arrival",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("reprise_inter_token_latency_seconds",
                             "Time between successive token emissions of a request (one per verification step)",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("reprise_request_time_per_output_token_seconds",
                              "(end - first token) / (output tokens - 1), per request",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("reprise_e2e_request_latency_seconds", "Request latency, arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.store_wait = Histogram("reprise_store_wait_seconds",
                                    "Time a recorded request's reply waited for its turn to be stored",
                                    buckets=FAST_BUCKETS + (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
                                    registry=r)
        requests = Counter("reprise_requests", "Finished generation requests by finish reason",
                           ["finish_reason"], registry=r)
        self._requests: dict[str, Any] = {name: requests.labels(finish_reason=name) for name in FINISH_REASONS}
        self.prompt_tokens = Counter("reprise_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("reprise_generation_tokens", "Tokens generated", registry=r)
        self.requests_running = Gauge("reprise_num_requests_running", "Generation requests in flight",
                                      registry=r)

    def _transport_metrics(self, r: CollectorRegistry) -> None:
        """gRPC (go-grpc-prometheus's names), HTTP, the store, integrity failures."""
        self.grpc_started = Counter("grpc_server_started", "RPCs started",
                                    ["grpc_service", "grpc_method", "grpc_type"], registry=r)
        self.grpc_handled = Counter("grpc_server_handled", "RPCs completed, by status code",
                                    ["grpc_service", "grpc_method", "grpc_type", "grpc_code"], registry=r)
        self.grpc_seconds = Histogram("grpc_server_handling_seconds", "RPC handling time",
                                      ["grpc_service", "grpc_method", "grpc_type"],
                                      buckets=LATENCY_BUCKETS, registry=r)
        # HTTP (the OpenAI-compatible API, metrics, dashboard); route is the route's template, never an id.
        self.http_handled = Counter("reprise_http_requests", "HTTP requests completed, by route and status",
                                    ["route", "status"], registry=r)
        self.http_seconds = Histogram("reprise_http_request_seconds", "HTTP handling time (to the last byte)",
                                      ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.storage_seconds = Histogram("reprise_storage_op_seconds", "History store operations",
                                         ["backend", "op"], buckets=LATENCY_BUCKETS, registry=r)
        self.crypto_failures = Counter("reprise_crypto_failures", "Records that failed their integrity check",
                                       ["kind"], registry=r)

    # ---- called by the engine's step observer, once per step ----------------------------------------------

    def observe_step(self, num_draft_tokens: int, num_accepted: int, lookup_seconds: float | None = None,
                     match_len: int | None = None, skipped: bool = False) -> None:
        """One verification step: ``num_draft_tokens`` nodes verified, ``num_accepted`` of them accepted
        (along one path, so positions 0..num_accepted-1 each gained one)."""
        self.num_steps.inc()
        if skipped:
            self._lookups["skipped"].inc()
        elif num_draft_tokens:
            self._lookups["match"].inc()
            self.num_drafts.inc()
            self.num_draft_tokens.inc(num_draft_tokens)
            self.draft_length.observe(num_draft_tokens)
            if num_accepted:
                self.num_accepted_tokens.inc(num_accepted)
                for child in self._per_pos[: min(num_accepted, self.max_positions)]:
                    child.inc()
        else:
            self._lookups["no_match"].inc()
        if lookup_seconds is not None:
            self.lookup_seconds.observe(lookup_seconds)
        if match_len is not None:
            self.match_length.observe(match_len)

    def observe_costs(self, step: RequestCost | None, prefill: RequestCost | None = None) -> None:
        """One request's share of a step (and of its prefill): seconds spent and the plain estimate."""
        for phase, cost in (("decode", step), ("prefill", prefill)):
            if cost is not None:
                self._spent[phase].inc(max(cost.seconds, 0.0))
                self._plain[phase].inc(max(cost.plain_seconds, 0.0))

    # ---- called by the gRPC layer ------------------------------------------------------------------

    def observe_request(self, finish_reason: str, prompt_tokens: int, completion_tokens: int,
                        ttft: float | None, e2e: float) -> None:
        """A finished generation request (``finish_reason`` one of FINISH_REASONS)."""
        self._requests.get(finish_reason, self._requests["error"]).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.e2e.observe(e2e)
        if ttft is not None:
            self.ttft.observe(ttft)
            if completion_tokens > 1:
                self.tpot.observe((e2e - ttft) / (completion_tokens - 1))

    def set_requests_running(self, num: int) -> None:
        self.requests_running.set(num)

    def observe_append_refused(self, quota: str) -> None:
        self.append_refused.labels(quota=quota).inc()

    def observe_store_wait(self, seconds: float) -> None:
        self.store_wait.observe(seconds)

    def observe_emission_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def observe_rpc_started(self, service: str, method: str, rpc_type: str) -> None:
        self.grpc_started.labels(service, method, rpc_type).inc()

    def observe_rpc(self, service: str, method: str, rpc_type: str, code: str, seconds: float) -> None:
        self.grpc_handled.labels(service, method, rpc_type, code).inc()
        self.grpc_seconds.labels(service, method, rpc_type).observe(seconds)

    def observe_http(self, route: str, status: int, seconds: float) -> None:
        self.http_handled.labels(route, str(status)).inc()
        self.http_seconds.labels(route).observe(seconds)

    def watch_engine(self, engine: Any) -> None:
        """Report the engine's prefix cache and fitted step cost, read when Prometheus scrapes."""
        self.registry.register(_EngineCollector(engine))

    def render(self) -> tuple[bytes, str]:
        """The text exposition format and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EngineCollector:
    """Figures read from the engine at scrape time: the prefix cache (vLLM's ``prefix_cache_queries`` and
    ``prefix_cache_hits`` counters, in tokens, plus its bytes), the requests preempted for fair shares,
    and the draft budget's fitted step cost."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        cache = self._engine.runner.prefix_cache
        if cache is not None:
            s = cache.stats()
            yield GaugeMetricFamily("reprise_prefix_cache_bytes", "KV bytes held by the prefix cache", value=s.bytes)
            yield GaugeMetricFamily("reprise_prefix_cache_capacity_bytes", "The prefix cache's memory budget",
                                    value=s.capacity_bytes)
            yield CounterMetricFamily("reprise_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      value=s.query_tokens)
            yield CounterMetricFamily("reprise_prefix_cache_hits",
                                      "Prompt tokens whose KV came from the prefix cache", value=s.hit_tokens)
            yield CounterMetricFamily("reprise_prefix_cache_evicted_blocks",
                                      "Blocks evicted from the prefix cache to make room", value=s.evicted_blocks)
        yield CounterMetricFamily("reprise_preemptions", "Requests that yielded their decoding slot to a waiting "
                                  "tenant (fair share), to resume later", value=self._engine.preemptions)
        fit = self._engine.step_costs
        if fit is not None:
            cost = GaugeMetricFamily("reprise_step_cost_seconds",
                                     f"Fitted verification-step time ({fit.clock_name} clock) by rows beyond the "
                                     "first: the draft budget's cost model", labels=["extra_rows"])
            for rows, seconds, _ in fit.table():
                cost.add_metric([str(rows)], seconds)
            yield cost
            offset = GaugeMetricFamily("reprise_step_cost_batch_offset_seconds",
                                       "Fitted time a step of this many requests pays beyond the table's price of "
                                       "its rows (reading each request's cached prefix)", labels=["batch"])
            for batch, (seconds, _) in fit.offsets().items():
                offset.add_metric([str(batch)], seconds)
            yield offset
