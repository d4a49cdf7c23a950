"""Redis connection options against real servers: TLS with a client certificate and an ACL user limited
to Reprise's keys and commands (a private server started here), and the db number (the shared server)."""

from __future__ import annotations

import datetime
import ipaddress
import random
import shutil
import socket
import subprocess
import time

import pytest
import redis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from privacy import StorageError, StoreConfig, open_store

pytestmark = pytest.mark.redis
ACL = "-@all +@read +@write +@transaction +@connection"


def _cert(name: str, issuer_key, issuer_name, ca: bool = False):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(issuer_name or x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                        critical=False)
    return key, builder.sign(issuer_key or key, hashes.SHA256())


def _write(path, key, cert) -> None:
    path.with_suffix(".key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _free_port() -> int:
    while True:
        p = random.randrange(20000, 45000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
                return p
            except OSError:
                continue


@pytest.fixture
def tls_redis(tmp_path):
    if not shutil.which("redis-server"):
        pytest.skip("redis-server not installed")
    ca_key, ca = _cert("reprise test CA", None, None, ca=True)
    _write(tmp_path / "ca", ca_key, ca)
    for name in ("server", "client"):
        key, cert = _cert(name, ca_key, ca.subject)
        _write(tmp_path / name, key, cert)
    port = _free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", str(tmp_path / "server.crt"), "--tls-key-file", str(tmp_path / "server.key"),
         "--tls-ca-cert-file", str(tmp_path / "ca.crt"), "--tls-auth-clients", "yes",
         "--save", "", "--appendonly", "no", "--dir", str(tmp_path),
         "--user", "default", "off", "--user", "reprise-svc", "on", ">s3cret:pw", "~reprise:*", *ACL.split()],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        yield port, tmp_path
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_tls_client_certificate_and_acl_user(tls_redis, master_env) -> None:
    port, d = tls_redis
    base = {"data_dir": d / "data", "backend": "redis", "redis_url": f"rediss://127.0.0.1:{port}/0",
                "redis_username": "reprise-svc", "redis_password": "s3cret:pw", "redis_tls_ca_file": d / "ca.crt",
                "redis_tls_cert_file": d / "client.crt", "redis_tls_key_file": d / "client.key"}
    store = open_store(StoreConfig(**base), env=master_env)
    t = store.create_tenant("acme").id
    key = store.create_api_key(t)
    store.append_trajectory(t, "s", [1, 2, 3], "over TLS")
    store.put_snapshot(t, b"snap")
    store.add_corpus_documents(t, [[4, 5]])
    assert store.authenticate(key.secret) == t
    assert store.rotate_data_key(t).num_records == 3
    assert [r.trajectory.text for r in store.iter_trajectories(t, session_id="s")] == ["over TLS"]
    assert store.delete_tenant(t).num_records == 3  # SCAN + UNLINK are within the ACL
    store.close()
    for bad, message in [
        ({"redis_password": "wrong"}, "WRONGPASS|invalid username-password"),
        ({"redis_tls_cert_file": None, "redis_tls_key_file": None}, "cannot reach Redis"),
        ({"redis_url": f"redis://127.0.0.1:{port}/0", "redis_tls_ca_file": None, "redis_tls_cert_file": None,
              "redis_tls_key_file": None}, "cannot reach Redis"),
    ]:
        with pytest.raises(StorageError, match=message):
            open_store(StoreConfig(**{**base, **bad}), env=master_env)


def test_db_number_is_honoured(redis_client, redis_prefix, tmp_path, master_env) -> None:
    config = StoreConfig(data_dir=tmp_path, backend="redis", redis_url="redis://127.0.0.1:6379/7",
                         redis_key_prefix=redis_prefix)
    store = open_store(config, env=master_env)
    store.append_trajectory(store.create_tenant("acme").id, "s", [1], "x")
    store.close()
    db7 = redis.Redis(host="127.0.0.1", port=6379, db=7)
    try:
        assert list(db7.scan_iter(match=f"{redis_prefix}:*"))
        assert not list(redis_client.scan_iter(match=f"{redis_prefix}:*"))  # nothing in db 0
    finally:
        keys = list(db7.scan_iter(match=f"{redis_prefix}:*"))
        if keys:
            db7.unlink(*keys)
