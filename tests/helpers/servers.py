"""Servers on loopback for tests: certificates for the HTTPS range server (see fault_server).

Module level, so that DataLoader workers and ranks started with spawn can unpickle them."""

from __future__ import annotations

import datetime
from pathlib import Path


def self_signed_cert(directory: Path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and localhost signed by its own key, written to ``directory``:
    ``(cert.pem, key.pem)``. The cert is its own CA: trust it with ``SSL_CERT_FILE``. Skips the
    test when ``cryptography`` is not installed."""
    import pytest

    pytest.importorskip("cryptography", reason="generating a self-signed certificate needs cryptography")
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "shardkit test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    names = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path)


def upload_tree(storage_options: dict, local: str, bucket: str, name: str) -> str:
    """Copy the folder ``local`` (every file below it, byte for byte) to ``<bucket>/<name>`` on the
    S3 server ``storage_options`` reach (the ``s3_server`` fixture's), and return that url."""
    import fsspec

    fs = fsspec.filesystem("s3", **storage_options)
    target = f"{bucket}/{name}"
    fs.put(str(local).rstrip("/") + "/", target, recursive=True)
    return target


def lance_s3_options(storage_options: dict) -> dict:
    """Lance's object store options for the S3 server that fsspec's ``storage_options`` reach."""
    return {
        "aws_access_key_id": storage_options["key"],
        "aws_secret_access_key": storage_options["secret"],
        "aws_endpoint": storage_options["client_kwargs"]["endpoint_url"],
        "aws_region": "us-east-1",
        "allow_http": "true",
    }
