"""Certificates for TLS tests, made on the spot: a certificate authority of the test's
own, a server certificate for ``localhost`` (and not for ``127.0.0.1``) signed by it, and a client
certificate signed by it. Nothing here is fit for production: the keys are written
unencrypted to the directory given, and the certificates live a day.

Needs the ``cryptography`` package (``reservoir-scheduler[signing]``, and the test extra).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TlsFiles", "make_tls_files"]


@dataclass(frozen=True)
class TlsFiles:
    """PEM files: the CA, the server's certificate and key, the client's."""

    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    #: a CA that signed nothing here: a client trusting only it must refuse the server
    other_ca_cert: Path


def make_tls_files(directory: Path, *, client_name: str = "reservoir-test-client") -> TlsFiles:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        path.chmod(0o644)  # the broker runs as its own user in some setups and must read it
        return path

    def write_cert(cert: x509.Certificate, path: Path) -> Path:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return path

    def authority(common: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(name(common))
            .issuer_name(name(common))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(key, hashes.SHA256())
        )
        return key, cert

    def leaf(
        common: str,
        ca_key: ec.EllipticCurvePrivateKey,
        ca_cert: x509.Certificate,
        usage: x509.ObjectIdentifier,
        alternative: list[x509.GeneralName],
    ) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(common))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if alternative:
            builder = builder.add_extension(x509.SubjectAlternativeName(alternative), False)
        return key, builder.sign(ca_key, hashes.SHA256())

    ca_key, ca_cert = authority("reservoir test CA")
    _other_key, other_cert = authority("reservoir unrelated CA")
    server_key, server_cert = leaf(
        "localhost",
        ca_key,
        ca_cert,
        ExtendedKeyUsageOID.SERVER_AUTH,
        # localhost only, not 127.0.0.1: a client connecting by address must refuse it,
        # which is how the tests see the host name checked
        [x509.DNSName("localhost")],
    )
    client_key, client_cert = leaf(
        client_name, ca_key, ca_cert, ExtendedKeyUsageOID.CLIENT_AUTH, []
    )
    return TlsFiles(
        ca_cert=write_cert(ca_cert, directory / "ca.pem"),
        server_cert=write_cert(server_cert, directory / "server.pem"),
        server_key=write_key(server_key, directory / "server.key"),
        client_cert=write_cert(client_cert, directory / "client.pem"),
        client_key=write_key(client_key, directory / "client.key"),
        other_ca_cert=write_cert(other_cert, directory / "other-ca.pem"),
    )
