"""Issue 36, items 4, 5 and 8, from outside: files and values that cost the service work before they
are checked (a crafted export's KDF, a trace line of 1.5 GB), and answers that named the wrong thing
(a schema with no valid value answered 200, a missing stored response answered ``model_not_found``, a
tenant named with another tenant's id)."""

from __future__ import annotations

import io
import struct

import grpc
import pytest
from testkit.hostile import assert_unharmed

from grpc_api.client import AdminClient, RepriseClient, RepriseError
from privacy.transfer import MAGIC
from reprise.benchmarks.hostile import MiB, http_call, run_cli, trace_bomb

USER = [{"role": "user", "content": "hi"}]


def crafted_export(log2_n: int = 20, r: int = 16, p: int = 1) -> bytes:
    """76 bytes: a valid-looking header asking for scrypt log2 n 20, r 16 (2 GiB), and one junk frame."""
    return MAGIC + struct.pack(">BBBB16s8s", 1, log2_n, r, p, b"s" * 16, b"n" * 8) + struct.pack(">I", 28) + b"\0" * 28


@pytest.mark.parametrize("params", [(20, 16, 1), (15, 32, 16), (22, 8, 1)])
def test_a_crafted_export_is_refused_before_its_kdf_runs(served, tenant, params) -> None:
    data = crafted_export(*params)
    assert len(data) == 76
    served.reset_peak()
    before = served.rss()
    with AdminClient(served.grpc_target, served.admin_key) as admin, pytest.raises(RepriseError) as exc:
        admin.import_history(io.BytesIO(data), "correct horse battery staple", new_tenant_name="migrated")
    assert exc.value.code == grpc.StatusCode.DATA_LOSS
    assert f"asks for scrypt log2 n {params[0]}, r {params[1]}, p {params[2]}" in exc.value.message
    assert served.peak_rss() - before < 100 * MiB
    with AdminClient(served.grpc_target, served.admin_key) as admin:
        assert "migrated" not in [t.name for t in admin.list_tenants()]
    assert_unharmed(served, tenant)


def test_a_trace_line_of_one_and_a_half_gigabytes_is_refused_without_reading_it(tmp_path) -> None:
    """`reprise replay` on a 1.5 MB gzip holding one 1.5 GB line: refused after its first 64 MiB, naming
    file, line and limit; measured in the CLI's own process (its peak RSS above its RSS at the start)."""
    path = trace_bomb(tmp_path / "bomb.jsonl.gz", 1536 * MiB)
    assert path.stat().st_size < 10 * MiB
    run = run_cli("replay", str(path))
    assert run.returncode == 2, run.stderr[-2000:]
    assert (f"{path}:2: line longer than {64 * MiB} bytes (the limit of a trace line; set "
            "REPRISE_TRACE_MAX_LINE_BYTES to raise it)") in run.stderr
    # the replay command's imports and the line's first 64 MiB; read whole, 1.5 GB took 3.5 GB
    assert 0 < run.peak_above_start < 400 * MiB, run


@pytest.mark.parametrize("schema", [{"anyOf": []}, {"oneOf": []}, {"type": []}, {"const": 1, "type": "string"},
                                    {"type": "object", "properties": {"a": {"anyOf": []}}, "required": ["a"]},
                                    {"type": "object", "required": ["b"], "additionalProperties": False}])
def test_a_schema_with_no_valid_value_is_a_400_on_both_fronts(served, tenant, attacker, schema) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    status, _, doc = http_call(served.http, "POST", "/v1/chat/completions",
                               {"messages": USER, "max_tokens": 20, "response_format": fmt}, key=attacker)
    assert status == 400 and doc["error"]["param"] == "response_format.json_schema.schema", doc
    assert "admits no value" in doc["error"]["message"]
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    status, _, doc = http_call(served.http, "POST", "/v1/chat/completions",
                               {"messages": USER, "max_tokens": 20, "tools": [tool], "tool_choice": "required"},
                               key=attacker)
    assert status == 400 and doc["error"]["param"] == "tools[0].function.parameters", doc
    with RepriseClient(served.grpc_target, attacker) as client, pytest.raises(RepriseError) as exc:
        client.generate(messages=USER, max_new_tokens=20, response_format=fmt, timeout=30)
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT and "admits no value" in exc.value.message
    assert_unharmed(served, tenant)


@pytest.mark.parametrize("method, path", [("GET", "/v1/responses/resp_0123456789abcdef"),
                                          ("DELETE", "/v1/responses/resp_0123456789abcdef"),
                                          ("GET", "/v1/responses/resp_0123456789abcdef/input_items")])
def test_a_missing_stored_response_is_not_called_a_model(served, attacker, method, path) -> None:
    status, _, doc = http_call(served.http, method, path, key=attacker)
    assert status == 404 and doc["error"]["type"] == "not_found_error", doc
    assert doc["error"]["code"] == "response_not_found", doc
    status, _, doc = http_call(served.http, "GET", "/v1/models/no-such-model", key=attacker)
    assert status == 404 and doc["error"]["code"] == "model_not_found", doc


def test_a_tenant_cannot_be_named_with_an_id(served, tenant) -> None:
    with AdminClient(served.grpc_target, served.admin_key) as admin:
        victim = next(t for t in admin.list_tenants() if t.name == "normal").tenant_id
        for name in (victim, victim.upper(), "0" * 32):
            with pytest.raises(RepriseError) as exc:
                admin.create_tenant(name)
            assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "has the shape of a tenant id" in exc.value.message
        assert [t.name for t in admin.list_tenants()].count(victim) == 0
    assert_unharmed(served, tenant)
