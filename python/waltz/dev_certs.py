"""Certificates for development clusters (`waltz.tls.generate_dev_certificates`), made with the
`cryptography` package: ECDSA P-256 keys, which both OpenSSL (Python) and rustls (the storage
node) accept."""

from __future__ import annotations

import datetime
import ipaddress
import secrets

from waltz._extras import require

require("cryptography", "tls", "Generating TLS certificates")

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Waltz development"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def certificate_authority(now: datetime.datetime, days: int) -> tuple[bytes, bytes]:
    """(key PEM, certificate PEM) of a new self-signed CA."""
    key = _key()
    # A name of its own: a certificate of another development CA then reads as "unknown issuer"
    # rather than as a bad signature under a CA of the same name.
    name = _name(f"Waltz development CA {secrets.token_hex(4)}")
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _pem_key(key), cert.public_bytes(serialization.Encoding.PEM)


def leaf(
    ca_key_pem: bytes,
    ca_cert_pem: bytes,
    common_name: str,
    sans: list[tuple[str, str]],
    *,
    role: str,
    server: bool,
    now: datetime.datetime,
    days: int,
) -> tuple[bytes, bytes]:
    """(key PEM, certificate PEM) signed by the CA. `sans`: ("ip" | "dns", value); `role` becomes
    the URI name `waltz:role:<role>` the ports check. A `server` certificate can both accept and
    connect (serverAuth and clientAuth); otherwise clientAuth."""
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    key = _key()
    usages = (
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        if server
        else [ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=False,
                crl_sign=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    names: list[x509.GeneralName] = [
        x509.IPAddress(ipaddress.ip_address(v)) if kind == "ip" else x509.DNSName(v) for kind, v in sans
    ]
    names.append(x509.UniformResourceIdentifier(f"waltz:role:{role}"))
    builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return _pem_key(key), cert.public_bytes(serialization.Encoding.PEM)
