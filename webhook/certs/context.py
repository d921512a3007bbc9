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


def _stamp(paths: tuple[str, ...]) -> Stamp:
    stamps = []
    for p in paths:
        try:
            st = os.stat(p)
            stamps.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            stamps.append(None)
    return tuple(stamps)


class ReloadingContext:
    """A server SSLContext (TLS 1.2 or newer), rebuilt when tls.crt, tls.key or the client CA change.

    The server asks for a context on every connection; this answers the cached one, looking at the
    files at most once a second. A half-written, mismatched or unreadable pair keeps the previous
    context: what is held is always a pair that loaded. `valid()` says whether the held serving
    certificate is inside its validity period (what /readyz reports as "certificate").
    """

    CHECK_EVERY = 1.0

    def __init__(self, certfile: str, keyfile: str, client_ca: str | None = None, cafile: str | None = None,
                 clock=time.time):
        self.certfile, self.keyfile, self.client_ca, self.cafile = certfile, keyfile, client_ca, cafile
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
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.certfile, self.keyfile)
        with open(self.certfile, "rb") as f:
            if f.read() != pem:
                raise ValueError(f"{self.certfile} changed while it was loaded")
        if self.client_ca:
            ctx.load_verify_locations(cafile=self.client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
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
