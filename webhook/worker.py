"""A gunicorn worker that slow or stalled clients cannot starve (SPEC 7).

Gunicorn stays the process manager (master, workers restarted when they die or stop reporting, graceful
drain on SIGTERM); this worker replaces `gthread`, where a connection held a thread from accept to
response, so eight clients that sent three bytes and stalled held every thread.

One event loop per worker (uvloop's when installed: its loop and TLS layer are compiled) does all the
waiting, and the app only ever sees whole requests:

- accept one connection at a time, then TLS from the socket's first byte under the handshake deadline,
  with the context gunicorn's `ssl_context` hook answers for this connection (the webhook's reloads a
  rotated certificate, and asks for client certificates when configured);
- HTTP/1.1 framed by one httptools parser per connection (llhttp, strict), under a deadline from a
  request's first byte (a connection's first request: from the handshake's end) to its last; a head is
  bounded by gunicorn's limit_request_* settings and HEAD_LIMIT, a body by the max-body limit. The API
  server sends Content-Length bodies, no `Expect: 100-continue` and no upgrade: a request with
  Transfer-Encoding is answered 411 and the connection closed, and Expect and Upgrade are not honoured;
- a small review is answered on the loop, a larger one (or one that needs a live read) on a small pool
  of threads (gunicorn's `threads`); the worker writes the response head and framing, and calls the
  result's close() (PEP 3333) on the loop once the answer is written;
- pipelined requests are answered in order; kept-alive connections wait gunicorn's `keepalive` seconds.

A connection past a deadline is closed; it never held a thread, so other clients do not wait for it. A
body over the limit is handed to the app with its length and no data (the app answers 413) as soon as its
head is read, and the rest is read and dropped (up to DRAIN_LIMIT) so the client reads the answer.

Options beyond gunicorn's settings come from the gunicorn application's `worker_options` (a
`WorkerOptions`); a listener named there as the metrics address is served in plain HTTP with the
application's `metrics_app()`.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import queue
import signal
import sys
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import unquote_to_bytes, urlsplit

import httptools
from gunicorn import sock as gunicorn_sock
from gunicorn.workers import base

from .cluster import NoBlocking
from .core.runtimes import WouldBlock

DEFAULT_READ_TIMEOUT = 5.0          # seconds for the TLS handshake, and for a whole request (SPEC 7)
DEFAULT_MAX_BODY = 7 * 1024 * 1024  # two 3 MiB objects (an UPDATE carries old and new) and the envelope
DRAIN_LIMIT = 64 * 1024 * 1024  # an over-limit body longer than this is not read to its end: closed after the 413
HEAD_LIMIT = 64 * 1024          # a head not complete within this many bytes is refused (431)
SLICE = 16 * 1024               # data reaches the parser in slices this size: a head's size is known within one
INLINE_LIMIT = 64 * 1024        # a review body up to this size is answered on the loop (a larger one on a thread)
ACCEPT_PAUSE = 0.002            # after each accept, the next connection is left to the other workers this long
SWEEP_EVERY = 0.25              # deadlines are checked this often: a connection is closed at most this late

WSGIApp = Callable[[dict, Callable], Any]
Answer = tuple[str, list, bytes, Callable[[], object] | None]  # status, headers, body, the result's close()


@dataclass(frozen=True, kw_only=True)
class WorkerOptions:
    handshake_timeout: float = DEFAULT_READ_TIMEOUT  # accept to end of the TLS handshake
    request_timeout: float = DEFAULT_READ_TIMEOUT    # first byte of a request to its last
    max_body: int = DEFAULT_MAX_BODY
    metrics_address: tuple[str, int] | None = None   # a listener served in plain HTTP by metrics_app()


HANDSHAKE, IDLE, READING, BUSY, CLOSED = range(5)  # a connection's states


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop when installed, else asyncio's; DISPATCH_ADMISSION_LOOP=asyncio asks for asyncio's
    (to tell a fault of uvloop's from ours)."""
    if os.environ.get("DISPATCH_ADMISSION_LOOP", "") != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class Worker(base.Worker):
    """The gunicorn worker class: `worker_class = "webhook.worker.Worker"`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.connections: set[Connection] = set()
        self.listening: list = []
        self.tasks: set[asyncio.Task] = set()  # held until done (the loop keeps only weak references)
        self.quick = False
        self.options: WorkerOptions = getattr(self.app, "worker_options", None) or WorkerOptions()

    @classmethod
    def check_config(cls, cfg, log):
        pass

    def init_process(self):  # gunicorn calls it after fork
        self.loop = new_event_loop()
        asyncio.set_event_loop(self.loop)
        super().init_process()

    def init_signals(self):
        for s in self.SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        for s, handler in ((signal.SIGTERM, self._graceful), (signal.SIGQUIT, self._quick),
                           (signal.SIGINT, self._quick), (signal.SIGUSR1, self.log.reopen_files),
                           (signal.SIGWINCH, lambda: None), (signal.SIGABRT, self._abort)):
            self.loop.add_signal_handler(s, handler)

    def _graceful(self):
        self.alive = False

    def _quick(self):
        self.alive, self.quick = False, True
        self.cfg.worker_int(self)

    def _abort(self):
        self.alive = False
        self.cfg.worker_abort(self)
        sys.exit(1)

    def load_wsgi(self):
        super().load_wsgi()
        self.metrics_wsgi = None
        if self.options.metrics_address and hasattr(self.app, "metrics_app"):
            self.metrics_wsgi = self.app.metrics_app()

    def run(self):
        self.threads = AppThreads(self.cfg.threads, self.loop, self.log)
        try:
            self.loop.run_until_complete(self._serve())
        except Exception:
            self.log.exception("worker failed")
        finally:
            self.threads.stop()
            try:
                self.loop.close()
            except Exception:
                pass

    def _is_metrics(self, host: str, port: int) -> bool:
        want = self.options.metrics_address
        return bool(want and self.metrics_wsgi is not None and port == want[1]
                    and (host == want[0] or want[0] in ("", "0.0.0.0", "::", "localhost")))

    async def _serve(self):
        loop = self.loop
        for listener in self.sockets:
            try:
                host, port = listener.sock.getsockname()[:2]
            except (OSError, ValueError):
                host, port = "", 0
            metrics = self._is_metrics(host, port)
            site = Site(self, self.metrics_wsgi if metrics else self.wsgi, self.cfg.is_ssl and not metrics,
                        str(host), str(port))
            listener.sock.setblocking(False)
            loop.add_reader(listener.sock.fileno(), self._accept, listener.sock, site)
            self.listening.append(listener.sock)
        stuck_after = max(self.timeout, 1)
        while self.alive:
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
            self._pause_accepting(sock, site, 1.0)
            return
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
            sock.close()
            return
        if not site.tls:
            try:
                await self.loop.connect_accepted_socket(lambda: conn, sock)
            except OSError:
                sock.close()
                conn.gone()
            return
        # The handshake counts against worker_connections and can be evicted or closed at shutdown
        # (cancelling this task), under a backstop deadline beside the loop's own.
        conn.handshake = asyncio.current_task()
        conn.deadline = self.loop.time() + site.options.handshake_timeout + 1
        try:
            await self.loop.connect_accepted_socket(
                lambda: conn, sock, ssl=gunicorn_sock.ssl_context(site.cfg),
                ssl_handshake_timeout=site.options.handshake_timeout, ssl_shutdown_timeout=site.options.request_timeout)
        except asyncio.CancelledError:  # evicted, expired or shut down: the loop closed the socket
            conn.gone()
        except Exception as e:  # a failed or timed-out handshake, or the client went away
            if isinstance(e, ConnectionAbortedError) and "taking longer" in str(e):
                _count_timeout("handshake")
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
            elif conn.state == BUSY and now - conn.since > stuck_after:
                stuck = True
        if stuck:
            self.log.error("a request has been with the application for over %ss: not reporting alive", stuck_after)
        return stuck

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
                min(waiting, key=lambda c: c.deadline).abort()
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
            conn.abort()


class Site:
    """What the connections of one listener share."""

    def __init__(self, worker: Worker, app: WSGIApp, tls: bool, host: str, port: str):
        cfg = worker.cfg
        self.worker, self.app, self.tls, self.loop, self.cfg = worker, app, tls, worker.loop, cfg
        self.options = worker.options
        self.limit_line, self.limit_fields = cfg.limit_request_line, cfg.limit_request_fields
        self.limit_field_size = cfg.limit_request_field_size
        self.keepalive = float(cfg.keepalive)
        self.base_environ = {
            "SCRIPT_NAME": "", "SERVER_NAME": host, "SERVER_PORT": port,
            "wsgi.version": (1, 0), "wsgi.url_scheme": "https" if tls else "http", "wsgi.errors": sys.stderr,
            "wsgi.multithread": True, "wsgi.multiprocess": cfg.workers > 1, "wsgi.run_once": False,
            "wsgi.input_terminated": True,
        }


def error_body(code: int, message: str) -> bytes:
    """The JSON error every refusal carries, the worker's and the app's: {"error": ..., "code": ...}."""
    return json.dumps({"error": message, "code": code}, separators=(",", ":")).encode()


_JSON = [("Content-Type", "application/json")]
_INTERNAL = error_body(500, "internal error")
_REASONS = {400: "Bad Request", 411: "Length Required", 413: "Content Too Large", 414: "URI Too Long",
            431: "Request Header Fields Too Large", 505: "HTTP Version Not Supported"}
_HOP_BY_HOP = frozenset(("connection", "keep-alive", "transfer-encoding", "content-length"))


def _head(status: str, headers: list[tuple[str, str]], length: int, keep: bool) -> bytes:
    """The response head, written by the worker: the app's headers are checked for what could split the
    response (CR, LF) and framing is the worker's (Content-Length, Connection) whatever the app said."""
    lines = ["HTTP/1.1 ", status, "\r\n"]
    for name, value in headers:
        if name.lower() in _HOP_BY_HOP:
            continue
        if "\n" in value or "\r" in value or "\n" in name or "\r" in name or ":" in name:
            raise ValueError(f"header {name[:40]!r} has a line break or a colon")
        lines += (name, ": ", value, "\r\n")
    lines.append(f"Content-Length: {length}\r\n\r\n" if keep else f"Content-Length: {length}\r\nConnection: close\r\n\r\n")
    return "".join(lines).encode("latin-1")


class Refused(Exception):
    """A request the worker answers itself (bad framing, a head over the limits), then closes on."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class Request:
    """A request whose head has been read; its body (kept unless over the limit) follows."""

    __slots__ = ("method", "target", "version", "headers", "length", "keep_alive", "over_limit", "body",
                 "complete", "dispatched")

    def __init__(self, *, method: bytes, target: bytes, version: str, headers: list[tuple[bytes, bytes]],
                 length: int, keep_alive: bool, over_limit: bool):
        self.method, self.target, self.version, self.headers = method, target, version, headers
        self.length, self.keep_alive, self.over_limit = length, keep_alive, over_limit
        self.body: list[bytes] = []
        self.complete = self.dispatched = False


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
        self.state = HANDSHAKE
        self.deadline = self.write_deadline = 0.0
        self.since = 0.0         # when the state began (idle: for eviction; busy: for the stuck check)
        self.served = 0          # answers written on this connection
        self.url: bytearray | None = None  # the head being read: its target, its fields, bytes fed
        self.fields: list[tuple[bytes, bytes]] = []
        self.head_fed = 0
        self.request: Request | None = None    # the request whose body is being read
        self.answering: Request | None = None  # the request with the app
        self.ready: deque[Request] = deque()   # requests ready for the app, in order
        self.last = False        # nothing more is read (Connection: close, an upgrade, a refusal)
        self.refusal: bytes | None = None  # sent, then closed on, once the answers before it are out

    # ---- transport events ----

    def connection_made(self, transport):
        """Called with the TLS transport once the handshake is done (or the plain one at once)."""
        if self.state == CLOSED:  # closed while the handshake ended
            transport.abort()
            return
        if not self.site.worker.alive:
            transport.close()
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
            if len(data) <= SLICE:
                self._feed(data)
            else:
                view = memoryview(data)
                for at in range(0, len(data), SLICE):
                    self._feed(view[at:at + SLICE])
                    if self.last:
                        break
        except httptools.HttpParserUpgrade:
            pass  # the upgrade request was read and is answered (keep_alive False); what follows is not read
        except Refused as e:
            self._refuse(e.code, e.message)
        except httptools.HttpParserError as e:
            if isinstance(e.__context__, Refused):  # raised in a callback
                self._refuse(e.__context__.code, e.__context__.message)
            elif not self.last:  # after Connection: close, llhttp refuses what follows: it is not read anyway
                self._refuse(400, str(e)[:200] or type(e).__name__)
        self._flow()

    def _feed(self, data):
        self.parser.feed_data(data)
        if self.url is not None:  # a head still incomplete after this slice
            self.head_fed += len(data)
            if self.head_fed > HEAD_LIMIT:
                raise Refused(431, f"the request head is over {HEAD_LIMIT} bytes")

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

    # ---- llhttp's callbacks (httptools) ----

    def on_message_begin(self):
        self.url, self.fields, self.head_fed = bytearray(), [], 0
        if self.state == IDLE:  # blank lines between requests do not begin one
            self.state = READING
            if self.served:  # a connection's first request keeps the deadline set at the handshake's end
                self.deadline = self.loop.time() + self.site.options.request_timeout

    def on_url(self, url: bytes):
        self.url += url

    def on_header(self, name: bytes, value: bytes):
        self.fields.append((name.lower(), value.strip(b" \t")))

    def on_headers_complete(self):
        site, parser, fields, target = self.site, self.parser, self.fields, bytes(self.url)
        self.url = None
        method, version = parser.get_method(), parser.get_http_version()
        if site.limit_line and len(method) + len(target) + 10 > site.limit_line:
            raise Refused(414, f"the request line is over {site.limit_line} bytes")
        if site.limit_fields and len(fields) > site.limit_fields:
            raise Refused(431, f"more than {site.limit_fields} header fields")
        if version not in ("1.1", "1.0"):
            raise Refused(505, f"HTTP/{version} is not served: HTTP/1.1 only")
        if method == b"CONNECT":
            raise Refused(400, "CONNECT is not served")
        length, hosts, expect = 0, 0, False
        for name, value in fields:
            if site.limit_field_size and len(name) + len(value) + 2 > site.limit_field_size:
                raise Refused(431, f"a header field is over {site.limit_field_size} bytes")
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
        over = length > site.options.max_body
        # No protocol switch here: an upgrade request is answered, then the connection closed. A client
        # waiting to be told to continue is told 413 instead, and will not send the body: closed after.
        keep = (bool(site.keepalive) and version == "1.1" and parser.should_keep_alive() and not parser.should_upgrade()
                and not (over and (expect or length > DRAIN_LIMIT)))
        self.request = req = Request(method=method, target=target, version=version, headers=fields, length=length,
                                     keep_alive=keep, over_limit=over)
        if over:
            self.ready.append(req)  # the app answers 413 from the length; the body is dropped as it comes

    def on_body(self, data: bytes):
        if not self.request.over_limit:
            self.request.body.append(data)

    def on_message_complete(self):
        req, self.request = self.request, None
        req.complete = True
        if not req.keep_alive:
            self.last = True
        if not req.over_limit:
            self.ready.append(req)
        elif req.dispatched and req is not self.answering:  # dropped to its end after the 413 went out
            self._idle()

    # ---- the app ----

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
        env = self.environ.copy()
        path, _, query = req.target.partition(b"?")
        env["REQUEST_METHOD"] = req.method.decode("ascii")
        env["PATH_INFO"] = unquote_to_bytes(path).decode("latin-1")
        env["QUERY_STRING"] = query.decode("latin-1")
        env["RAW_URI"] = req.target.decode("latin-1")
        env["SERVER_PROTOCOL"] = "HTTP/" + req.version
        env["CONTENT_LENGTH"] = str(req.length)
        for name, value in req.headers:
            if b"_" in name:  # ambiguous with '-' once in the environ: dropped, as gunicorn does
                continue
            if name == b"content-type":
                env["CONTENT_TYPE"] = value.decode("latin-1")
            elif name != b"content-length":
                key = "HTTP_" + name.decode("latin-1").upper().replace("-", "_")
                text = value.decode("latin-1")
                env[key] = env[key] + "," + text if key in env else text
        env["wsgi.input"] = io.BytesIO(body)
        self.answering, self.state, self.since = req, BUSY, self.loop.time()
        self.site.worker.nr += 1
        threads = self.site.worker.threads
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
        threads.submit(self, self.site.app, env)

    def respond(self, status: str, headers: list[tuple[str, str]], body: bytes,
                close: Callable[[], object] | None = None):
        """On the loop, with the app's answer: written, then the app's result closed, then the next request
        (or a close of the connection)."""
        if self.state == CLOSED:
            _closed(close, self.site.worker.log)
            return
        req, self.answering = self.answering, None
        keep = req.keep_alive and self.site.worker.alive
        try:
            try:
                head = _head(status, headers, len(body), keep)
            except ValueError as e:  # a header no HTTP/1.1 message can carry: a fault of the app's
                self.site.worker.log.error("the application's answer cannot be sent: %s", e)
                head, body, keep = _head("500 Internal Server Error", _JSON, len(_INTERNAL), False), _INTERNAL, False
            self._send(head + body if body and req.method != b"HEAD" else head)
        finally:
            _closed(close, self.site.worker.log)
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
        self.deadline = self.since + self.site.keepalive

    # ---- writing and closing ----

    def _send(self, data: bytes):
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _refuse(self, code: int, message: str):
        """Answer a request the worker refuses itself, after the answers before it, then close."""
        _count_bad(code)
        self.last = True
        body = error_body(code, message)
        self.refusal = _head(f"{code} {_REASONS.get(code, 'Bad Request')}", _JSON, len(body), False) + body

    def expire(self, now: float):
        """A deadline passed: handshake, request or write too slow, or idle too long."""
        if self.write_deadline and now >= self.write_deadline:
            _count_timeout("write")
        elif self.state == READING or (self.state == BUSY and not self.answering.complete) or (
                self.state == IDLE and not self.served):  # a first request never started counts too
            _count_timeout("request")
        elif self.state == HANDSHAKE:
            _count_timeout("handshake")
        self.abort()

    def close(self):
        if self.transport is not None:
            self.transport.close()
        elif self.handshake is not None:
            self.handshake.cancel()
        self.gone()

    def abort(self):
        if self.transport is not None:
            self.transport.abort()
        elif self.handshake is not None:
            self.handshake.cancel()
        self.gone()

    def gone(self):
        self.state, self.last = CLOSED, True
        self.deadline = self.write_deadline = 0.0
        self.site.worker.connections.discard(self)


class AppThreads:
    """The threads that run the WSGI app, fed whole requests through a queue; answers go back to the loop."""

    def __init__(self, n: int, loop: asyncio.AbstractEventLoop, log):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.loop, self.log = loop, log
        self.threads = [threading.Thread(target=self._run, name=f"app-{i}", daemon=True) for i in range(max(1, n))]
        for t in self.threads:
            t.start()

    def submit(self, conn: Connection, app: WSGIApp, environ: dict) -> None:
        self.queue.put((conn, app, environ))

    def stop(self) -> None:
        for _ in self.threads:
            self.queue.put(None)

    def _run(self):
        get, call_soon = self.queue.get, self.loop.call_soon_threadsafe
        while (item := get()) is not None:
            conn, app, environ = item
            answer = self.call(app, environ)
            try:
                call_soon(conn.respond, *answer)  # closed on the loop, once written
            except RuntimeError:  # the loop is closed: the worker is exiting
                _closed(answer[3], self.log)
                return

    def call(self, app: WSGIApp, environ: dict, passthrough: type[BaseException] | tuple = ()) -> Answer:
        """Run the app on the caller's thread: (status, headers, body, close), where `close` is the result's
        (PEP 3333: called once the request is complete), to be called on the loop after the answer is
        written, so the app's after-work (metrics, the log line) is off the client's clock. `passthrough`
        exceptions reach the caller."""
        started: list = []
        written: list[bytes] = []

        def start_response(status, headers, exc_info=None):
            if exc_info and started:
                raise exc_info[1].with_traceback(exc_info[2])
            started[:] = [status, headers]
            return written.append

        close = None
        try:
            result = app(environ, start_response)
            close = getattr(result, "close", None)
            body = b"".join(result)
            return started[0], started[1], b"".join(written) + body if written else body, close
        except passthrough:
            _closed(close, self.log)
            raise
        except Exception:
            _closed(close, self.log)
            self.log.exception("Error handling request %s", environ.get("PATH_INFO"))
            return "500 Internal Server Error", _JSON, _INTERNAL, None


def _closed(close: Callable[[], object] | None, log) -> None:
    """Call a WSGI result's close(); its faults are logged, never raised into the loop or a thread."""
    if close is not None:
        try:
            close()
        except Exception:
            log.exception("Error closing a response")


def _count_timeout(stage: str) -> None:
    from . import metrics
    metrics.get().client_timeouts.labels(stage).inc()


def _count_bad(code: int) -> None:
    from . import metrics
    metrics.get().bad_requests.labels(str(code)).inc()
