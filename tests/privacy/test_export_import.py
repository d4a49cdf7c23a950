"""Sealed export files: round trips (password or key), into a new or the same tenant, across backends and
master keys; wrong secrets, truncation, altered bytes and bad arguments fail clearly."""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from privacy import IntegrityError, StoreConfig, TenantExistsError, open_store
from privacy.transfer import MAGIC

PASSWORD = "correct horse battery staple"


def _fill(store, name="acme", n=30):
    t = store.create_tenant(name).id
    for i in range(n):
        store.append_trajectory(t, f"s{i % 4}", list(range(i, i + 25)), f"turn {i} ✓", num_prompt_tokens=5,
                                started_at=float(i), finished_at=i + 0.5)
    refs = list(store.iter_trajectories(t))
    store.put_snapshot(t, b"serialized index " * 100, cursor=refs[19].cursor)
    store.add_corpus_documents(t, [[1, 2, 3], [70_000]], name="docs")
    store.put_hidden_states(t, "h1", [3, 4], np.full((2, 8), 0.5))
    return t


def _contents(store, t):
    trajs = [r.trajectory for r in store.iter_trajectories(t)]
    corpora = {c.name: [d.tolist() for d in store.iter_corpus(t, c.name)] for c in store.list_corpora(t)}
    hidden = store.get_hidden_states(t, "h1")
    return trajs, corpora, (hidden[0].tolist(), hidden[1].tolist())


def _export(store, t, **secret) -> bytes:
    buf = io.BytesIO()
    report = store.export_tenant(t, buf, **secret)
    assert report.num_bytes == len(buf.getvalue()) and report.num_trajectories == 30 and report.num_blobs == 3
    return buf.getvalue()


@pytest.mark.parametrize("secret", [{"password": PASSWORD}, {"key": b"\x07" * 32}])
def test_round_trip_into_a_new_tenant_on_another_store(store, tmp_path, secret) -> None:
    t = _fill(store)
    data = _export(store, t, **secret)
    assert data.startswith(MAGIC) and b"turn 1" not in data and b"acme" not in data
    # Another store with its own master key (the file does not depend on either).
    other = open_store(StoreConfig(data_dir=tmp_path / "other"), env={})
    seen = []
    report = other.import_tenant(io.BytesIO(data), progress=seen.append, **secret)
    assert report.created and report.tenant.name == "acme" and (report.num_trajectories, report.num_blobs) == (30, 3)
    assert _contents(other, report.tenant.id) == _contents(store, t)
    snap = other.get_snapshot(report.tenant.id)
    # The snapshot's cursor now points at the same trajectory in the new store.
    assert snap.data == b"serialized index " * 100
    imported = list(other.iter_trajectories(report.tenant.id))
    assert [r.cursor for r in imported].index(snap.cursor) == 19
    other.close()


def test_import_into_the_same_tenant_and_under_a_new_name(store) -> None:
    t = _fill(store)
    data = _export(store, t, password=PASSWORD)
    with pytest.raises(TenantExistsError):
        store.import_tenant(io.BytesIO(data), password=PASSWORD)  # "acme" exists
    copy = store.import_tenant(io.BytesIO(data), password=PASSWORD, name="acme-copy")
    assert copy.tenant.name == "acme-copy" and copy.tenant.id != t
    same = store.import_tenant(io.BytesIO(data), password=PASSWORD, into=t)
    assert not same.created and store.count_trajectories(t) == 60
    assert [c.num_documents for c in store.list_corpora(t)] == [4]


class _Stream(io.RawIOBase):
    """A non-seekable reader (a pipe or a network stream)."""

    def __init__(self, data: bytes) -> None:
        self._buf = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        chunk = self._buf.read(len(b))
        b[:len(chunk)] = chunk
        return len(chunk)


def test_non_seekable_import_and_rollback_of_a_new_tenant(store) -> None:
    t = _fill(store)
    data = _export(store, t, password=PASSWORD)
    report = store.import_tenant(io.BufferedReader(_Stream(data)), password=PASSWORD, name="piped")
    assert report.num_trajectories == 30
    with pytest.raises(IntegrityError, match="truncated"):
        store.import_tenant(io.BufferedReader(_Stream(data[:-10])), password=PASSWORD, name="cut")
    assert store.find_tenant("cut") is None  # the half-imported tenant was removed again


def _corrupt(data: bytes, how: str) -> bytes:
    if how == "truncated":
        return data[: len(data) // 2]
    if how == "no_final_frame":
        return data[:-1]
    if how == "trailing":
        return data + b"\0\0\0\x20" + os.urandom(32)
    if how == "flipped":
        i = len(data) // 3
        return data[:i] + bytes([data[i] ^ 1]) + data[i + 1:]
    if how == "header":
        return data[:20] + bytes([data[20] ^ 1]) + data[21:]
    return b"NOT-AN-EXPORT" + data
    

@pytest.mark.parametrize("how", ["truncated", "no_final_frame", "trailing", "flipped", "header", "magic"])
def test_damaged_files_fail_and_import_nothing(store, how) -> None:
    t = _fill(store)
    data = _export(store, t, password=PASSWORD)
    before = [x.id for x in store.list_tenants()]
    with pytest.raises(IntegrityError):
        store.import_tenant(io.BytesIO(_corrupt(data, how)), password=PASSWORD, name="broken")
    assert [x.id for x in store.list_tenants()] == before


def test_wrong_secret_fails(store) -> None:
    t = _fill(store)
    data = _export(store, t, password=PASSWORD)
    with pytest.raises(IntegrityError, match="wrong password"):
        store.import_tenant(io.BytesIO(data), password=PASSWORD + "!", name="x")
    with pytest.raises(ValueError, match="password-protected"):
        store.import_tenant(io.BytesIO(data), key=b"\0" * 32, name="x")


def test_bad_arguments(store) -> None:
    t = store.create_tenant("acme").id
    sink = io.BytesIO()
    with pytest.raises(ValueError, match="exactly one"):
        store.export_tenant(t, sink)
    with pytest.raises(ValueError, match="exactly one"):
        store.export_tenant(t, sink, password=PASSWORD, key=b"\0" * 32)
    with pytest.raises(ValueError, match="at least 10"):
        store.export_tenant(t, sink, password="short")
    with pytest.raises(ValueError, match="32 bytes, got 5"):
        store.export_tenant(t, sink, key=b"12345")
    with pytest.raises(ValueError, match="not both"):
        store.import_tenant(io.BytesIO(b""), password=PASSWORD, into=t, name="x")
    assert sink.getvalue() == b""


def crafted_export(log2_n: int, r: int, p: int, first_frame_length: int = 28) -> bytes:
    """A file with a valid-looking header asking for these scrypt parameters and one (junk) frame: the
    76 bytes a hostile tenant hands over for migration."""
    header = MAGIC + struct.pack(">BBBB16s8s", 1, log2_n, r, p, b"s" * 16, b"n" * 8)
    return header + struct.pack(">I", first_frame_length) + b"\0" * 28


@pytest.mark.parametrize("params", [(20, 16, 1), (20, 8, 1), (15, 32, 1), (15, 8, 16), (14, 8, 1), (15, 8, 0)])
def test_only_the_scrypt_parameters_reprise_writes_are_accepted(store, monkeypatch, params) -> None:
    def no_kdf(*args, **kwargs):
        raise AssertionError("the KDF ran on parameters the file chose")

    monkeypatch.setattr("privacy.transfer.Scrypt", no_kdf)
    data = crafted_export(*params)
    assert len(data) == 76
    with pytest.raises(IntegrityError, match=f"log2 n {params[0]}, r {params[1]}, p {params[2]}; Reprise writes"):
        store.import_tenant(io.BytesIO(data), password=PASSWORD, name="crafted")
    assert store.find_tenant("crafted") is None


def test_a_crafted_export_is_refused_before_100_mb_of_allocation(tmp_path) -> None:
    """Issue 36: scrypt log2 n 20, r 16 is 2 GiB of memory; measured in a fresh process (VmHWM)."""
    path = tmp_path / "crafted.export"
    path.write_bytes(crafted_export(20, 16, 1))
    script = f"""
import base64, os, resource
from privacy import StoreConfig, open_store, IntegrityError
env = {{"REPRISE_MASTER_KEY": base64.b64encode(os.urandom(32)).decode()}}
store = open_store(StoreConfig(data_dir={str(tmp_path / "data")!r}), env=env)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    store.import_tenant(open({str(path)!r}, "rb"), password="correct horse battery staple")
except IntegrityError as exc:
    print("refused:", exc)
print("grew_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True).stdout
    assert "refused: export file asks for scrypt log2 n 20, r 16, p 1" in out, out
    assert int(out.split("grew_kib")[1]) < 100 * 1024, out


@pytest.mark.parametrize("length", [1 << 30, (1 << 20) + 1])
def test_a_large_first_frame_is_refused_before_it_is_read(store, length) -> None:
    data = crafted_export(15, 8, 1, first_frame_length=length)
    source = io.BytesIO(data + b"\0" * 64)
    with pytest.raises(IntegrityError, match=f"implausible length {length} \\(frame 0: at most 1048576\\)"):
        store.import_tenant(source, password=PASSWORD, name="crafted")
    assert source.tell() <= len(data)  # nothing of the frame was read
