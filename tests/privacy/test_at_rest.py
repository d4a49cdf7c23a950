"""Nothing written through the API appears in plaintext anywhere in the store: not in any SQLite row or
file byte (WAL included), not in any Redis key or value of any type."""

from __future__ import annotations

import numpy as np
from testkit.privacy import contains, raw_dump

from privacy import open_store

CANARY_TEXT = "CANARY-5f0e9 the customer's password is tr0ub4dor&3"
CANARY_SESSION = "session-CANARY-a41c user@example.com"
CANARY_NAME = "canary-tenant-77d2"
CANARY_CORPUS = "corpus-CANARY-91be"
CANARY_HIDDEN_KEY = "hidden-CANARY-03aa"
NARROW_RUN = np.array([40001, 40002, 51234, 60001, 12345, 23456, 34567, 45678], dtype=np.int32)  # uint16 packing
WIDE_RUN = np.array([987654, 123456, 765432, 100001, 99999, 888888], dtype=np.int32)  # int32 packing
SNAPSHOT_CANARY = b"SNAPSHOT-CANARY-bytes-6c1f" * 8
HIDDEN_ROW = np.array([1.25, -3.5, 7.0, 0.0625, 100.0, -0.001, 42.0, 8.5], dtype=np.float16)


def _needles() -> list[bytes]:
    out = [CANARY_TEXT.encode(), CANARY_TEXT.encode("utf-16-le"), b"CANARY", CANARY_SESSION.encode(),
           CANARY_NAME.encode(), CANARY_CORPUS.encode(), CANARY_HIDDEN_KEY.encode(), SNAPSHOT_CANARY[:26],
           HIDDEN_ROW.tobytes(), ",".join(map(str, NARROW_RUN)).encode(), ",".join(map(str, WIDE_RUN)).encode()]
    for run in (NARROW_RUN, WIDE_RUN):
        out += [run.astype("<i4").tobytes()[:16], run.astype("<i8").tobytes()[:24], run.astype(">i4").tobytes()[:16]]
    out.append(NARROW_RUN.astype("<u2").tobytes())
    return out


def test_canaries_never_reach_storage_in_plaintext(make_config, master_env) -> None:
    config = make_config(chunk_bytes=4096)
    store = open_store(config, env=master_env)
    t = store.create_tenant(CANARY_NAME).id
    for i in range(20):
        ids = np.concatenate([np.arange(i, i + 50), NARROW_RUN, WIDE_RUN if i % 2 else NARROW_RUN])
        store.append_trajectory(t, CANARY_SESSION, ids, f"{CANARY_TEXT} #{i}", num_prompt_tokens=10)
    store.put_snapshot(t, SNAPSHOT_CANARY * 50, cursor="1")
    store.add_corpus_documents(t, [NARROW_RUN, WIDE_RUN], name=CANARY_CORPUS)
    store.put_hidden_states(t, CANARY_HIDDEN_KEY, np.arange(4), np.tile(HIDDEN_ROW, (4, 1)))
    store.create_api_key(t)

    # The API reads them all back, so the scan below looks for data that really is stored.
    records = list(store.iter_trajectories(t, session_id=CANARY_SESSION))
    assert len(records) == 20 and CANARY_TEXT in records[0].trajectory.text
    assert store.find_tenant(CANARY_NAME).id == t
    assert store.get_snapshot(t).data.startswith(SNAPSHOT_CANARY)
    assert [d.tolist() for d in store.iter_corpus(t, CANARY_CORPUS)] == [NARROW_RUN.tolist(), WIDE_RUN.tolist()]
    assert np.array_equal(store.get_hidden_states(t, CANARY_HIDDEN_KEY)[1][0], HIDDEN_ROW)

    dump = raw_dump(config)  # while the store is open: the WAL file still holds the recent pages
    assert sum(len(b) for b in dump) > 20 * 4 * 60  # the scan sees at least the sealed bytes
    assert contains(dump, t.value.encode())  # positive control: the opaque tenant id is in keys/rows
    if config.backend == "sqlite":
        wal = config.sqlite.path.with_name(config.sqlite.path.name + "-wal")
        assert wal.exists() and wal.stat().st_size > 0
    for needle in _needles():
        assert not contains(dump, needle), f"plaintext {needle[:40]!r} found in the {config.backend} store"
    store.close()
    dump = raw_dump(config)  # after close: the WAL has been folded into the database file
    for needle in _needles():
        assert not contains(dump, needle), f"plaintext {needle[:40]!r} found in the closed {config.backend} store"
