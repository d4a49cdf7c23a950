"""Unit tests of the pieces: record framing, sealing and its associated data, master key parsing,
configuration validation."""

from __future__ import annotations

import base64
import os
import stat

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import given, settings
from hypothesis import strategies as st

from privacy import IntegrityError, MasterKeyError, RedisConfig, StoreConfig, Trajectory, envelope
from privacy.keyring import MasterKeyring, generate_keyring, load_keyring, parse_keyring
from privacy.records import decode_documents, decode_trajectory, encode_documents, encode_trajectory

ids_strategy = st.lists(st.integers(0, 2**31 - 1), max_size=300) | st.lists(st.integers(0, 65535), max_size=300)


@settings(max_examples=150, deadline=None)
@given(session=st.text(max_size=50), ids=ids_strategy, text=st.text(max_size=200),
       times=st.tuples(st.floats(allow_nan=False), st.floats(allow_nan=False)), data=st.data())
def test_trajectory_encoding_round_trips(session, ids, text, times, data) -> None:
    prompt = data.draw(st.integers(0, len(ids)))
    t = Trajectory(session, np.array(ids, dtype=np.int64), text, prompt, times[0], times[1])
    body = encode_trajectory(t)
    assert decode_trajectory(body) == t
    cut = data.draw(st.integers(0, len(body) - 1))
    with pytest.raises(IntegrityError):
        decode_trajectory(body[:cut])  # framing rejects every truncation
    with pytest.raises(IntegrityError):
        decode_trajectory(body + b"\0")


@settings(max_examples=60, deadline=None)
@given(docs=st.lists(ids_strategy, max_size=8))
def test_documents_encoding_round_trips(docs) -> None:
    arrays = [np.array(d, dtype=np.int32) for d in docs]
    assert [d.tolist() for d in decode_documents(encode_documents(arrays))] == docs


def test_associated_data_binds_every_field() -> None:
    cipher, tid, other = AESGCM(os.urandom(32)), os.urandom(16), os.urandom(16)
    sealed = envelope.seal(cipher, 3, envelope.record_aad(tid, "trajectory", b"rid", 3), b"secret")
    assert envelope.sealed_version(sealed, "x") == 3
    assert envelope.open_sealed(cipher, envelope.record_aad(tid, "trajectory", b"rid", 3), sealed, "x") == b"secret"
    for aad in (envelope.record_aad(other, "trajectory", b"rid", 3), envelope.record_aad(tid, "snapshot", b"rid", 3),
                envelope.record_aad(tid, "trajectory", b"rie", 3), envelope.record_aad(tid, "trajectory", b"rid", 4),
                envelope.record_aad(tid, "trajectoryr", b"id", 3)):  # length prefixes: no ambiguity
        with pytest.raises(IntegrityError):
            envelope.open_sealed(cipher, aad, sealed, "x")
    assert len(sealed) == len(b"secret") + envelope.OVERHEAD_BYTES
    nonces = {envelope.seal(cipher, 1, b"", b"")[5:17] for _ in range(1000)}
    assert len(nonces) == 1000  # random 96-bit nonces


def test_check_values_and_key_wrapping() -> None:
    k1, k2, owner = os.urandom(32), os.urandom(32), os.urandom(16)
    check = envelope.make_check(k1, 1)
    assert envelope.verify_check(k1, check) and not envelope.verify_check(k2, check)
    wrapped = envelope.wrap_key(k1, 1, owner, "dek:1", b"K" * 32)
    assert envelope.unwrap_key(k1, owner, "dek:1", wrapped) == b"K" * 32
    for args in ((k2, owner, "dek:1"), (k1, os.urandom(16), "dek:1"), (k1, owner, "dek:2")):
        with pytest.raises(IntegrityError):
            envelope.unwrap_key(*args, wrapped)


def test_keyring_formats_and_files(tmp_path) -> None:
    k1, k2 = os.urandom(32), os.urandom(32)
    b1, b2 = base64.b64encode(k1).decode(), base64.b64encode(k2).decode()
    assert parse_keyring(b1, "env").versions == [1]
    ring = parse_keyring(f"# comment\n2:{b2}\nv1:{b1}\n", "file")
    assert ring.primary == 2 and ring.key(1) == k1 and ring.key(2) == k2
    assert parse_keyring(f"2:{b2}, 1:{b1}", "env").versions == [1, 2]
    assert parse_keyring(base64.urlsafe_b64encode(k1).decode(), "env").key(1) == k1
    assert b1 not in repr(ring)
    with pytest.raises(MasterKeyError, match="version 3"):
        ring.key(3)
    path = tmp_path / "d" / "master.key"
    generated = generate_keyring(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    with pytest.raises(FileExistsError):
        generate_keyring(path)  # never overwrites a key
    assert load_keyring(path, env={}).keys == generated.keys
    assert load_keyring(path, env={"REPRISE_MASTER_KEY": b2}).key(1) == k2  # the environment wins
    assert load_keyring(tmp_path / "none", env={}) is None
    grown = generated.with_new_version()
    grown.save()
    assert load_keyring(path, env={}).versions == [1, 2]
    with pytest.raises(MasterKeyError, match="cannot rewrite"):
        MasterKeyring(((1, k1),), "environment variable X").save()


def test_store_config_validation(tmp_path) -> None:
    assert StoreConfig().backend == "sqlite"
    for kwargs, message in [
        ({"backend": "postgres"}, "backend"),
        ({"sqlite_synchronous": "OFF"}, "synchronous"),
        ({"max_encryptions_per_key": 2**32}, "max_encryptions_per_key"),
        ({"max_encryptions_per_key": 1}, "max_encryptions_per_key"),
        ({"chunk_bytes": 10}, "chunk_bytes"),
        ({"backend": "redis", "redis_url": "http://x"}, "redis://"),
        ({"backend": "redis", "redis_url": "redis://h:99999/0"}, "port"),
        ({"backend": "redis", "redis_url": "redis://h/x"}, "database"),
        ({"backend": "redis", "redis_key_prefix": "a:{b}"}, "key_prefix"),
        ({"backend": "redis", "redis_tls_ca_file": tmp_path / "missing.pem"}, "tls is off"),
        ({"backend": "redis", "redis_url": "rediss://h/0", "redis_tls_ca_file": tmp_path / "missing.pem"}, "readable"),
        ({"backend": "redis", "redis_url": "redis://h/3", "redis_cluster": True}, "db 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            StoreConfig(**kwargs)
    with pytest.raises(ValueError, match="unknown store settings: nope"):
        StoreConfig.from_dict({"nope": 1})
    c = StoreConfig(data_dir=str(tmp_path), backend="redis", redis_url="rediss://svc:p%40ss@redis.internal:6380/2",
                    redis_key_prefix="rp")
    r = c.redis
    assert (r.host, r.port, r.db, r.username, r.password, r.tls, r.key_prefix) == (
        "redis.internal", 6380, 2, "svc", "p@ss", True, "rp")
    assert "p@ss" not in repr(r) and "p@ss" not in repr(StoreConfig(redis_password="p@ss"))
    assert c.key_file == tmp_path / "master.key" and c.sqlite.path == tmp_path / "history.db"
    back = StoreConfig.for_redis(RedisConfig(username="u", password="a:b@c", db=5), data_dir=tmp_path).redis
    assert (back.username, back.password, back.db) == ("u", "a:b@c", 5)
