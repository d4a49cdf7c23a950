"""One store shared by threads: concurrent appends, reads and a data key rotation lose nothing and leave
every record readable."""

from __future__ import annotations

import threading
import time

from privacy import envelope


def test_threads_append_read_and_rotate(store) -> None:
    tenants = [store.create_tenant(f"t{i}").id for i in range(2)]
    real_append = store.storage.traj_append

    def slow_append(tid, items):  # a slow link between sealing and storing widens the race
        time.sleep(0.02)
        return real_append(tid, items)

    store.storage.traj_append = slow_append
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer(w: int) -> None:
        try:
            for i in range(40):
                t = tenants[(w + i) % 2]
                store.append_trajectory(t, f"w{w}", [w, i, w * 1000 + i], f"{w}:{i}")
                if i % 10 == 0:
                    store.put_snapshot(t, f"snapshot {w}:{i}".encode(), name=f"w{w}")
        except Exception as exc:  # noqa: BLE001 - surfaced by the assert below
            errors.append(exc)

    def reader() -> None:
        try:
            while not stop.is_set():
                for t in tenants:
                    for rec in store.iter_trajectories(t, batch_size=16):
                        w, i = map(int, rec.trajectory.text.split(":"))
                        assert rec.trajectory.token_ids.tolist() == [w, i, w * 1000 + i]
        except Exception as exc:  # noqa: BLE001 - surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)] + [threading.Thread(target=reader)]
    for th in threads:
        th.start()
    try:
        rotations = [store.rotate_data_key(tenants[0]) for _ in range(2)]
    finally:  # never leave writers running past the fixtures' cleanup
        for th in threads[:4]:
            th.join()
        stop.set()
        threads[4].join()
    assert not errors, errors
    assert [r.version for r in rotations] == [2, 3]
    texts = sorted(r.trajectory.text for t in tenants for r in store.iter_trajectories(t))
    assert texts == sorted(f"{w}:{i}" for w in range(4) for i in range(40))
    # Everything of tenant 0 is under its current key: the rotation waited for in-flight writes.
    rows = store.storage.traj_scan(tenants[0].value, None, 1000)
    assert {envelope.sealed_version(r.sealed, "t") for r in rows} <= {3}
    assert sorted(store.storage.keys_get(tenants[0].value)) == ["dek:3", "tag"]
    assert store.get_snapshot(tenants[0], "w0") is not None
