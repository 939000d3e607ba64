"""TLS on the gRPC ports, with a CA and a server certificate made in the test."""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
from pathlib import Path

import pytest
from async_guard import run
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from identity_helpers import api_key

import opentinker
from opentinker.services.common.auth import IdentityServiceAuthenticator
from opentinker.services.common.grpc_server import aio_channel
from opentinker.services.scheduler.server import running_scheduler
from opentinker.services.scheduler.settings import SchedulerSettings

pytestmark = pytest.mark.integration


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_ca(folder: Path, name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    (folder / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert


def make_server_cert(folder: Path, ca_key, ca_cert) -> tuple[Path, Path]:  # noqa: ANN001
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    san = x509.SubjectAlternativeName(
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("opentinker-scheduler"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(san, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert_file, key_file = folder / "server.pem", folder / "server.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


def test_the_scheduler_serves_tls_and_only_clients_trusting_its_ca_get_in(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca_key, ca_cert = make_ca(tmp_path, "ca")
    make_ca(tmp_path, "other-ca")
    cert_file, key_file = make_server_cert(tmp_path, ca_key, ca_cert)
    monkeypatch.setenv("OPENTINKER_TLS_CERT_FILE", str(cert_file))
    monkeypatch.setenv("OPENTINKER_TLS_KEY_FILE", str(key_file))
    monkeypatch.delenv("OPENTINKER_TLS_CA_FILE", raising=False)

    async def main() -> None:
        settings = SchedulerSettings(redis_url=redis_url, port=0)
        async with running_scheduler(settings, stop_grace_s=0.2) as running:
            key = await api_key(running.stores.identity)
            address = running.address

            def sdk_calls() -> None:
                ca = tmp_path / "ca.pem"
                with opentinker.Client(address, api_key=key, ca_file=ca, timeout=5) as client:
                    assert client.whoami().user_id == "alice"
                for wrong in (None, tmp_path / "other-ca.pem"):  # plaintext, or another CA
                    client = opentinker.Client(address, api_key=key, ca_file=wrong, timeout=3)
                    with client, pytest.raises(opentinker.UnavailableError):
                        client.whoami()

            await asyncio.to_thread(sdk_calls)
            # Service-to-service channels follow OPENTINKER_TLS_CA_FILE (here: EnvHub's check).
            monkeypatch.setenv("OPENTINKER_TLS_CA_FILE", str(tmp_path / "ca.pem"))
            async with aio_channel(address) as channel:
                who = await IdentityServiceAuthenticator(channel, address=address).authenticate(key)
            assert (who.tenant_id, who.user_id) == ("acme", "alice")

    run(main)
