"""Certificates: a CA and a serving certificate made with `cryptography`, and a TLS context that
picks up renewed files (as a mounted Secret updates them) without a restart.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import ssl
import threading
import time
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
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
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn)).issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
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
    now = dt.datetime.now(dt.timezone.utc)
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


def _write(path: Path, data: bytes, private: bool) -> None:
    # Written beside and renamed, so a reader never sees half a file.
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
                                   (False, True, False, True)):
        _write(path, data, private)
    return targets


def renew_serving(cert_dir: Path, names: list[str]) -> None:
    """A new serving certificate from the CA already in `cert_dir` (what a rotation looks like)."""
    ca_key = serialization.load_pem_private_key((cert_dir / "ca.key").read_bytes(), None)
    ca_cert = x509.load_pem_x509_certificate((cert_dir / "ca.crt").read_bytes())
    key, cert = make_leaf(ca_key, ca_cert, names)
    # The key first: the reloader checks that the pair matches before it swaps.
    _write(cert_dir / "tls.key", pem_key(key), True)
    _write(cert_dir / "tls.crt", pem_cert(cert), False)


class ReloadingContext:
    """A server SSLContext, rebuilt when tls.crt or tls.key change on disk.

    Gunicorn asks for a context on every connection; this answers the cached one, looking at the
    files at most once a second. A half-written or mismatched pair keeps the previous context.
    """

    CHECK_EVERY = 1.0

    def __init__(self, certfile: str, keyfile: str, client_ca: str | None = None):
        self.certfile, self.keyfile, self.client_ca = certfile, keyfile, client_ca
        self._lock = threading.Lock()
        self._checked = 0.0
        self._stamp = self._files_stamp()
        self.context = self._build()  # raises when the first pair is unusable: the server must not start

    def _files_stamp(self):
        try:
            return tuple((os.stat(f).st_mtime_ns, os.stat(f).st_size, os.stat(f).st_ino)
                         for f in (self.certfile, self.keyfile))
        except OSError:
            return None

    def _build(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.certfile, self.keyfile)
        if self.client_ca:
            ctx.load_verify_locations(cafile=self.client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.set_alpn_protocols(["http/1.1"])
        return ctx

    def get(self) -> ssl.SSLContext:
        now = time.monotonic()
        if now - self._checked < self.CHECK_EVERY:
            return self.context
        with self._lock:
            self._checked = now
            stamp = self._files_stamp()
            if stamp is not None and stamp != self._stamp:
                try:
                    self.context = self._build()
                    self._stamp = stamp
                except (ssl.SSLError, OSError, ValueError):
                    pass  # mid-rotation (key and cert out of step): keep serving the old pair, retry soon
        return self.context

    def loaded(self) -> bool:
        return self.context is not None


# ---- self-managed mode: one CA and serving certificate per release, kept in a Secret ----

RENEW_BEFORE = dt.timedelta(days=30)


def _decode_secret(data: dict | None) -> dict[str, bytes]:
    import base64

    return {k: base64.b64decode(v) for k, v in (data or {}).items()}


def usable(files: dict[str, bytes], names: list[str], now: dt.datetime | None = None) -> bool:
    """Whether a Secret's pair can be served: all four files, matching, covering `names`, not expiring soon."""
    now = now or dt.datetime.now(dt.timezone.utc)
    if not all(files.get(f) for f in FILES):
        return False
    try:
        cert = x509.load_pem_x509_certificate(files["tls.crt"])
        ca = x509.load_pem_x509_certificate(files["ca.crt"])
        key = serialization.load_pem_private_key(files["tls.key"], None)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return False
    covered = {str(n) for n in san.get_values_for_type(x509.DNSName)} | {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    same_key = key.public_key().public_numbers() == cert.public_key().public_numbers()
    try:
        cert.verify_directly_issued_by(ca)  # the name alone is not enough: every CA we make has the same one
    except (ValueError, TypeError, InvalidSignature):
        return False
    return (same_key and set(names) <= covered
            and cert.not_valid_after_utc - now > RENEW_BEFORE and ca.not_valid_after_utc - now > RENEW_BEFORE)


def _new_files(old: dict[str, bytes], names: list[str]) -> dict[str, bytes]:
    """A new serving pair, under the old CA while it is still good (the caBundle then stays put)."""
    try:
        ca_cert = x509.load_pem_x509_certificate(old["ca.crt"])
        ca_key = serialization.load_pem_private_key(old["ca.key"], None)
        if ca_cert.not_valid_after_utc - dt.datetime.now(dt.timezone.utc) <= dt.timedelta(days=SERVING_DAYS):
            raise ValueError("CA expires too soon")
    except (KeyError, ValueError, TypeError):
        ca_key, ca_cert = make_ca()
    key, cert = make_leaf(ca_key, ca_cert, names)
    return {"ca.crt": pem_cert(ca_cert), "ca.key": pem_key(ca_key), "tls.crt": pem_cert(cert), "tls.key": pem_key(key)}


def ensure_secret(api_client, namespace: str, name: str, names: list[str]) -> dict[str, bytes]:
    """Read the Secret and, when it holds no usable pair, fill it; replicas racing agree on one.

    Writes use the Secret's resourceVersion: a replica that loses the race gets 409 Conflict (or
    AlreadyExists), reads again, and serves the winner's certificate instead of minting its own.
    """
    import base64

    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    core = client.CoreV1Api(api_client)
    for _ in range(10):
        try:
            secret = core.read_namespaced_secret(name, namespace)
        except ApiException as e:
            if e.status != 404:
                raise
            secret = None
        files = _decode_secret(secret.data if secret else None)
        if usable(files, names):
            return files
        fresh = _new_files(files, names)
        encoded = {k: base64.b64encode(v).decode() for k, v in fresh.items()}
        try:
            if secret is None:
                core.create_namespaced_secret(namespace, client.V1Secret(
                    metadata=client.V1ObjectMeta(name=name, namespace=namespace), type="Opaque", data=encoded))
            else:
                secret.data = encoded
                core.replace_namespaced_secret(name, namespace, secret)  # carries resourceVersion
            return fresh
        except ApiException as e:
            if e.status != 409:
                raise
            # Another replica wrote first: read theirs.
    raise RuntimeError(f"could not settle the certificate in Secret {namespace}/{name}")


def inject_ca_bundle(api_client, configuration: str, ca_pem: bytes) -> int:
    """Write the CA into every webhook of the named Mutating and Validating configurations; return how many changed."""
    import base64

    from kubernetes import client

    adm = client.AdmissionregistrationV1Api(api_client)
    bundle = base64.b64encode(ca_pem).decode()
    changed = 0
    for read, patch in ((adm.read_mutating_webhook_configuration, adm.patch_mutating_webhook_configuration),
                        (adm.read_validating_webhook_configuration, adm.patch_validating_webhook_configuration)):
        obj = read(configuration)
        ops = [{"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": bundle}
               for i, w in enumerate(obj.webhooks or []) if w.client_config.ca_bundle != bundle]
        if ops:
            patch(configuration, ops)
            changed += len(ops)
    return changed


def write_served(cert_dir: Path, files: dict[str, bytes]) -> bool:
    """Put the Secret's pair where the server reads it; True when anything changed."""
    cert_dir.mkdir(parents=True, exist_ok=True)
    changed = False
    for fname, private in (("ca.crt", False), ("tls.key", True), ("tls.crt", False)):
        path = cert_dir / fname
        if not path.exists() or path.read_bytes() != files[fname]:
            _write(path, files[fname], private)
            changed = True
    return changed
