"""reprise.server.metrics: vLLM-compatible names, counters bumped per step, and dashboards that only use
metrics the service exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from reprise.server.metrics import ServiceMetrics

ROOT = Path(__file__).resolve().parents[3]


def exported_names(m: ServiceMetrics) -> set[str]:
    names: set[str] = set()
    for family in m.registry.collect():
        if family.type == "counter":
            names |= {family.name + "_total", family.name + "_created"}
        elif family.type == "histogram":
            names |= {family.name + s for s in ("_bucket", "_sum", "_count", "_created")}
        else:
            names.add(family.name)
    return names


def samples(m: ServiceMetrics) -> dict[tuple[str, tuple], float]:
    body, _ = m.render()
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_vllm_compatible_names_and_step_accounting() -> None:
    m = ServiceMetrics()
    m.observe_step(num_draft_tokens=8, num_accepted=3, lookup_seconds=2e-5, match_len=12)
    m.observe_step(num_draft_tokens=4, num_accepted=0)
    m.observe_step(num_draft_tokens=0, num_accepted=0)
    m.observe_step(num_draft_tokens=0, num_accepted=0, skipped=True)
    s = samples(m)
    assert s[("reprise_spec_decode_num_drafts_total", ())] == 2
    assert s[("reprise_spec_decode_num_draft_tokens_total", ())] == 12
    assert s[("reprise_spec_decode_num_accepted_tokens_total", ())] == 3
    per_pos = {p: s[("reprise_spec_decode_num_accepted_tokens_per_pos_total", (("position", str(p)),))] for p in range(4)}
    assert per_pos == {0: 1, 1: 1, 2: 1, 3: 0}
    assert s[("reprise_index_lookups_total", (("result", "match"),))] == 2
    assert s[("reprise_index_lookups_total", (("result", "no_match"),))] == 1
    assert s[("reprise_index_lookups_total", (("result", "skipped"),))] == 1
    assert s[("reprise_verify_steps_total", ())] == 4


def test_request_figures_and_no_tenant_labels() -> None:
    m = ServiceMetrics()
    m.observe_request("stop", prompt_tokens=10, completion_tokens=5, ttft=0.2, e2e=1.0)
    m.observe_request("aborted", prompt_tokens=3, completion_tokens=0, ttft=None, e2e=0.1)
    m.observe_rpc("reprise.v1.DecodingService", "Generate", "unary", "OK", 0.5)
    s = samples(m)
    assert s[("reprise_requests_total", (("finish_reason", "stop"),))] == 1
    assert s[("reprise_requests_total", (("finish_reason", "aborted"),))] == 1
    assert s[("reprise_request_time_per_output_token_seconds_sum", ())] == 0.2  # (1.0 - 0.2) / 4
    labels = {k for (_, ls) in s for k, _ in ls}
    assert labels <= {"position", "result", "finish_reason", "reason", "grpc_service", "grpc_method", "grpc_type",
                      "grpc_code", "le", "backend", "op", "kind", "extra_rows", "phase"}


def test_savings_counters_are_service_wide() -> None:
    """Seconds spent against the plain estimate, by phase: speedup = their ratio, no tenant label."""
    from serving.savings import RequestCost

    m = ServiceMetrics()
    m.observe_costs(RequestCost(0.5, 1.5), RequestCost(2.0, 3.0))
    m.observe_costs(RequestCost(0.5, 0.5))
    s = samples(m)
    assert s[("reprise_engine_seconds_total", (("phase", "decode"),))] == 1.0
    assert s[("reprise_engine_plain_seconds_total", (("phase", "decode"),))] == 2.0
    assert s[("reprise_engine_seconds_total", (("phase", "prefill"),))] == 2.0
    assert s[("reprise_engine_plain_seconds_total", (("phase", "prefill"),))] == 3.0


def watching_an_engine(engines: list | None = None) -> ServiceMetrics:
    """Metrics of a service whose engine has a prefix cache and a fitted step cost (a tiny model); the
    engine is appended to ``engines`` when given."""
    from reprise.engine.engine import Engine
    from retrieval.registry import make_proposer
    from verifier.runner import ModelRunner
    from verifier.testing import tiny_model

    runner = ModelRunner(tiny_model("llama", vocab_size=64), max_len=96, max_draft_nodes=4, prefix_cache_bytes=1 << 20)
    m = ServiceMetrics()
    engine = Engine(runner, make_proposer("prompt_lookup"))
    m.watch_engine(engine)
    if engines is not None:
        engines.append(engine)
    return m


def test_the_engines_prefix_cache_and_step_cost_are_exported() -> None:
    m = watching_an_engine()
    s = samples(m)
    assert s[("reprise_prefix_cache_capacity_bytes", ())] > 0 and s[("reprise_prefix_cache_bytes", ())] == 0
    assert s[("reprise_prefix_cache_queries_total", ())] == 0
    assert s[("reprise_preemptions_total", ())] == 0
    costs = {dict(labels)["extra_rows"]: v for (name, labels), v in s.items() if name == "reprise_step_cost_seconds"}
    assert set(costs) >= {"0", "1", "4"} and all(v > 0 for v in costs.values())
    assert not any(name == "reprise_step_cost_batch_offset_seconds" for name, _ in s)  # no batch has run yet


def test_each_batch_sizes_step_cost_offset_is_exported() -> None:
    engines: list = []
    m = watching_an_engine(engines)
    fit = engines[0].step_costs
    for _ in range(fit.refresh_every):
        fit.observe(3, 2 * float(fit.cost(np.array([3]))[0]), batch=4)  # four requests: twice four rows' price
    offsets = {dict(labels)["batch"]: v for (name, labels), v in samples(m).items()
               if name == "reprise_step_cost_batch_offset_seconds"}
    assert list(offsets) == ["4"] and offsets["4"] > 0


def test_dashboards_use_only_exported_metrics() -> None:
    names = exported_names(watching_an_engine())
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "reprise.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    alerts = (ROOT / "deploy" / "grafana" / "alerts.yaml").read_text()
    used = set(re.findall(r"\b((?:reprise|grpc_server)_[a-z0-9_]+)", " ".join(exprs) + alerts))
    assert used and used <= names, sorted(used - names)
    assert len(exprs) >= 20 and all(p["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"] if "datasource" in p)
