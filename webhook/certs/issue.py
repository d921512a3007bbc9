"""Making certificates: a CA, serving and client certificates (ECDSA P-256, with `cryptography`), their
PEM forms, and the development pair `serve --dev` and `dispatch-admission certs` write.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_DAYS = 3650
SERVING_DAYS = 365
FILES = ("ca.crt", "ca.key", "tls.crt", "tls.key")


def service_names(service: str, namespace: str) -> list[str]:
    """The DNS names the API server may use for the Service, plus loopback for local use."""
    return [service, f"{service}.{namespace}", f"{service}.{namespace}.svc",
            f"{service}.{namespace}.svc.cluster.local", "localhost", "127.0.0.1"]


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(cn: str = "dispatch-admission CA") -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn)).issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def make_leaf(ca_key, ca_cert: x509.Certificate, names: list[str], client: bool = False,
              days: int = SERVING_DAYS) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A serving certificate for `names` (DNS names or IP addresses), or a client certificate."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    sans: list[x509.GeneralName] = []
    for n in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            sans.append(x509.DNSName(n))
    usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(names[0])).issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def write_file(path: Path, data: bytes, private: bool) -> None:
    """Written beside and renamed, so a reader never sees half a file; keys are 0600."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.chmod(tmp, 0o600 if private else 0o644)
    os.replace(tmp, path)


def write_dev_pair(out: Path, names: list[str], force: bool = False) -> list[Path]:
    """Write ca.crt, ca.key, tls.crt and tls.key into `out`; without `force`, only when absent."""
    out.mkdir(parents=True, exist_ok=True)
    targets = [out / f for f in FILES]
    if not force and all(p.exists() for p in targets):
        return []
    ca_key, ca_cert = make_ca()
    key, cert = make_leaf(ca_key, ca_cert, names)
    for path, data, private in zip(targets, (pem_cert(ca_cert), pem_key(ca_key), pem_cert(cert), pem_key(key)),
                                   (False, True, False, True), strict=True):
        write_file(path, data, private)
    return targets


