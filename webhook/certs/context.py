"""The server's TLS context, rebuilt when the certificate files change on disk (as a mounted Secret, or
the self-managed refresh, updates them) without a restart, and what it holds: the serving certificate's
validity for /readyz, and the serving and CA certificates' expiry for the metrics.
"""

from __future__ import annotations

import os
import ssl
import threading
import time

from cryptography import x509

Stamp = tuple[tuple[int, int, int] | None, ...]

TLS_VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}
# TLS 1.2 suites: ECDHE with AEAD only (Mozilla's "intermediate"), in OpenSSL's cipher-list syntax. TLS 1.3's
# suites are all AEAD and are not set by this list.
DEFAULT_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"


def _common_names(cert: dict) -> list[str]:
    return [value for rdn in cert.get("subject", ()) for key, value in rdn if key == "commonName"]


def pinning(allowed: frozenset[str]) -> type[ssl.SSLObject]:
    """An SSLObject class whose handshake fails unless the client certificate's subject common name is in
    `allowed`: trusting the CA is not enough, the API server's own certificate must be the one presented.
    Checked on every connection (asyncio's and uvloop's TLS layers both call do_handshake on it)."""

    class Pinned(ssl.SSLObject):
        def do_handshake(self) -> None:
            super().do_handshake()
            names = _common_names(self.getpeercert() or {})
            if not allowed.intersection(names):
                raise ssl.SSLCertVerificationError(
                    f"client certificate subject CN {names or 'none'} is not one of {sorted(allowed)}")

    return Pinned


def _stamp(paths: tuple[str, ...]) -> Stamp:
    stamps: list[tuple[int, int, int] | None] = []
    for p in paths:
        try:
            st = os.stat(p)
            stamps.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            stamps.append(None)
    return tuple(stamps)


class ReloadingContext:
    """A server SSLContext (TLS `min_version` or newer, TLS 1.2 limited to `ciphers`), rebuilt when tls.crt,
    tls.key or the client CA change. With `client_subjects`, a client certificate is accepted only when its
    subject common name is one of them.

    The server asks for a context on every connection; this answers the cached one, looking at the
    files at most once a second. A half-written, mismatched or unreadable pair keeps the previous
    context: what is held is always a pair that loaded. `valid()` says whether the held serving
    certificate is inside its validity period (what /readyz reports as "certificate").
    """

    CHECK_EVERY = 1.0

    def __init__(self, certfile: str, keyfile: str, client_ca: str | None = None, cafile: str | None = None,
                 clock=time.time, min_version: str = "1.2", ciphers: str = DEFAULT_CIPHERS,
                 client_subjects: tuple[str, ...] = ()):
        self.certfile, self.keyfile, self.client_ca, self.cafile = certfile, keyfile, client_ca, cafile
        if min_version not in TLS_VERSIONS:
            raise ValueError(f"TLS minimum version {min_version!r} is not one of {sorted(TLS_VERSIONS)}")
        self.min_version, self.ciphers = TLS_VERSIONS[min_version], ciphers
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).set_ciphers(ciphers)
        except ssl.SSLError:
            raise ValueError(f"the TLS 1.2 cipher list {ciphers!r} matches no cipher suite") from None
        self.client_subjects = frozenset(client_subjects)
        if self.client_subjects and not client_ca:
            raise ValueError("client subjects are pinned, but no client CA is given to verify the certificates")
        self.clock = clock
        self._lock = threading.Lock()
        self._checked = 0.0
        self._watched = tuple(p for p in (certfile, keyfile, client_ca) if p)
        self._stamp = _stamp(self._watched)
        # Raises when the first pair is unusable: the server must not start without one.
        self.context, self.not_before, self.not_after = self._build()
        self._ca_stamp: Stamp = ()
        self.ca_not_after: float | None = None
        self._read_ca()

    def _build(self) -> tuple[ssl.SSLContext, float, float]:
        with open(self.certfile, "rb") as f:
            pem = f.read()
        leaf = x509.load_pem_x509_certificate(pem)  # the first certificate of the chain is the server's
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = self.min_version
        ctx.set_ciphers(self.ciphers)
        ctx.load_cert_chain(self.certfile, self.keyfile)
        with open(self.certfile, "rb") as f:
            if f.read() != pem:
                raise ValueError(f"{self.certfile} changed while it was loaded")
        if self.client_ca:
            ctx.load_verify_locations(cafile=self.client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
            if self.client_subjects:
                ctx.sslobject_class = pinning(self.client_subjects)
        ctx.set_alpn_protocols(["http/1.1"])
        return ctx, leaf.not_valid_before_utc.timestamp(), leaf.not_valid_after_utc.timestamp()

    def _read_ca(self) -> None:
        if not self.cafile:
            return
        stamp = _stamp((self.cafile,))
        if stamp == self._ca_stamp:
            return
        self._ca_stamp = stamp
        try:
            with open(self.cafile, "rb") as f:
                self.ca_not_after = x509.load_pem_x509_certificate(f.read()).not_valid_after_utc.timestamp()
        except (OSError, ValueError):
            self.ca_not_after = None

    def get(self) -> ssl.SSLContext:
        now = time.monotonic()
        if now - self._checked < self.CHECK_EVERY:
            return self.context
        with self._lock:
            self._checked = now
            stamp = _stamp(self._watched)
            if None not in stamp and stamp != self._stamp:
                try:
                    self.context, self.not_before, self.not_after = self._build()
                    self._stamp = stamp
                except (ssl.SSLError, OSError, ValueError):
                    pass  # mid-rotation (key and cert out of step): keep serving the old pair, retry soon
            self._read_ca()
        return self.context

    def valid(self) -> bool:
        """Whether the held serving certificate can be served now: loaded and not expired (nor not yet valid)."""
        self.get()
        return self.not_before <= self.clock() < self.not_after

    def expiry(self) -> dict[str, float]:
        """Unix times at which the held serving certificate, and the CA file when present, expire."""
        self.get()
        found = {"serving": self.not_after}
        if self.ca_not_after is not None:
            found["ca"] = self.ca_not_after
        return found
