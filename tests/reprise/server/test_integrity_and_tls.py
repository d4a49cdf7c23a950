"""The server over TLS and mutual TLS. (Tampered history: tests/reprise/server/test_history_repair.py.)"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from testkit.service import LoopThread, start_service

from grpc_api.client import AdminClient, RepriseClient, RepriseError


def _certs(tmp: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1/localhost, and a client certificate."""
    now = datetime.datetime.now(datetime.timezone.utc)

    def make(name: str, issuer_key=None, issuer_name=None, ca=False, san=None):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name or subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        cert = builder.sign(issuer_key or key, hashes.SHA256())
        return key, cert

    ca_key, ca = make("reprise-test-ca", ca=True)
    srv_key, srv = make("localhost", ca_key, ca.subject,
                        san=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    cli_key, cli = make("client", ca_key, ca.subject)
    out = {}
    for name, obj in (("ca", ca), ("server", srv), ("client", cli)):
        out[name] = tmp / f"{name}.pem"
        out[name].write_bytes(obj.public_bytes(serialization.Encoding.PEM))
    for name, key in (("server_key", srv_key), ("client_key", cli_key)):
        out[name] = tmp / f"{name}.pem"
        out[name].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                serialization.NoEncryption()))
    return out


@pytest.mark.parametrize("mutual", [False, True])
def test_tls_and_mutual_tls(tmp_path: Path, monkeypatch, mutual: bool) -> None:
    monkeypatch.delenv("REPRISE_MASTER_KEY", raising=False)
    c = _certs(tmp_path)
    settings = {"server.tls_cert_file": str(c["server"]), "server.tls_key_file": str(c["server_key"])}
    if mutual:
        settings["server.tls_client_ca_file"] = str(c["ca"])
    r = start_service(tmp_path / "home", **settings)
    try:
        client_cert = (str(c["client"]), str(c["client_key"])) if mutual else None
        with AdminClient(r.target, r.admin_key, root_certificates=c["ca"], client_cert=client_cert) as admin:
            _, key = admin.create_tenant("acme")
        with RepriseClient(r.target, key, root_certificates=c["ca"], client_cert=client_cert) as client:
            assert client.generate(tokens=[1, 2], max_new_tokens=2).completion_tokens == 2
        with RepriseClient(r.target, key, timeout=5) as plaintext:  # no TLS at all: refused
            with pytest.raises(RepriseError) as exc:
                plaintext.generate(tokens=[1, 2], max_new_tokens=2)
            assert exc.value.code == grpc.StatusCode.UNAVAILABLE
        if mutual:  # TLS without a client certificate: refused by the handshake
            with RepriseClient(r.target, key, root_certificates=c["ca"], timeout=5) as anonymous:
                with pytest.raises(RepriseError) as exc:
                    anonymous.generate(tokens=[1, 2], max_new_tokens=2)
                assert exc.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        r.stop()


def test_loopthread_helper_closes() -> None:
    lt = LoopThread()
    assert lt.on_loop(lambda: 41 + 1) == 42
    lt.close()
    assert not lt.thread.is_alive()
