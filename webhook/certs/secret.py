"""Self-managed certificates: one CA and serving pair per release, kept in a Secret that the replicas
agree on, copied to the directory the server reads, and the CA written into the webhook configurations'
caBundle. Used by `serve --tls-secret`.
"""

from __future__ import annotations

import base64
import datetime as dt
import logging
import time
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

from .issue import FILES, SERVING_DAYS, make_ca, make_leaf, pem_cert, pem_key, write_file

RENEW_BEFORE = dt.timedelta(days=30)
log = logging.getLogger(__name__)


def _decode_secret(data: dict | None) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in (data or {}).items()}


def usable(files: dict[str, bytes], names: list[str], now: dt.datetime | None = None) -> bool:
    """Whether a Secret's pair can be served: all four files, matching, covering `names`, not expiring soon."""
    now = now or dt.datetime.now(dt.UTC)
    if not all(files.get(f) for f in FILES):
        return False
    try:
        cert = x509.load_pem_x509_certificate(files["tls.crt"])
        ca = x509.load_pem_x509_certificate(files["ca.crt"])
        key = serialization.load_pem_private_key(files["tls.key"], None)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return False
    covered = ({str(n) for n in san.get_values_for_type(x509.DNSName)}
               | {str(ip) for ip in san.get_values_for_type(x509.IPAddress)})
    same_key = key.public_key().public_numbers() == cert.public_key().public_numbers()  # type: ignore[union-attr]
    try:
        cert.verify_directly_issued_by(ca)  # the name alone is not enough: every CA we make has the same one
    except (ValueError, TypeError, InvalidSignature):
        return False
    return (same_key and set(names) <= covered
            and cert.not_valid_after_utc - now > RENEW_BEFORE and ca.not_valid_after_utc - now > RENEW_BEFORE)


def new_files(old: dict[str, bytes], names: list[str]) -> dict[str, bytes]:
    """A new serving pair, under the old CA while it is still good (the caBundle then stays put)."""
    try:
        ca_cert = x509.load_pem_x509_certificate(old["ca.crt"])
        ca_key = serialization.load_pem_private_key(old["ca.key"], None)
        if ca_cert.not_valid_after_utc - dt.datetime.now(dt.UTC) <= dt.timedelta(days=SERVING_DAYS):
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
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    core: Any = client.CoreV1Api(api_client)  # Any: the client types JSON answers as object
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
        fresh = new_files(files, names)
        encoded: dict[str, bytes | str] = {k: base64.b64encode(v).decode() for k, v in fresh.items()}
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


RUNTIMES_SUFFIX = "-runtimes"


def inject_ca_bundle(api_client, configuration: str, ca_pem: bytes) -> int:
    """Write the CA (one PEM certificate, or several concatenated) into every webhook of the named Mutating and
    Validating configurations, and of the ValidatingWebhookConfiguration `<configuration>-runtimes` (the chart's
    runtime warnings) when it exists; return how many changed."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    adm = client.AdmissionregistrationV1Api(api_client)
    bundle = base64.b64encode(ca_pem).decode()
    changed = 0
    for read, patch, name, optional in (
            (adm.read_mutating_webhook_configuration, adm.patch_mutating_webhook_configuration, configuration, False),
            (adm.read_validating_webhook_configuration, adm.patch_validating_webhook_configuration, configuration,
             False),
            (adm.read_validating_webhook_configuration, adm.patch_validating_webhook_configuration,
             configuration + RUNTIMES_SUFFIX, True)):
        try:
            obj = read(name)
        except ApiException as e:
            # Runtime warnings turned off (webhook.runtimes.enabled: false): the configuration is absent (404),
            # and the chart's ClusterRole then does not name it either (403).
            if optional and e.status in (403, 404):
                if e.status == 403:
                    log.warning("cannot read ValidatingWebhookConfiguration %s (403): its caBundle is not written",
                                name)
                continue
            raise
        ops = [{"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": bundle}
               for i, w in enumerate(obj.webhooks or [])
               if w.client_config.ca_bundle != bundle]  # type: ignore[attr-defined]  # a webhook's model
        if ops:
            patch(name, ops)
            changed += len(ops)
    return changed


# A CA change (the Secret deleted or emptied, or the CA renewed): the replaced CA stays in the caBundle
# this long after this replica switched, so every replica (each checks the Secret every few seconds) has
# switched before the API server stops trusting the old pair.
TRUST_REPLACED_CA_SECONDS = 60.0
# Between widening the caBundle to both CAs and serving the new pair: time for the API servers' webhook
# configuration informers to load the wider bundle.
SETTLE_SECONDS = 2.0
# serve --tls-read-only at start: how long a pod waits for the controller to fill the Secret (below the
# chart's startup probe's minute) before it exits, to be restarted.
READ_ONLY_WAIT_SECONDS = 45.0


def read_secret(api_client, namespace: str, name: str) -> tuple[object | None, dict[str, bytes]]:
    """The Secret (None when absent) and its files."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    try:
        secret = client.CoreV1Api(api_client).read_namespaced_secret(name, namespace)
    except ApiException as e:
        if e.status != 404:
            raise
        return None, {}
    return secret, _decode_secret(secret.data)


def trusted_cas(api_client, configuration: str) -> list[bytes]:
    """The CA certificates (PEM, in order, without repeats) the MutatingWebhookConfiguration's caBundles trust."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    try:
        obj = client.AdmissionregistrationV1Api(api_client).read_mutating_webhook_configuration(configuration)
    except ApiException as e:
        if e.status != 404:
            raise
        return []
    found: list[bytes] = []
    for hook in obj.webhooks or []:
        bundle = base64.b64decode(hook.client_config.ca_bundle or "")
        for cert in x509.load_pem_x509_certificates(bundle) if bundle.strip() else []:
            pem = pem_cert(cert)
            if pem not in found:
                found.append(pem)
    return found


# The serving Secret's files under the certificate controller: the CA's key is never in the Secret the serving
# pods read (issue 35: a compromised pod must not be able to mint serving certificates the API server trusts).
SERVING_FILES = ("ca.crt", "tls.crt", "tls.key")


def issuing_ca(files: dict[str, bytes]) -> dict[str, bytes] | None:
    """`files`' CA (ca.crt and ca.key) when the two match and the CA outlives a serving certificate issued now."""
    try:
        cert = x509.load_pem_x509_certificate(files["ca.crt"])
        key = serialization.load_pem_private_key(files["ca.key"], None)
    except (KeyError, ValueError, TypeError):
        return None
    if key.public_key().public_numbers() != cert.public_key().public_numbers():  # type: ignore[union-attr]
        return None
    if cert.not_valid_after_utc - dt.datetime.now(dt.UTC) <= dt.timedelta(days=SERVING_DAYS):
        return None
    return {"ca.crt": files["ca.crt"], "ca.key": files["ca.key"]}


def serving_files(files: dict[str, bytes], ca: dict[str, bytes], names: list[str]) -> dict[str, bytes]:
    """What the serving Secret should hold under `ca`: its pair when usable (kept, so the pods serve on), else a
    new one; and the CA certificate beside it, never the CA's key."""
    pair = {"tls.crt": files.get("tls.crt", b""), "tls.key": files.get("tls.key", b"")}
    if not usable({**pair, **ca}, names):
        ca_cert = x509.load_pem_x509_certificate(ca["ca.crt"])
        key, cert = make_leaf(serialization.load_pem_private_key(ca["ca.key"], None), ca_cert, names)
        pair = {"tls.crt": pem_cert(cert), "tls.key": pem_key(key)}
    return {"ca.crt": ca["ca.crt"], **pair}


class CertificateController:
    """Self-managed certificates, issued by a controller of their own (`dispatch-admission certificates`, the
    chart's <fullname>-certs Deployment and ServiceAccount): it alone may create the Secrets and patch the
    webhook configurations; the serving pods only read the serving Secret (`serve --tls-read-only`), so a
    compromised serving pod can neither rewrite the webhooks' rules nor create Secrets.

    The CA (certificate and key) is kept in a Secret of its own, `ca_secret`, which only this controller reads;
    the serving Secret holds the serving pair and the CA certificate. An install from before that split has the
    CA's key in the serving Secret: it is moved to the CA Secret, and the serving Secret rewritten without it.
    Deleting the CA Secret rotates everything: a new CA, and a new serving pair under it.

    `sync()` keeps a usable pair in the serving Secret and its CA in every caBundle. A new CA never reaches a pod
    before the API server trusts it: the bundle is first widened to the new CA beside the ones it trusts, and the
    Secret is written SETTLE_SECONDS later; the pods read it within their refresh (serve's REFRESH_SECONDS), and a
    CA other than the Secret's leaves the bundle TRUST_REPLACED_CA_SECONDS after this controller first saw it there.
    """

    def __init__(self, api_client, namespace: str, secret: str, names: list[str], configuration: str,
                 ca_secret: str, clock=time.monotonic, sleep=time.sleep):
        self.api, self.namespace, self.secret, self.names = api_client, namespace, secret, names
        self.configuration, self.ca_secret, self.clock, self.sleep = configuration, ca_secret, clock, sleep
        self.other_since: dict[bytes, float] = {}  # a trusted CA that is not the Secret's: when first seen

    def _write(self, name: str, secret, files: dict[str, bytes]) -> bool:
        """Create or replace (with its resourceVersion) the Secret `name`; False when another writer came first."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        encoded: dict[str, bytes | str] = {k: base64.b64encode(v).decode() for k, v in files.items()}
        core: Any = client.CoreV1Api(self.api)  # Any: the client types JSON answers as object
        try:
            if secret is None:
                core.create_namespaced_secret(self.namespace, client.V1Secret(
                    metadata=client.V1ObjectMeta(name=name, namespace=self.namespace), type="Opaque", data=encoded))
            else:
                secret.data = encoded
                core.replace_namespaced_secret(name, self.namespace, secret)  # carries resourceVersion
        except ApiException as e:
            if e.status != 409:
                raise
            return False  # written meanwhile (a second controller during a rollout): read again next time
        return True

    def sync(self) -> bool:
        """True when the serving Secret was (re)written."""
        ca_secret, ca_files = read_secret(self.api, self.namespace, self.ca_secret)
        secret, files = read_secret(self.api, self.namespace, self.secret)
        ca = issuing_ca(ca_files) or issuing_ca(files)  # the CA Secret's, else one from before the split
        if ca is None:
            ca_key, ca_cert = make_ca()
            ca = {"ca.crt": pem_cert(ca_cert), "ca.key": pem_key(ca_key)}
        if ca != ca_files:
            if not self._write(self.ca_secret, ca_secret, ca):
                return False
            log.info("kept the CA in Secret %s/%s", self.namespace, self.ca_secret)
        trusted = trusted_cas(self.api, self.configuration)
        written = False
        fresh = serving_files(files, ca, self.names)
        if fresh != files:
            if fresh["ca.crt"] not in trusted:
                inject_ca_bundle(self.api, self.configuration, fresh["ca.crt"] + b"".join(trusted))
                self.sleep(SETTLE_SECONDS)
                trusted = [fresh["ca.crt"], *trusted]
            if not self._write(self.secret, secret, fresh):
                return False
            files, written = fresh, True
            log.info("issued a serving pair into Secret %s/%s", self.namespace, self.secret)
        ca_pem, now = files["ca.crt"], self.clock()
        self.other_since = {c: self.other_since.get(c, now) for c in trusted if c != ca_pem}
        kept = [c for c, since in self.other_since.items() if now - since < TRUST_REPLACED_CA_SECONDS]
        inject_ca_bundle(self.api, self.configuration, ca_pem + b"".join(kept))
        return written


class SelfManaged:
    """One replica's side of self-managed certificates: the Secret's pair served from `cert_dir`, its CA in
    the webhook configurations' caBundle, through a change of CA without a failed call.

    `sync()` settles the Secret (filling or re-creating it when it holds no usable pair) and serves it.
    When the Secret's CA differs from the one this replica serves, the caBundle first trusts both, then
    the new pair is served; the old CA leaves the bundle at a sync TRUST_REPLACED_CA_SECONDS later.
    """

    def __init__(self, api_client, namespace: str, secret: str, names: list[str], cert_dir: Path,
                 configuration: str | None, clock=time.monotonic, sleep=time.sleep, read_only: bool = False):
        self.api, self.namespace, self.secret, self.names = api_client, namespace, secret, names
        self.cert_dir, self.configuration = Path(cert_dir), configuration
        self.clock, self.sleep = clock, sleep
        self.read_only = read_only  # the pair is issued by the CertificateController: read it, never write
        self.replaced: tuple[bytes, float] | None = None  # (old CA, trusted until)

    def _read_only_sync(self) -> bool:
        """Serve the Secret's pair once the controller has filled it: waited for at start (READ_ONLY_WAIT_SECONDS),
        later the served pair is kept until a complete one is there."""
        deadline = self.clock() + READ_ONLY_WAIT_SECONDS
        while True:
            _, files = read_secret(self.api, self.namespace, self.secret)
            if all(files.get(f) for f in SERVING_FILES):
                return write_served(self.cert_dir, files)
            if (self.cert_dir / "tls.crt").exists():
                return False
            if self.clock() >= deadline:
                raise RuntimeError(f"Secret {self.namespace}/{self.secret} holds no serving pair after "
                                   f"{READ_ONLY_WAIT_SECONDS:.0f}s: the certificate controller fills it "
                                   f"(kubectl -n {self.namespace} logs deployment/<release>-certs)")
            self.sleep(1.0)

    def sync(self) -> bool:
        """True when the served pair changed."""
        if self.read_only:
            return self._read_only_sync()
        files = ensure_secret(self.api, self.namespace, self.secret, self.names)
        ca = files["ca.crt"]
        served = self.cert_dir / "ca.crt"
        old = served.read_bytes() if served.exists() else None
        if old is not None and old != ca:
            self.replaced = (old, self.clock() + TRUST_REPLACED_CA_SECONDS)
            if self.configuration:
                inject_ca_bundle(self.api, self.configuration, ca + old)
                self.sleep(SETTLE_SECONDS)
        if self.replaced is not None and self.clock() >= self.replaced[1]:
            self.replaced = None
        changed = write_served(self.cert_dir, files)
        if self.configuration:
            inject_ca_bundle(self.api, self.configuration, ca + (self.replaced[0] if self.replaced else b""))
        return changed


def write_served(cert_dir: Path, files: dict[str, bytes]) -> bool:
    """Put the Secret's pair where the server reads it; True when anything changed."""
    cert_dir.mkdir(parents=True, exist_ok=True)
    changed = False
    for fname, private in (("ca.crt", False), ("tls.key", True), ("tls.crt", False)):
        path = cert_dir / fname
        if not path.exists() or path.read_bytes() != files[fname]:
            write_file(path, files[fname], private)
            changed = True
    return changed
