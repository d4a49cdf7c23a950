"""The admin plane over real gRPC, with fake tenant and index backends (unit level)."""

from __future__ import annotations

import io

import grpc
import pytest

from grpc_api.client import AdminClient, RepriseClient, RepriseError
from grpc_api.v1 import admin_pb2, admin_pb2_grpc

ADMIN = "rpa_admin"


def test_tenant_lifecycle(server, fakes) -> None:
    _, admin, _ = fakes
    with AdminClient(server.target, ADMIN) as client:
        tenant, key = client.create_tenant("acme")
        assert tenant.name == "acme" and key
        assert [t.tenant_id for t in client.list_tenants()] == [tenant.tenant_id]
        with RepriseClient(server.target, key) as data:  # the new key decodes at once
            assert data.generate(tokens=[1], max_new_tokens=2).completion_tokens == 2
        with pytest.raises(RepriseError) as exc:
            client.delete_tenant(tenant.tenant_id, confirm="acme")
        assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "set confirm to the tenant id" in exc.value.message
        assert client.delete_tenant(tenant.tenant_id, confirm=tenant.tenant_id, dry_run=True) == 7
        assert admin.deleted == []
        assert client.delete_tenant(tenant.tenant_id, confirm=tenant.tenant_id) == 7
        assert admin.deleted == [tenant.tenant_id]
        with pytest.raises(RepriseError) as exc:
            client.delete_tenant(tenant.tenant_id, confirm=tenant.tenant_id)
        assert exc.value.code == grpc.StatusCode.NOT_FOUND


def test_rotate_keys_streams_progress(server) -> None:
    with AdminClient(server.target, ADMIN) as client:
        tenant, old = client.create_tenant("acme")
        seen = []
        result = client.rotate_keys("api_key", tenant.tenant_id, seen.append)
        assert result.api_key and result.api_key != old
        with RepriseClient(server.target, old) as data:
            with pytest.raises(RepriseError) as exc:
                data.generate(tokens=[1], max_new_tokens=1)
            assert exc.value.code == grpc.StatusCode.UNAUTHENTICATED
        with RepriseClient(server.target, result.api_key) as data:
            assert data.generate(tokens=[1], max_new_tokens=1).completion_tokens == 1
        result = client.rotate_keys("master_key", "", seen.append)
        assert result.key_version == 2 and [p.done for p in seen] == [1, 2, 3]
        with pytest.raises(RepriseError, match="leave tenant_id empty"):
            client.rotate_keys("master_key", tenant.tenant_id)
        with pytest.raises(ValueError, match="kind must be one of"):
            client.rotate_keys("everything", tenant.tenant_id)


def test_index_operations(server, fakes) -> None:
    _, admin, _ = fakes
    with AdminClient(server.target, ADMIN) as client:
        tenant, _ = client.create_tenant("acme")
        stats = client.index_stats(tenant.tenant_id)[0]
        assert stats.hit_rate == pytest.approx(0.5) and stats.tau == pytest.approx(1.8)
        assert stats.acceptance_by_position == pytest.approx([0.8, 0.5]) and stats.drafter_steps == {"suffix": 5}
        assert stats.speedup == pytest.approx(1.25 / 0.75) and stats.tokens_per_second == pytest.approx(24.0)
        assert (stats.seconds_saved_drafts, stats.seconds_saved_cache) == pytest.approx((0.4, 0.1))
        assert stats.seconds_saved == pytest.approx(0.5) and stats.plain_seconds == pytest.approx(1.25)
        assert len(client.index_stats()) == 1
        _, memory = client.index_stats_and_memory()
        assert (memory.budget_bytes, memory.resident_bytes, memory.resident_tenants) == (1 << 30, 1000, 1)
        check = client.verify_history(tenant.tenant_id)
        assert (check.num_records, check.repaired, [b.cursor for b in check.bad]) == (3, False, ["2"])
        fixed = client.repair_history(tenant.tenant_id)
        assert fixed.repaired and fixed.num_quarantined == 1 and fixed.bad[0].reason == "authentication failed"
        seen = []
        stats, seconds = client.build_index(tenant.tenant_id, seen.append)
        assert [p.done for p in seen] == [1, 2, 3, 4] and seen[-1].total == 4 and seconds >= 0
        seen.clear()
        client.compact_index(tenant.tenant_id, seen.append)
        assert len(seen) == 4
        result = client.import_corpus(tenant.tenant_id, ["doc one", [1, 2, 3]] * 50, replace=True)
        assert result.num_documents == 100 and len(admin.corpus[tenant.tenant_id]) == 100
        out = io.BytesIO()
        summary = client.export_history(tenant.tenant_id, out, "pw")
        assert (summary.num_bytes, summary.num_trajectories, summary.skipped) == (3003, 3, [])
        assert out.getvalue()[3:1003] == b"\x00" * 1000
        out.seek(0)
        reply = client.import_history(out, "pw", new_tenant_name="copy", piece=500)
        assert reply.created and reply.tenant.name == "copy" and reply.api_key
        assert reply.num_trajectories == 3003
        out.seek(0)
        with pytest.raises(RepriseError) as exc:
            client.import_history(out, "wrong")
        assert exc.value.code == grpc.StatusCode.DATA_LOSS
        with pytest.raises(RepriseError, match="password is empty"):
            client.export_history(tenant.tenant_id, io.BytesIO(), "")


def test_admin_errors(server) -> None:
    with AdminClient(server.target, ADMIN) as client:
        for call, code, needle in [
            (lambda: client.index_stats("nope"), "NOT_FOUND", "no tenant nope"),
            (lambda: client.index_stats("bad id!"), "INVALID_ARGUMENT", "is not a tenant id"),
            (lambda: client.build_index(""), "INVALID_ARGUMENT", "tenant_id is empty"),
            (lambda: client.create_tenant(""), "INVALID_ARGUMENT", "tenant name is empty"),
            (lambda: client.import_corpus("nope", ["x"]), "NOT_FOUND", "no tenant"),
            (lambda: client.import_corpus("", ["x"]), "INVALID_ARGUMENT", "header.tenant_id is empty"),
        ]:
            with pytest.raises(RepriseError) as exc:
                call()
            assert exc.value.code.name == code, (exc.value, needle)
            assert needle in exc.value.message


def test_tenant_cannot_use_the_admin_plane(server) -> None:
    with AdminClient(server.target, ADMIN) as admin:
        _, key_a = admin.create_tenant("a")
        tenant_b, _ = admin.create_tenant("b")
    with AdminClient(server.target, key_a) as as_tenant:
        for call in (lambda: as_tenant.index_stats(tenant_b.tenant_id), lambda: as_tenant.index_stats(),
                     lambda: as_tenant.list_tenants(), lambda: as_tenant.create_tenant("c")):
            with pytest.raises(RepriseError) as exc:
                call()
            assert exc.value.code == grpc.StatusCode.PERMISSION_DENIED
            assert "needs an admin key" in exc.value.message
    with AdminClient(server.target, None) as anonymous:
        with pytest.raises(RepriseError) as exc:
            anonymous.list_tenants()
        assert exc.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_upload_that_breaks_off_keeps_nothing(server, fakes) -> None:
    _, admin, _ = fakes
    with AdminClient(server.target, ADMIN) as client:
        tenant, _ = client.create_tenant("acme")
    messages = [admin_pb2.ImportCorpusRequest(header=admin_pb2.ImportCorpusHeader(tenant_id=tenant.tenant_id))]
    messages += [admin_pb2.ImportCorpusRequest(document=admin_pb2.CorpusDocument(text="x"))] * 3
    messages += [admin_pb2.ImportCorpusRequest(header=admin_pb2.ImportCorpusHeader(tenant_id=tenant.tenant_id))]
    with grpc.insecure_channel(server.target) as channel:
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        with pytest.raises(grpc.RpcError) as exc:
            stub.ImportCorpus(iter(messages), metadata=(("authorization", f"Bearer {ADMIN}"),))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "repeats the header" in exc.value.details()
    assert tenant.tenant_id not in admin.corpus
