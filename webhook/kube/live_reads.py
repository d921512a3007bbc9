"""Live reads of runtimes on a cache miss, bounded per pod (issue 33, item 3).

A TrainJob naming a runtime the store does not hold (created a moment before it, or a name that exists
nowhere) must be confirmed with one live read before it is refused as not found (SPEC 7). Names come from
reviews, and reviews from tenants: random names would be unbounded reads of the API server under the
webhook's identity, and the API server's fairness queueing would then throttle the webhook's own reads. So
the pod's live reads are made in one place, the runtime keeper, which answers the workers over a Unix socket
in the store's directory and keeps, for the whole pod:

- one read in flight per name (the workers asking for it at once share its answer);
- a token bucket per namespace (`rate` a second, `burst` at once), the namespace of the TrainJob naming the
  runtime, a ClusterTrainingRuntime's too: over it, the answer is `limited` at once, and the review naming that
  runtime alone gets ErrUnavailable (503, retryable); runtimes in the store are answered as ever. A tenant
  reviewing random names in its namespace, of either kind, empties its own bucket, never another namespace's
  (issue 47; one bucket for every ClusterTrainingRuntime let one tenant's random cluster names refuse every
  other tenant's new ClusterTrainingRuntime). At most BUCKETS namespaces have a bucket at once,
  the least recently used forgotten first (a forgotten namespace starts again full: a tenant cycling through more
  namespaces than that gains at most `burst` reads a namespace, and must be able to review TrainJobs there);
  and under them one ceiling for the pod, POD_SHARES times a namespace's (50 a second, 100 at once by default),
  so reviews spread over many namespaces still cannot read the API server without bound;
- at most `in_flight` reads at once (each parses an object of up to the API server's limit);
- what a read found, for FOUND_SECONDS (until the watch brings it), and a miss, for MISSING_SECONDS.

A name that is no valid object name is answered missing without a read (it cannot exist). The worker's side,
`LiveReads.get`, raises RuntimeUnavailable when the keeper cannot be asked (not running): the store's runtimes
are still answered.
"""

from __future__ import annotations

import base64
import logging
import os
import re
import socket
import socketserver
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from ..core.runtimes import KINDS, NAMESPACED_KIND, Runtime, RuntimeUnavailable

log = logging.getLogger(__name__)

SOCKET = "live.sock"
DEFAULT_RATE = 10.0       # live reads a second per namespace (chart: runtimeCache.liveReads.perSecond)
DEFAULT_BURST = 20        # ... at once after a quiet spell
IN_FLIGHT = 4             # reads of the API server at once
CONNECTIONS = 64          # workers' requests being answered at once (more are answered `busy`)
FOUND_SECONDS = 5.0       # a runtime a read found is answered from memory this long (the watch brings it meanwhile)
MISSING_SECONDS = 1.0     # a confirmed miss, this long
REMEMBERED = 10_000       # names remembered at once (found or missing), least recently used forgotten first
BUCKETS = 1_000           # namespaces with a bucket at once (~420 bytes each with its name: 0.4 MiB), LRU first
CLUSTER = ""              # the bucket of ClusterTrainingRuntime reads no namespace asked for (no namespace is "")
POD_SHARES = 5            # the pod's ceiling, in namespaces' rates: the API server's bound whatever the names
ASK_TIMEOUT = 6.0         # a worker waits this long for the keeper's answer (its GET: 2 s connect, 3 s read)
MAX_REQUEST = 1024        # kind, namespace and name, with separators

# Kubernetes object names: a DNS-1123 subdomain (custom resources included); namespaces: a DNS-1123 label.
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def can_exist(kind: str, namespace: str, name: str) -> bool:
    """Whether an object of this kind could have this name (else it is missing without asking anyone)."""
    if kind not in KINDS or not name or len(name) > 253 or not _NAME.match(name):
        return False
    if kind == NAMESPACED_KIND:
        return 0 < len(namespace) <= 63 and bool(_LABEL.match(namespace))
    return True


class TokenBucket:
    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens, self.at = float(burst), clock()
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            now = self.clock()
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
            self.at = now
            if self.tokens >= 1:
                self.tokens -= 1
                return True
            return False

    def give_back(self) -> None:
        with self._lock:
            self.tokens = min(self.burst, self.tokens + 1)


class Buckets:
    """A token bucket per namespace, at most `most` of them (least recently used forgotten first), so what is
    held stays bounded whatever namespaces the reviews name."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic, most: int = BUCKETS):
        self.rate, self.burst, self.clock, self.most = rate, burst, clock, most
        self._lock = threading.Lock()
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()
        self.ceiling = TokenBucket(rate * POD_SHARES, burst * POD_SHARES, clock)

    def take(self, namespace: str) -> bool:
        """A token of `namespace`'s bucket, then of the pod's ceiling; False (take nothing) when either is empty:
        a namespace's token is given back when the ceiling refuses, or one tenant's flood, emptying the ceiling,
        would drain the others' buckets with reads that were never made."""
        bucket = self._bucket(namespace)
        if not bucket.take():
            return False
        if self.ceiling.take():
            return True
        bucket.give_back()
        return False

    def _bucket(self, namespace: str) -> TokenBucket:
        with self._lock:
            bucket = self._buckets.get(namespace)
            if bucket is None:
                bucket = self._buckets[namespace] = TokenBucket(self.rate, self.burst, self.clock)
                while len(self._buckets) > self.most:
                    self._buckets.popitem(last=False)
            else:
                self._buckets.move_to_end(namespace)
        return bucket

    def __len__(self) -> int:
        return len(self._buckets)


class _Flight:
    """One read in flight; every asker of its name waits on it."""

    def __init__(self):
        self.done = threading.Event()
        self.answer: tuple[str, bytes] = ("unavailable", b"not answered")


class Answers:
    """The keeper's side, without the socket: `answer(kind, namespace, name)` -> (outcome, payload), outcome one
    of found (payload: the stored bytes), missing, limited, busy, unavailable (payload: why); `namespace` is the
    TrainJob's, whose bucket pays for the read, a ClusterTrainingRuntime's too. `read` is the API server's GET (a
    runtime object, None for 404, raises RuntimeUnavailable)."""

    def __init__(self, read: Callable[[str, str, str], dict | None], rate: float = DEFAULT_RATE,
                 burst: int = DEFAULT_BURST, in_flight: int = IN_FLIGHT, clock: Callable[[], float] = time.monotonic,
                 count: Callable[[str], None] = lambda outcome: None):
        self.read, self.clock, self.count = read, clock, count
        self.buckets = Buckets(rate, burst, clock)
        self.reads = threading.BoundedSemaphore(in_flight)
        self._lock = threading.Lock()
        self._flights: dict[tuple[str, str, str], _Flight] = {}
        self._known: OrderedDict[tuple[str, str, str], tuple[float, str, bytes]] = OrderedDict()

    def answer(self, kind: str, namespace: str, name: str) -> tuple[str, bytes]:
        outcome, payload = self._answer(kind, namespace if kind == NAMESPACED_KIND else "", name,
                                        namespace if len(namespace) <= 63 and _LABEL.match(namespace) else CLUSTER)
        self.count(outcome)
        return outcome, payload

    def _answer(self, kind: str, namespace: str, name: str, asker: str) -> tuple[str, bytes]:
        if not can_exist(kind, namespace, name):
            return "missing", b""
        k = (kind, namespace, name)
        with self._lock:
            known = self._known.get(k)
            if known is not None and self.clock() < known[0]:
                self._known.move_to_end(k)
                return known[1], known[2]
            flight = self._flights.get(k)
            leader = flight is None
            if leader:
                if not self.buckets.take(asker):
                    return "limited", b""
                flight = self._flights[k] = _Flight()
        assert flight is not None  # this worker's, or another's it waits for
        if not leader:  # another worker asked for it first: its answer is this one's
            flight.done.wait(ASK_TIMEOUT)
            return flight.answer
        try:
            flight.answer = self._read(kind, namespace, name)
        finally:
            with self._lock:
                self._flights.pop(k, None)
                outcome, payload = flight.answer
                if outcome in ("found", "missing"):
                    self._remember(k, outcome, payload)
            flight.done.set()
        return flight.answer

    def _read(self, kind: str, namespace: str, name: str) -> tuple[str, bytes]:
        if not self.reads.acquire(blocking=False):
            return "busy", f"{IN_FLIGHT} live reads already in flight".encode()
        try:
            obj = self.read(kind, namespace, name)
        except RuntimeUnavailable as e:
            return "unavailable", str(e).encode()[:500]
        finally:
            self.reads.release()
        if obj is None:
            return "missing", b""
        return "found", Runtime.of(obj, kind).to_bytes()

    def _remember(self, k, outcome: str, payload: bytes) -> None:
        ttl = FOUND_SECONDS if outcome == "found" else MISSING_SECONDS
        self._known[k] = (self.clock() + ttl, outcome, payload)
        self._known.move_to_end(k)
        while len(self._known) > REMEMBERED:
            self._known.popitem(last=False)


class _Handler(socketserver.StreamRequestHandler):
    timeout = ASK_TIMEOUT

    def handle(self) -> None:
        line = self.rfile.readline(MAX_REQUEST)
        parts = line.rstrip(b"\n").decode("utf-8", "replace").split("\x1f")
        if len(parts) != 3:
            outcome, payload = "unavailable", b"a request the keeper cannot read"
        else:
            outcome, payload = self.server.answers.answer(*parts)  # type: ignore[attr-defined]
        self.wfile.write(outcome.encode() + b" " + base64.b64encode(payload) + b"\n")


class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """The keeper's socket: one thread per request being answered, at most CONNECTIONS at once."""

    daemon_threads = True

    def __init__(self, directory: str, answers: Answers):
        self.answers = answers
        self.slots = threading.BoundedSemaphore(CONNECTIONS)
        path = os.path.join(directory, SOCKET)
        try:
            os.unlink(path)  # a keeper that died left it
        except FileNotFoundError:
            pass
        super().__init__(path, _Handler)
        os.chmod(path, 0o600)

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):
            try:
                request.sendall(b"busy " + base64.b64encode(b"the keeper is answering too many requests") + b"\n")
            finally:
                self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class LiveReads:
    """A worker's side: ask the pod's keeper for a runtime the store does not hold. Answers what the keeper
    found (a Runtime) or None (missing); raises RuntimeUnavailable when the keeper says it is over its limit,
    cannot read the API server now, or cannot be asked."""

    def __init__(self, directory: str, timeout: float = ASK_TIMEOUT):
        self.path, self.timeout = os.path.join(directory, SOCKET), timeout

    def get(self, kind: str, namespace: str, name: str) -> Runtime | None:
        if not can_exist(kind, namespace, name):
            return None
        request = "\x1f".join((kind, namespace, name)).encode() + b"\n"
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(self.timeout)
                s.connect(self.path)
                s.sendall(request)
                reply = s.makefile("rb").readline(MAX_REQUEST * 512)
        except OSError as e:
            raise RuntimeUnavailable(f"the runtime keeper cannot be asked ({type(e).__name__})") from None
        outcome, _, payload = reply.rstrip(b"\n").partition(b" ")
        data = base64.b64decode(payload) if payload else b""
        if outcome == b"found":
            return Runtime.from_bytes(data)
        if outcome == b"missing":
            return None
        if outcome == b"limited":
            raise RuntimeUnavailable(f"this pod's live reads of the API server for namespace {namespace or '(none)'}"
                                     " are over their limit")
        why = data.decode("utf-8", "replace") or "no answer"
        raise RuntimeUnavailable(f"the runtime keeper could not read it: {why}")
