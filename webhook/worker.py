"""A gunicorn worker that slow or stalled clients cannot starve (SPEC 7).

Gunicorn stays the process manager; this worker replaces `gthread`, where a connection held a thread from
accept to response, so eight clients that sent three bytes and stalled held every thread. Here one event
loop per worker (uvloop's when installed) does all the waiting, and the app only sees whole requests:

- TLS from an accepted socket's first byte, under the handshake deadline, with the context gunicorn's
  `ssl_context` hook answers for this connection (reloaded certificates, client certificates);
- HTTP/1.1 framed by one httptools (llhttp, strict) parser per connection, under a deadline from a
  request's first byte (the first request's: from the handshake's end) to its last; heads bounded by
  gunicorn's limit_request_* settings and HEAD_LIMIT, bodies by max_body (413, answered at the head, the
  body then dropped as it comes: the client reads the answer); every request byte one worker holds, heads
  included, by max_body_in_flight (webhook.room: 503). The API server sends Content-Length bodies and
  never Expect or Upgrade: Transfer-Encoding is answered 411, Expect and Upgrade not honoured;
- small reviews answered on the loop, the rest on gunicorn's `threads`, /metrics on threads of its own
  (METRICS_THREADS, at most METRICS_WAITING scrapes at once: it judges every runtime and may wait on the
  API server's token reviews); the response written, then the result's close() (PEP 3333) called on the
  loop; pipelining and keep-alive kept.

Options beyond gunicorn's settings: the application's `worker_options` (`WorkerOptions`); its metrics
address is served with the application's `metrics_app()`, in plain HTTP unless given a TLS context.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections import deque
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlsplit

import httptools
from gunicorn import sock as gunicorn_sock
from gunicorn.workers import base

from . import metrics
from .cluster import NoBlocking
from .core.runtimes import WouldBlock
from .room import HEADROOM, Room
from .wsgi import INTERNAL, JSON, AppThreads, WSGIApp, close_result, error_body, request_environ, response_head

DEFAULT_READ_TIMEOUT = 5.0          # seconds for the TLS handshake, and for a whole request (SPEC 7)
DEFAULT_MAX_BODY = 7 * 1024 * 1024  # two 3 MiB objects (an UPDATE carries old and new) and the envelope
DRAIN_LIMIT = 64 * 1024 * 1024  # an over-limit body longer than this is not read to its end: closed after the 413
HEAD_LIMIT = 64 * 1024          # a head not complete within this many bytes is refused (431)
SLICE = 16 * 1024               # data reaches the parser in slices this size: a head's size is known within one
INLINE_LIMIT = 64 * 1024        # a review body up to this size is answered on the loop (a larger one on a thread)
ACCEPT_PAUSE = 0.002            # after each accept, the next connection is left to the other workers this long
SWEEP_EVERY = 0.25              # deadlines are checked this often: a connection is closed at most this late
METRICS_THREADS = 2             # /metrics is answered on threads of its own (it may wait on the API server's reviews)
METRICS_WAITING = 8             # ... with at most this many scrapes queued or running; past that, 503 at once

@dataclass(frozen=True, kw_only=True)
class WorkerOptions:
    handshake_timeout: float = DEFAULT_READ_TIMEOUT  # accept to end of the TLS handshake
    request_timeout: float = DEFAULT_READ_TIMEOUT    # first byte of a request to its last
    max_body: int = DEFAULT_MAX_BODY
    max_body_in_flight: int = 0  # request bytes held at once (webhook.room); 0: max_body + HEADROOM
    metrics_address: tuple[str, int] | None = None   # a listener served by metrics_app(), in plain HTTP or:
    metrics_tls: Callable[[], object] | None = None  # in HTTPS with the SSLContext this answers


HANDSHAKE, IDLE, READING, BUSY, CLOSED = range(5)  # a connection's states


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop (a dependency), or asyncio's with DISPATCH_ADMISSION_LOOP=asyncio (to tell a fault of
    uvloop's from ours)."""
    if os.environ.get("DISPATCH_ADMISSION_LOOP", "") == "asyncio":
        return asyncio.new_event_loop()
    import uvloop

    return uvloop.new_event_loop()


class Worker(base.Worker):
    """The gunicorn worker class: `worker_class = "webhook.worker.Worker"`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.connections: set[Connection] = set()
        self.listening, self.quick = [], False  # quick: SIGQUIT or SIGINT, stop now
        self.tasks: set[asyncio.Task] = set()  # held until done (the loop keeps only weak references)
        self.options: WorkerOptions = getattr(self.app, "worker_options", None) or WorkerOptions()
        self.room = Room(self.options.max_body_in_flight or self.options.max_body + HEADROOM)

    def init_process(self):  # gunicorn calls it after fork
        self.loop = new_event_loop()
        asyncio.set_event_loop(self.loop)
        super().init_process()

    def init_signals(self):
        for s in self.SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        for s, handler in ((signal.SIGTERM, lambda: setattr(self, "alive", False)), (signal.SIGQUIT, self._quick),
                           (signal.SIGINT, self._quick), (signal.SIGUSR1, self.log.reopen_files),
                           (signal.SIGWINCH, lambda: None), (signal.SIGABRT, self._abort)):
            self.loop.add_signal_handler(s, handler)

    def _quick(self):
        self.alive, self.quick = False, True
        self.cfg.worker_int(self)

    def _abort(self):
        self.alive = False
        self.cfg.worker_abort(self)
        sys.exit(1)

    def load_wsgi(self):
        super().load_wsgi()
        ops = self.options.metrics_address and hasattr(self.app, "metrics_app")
        self.metrics_wsgi = self.app.metrics_app() if ops else None

    def run(self):
        self.threads = AppThreads(self.cfg.threads, self.loop, self.log)
        self.metrics_threads = AppThreads(METRICS_THREADS, self.loop, self.log, name="metrics", waiting=METRICS_WAITING)
        try:
            self.loop.run_until_complete(self._serve())
        except Exception:
            self.log.exception("worker failed")
        finally:
            self.threads.stop()
            self.metrics_threads.stop()
            self.loop.close()

    async def _serve(self):
        loop, want = self.loop, self.options.metrics_address
        for listener in self.sockets:
            try:
                host, port = listener.sock.getsockname()[:2]
            except (OSError, ValueError):
                host, port = "", 0
            ops = bool(want and self.metrics_wsgi is not None and port == want[1]
                       and (host == want[0] or want[0] in ("", "0.0.0.0", "::", "localhost")))
            tls = self.options.metrics_tls if ops else (lambda: gunicorn_sock.ssl_context(self.cfg)) if self.cfg.is_ssl else None
            site = Site(self, self.metrics_wsgi if ops else self.wsgi, tls, host, port, bodies=not ops)
            listener.sock.setblocking(False)
            loop.add_reader(listener.sock.fileno(), self._accept, listener.sock, site)
            self.listening.append(listener.sock)
        stuck_after = max(self.timeout, 1)
        families = metrics.get()
        while self.alive:
            families.request_bytes_held.set(self.room.used)
            families.request_bytes_held_peak.set(self.room.peak)
            if not self._sweep(loop.time(), stuck_after):
                self.notify()  # a request with the app past the worker timeout stops this: the master replaces us
            if self.ppid != os.getppid():
                self.log.info("Parent changed, shutting down: %s", self)
                break
            if self.nr >= self.max_requests:
                self.log.info("Autorestarting worker after current request.")
                break
            await asyncio.sleep(SWEEP_EVERY)
        await self._shutdown()

    def _accept(self, sock, site: Site) -> None:
        """One connection, then a pause of ACCEPT_PAUSE: the workers share the listening socket, and taking
        one at a time spreads connections (the API server keeps them for minutes) over the workers."""
        try:
            conn, _ = sock.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return  # another worker took it, or the client gave up
        except OSError as e:  # out of file descriptors or memory: wait a little rather than spin
            self.log.warning("accept failed (%s): pausing accepts for a second", e)
            return self._pause_accepting(sock, site, 1.0)
        conn.setblocking(False)
        task = self.loop.create_task(self._connected(conn, site))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        if self.cfg.workers > 1:
            self._pause_accepting(sock, site, ACCEPT_PAUSE)

    def _pause_accepting(self, sock, site: Site, seconds: float) -> None:
        self.loop.remove_reader(sock.fileno())
        self.loop.call_later(seconds, lambda: self.alive and self.loop.add_reader(sock.fileno(), self._accept, sock, site))

    async def _connected(self, sock, site: Site) -> None:
        conn = Connection(site)
        if not self.admit(conn):
            return sock.close()
        # The handshake counts against worker_connections and can be evicted or closed at shutdown
        # (cancelling this task), under a backstop deadline beside the loop's own.
        conn.handshake = asyncio.current_task()
        conn.deadline = self.loop.time() + site.options.handshake_timeout + 1
        tls = {"ssl": site.tls(), "ssl_handshake_timeout": site.options.handshake_timeout,
               "ssl_shutdown_timeout": site.options.request_timeout} if site.tls else {}
        try:
            await self.loop.connect_accepted_socket(lambda: conn, sock, **tls)
        except asyncio.CancelledError:  # evicted, expired or shut down: the loop closed the socket
            conn.gone()
        except Exception as e:  # a failed or timed-out handshake, or the client went away
            if isinstance(e, ConnectionAbortedError) and "taking longer" in str(e):
                metrics.get().client_timeouts.labels("handshake").inc()
            sock.close()
            conn.gone()
        finally:
            conn.handshake = None

    def _sweep(self, now: float, stuck_after: float) -> bool:
        """Close connections past a deadline; True when a request has been with the app too long."""
        stuck = False
        for conn in list(self.connections):
            if (conn.deadline and now >= conn.deadline) or (conn.write_deadline and now >= conn.write_deadline):
                conn.expire(now)
            elif conn.state == BUSY and now - conn.since > stuck_after and not conn.answering.aside:
                stuck = True
        if stuck:
            self.log.error("a request has been with the application for over %ss: not reporting alive", stuck_after)
        return stuck

    def readers(self) -> list[Connection]:
        """The connections, for the room to find the requests being read that may give way."""
        return list(self.connections)

    def admit(self, conn: Connection) -> bool:
        """Room for one more connection (gunicorn's worker_connections). At the limit the longest-idle
        keep-alive connection gives way, else the waiting one nearest its deadline (handshake or request
        not complete: the likeliest staller); connections with the app are never dropped."""
        if len(self.connections) >= self.cfg.worker_connections:
            idle = [c for c in self.connections if c.state == IDLE]
            waiting = [c for c in self.connections if c.state in (HANDSHAKE, READING) and c.deadline]
            if idle:
                min(idle, key=lambda c: c.since).close()
            elif waiting:
                min(waiting, key=lambda c: c.deadline).close(abort=True)
            else:
                return False
        self.connections.add(conn)
        return True

    async def _shutdown(self):
        for sock in self.listening:
            self.loop.remove_reader(sock.fileno())  # no new connections here; other workers go on accepting
        deadline = self.loop.time() + (0 if self.quick else self.cfg.graceful_timeout)
        while True:
            for conn in list(self.connections):
                if conn.state in (IDLE, HANDSHAKE):
                    conn.close()
                elif conn.deadline and self.loop.time() >= conn.deadline:
                    conn.expire(self.loop.time())
            if not self.connections or self.quick or self.loop.time() >= deadline:
                break
            self.notify()
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            conn.close(abort=True)


class Site:
    """What the connections of one listener share."""

    def __init__(self, worker: Worker, app: WSGIApp, tls: Callable | None, host: str, port: int, bodies: bool = True):
        self.worker, self.app, self.tls, self.loop, self.cfg, self.options = worker, app, tls, worker.loop, worker.cfg, worker.options
        self.bodies, self.keepalive = bodies, float(self.cfg.keepalive)  # bodies: the metrics listener takes none
        self.base_environ = {
            "SCRIPT_NAME": "", "SERVER_NAME": str(host), "SERVER_PORT": str(port), "wsgi.version": (1, 0),
            "wsgi.url_scheme": "https" if tls else "http", "wsgi.errors": sys.stderr, "wsgi.multithread": True,
            "wsgi.multiprocess": self.cfg.workers > 1, "wsgi.run_once": False, "wsgi.input_terminated": True}


REASONS = {400: "Bad Request", 411: "Length Required", 413: "Content Too Large", 414: "URI Too Long",
           431: "Request Header Fields Too Large", 503: "Service Unavailable", 505: "HTTP Version Not Supported"}


class Refused(Exception):
    """Refused(code, message): a request the worker answers itself (bad framing, a head over the limits)."""


class Request:
    """A request whose head has been read; its body (kept unless over the limit) follows."""

    __slots__ = ("method", "target", "version", "headers", "length", "keep_alive", "over_limit", "busy", "body",
                 "complete", "dispatched", "held", "since", "size", "aside")

    def __init__(self, *, method: bytes, target: bytes, version: str, headers: list[tuple[bytes, bytes]],
                 length: int, keep_alive: bool, over_limit: bool, since: float, held: int, busy: str = ""):
        self.method, self.target, self.version, self.headers = method, target, version, headers
        self.length, self.keep_alive, self.over_limit, self.busy = length, keep_alive, over_limit, busy
        self.body: list[bytes] = []
        self.complete = self.dispatched = False
        self.aside = False  # answered on the metrics threads: never counts as the worker stuck
        # held: its bytes (head, body) counted in the worker's room until answered; since: its first byte;
        # size: its head and Content-Length
        self.held, self.since, self.size = held, since, held + length


class Connection(asyncio.Protocol):
    """One client connection: handshake, read, hand over, answer, and again while kept alive.

    llhttp (through httptools' callbacks, below) frames the stream: where a head ends, a Content-Length body
    and the next request. Requests read whole (or over the limit, at their head) wait in `ready` and go to
    the app one at a time; reading pauses while a whole request waits for its answer."""

    def __init__(self, site: Site):
        self.site, self.loop = site, site.loop
        self.transport: asyncio.Transport | None = None
        self.handshake: asyncio.Task | None = None  # the TLS handshake under way
        self.parser = httptools.HttpRequestParser(self)
        self.environ: dict = {}
        self.state, self.deadline, self.write_deadline = HANDSHAKE, 0.0, 0.0
        self.since, self.served = 0.0, 0  # when the state began (idle: eviction; busy: stuck check); answers written
        # The head being read: its target, fields, the bytes fed for it (counted in the room), its first byte
        self.url, self.fields, self.head_fed, self.head_since = None, [], 0, 0.0
        self.request: Request | None = None    # the request whose body is being read
        self.answering: Request | None = None  # the request with the app
        self.ready: deque[Request] = deque()   # requests ready for the app, in order
        # last: nothing more is read (Connection: close, an upgrade, a refusal); refusal: sent, then closed on
        self.last, self.refusal = False, None

    def connection_made(self, transport):
        """Called with the TLS transport once the handshake is done (or the plain one at once)."""
        if self.state == CLOSED or not self.site.worker.alive:  # closed while the handshake ended, or shutting down
            transport.abort()
            self.gone()
            return
        peer = transport.get_extra_info("peername") or ("", 0)
        self.environ = {**self.site.base_environ, "REMOTE_ADDR": str(peer[0]), "REMOTE_PORT": str(peer[1])}
        self.transport, self.state = transport, IDLE
        # The first request must start soon (nothing sent yet); later ones may wait the keep-alive time.
        self.since = self.loop.time()
        self.deadline = self.since + self.site.options.request_timeout

    def data_received(self, data: bytes):
        if self.last or self.state == CLOSED:
            return
        try:
            for at in range(0, len(data), SLICE):
                self._feed(memoryview(data)[at:at + SLICE])
                if self.last:
                    break
        except httptools.HttpParserUpgrade:
            pass  # the upgrade request was read and is answered (keep_alive False); what follows is not read
        except Refused as e:
            self._refuse(*e.args)
        except httptools.HttpParserError as e:
            if isinstance(e.__context__, Refused):  # raised in a callback
                self._refuse(*e.__context__.args)
            elif not self.last:  # after Connection: close, llhttp refuses what follows: it is not read anyway
                self._refuse(400, str(e)[:200] or type(e).__name__)
        self._flow()

    def _feed(self, data):
        self.parser.feed_data(data)
        if self.url is not None:  # a head still incomplete after this slice: the slice is held for it
            if self.head_fed + len(data) > HEAD_LIMIT:
                raise Refused(431, f"the request head is over {HEAD_LIMIT} bytes")
            self._take(len(data), self.head_fed + len(data))
            self.head_fed += len(data)

    def _take(self, n: int, size: int) -> None:
        """Count `n` more bytes in the worker's room for a request of `size`, or refuse it (503) when they do
        not fit."""
        room = self.site.worker.room
        if not room.take(n, size, self.loop.time(), self.site.worker.readers, self):
            raise Refused(503, room.full)

    def eof_received(self):
        if self.state == READING and (self.url is not None or (self.request and not self.request.dispatched)):
            self._refuse(400, "the connection was closed inside a request")
            self._flow()
        return False  # close our side too

    def connection_lost(self, exc):
        self.gone()

    def pause_writing(self):  # the client does not read what we write: it has the request timeout to start again
        self.write_deadline = self.loop.time() + self.site.options.request_timeout

    def resume_writing(self):
        self.write_deadline = 0.0

    # llhttp's callbacks (httptools)

    def on_message_begin(self):
        self.url, self.fields, self.head_fed, self.head_since = bytearray(), [], 0, self.loop.time()
        if self.state == IDLE:  # blank lines between requests do not begin one
            self.state = READING
            if self.served:  # a connection's first request keeps the deadline set at the handshake's end
                self.deadline = self.loop.time() + self.site.options.request_timeout

    def on_url(self, url: bytes):
        self.url += url

    def on_header(self, name: bytes, value: bytes):
        self.fields.append((name.lower(), value.strip(b" \t")))

    def on_headers_complete(self):
        cfg, parser, fields, target = self.site.cfg, self.parser, self.fields, bytes(self.url)
        self.url = None
        method, version = parser.get_method(), parser.get_http_version()
        if cfg.limit_request_line and len(method) + len(target) + 10 > cfg.limit_request_line:
            raise Refused(414, f"the request line is over {cfg.limit_request_line} bytes")
        if cfg.limit_request_fields and len(fields) > cfg.limit_request_fields:
            raise Refused(431, f"more than {cfg.limit_request_fields} header fields")
        if version not in ("1.1", "1.0"):
            raise Refused(505, f"HTTP/{version} is not served: HTTP/1.1 only")
        if method == b"CONNECT":
            raise Refused(400, "CONNECT is not served")
        length, hosts, expect = 0, 0, False
        head = len(method) + len(target) + 14  # its size as sent: "METHOD TARGET HTTP/1.1\r\n", fields, "\r\n"
        for name, value in fields:
            head += len(name) + len(value) + 4
            if cfg.limit_request_field_size and len(name) + len(value) + 2 > cfg.limit_request_field_size:
                raise Refused(431, f"a header field is over {cfg.limit_request_field_size} bytes")
            if name == b"content-length":
                length = int(value)  # llhttp has checked it: digits, one value
            elif name == b"host":
                hosts += 1
            elif name == b"transfer-encoding":
                raise Refused(411, "Transfer-Encoding is not served: send the body with a Content-Length")
            elif name == b"expect":
                expect = True
        if hosts > 1 or (version == "1.1" and not hosts):  # RFC 9112 3.2
            raise Refused(400, "an HTTP/1.1 request needs exactly one Host header")
        if target[:1] != b"/":  # absolute-form (or '*'): reduced to its path and query
            try:
                parts = urlsplit(target)
            except ValueError:
                raise Refused(400, "an invalid request target") from None
            target = (parts.path or b"/") + (b"?" + parts.query if parts.query else b"")
        if length and not self.site.bodies:
            raise Refused(413, "no request body is taken on this port")
        # The head is counted by its size from now on (the slices held while it came are given back).
        room, held, busy = self.site.worker.room, head, ""
        if head > self.head_fed:
            self._take(head - self.head_fed, head)
        else:
            room.give_back(self.head_fed - head)
        self.head_fed = 0
        if length <= self.site.options.max_body and not room.make_room(length, head + length, self.loop.time(),
                                                                       self.site.worker.readers, self):
            busy, held, fields = room.full, 0, []  # answered 503 from the head, its body dropped: nothing held
            room.give_back(head)
        over = length > self.site.options.max_body or bool(busy)
        # No protocol switch here: an upgrade request is answered, then the connection closed. A client
        # waiting to be told to continue is told 413 (or 503) instead, and will not send the body: closed after.
        keep = (bool(self.site.keepalive) and version == "1.1" and parser.should_keep_alive() and not parser.should_upgrade()
                and not (over and (expect or length > DRAIN_LIMIT)))
        self.request = req = Request(method=method, target=target, version=version, headers=fields, length=length,
                                     keep_alive=keep, over_limit=over, since=self.head_since, held=held, busy=busy)
        if over:  # answered from its head (413 by the app, 503 here), its body dropped as it comes
            self.ready.append(req)

    def on_body(self, data: bytes):
        req, room = self.request, self.site.worker.room
        if req.over_limit:
            return
        if not room.take(len(data), req.size, self.loop.time(), self.site.worker.readers, self):
            return self._drop_body(room.full)
        req.held += len(data)
        req.body.append(data)

    def on_message_complete(self):
        req, self.request = self.request, None
        req.complete = True
        if not req.keep_alive:
            self.last = True
        if not req.over_limit:
            self.ready.append(req)
        elif req.dispatched and req is not self.answering:  # dropped to its end after the 413 went out
            self._idle()

    def _flow(self):
        """The next request to the app if none is with it; reading paused while a whole request waits."""
        if self.state == CLOSED:
            return
        if self.state != BUSY:
            if self.ready:
                self._dispatch(self.ready.popleft())
            elif self.refusal is not None:
                self._send(self.refusal)
                self.close()
                return
        if self.state == BUSY and self.transport is not None and (self.ready or self.answering.complete):
            self.deadline = 0.0  # read in full: no client deadline until the answer is out
            self.transport.pause_reading()

    def _dispatch(self, req: Request):
        body = req.body[0] if len(req.body) == 1 else b"".join(req.body)
        req.body, req.dispatched = [], True
        if req.busy:  # no room for its body: 503 (the client reads it while its body is dropped)
            metrics.get().bad_requests.labels("503").inc()
            self.answering, self.state = req, BUSY
            return self.loop.call_soon(self.respond, "503 Service Unavailable", JSON, error_body(503, req.busy))
        env = request_environ(self.environ, req.method, req.target, req.version, req.length, req.headers, body)
        self.answering, self.state, self.since = req, BUSY, self.loop.time()
        self.site.worker.nr += 1
        threads = self.site.worker.threads
        if env["PATH_INFO"] == "/metrics":  # judges every runtime, waits on the API server with --metrics-auth
            req.aside = True
            if not self.site.worker.metrics_threads.offer(self, self.site.app, env):
                metrics.get().bad_requests.labels("503").inc()
                self.loop.call_soon(self.respond, "503 Service Unavailable", JSON,
                                    error_body(503, f"{METRICS_WAITING} scrapes are being answered: try again"))
            return
        if self.site.tls and req.length <= INLINE_LIMIT:
            # A small review is answered here, on the loop: two thread hand-overs cost more than the review.
            # The app may not block here; a cache miss that needs a live read raises WouldBlock and the
            # request goes to a thread after all.
            try:
                with NoBlocking():
                    answer = threads.call(self.site.app, env, passthrough=WouldBlock)
            except WouldBlock:
                env["wsgi.input"].seek(0)
            else:
                self.loop.call_soon(self.respond, *answer)
                return
        threads.offer(self, self.site.app, env)

    def respond(self, status: str, headers: list[tuple[str, str]], body: bytes,
                close: Callable[[], object] | None = None):
        """On the loop, with the app's answer: written, then the app's result closed, then the next request
        (or a close of the connection)."""
        if self.state == CLOSED:
            close_result(close, self.site.worker.log)
            return
        req, self.answering = self.answering, None
        self.site.worker.room.release(req)
        keep = req.keep_alive and self.site.worker.alive
        try:
            try:
                head = response_head(status, headers, len(body), keep)
            except ValueError as e:  # a header no HTTP/1.1 message can carry: a fault of the app's
                self.site.worker.log.error("the application's answer cannot be sent: %s", e)
                head, body, keep = response_head("500 Internal Server Error", JSON, len(INTERNAL), False), INTERNAL, False
            self._send(head + body if body and req.method != b"HEAD" else head)
        finally:
            close_result(close, self.site.worker.log)
        self.served += 1
        if not keep:
            self.close()
            return
        if self.ready or not req.complete or self.url is not None or self.request is not None:
            self.state = READING  # what follows (or the rest of an over-limit body) is read under a deadline
            self.deadline = self.loop.time() + self.site.options.request_timeout
        else:
            self._idle()
        if self.transport is not None:
            self.transport.resume_reading()
        self._flow()

    def _idle(self):
        self.state, self.since = IDLE, self.loop.time()
        self.deadline = self.since + self.site.keepalive  # a kept-alive connection waits this long

    def _send(self, data: bytes):
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    # webhook.room: what the worker's room counts for this connection

    def reading(self) -> tuple[int, float] | None:
        """(bytes held, since its first byte) for the request being read, or None."""
        if self.url is not None:
            return self.head_fed, self.head_since
        req = self.request
        return (req.held, req.since) if req is not None and not req.over_limit else None

    def give_way(self, why: str):
        """The room is needed: the request being read is answered 503: a head, then the connection closed; a
        body, its rest dropped."""
        if self.url is not None:
            self._refuse(503, why)
        else:
            self._drop_body(why)
        self._flow()

    def _drop_body(self, why: str):
        """The request whose body is being read is answered 503 (after the answers before it), the rest of its
        body dropped as it comes."""
        req, req.busy, req.over_limit, req.body, req.headers = self.request, why, True, [], []
        self.site.worker.room.release(req)
        self.ready.append(req)

    def _refuse(self, code: int, message: str):
        """Answer a request the worker refuses itself, after the answers before it, then close."""
        metrics.get().bad_requests.labels(str(code)).inc()
        self.site.worker.room.give_back(self.head_fed)  # nothing more is read
        self.head_fed = 0
        self.last = True
        body = error_body(code, message)
        self.refusal = response_head(f"{code} {REASONS.get(code, 'Bad Request')}", JSON, len(body), False) + body

    def expire(self, now: float):
        """A deadline passed: handshake, request or write too slow (counted), or idle too long."""
        late = self.state == READING or (self.state == BUSY and not self.answering.complete) or (
            self.state == IDLE and not self.served)  # a first request never started counts too
        stage = "write" if self.write_deadline and now >= self.write_deadline else "request" if late else (
            "handshake" if self.state == HANDSHAKE else None)
        if stage:
            metrics.get().client_timeouts.labels(stage).inc()
        self.close(abort=True)

    def close(self, abort: bool = False):
        if self.transport is not None:
            self.transport.abort() if abort else self.transport.close()
        elif self.handshake is not None:
            self.handshake.cancel()
        self.gone()

    def gone(self):
        for req in (self.request, self.answering, *self.ready):
            self.site.worker.room.release(req)
        self.site.worker.room.give_back(self.head_fed)
        self.head_fed = 0
        self.state, self.last = CLOSED, True
        self.deadline = self.write_deadline = 0.0
        self.site.worker.connections.discard(self)
