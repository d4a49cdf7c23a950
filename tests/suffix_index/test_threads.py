"""The threading contract: concurrent speculate calls with add/extend/remove running, GIL released."""

from __future__ import annotations

import threading
import time

import numpy as np
from testkit.suffix_checks import apply_op, same_index

from suffix_index import SuffixIndex


def _writer_ops(rng: np.random.Generator, n: int) -> list[tuple[str, int, np.ndarray]]:
    base = rng.integers(0, 300, size=2000).astype(np.int32)
    ops = []
    for i in range(n):
        kind = ("extend", "extend", "add", "remove")[i % 4]
        sid = int(rng.integers(0, 12))
        start = int(rng.integers(0, 1800))
        ops.append((kind, sid, base[start : start + int(rng.integers(1, 120))].copy()))
    return ops


def test_speculate_while_writing() -> None:
    rng = np.random.default_rng(11)
    ops = _writer_ops(rng, 2000)
    ix = SuffixIndex(max_depth=32, key_lengths=(4, 8), max_bytes=400_000)
    for op in ops[:40]:
        apply_op(ix, op)
    contexts = [op[2][: max(1, len(op[2]) // 2)] for op in ops]
    errors: list[BaseException] = []
    stop = threading.Event()
    calls = [0, 0, 0]

    def reader(slot: int) -> None:
        r = np.random.default_rng(slot)
        try:
            while not stop.is_set():
                ctx = contexts[int(r.integers(0, len(contexts)))]
                d = ix.speculate(ctx, 16, use_tree=bool(slot % 2), max_spec_factor=2.0)
                assert all(-1 <= p < i for i, p in enumerate(d.parents.tolist()))
                assert len(d) <= 16 and 0.0 <= d.score <= 16.0
                e = ix.speculate_exact(ctx, 24)
                assert len(e) <= 24
                ix.memory_bytes()
                ix.sequence_ids()
                calls[slot] += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def writer() -> None:
        try:
            for op in ops[40:]:
                apply_op(ix, op)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    readers = [threading.Thread(target=reader, args=(i,)) for i in range(3)]
    w = threading.Thread(target=writer)
    for t in readers:
        t.start()
    w.start()
    w.join(timeout=120)
    stop.set()
    for t in readers:
        t.join(timeout=60)
    assert not errors, errors[:3]
    assert not w.is_alive() and min(calls) > 0
    ix.check_integrity()
    # One writer: the result equals the same operations applied on one thread.
    sequential = SuffixIndex(max_depth=32, key_lengths=(4, 8), max_bytes=400_000)
    for op in ops:
        apply_op(sequential, op)
    same_index(sequential, ix, contexts[::20])


def test_native_calls_release_the_gil() -> None:
    """While a long add runs natively, Python code keeps running on another thread."""
    big = np.random.default_rng(5).integers(0, 1000, size=400_000).astype(np.int32)
    ix = SuffixIndex(max_depth=64)
    done = threading.Event()
    t = threading.Thread(target=lambda: (ix.add(0, big), done.set()))
    ticks = 0
    t.start()
    start = time.perf_counter()
    while not done.is_set():
        ticks += 1
        time.sleep(0)
    t.join()
    elapsed = time.perf_counter() - start
    assert ix.num_tokens == len(big)
    # Holding the GIL for the whole add would let this loop run only around the switch interval.
    assert elapsed > 0.02 and ticks > 50, (elapsed, ticks)
