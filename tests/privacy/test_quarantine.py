"""One bad record costs only itself: readers that can go on skip and report it, verify names it, repair
sets it aside (quarantine, bytes unchanged) and says what it dropped, and the export leaves it out."""

from __future__ import annotations

import io

import pytest

from privacy import IntegrityError
from privacy.blobs import KIND_CORPUS
from privacy.integrity import KIND_QUARANTINE, list_quarantined

PASSWORD = "correct horse battery"


def _flip(store, tenant, index: int) -> tuple[str, str]:
    """Flip one ciphertext byte of the tenant's ``index``-th trajectory; its (cursor, record id hex)."""
    row = store.storage.traj_scan(tenant.value, None, 1000)[index]
    bad = bytearray(row.sealed)
    bad[len(bad) // 2] ^= 0x40
    store.storage.traj_replace(tenant.value, [(row.record_id, bytes(bad))])
    return row.cursor, row.record_id.hex()


def _history(store, n: int = 12):
    tenant = store.create_tenant("acme").id
    for i in range(n):
        store.append_trajectory(tenant, f"s{i % 3}", [i, i + 1, i + 2], f"turn {i}")
    return tenant


def test_a_flipped_byte_is_skipped_and_reported_by_readers_that_can_go_on(store) -> None:
    tenant = _history(store)
    cursor, rid = _flip(store, tenant, 5)
    with pytest.raises(IntegrityError):
        list(store.iter_trajectories(tenant))  # strict readers still refuse
    bad = []
    texts = [r.trajectory.text for r in store.iter_trajectories(tenant, on_bad=bad.append, batch_size=4)]
    assert texts == [f"turn {i}" for i in range(12) if i != 5]
    assert [(b.kind, b.record_id, b.cursor) for b in bad] == [("trajectory", rid, cursor)]
    assert "authentication failed" in bad[0].reason


def test_verify_names_the_record_and_repair_sets_it_aside(store) -> None:
    tenant = _history(store)
    cursor, rid = _flip(store, tenant, 0)
    stored_before = store.storage.traj_scan(tenant.value, None, 1)[0].sealed

    check = store.verify_history(tenant)
    assert (check.num_records, check.repaired, check.num_quarantined) == (12, False, 0)
    assert [(b.kind, b.record_id, b.cursor) for b in check.bad] == [("trajectory", rid, cursor)]
    assert store.count_trajectories(tenant) == 12  # verify writes nothing

    fixed = store.repair_history(tenant)
    assert fixed.repaired and [b.record_id for b in fixed.bad] == [rid] and fixed.num_quarantined == 1
    assert store.count_trajectories(tenant) == 11
    assert [r.trajectory.text for r in store.iter_trajectories(tenant)] == [f"turn {i}" for i in range(1, 12)]
    again = store.verify_history(tenant)
    assert again.bad == () and again.num_records == 11 and again.num_quarantined == 1
    (kept,) = list_quarantined(store, tenant)
    assert (kept["kind"], kept["record_id"], kept["cursor"]) == ("trajectory", rid, cursor)
    blob = store.storage.blob_get(tenant.value, KIND_QUARANTINE, bytes.fromhex(rid))
    assert blob.chunks == [stored_before]  # kept aside byte for byte, not deleted silently

    store.delete_tenant(tenant)
    assert store.storage.blob_list(tenant.value, KIND_QUARANTINE) == []


def test_a_bad_corpus_part_costs_only_its_documents(store) -> None:
    tenant = store.create_tenant("acme").id
    store.add_corpus_documents(tenant, [[1, 2, 3], [4, 5]])
    store.add_corpus_documents(tenant, [[6, 7]])
    store.add_corpus_documents(tenant, [[8, 9, 10]])
    tk = store.keychain.tenant_keys(tenant)
    (second,) = [b for b in store.storage.blob_list(tenant.value, KIND_CORPUS)
                 if store._blob_head(tk, KIND_CORPUS, b)["part"] == 1]
    whole = store.storage.blob_get(tenant.value, KIND_CORPUS, second.tag)
    chunk = bytearray(whole.chunks[0])
    chunk[-1] ^= 1
    store.storage.blob_put(tenant.value, KIND_CORPUS, second.tag, whole.blob_id, whole.head, [bytes(chunk)])

    with pytest.raises(IntegrityError):
        list(store.iter_corpus(tenant))
    bad = []
    assert [d.tolist() for d in store.iter_corpus(tenant, on_bad=bad.append)] == [[1, 2, 3], [4, 5], [8, 9, 10]]
    assert [(b.kind, b.record_id) for b in bad] == [("corpus", second.tag.hex())]

    check = store.repair_history(tenant)
    assert [(b.kind, b.record_id) for b in check.bad] == [("corpus", second.tag.hex())]
    assert store.verify_history(tenant).bad == ()
    assert [d.tolist() for d in store.iter_corpus(tenant)] == [[1, 2, 3], [4, 5], [8, 9, 10]]


def test_export_leaves_the_bad_record_out_and_says_so(store) -> None:
    tenant = _history(store, 6)
    _, rid = _flip(store, tenant, 2)
    out = io.BytesIO()
    report = store.export_tenant(tenant, out, password=PASSWORD)
    assert report.num_trajectories == 5 and [b.record_id for b in report.skipped] == [rid]
    out.seek(0)
    imported = store.import_tenant(out, password=PASSWORD, name="copy")
    assert [r.trajectory.text for r in store.iter_trajectories(imported.tenant.id)] == \
        [f"turn {i}" for i in range(6) if i != 2]
