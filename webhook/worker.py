"""A gunicorn worker that slow or stalled clients cannot starve (SPEC 7).

Gunicorn stays the process manager (master, workers restarted when they die or stop reporting,
graceful drain on SIGTERM); this worker replaces `gthread`, where a connection held a thread from
accept to response, so eight clients that sent three bytes and stalled held every thread.

Here one asyncio event loop per worker does all the waiting, and threads only ever see whole requests:

- the loop is uvloop's when it is installed (its TLS layer and loop are compiled: a third less CPU per
  review than asyncio's, whose TLS layer is Python), else asyncio's;
- accept, then TLS from the socket's first byte (`loop.connect_accepted_socket(..., ssl=,
  ssl_handshake_timeout=)`: nothing is read outside the TLS layer), the context asked of gunicorn's
  `ssl_context` hook per connection (the webhook's hook answers its reloading context, so a rotated
  certificate is served to new connections without a restart);
- HTTP/1.1: the head buffered to its blank line and parsed by httptools (llhttp, compiled: h11, pure
  Python, was a fifth of a review's CPU), a Content-Length body counted by the worker; under a deadline
  that starts at a request's first byte (or at the end of the handshake, for a connection's first
  request) and covers its head and whole body; the head bounded by gunicorn's limit_request_* settings
  and 64 KiB, the body by the max-body limit;
- a small review is answered on the loop; a larger one, or one that needs a live read, goes to a small
  pool of threads (gunicorn's `threads`) running the WSGI app, and the answer is written back from the
  loop (the head by the worker); keep-alive is honoured (gunicorn's `keepalive`, idle time between requests), so
  the API server's connections are reused.

A connection past its deadline is closed; it never held a thread, so other clients do not wait for it.
A body over the limit is answered by the app (413, from CONTENT_LENGTH, with an empty input) as soon as
the limit is passed, and the rest is read and dropped (bounded) so the client reads the answer.

Options the worker needs beyond gunicorn's settings come from the gunicorn application object's
`worker_options` attribute (a `WorkerOptions`); a listener named there as the metrics address is
served in plain HTTP with the application's `metrics_app()`.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import queue
import re
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import unquote_to_bytes, urlsplit

import httptools
from gunicorn import sock as gunicorn_sock
from gunicorn.workers import base

from .cluster import NoBlocking
from .core.runtimes import WouldBlock

DEFAULT_TIMEOUT = 5.0
DEFAULT_MAX_BODY = 7 * 1024 * 1024
DRAIN_LIMIT = 64 * 1024 * 1024  # what is read and dropped after a 413, at most, before closing instead
HEAD_LIMIT = 64 * 1024          # request line and headers together
INLINE_LIMIT = 64 * 1024  # a review body up to this size is answered on the loop (a larger one on a thread)
ACCEPT_PAUSE = 0.002            # after each accept, the next connection is left to the other workers this long
SWEEP_EVERY = 0.25              # deadlines are checked this often: a connection is closed at most this late

WSGIApp = Callable[[dict, Callable], Any]
Answer = tuple[str, list, bytes, Callable[[], object] | None]  # status, headers, body, the result's close()


@dataclass(frozen=True)
class WorkerOptions:
    handshake_timeout: float = DEFAULT_TIMEOUT   # accept to end of the TLS handshake
    request_timeout: float = DEFAULT_TIMEOUT     # first byte of a request to its last
    max_body: int = DEFAULT_MAX_BODY
    metrics_address: tuple[str, int] | None = None  # a listener served in plain HTTP by metrics_app()


# Connection states
HANDSHAKE, IDLE, READING, BUSY, CLOSED = range(5)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop when it is installed, else asyncio's. DISPATCH_ADMISSION_LOOP=asyncio asks for
    asyncio's (to tell a fault of uvloop's from ours)."""
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

    # ---- process setup (gunicorn calls init_process after fork) ----

    def init_process(self):
        self.loop = new_event_loop()
        asyncio.set_event_loop(self.loop)
        super().init_process()

    def init_signals(self):
        for s in self.SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        self.loop.add_signal_handler(signal.SIGTERM, self._graceful)
        self.loop.add_signal_handler(signal.SIGQUIT, self._quick)
        self.loop.add_signal_handler(signal.SIGINT, self._quick)
        self.loop.add_signal_handler(signal.SIGUSR1, self.log.reopen_files)
        self.loop.add_signal_handler(signal.SIGWINCH, lambda: None)
        self.loop.add_signal_handler(signal.SIGABRT, self._abort)

    def _graceful(self):
        self.alive = False

    def _quick(self):
        self.alive = False
        self.quick = True
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

    # ---- serving ----

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

    def _is_metrics(self, listener) -> bool:
        want = self.options.metrics_address
        if not want or self.metrics_wsgi is None:
            return False
        try:
            host, port = listener.sock.getsockname()[:2]
        except (OSError, ValueError):
            return False
        return port == want[1] and (host == want[0] or want[0] in ("", "0.0.0.0", "::", "localhost"))

    async def _serve(self):
        loop = self.loop
        for listener in self.sockets:
            metrics = self._is_metrics(listener)
            tls = self.cfg.is_ssl and not metrics
            app = self.metrics_wsgi if metrics else self.wsgi
            try:
                host, port = listener.sock.getsockname()[:2]
            except (OSError, ValueError):
                host, port = "", 0
            site = Site(self, app, tls, str(host), str(port))
            listener.sock.setblocking(False)
            loop.add_reader(listener.sock.fileno(), self._accept, listener.sock, site)
            self.listening.append(listener.sock)
        stuck_after = max(self.timeout, 1)
        while self.alive:
            now = loop.time()
            if not self._sweep(now, stuck_after):
                self.notify()  # a thread stuck in the app past the worker timeout stops this, and the
                # master replaces the worker
            if self.ppid != os.getppid():
                self.log.info("Parent changed, shutting down: %s", self)
                break
            if self.nr >= self.max_requests:
                self.log.info("Autorestarting worker after current request.")
                break
            await asyncio.sleep(SWEEP_EVERY)
        await self._shutdown()

    def _accept(self, sock, site: Site) -> None:
        """One connection, then a pause of ACCEPT_PAUSE. The workers share the listening socket: taking one
        at a time, and letting the next go to another worker, spreads connections (which the API server
        keeps for minutes) over the workers rather than in batches to the first one awake."""
        try:
            conn, _ = sock.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return  # another worker took it, or the client gave up
        except OSError as e:  # out of file descriptors or memory: wait a little rather than spin
            self.log.warning("accept failed (%s): pausing accepts for a second", e)
            self._pause_accepting(sock, site, 1.0)
            return
        conn.setblocking(False)
        self.spawn(self._connected(conn, site))
        if self.cfg.workers > 1:
            self._pause_accepting(sock, site, ACCEPT_PAUSE)

    def spawn(self, coroutine) -> None:
        task = self.loop.create_task(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _pause_accepting(self, sock, site: Site, seconds: float) -> None:
        self.loop.remove_reader(sock.fileno())
        self.loop.call_later(seconds, self._resume_accepting, sock, site)

    def _resume_accepting(self, sock, site: Site) -> None:
        if self.alive:
            self.loop.add_reader(sock.fileno(), self._accept, sock, site)

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
                conn._gone()
            return
        # The handshake: the connection counts against worker_connections and can be evicted or
        # closed at shutdown (cancelling this task), under a backstop deadline beside the loop's own.
        conn.handshake = asyncio.current_task()
        conn.deadline = self.loop.time() + site.options.handshake_timeout + 1
        try:
            context = gunicorn_sock.ssl_context(site.cfg)
            await self.loop.connect_accepted_socket(
                lambda: conn, sock, ssl=context, ssl_handshake_timeout=site.options.handshake_timeout,
                ssl_shutdown_timeout=site.options.request_timeout)
        except asyncio.CancelledError:  # evicted, expired or shut down: the loop closed the socket
            conn._gone()
        except Exception as e:  # a failed or timed-out handshake, or the client went away
            if isinstance(e, ConnectionAbortedError) and "taking longer" in str(e):
                _count_timeout("handshake")
            sock.close()
            conn._gone()
        finally:
            conn.handshake = None

    def _sweep(self, now: float, stuck_after: float) -> bool:
        """Close connections past their deadline; True when a request has been with the app too long."""
        stuck = False
        for conn in list(self.connections):
            if (conn.deadline and now >= conn.deadline) or (conn.write_deadline and now >= conn.write_deadline):
                conn.expire(now)
            elif conn.state == BUSY and conn.busy_since and now - conn.busy_since > stuck_after:
                stuck = True
        if stuck:
            self.log.error("a request has been with the application for over %ss: not reporting alive", stuck_after)
        return stuck

    def admit(self, conn: Connection) -> bool:
        """Room for one more connection (gunicorn's worker_connections). At the limit the longest-idle
        keep-alive connection gives way, else the waiting one nearest its deadline (handshake or request
        not complete: the likeliest staller); connections with the app are never dropped."""
        if len(self.connections) < self.cfg.worker_connections:
            self.connections.add(conn)
            return True
        idle = [c for c in self.connections if c.state == IDLE]
        if idle:
            min(idle, key=lambda c: c.idle_since).close()
        else:
            waiting = [c for c in self.connections if c.state in (HANDSHAKE, READING) and c.deadline]
            if not waiting:
                return False
            min(waiting, key=lambda c: c.deadline).abort()
        self.connections.add(conn)
        return True

    async def _shutdown(self):
        for sock in self.listening:
            self.loop.remove_reader(sock.fileno())  # no new connections here; other workers go on accepting
        for conn in list(self.connections):
            if conn.state in (IDLE, HANDSHAKE):
                conn.close()
        if not self.quick:
            deadline = self.loop.time() + self.cfg.graceful_timeout
            while self.connections and self.loop.time() < deadline and not self.quick:
                self.notify()
                for conn in list(self.connections):
                    if conn.state == IDLE:
                        conn.close()
                    elif conn.deadline and self.loop.time() >= conn.deadline:
                        conn.expire(self.loop.time())
                await asyncio.sleep(0.05)
        for conn in list(self.connections):
            conn.abort()


class Site:
    """What the connections of one listener share."""

    def __init__(self, worker: Worker, app: WSGIApp, tls: bool, host: str, port: str):
        self.worker, self.app, self.tls = worker, app, tls
        self.loop = worker.loop
        self.cfg = worker.cfg
        self.options = worker.options
        cfg = worker.cfg
        self.limit_line = cfg.limit_request_line
        self.limit_fields = cfg.limit_request_fields
        self.limit_field_size = cfg.limit_request_field_size
        self.keepalive = float(cfg.keepalive)
        self.base_environ = {
            "SCRIPT_NAME": "", "SERVER_NAME": host, "SERVER_PORT": port,
            "wsgi.version": (1, 0), "wsgi.url_scheme": "https" if tls else "http", "wsgi.errors": sys.stderr,
            "wsgi.multithread": True, "wsgi.multiprocess": cfg.workers > 1, "wsgi.run_once": False,
            "wsgi.input_terminated": True,
        }


def _error_body(code: int, message: str) -> bytes:
    return json.dumps({"error": message, "code": code}, separators=(",", ":")).encode()


_JSON = [("Content-Type", "application/json")]
_INTERNAL = _error_body(500, "internal error")
_REASONS = {400: "Bad Request", 413: "Content Too Large", 414: "URI Too Long", 505: "HTTP Version Not Supported",
            431: "Request Header Fields Too Large"}
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
    lines.append(f"Content-Length: {length}\r\n" if keep else f"Content-Length: {length}\r\nConnection: close\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")


class _EndOfMessage(Exception):
    """Raised from a callback to stop llhttp at the end of a chunked message: what follows is not read."""


class _Head:
    """httptools' callbacks for one request head (and, for a chunked request, its body)."""

    __slots__ = ("url", "headers", "complete", "done", "on_chunk")

    def __init__(self):
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.complete = False   # the head is parsed
        self.done = False       # the message is (chunked body read in full, or no body)
        self.on_chunk: Callable[[bytes], None] | None = None  # a chunked body's data, once the head is done

    def on_url(self, url: bytes):
        self.url += url

    def on_header(self, name: bytes, value: bytes):
        if not self.complete:  # a chunked body's trailer fields are not headers: dropped
            self.headers.append((name.lower(), value.strip(b" \t")))

    def on_headers_complete(self):
        self.complete = True

    def on_body(self, data: bytes):
        if self.on_chunk is not None:
            self.on_chunk(data)

    def on_message_complete(self):
        self.done = True
        if self.on_chunk is not None:
            raise _EndOfMessage


class Request:
    """A request whose head has been read."""

    __slots__ = ("method", "target", "path", "query", "version", "headers", "length", "chunked", "parser",
                 "callbacks")

    def __init__(self, method: bytes, target: bytes, path: bytes, query: bytes, version: str,
                 headers: list[tuple[bytes, bytes]], length: int, chunked: bool, parser, callbacks: _Head):
        self.method, self.target, self.version, self.headers = method, target, version, headers
        self.path, self.query = path, query  # the target's, origin-form
        self.length, self.chunked = length, chunked   # Content-Length (0 when none), or a chunked body
        self.parser, self.callbacks = parser, callbacks  # kept to read a chunked body


class Connection(asyncio.Protocol):
    """One client connection: handshake, read, hand over, answer, and again while kept alive.

    Reading is the worker's own where it decides where a request ends: the head is buffered up to its
    blank line (so its bound is exact) and parsed by httptools (llhttp, strict: bad framing, a duplicate
    or invalid Content-Length, Content-Length with Transfer-Encoding are refused), a Content-Length body
    is counted here, so what follows it is the next request, byte for byte. A chunked body is read by
    the head's parser, and the connection is closed after its answer (what follows the last chunk is not
    located)."""

    def __init__(self, site: Site):
        self.site = site
        self.loop = site.loop
        self.transport: asyncio.Transport | None = None
        self.handshake: asyncio.Task | None = None  # the TLS handshake under way
        self.state = HANDSHAKE
        self.deadline = 0.0
        self.idle_since = 0.0
        self.busy_since = 0.0
        self.write_deadline = 0.0
        self.served = 0          # answers written on this connection
        self.buffer = bytearray()  # received and not yet taken: a head in the making, or what follows a request
        self.searched = 0        # how far the buffer has been searched for the head's end
        self.fed = 0             # a chunked request's bytes as sent (framing included), bounded
        self.request: Request | None = None
        self.chunks: list[bytes] = []
        self.chunked_body = bytearray()  # a chunked body's data (chunks may be tiny: one buffer, not a list)
        self.size = 0            # body bytes read for the request in hand
        self.collecting = True   # body kept for the app; False once over the limit (dropped, counted)
        self.dispatched = False  # the request went to the app (early, when over the limit)
        self.body_done = False   # the request in hand has been read to its end
        self.environ: dict | None = None
        self.keep_alive = False  # the request in hand allows the connection to be kept

    # ---- transport events ----

    def connection_made(self, transport):
        """Called with the TLS transport once the handshake is done (or the plain one at once)."""
        if self.state == CLOSED:  # closed while the handshake ended
            transport.abort()
            return
        if not self.site.worker.alive:
            transport.close()
            self._gone()
            return
        peer = transport.get_extra_info("peername") or ("", 0)
        self.environ = {**self.site.base_environ, "REMOTE_ADDR": str(peer[0]), "REMOTE_PORT": str(peer[1])}
        self._ready(transport)

    def _ready(self, transport):
        self.transport = transport
        self.state = IDLE
        # A connection's first request must start soon (it has sent nothing yet); later ones may wait
        # for the keep-alive time.
        self.idle_since = self.loop.time()
        self.deadline = self.idle_since + self.site.options.request_timeout

    def data_received(self, data: bytes):
        state = self.state
        if state == IDLE:
            self.state = state = READING
            if self.served:  # a connection's first request keeps the deadline set at the handshake's end
                self.deadline = self.loop.time() + self.site.options.request_timeout
        elif state == CLOSED:
            return
        if self.request is None:
            self.buffer += data
            if state == READING:
                self._read()
        elif self.request.chunked:
            self._feed_chunked(data)
        else:
            self._body(data)
            if self.body_done and len(self.buffer) > HEAD_LIMIT and self.transport is not None:
                self.transport.pause_reading()  # what follows waits for the answer; it is read after it

    def eof_received(self):
        if self.state == READING and not self.dispatched and (self.request is not None or self.buffer.strip(b"\r\n")):
            self._refuse(400, "the connection was closed inside a request")
        return False  # close our side too

    def connection_lost(self, exc):
        self._gone()

    def pause_writing(self):
        # The client does not read what we write: it has the request timeout to start again.
        self.write_deadline = self.loop.time() + self.site.options.request_timeout

    def resume_writing(self):
        self.write_deadline = 0.0

    # ---- reading a request ----

    def _read(self):
        """A head from the buffer, if it has one (then its body, from what follows)."""
        buf = self.buffer
        if buf[:1] in (b"\r", b"\n"):  # blank lines before a request line are allowed (RFC 9112 2.2)
            stripped = buf.lstrip(b"\r\n")
            del buf[:len(buf) - len(stripped)]
            self.searched = 0
            if not buf:  # only blank lines: still between requests, under the same deadline
                self.state = IDLE
                self.deadline = self.idle_since + (self.site.keepalive if self.served else
                                                   self.site.options.request_timeout)
                return
        if buf[0] not in _TOKEN:  # a request line starts with a method: junk (a TLS hello on plain HTTP) at once
            self._refuse(400, "not an HTTP/1.1 request")
            return
        start = max(0, self.searched - 3)
        end = buf.find(b"\r\n\r\n", start)
        if _BARE_LF.search(buf, max(0, self.searched - 1), end + 4 if end >= 0 else len(buf)):
            self._refuse(400, "a line of the request head ends in LF without CR")
            return
        if end < 0:
            if len(buf) > HEAD_LIMIT:
                self._refuse(431, f"the request head is over {HEAD_LIMIT} bytes")
            else:
                self.searched = len(buf)
            return
        end += 4
        if end > HEAD_LIMIT:
            self._refuse(431, f"the request head is over {HEAD_LIMIT} bytes")
            return
        head, rest = bytes(buf[:end]), bytes(buf[end:])
        buf.clear()
        self.searched = 0
        callbacks = _Head()
        parser = httptools.HttpRequestParser(callbacks)
        upgrade = False
        try:
            parser.feed_data(head)
        except httptools.HttpParserUpgrade:
            upgrade = True
        except httptools.HttpParserError as e:
            self._refuse(400, _parser_error(e))
            return
        if not callbacks.complete:
            self._refuse(400, "incomplete request head")
            return
        req = self._head(parser, callbacks)
        if req is None:
            return
        if upgrade:
            if req.chunked:  # llhttp reads no body after an upgrade: a chunked one would be lost
                self._refuse(400, "an upgrade request with a chunked body")
                return
            self.keep_alive = False  # no protocol switch here: answered, then closed
        if req.chunked:
            self._feed_chunked(rest)
        elif req.length == 0:
            self.body_done = True
            self.buffer += rest
            self._dispatch(b"", 0)
        else:
            self._body(rest)

    def _head(self, parser, callbacks: _Head) -> Request | None:
        site = self.site
        method, target, headers = parser.get_method(), callbacks.url, callbacks.headers
        if site.limit_line and len(method) + len(target) + 10 > site.limit_line:
            self._refuse(414, f"the request line is over {site.limit_line} bytes")
            return None
        if site.limit_fields and len(headers) > site.limit_fields:
            self._refuse(431, f"more than {site.limit_fields} header fields")
            return None
        version = parser.get_http_version()
        if version not in ("1.1", "1.0"):
            self._refuse(505, f"HTTP/{version} is not served: HTTP/1.1 only")
            return None
        if method == b"CONNECT":
            self._refuse(400, "CONNECT is not served")
            return None
        length, chunked, expect, close, hosts = 0, False, False, False, 0
        codings: list[bytes] = []
        for name, value in headers:
            if site.limit_field_size and len(name) + len(value) + 2 > site.limit_field_size:
                self._refuse(431, f"a header field is over {site.limit_field_size} bytes")
                return None
            if name == b"content-length":
                try:
                    length = int(value)  # llhttp has checked it: digits, one value
                except ValueError:
                    self._refuse(400, "invalid Content-Length")
                    return None
            elif name == b"host":
                hosts += 1
            elif name == b"transfer-encoding":
                codings += (c.strip().lower() for c in value.split(b","))
            elif name == b"expect":
                expect = value.lower() == b"100-continue"
            elif name == b"connection":
                close = close or b"close" in value.lower()
        if hosts > 1 or (version == "1.1" and not hosts):  # RFC 9112 3.2
            self._refuse(400, "an HTTP/1.1 request needs exactly one Host header")
            return None
        if codings:
            if codings != [b"chunked"]:  # llhttp requires chunked last; no other coding is decoded here
                self._refuse(400, "Transfer-Encoding other than chunked")
                return None
            chunked = True
        try:
            path, query = _origin_form(target)
        except ValueError:
            self._refuse(400, "an invalid request target")
            return None
        req = Request(method, target, path, query, version, headers, length, chunked, parser, callbacks)
        self.request, self.chunks, self.size, self.collecting, self.dispatched = req, [], 0, True, False
        self.body_done, self.fed = False, 0
        self.keep_alive = bool(site.keepalive) and version == "1.1" and not close and not chunked
        if length > site.options.max_body:
            if expect:  # a body the client will not send unless told to continue
                self.keep_alive = False
            self._over_limit(length)
        elif expect and version == "1.1" and (length or chunked):
            self._send(b"HTTP/1.1 100 Continue\r\n\r\n")
        return req

    def _body(self, data: bytes):
        """Content-Length body bytes; what follows the body is kept for the next request."""
        req = self.request
        need = req.length - self.size
        if len(data) > need:
            self.buffer += data[need:]
            data = data[:need]
        self.size += len(data)
        if self.collecting:
            if data:
                self.chunks.append(data)
        elif self.size > DRAIN_LIMIT:
            self.abort()
            return
        if self.size == req.length:
            self.body_done = True
            if self.dispatched:  # the rest of an over-limit body has been dropped
                if self.state != BUSY:  # and the answer is out: ready for the next request
                    self._next_cycle()
                else:  # read in full: what follows waits for the answer, and no client deadline runs
                    self.deadline = 0.0
                    if self.transport is not None:
                        self.transport.pause_reading()
                return
            self._dispatch(self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks), self.size)

    def _feed_chunked(self, data: bytes):
        req = self.request
        callbacks = req.callbacks
        if callbacks.on_chunk is None:
            callbacks.on_chunk = self._chunk
        if callbacks.done:  # read to its last chunk: nothing after it is read (closed after the answer)
            self._chunked_done()
            return
        if not data:
            return
        self.fed += len(data)
        try:
            req.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as e:
            if not callbacks.done:  # stopped at the message's end (_EndOfMessage) is not an error
                if self.state != CLOSED:
                    self._refuse(400, _parser_error(e))
                return
        if self.state == CLOSED:
            return
        if callbacks.done:
            self._chunked_done()
        elif self.fed - self.size > HEAD_LIMIT + self.size // 8:
            # Framing (tiny chunks, extensions, trailers) far beyond the data it carries: each chunk is a
            # callback, so it is bounded against the data, not only the body
            if not self.dispatched:
                self._refuse(400, "chunked framing far larger than the data it carries")
            else:
                self.abort()

    def _chunk(self, data: bytes):
        if self.state == CLOSED:
            return
        self.size += len(data)
        if self.collecting:
            if self.size > self.site.options.max_body:
                self.chunked_body = bytearray()
                self._over_limit(self.size)
            else:
                self.chunked_body += data
        elif self.size > DRAIN_LIMIT:
            self.abort()

    def _chunked_done(self):
        if self.body_done:
            return
        self.body_done = True
        if not self.dispatched:
            body, self.chunked_body = bytes(self.chunked_body), bytearray()
            self._dispatch(body, self.size)
        elif self.state == BUSY:  # over the limit, the answer pending: nothing more is read
            self.deadline = 0.0
            if self.transport is not None:
                self.transport.pause_reading()
        else:  # over the limit, answered and the rest dropped: closed (nothing after it is read)
            self.close()

    def _over_limit(self, length: int):
        """Hand the app the request with its length and no body: it answers 413; the rest is dropped."""
        self.collecting = False
        if length > DRAIN_LIMIT:
            self.keep_alive = False  # more than is worth reading to keep the connection: closed after the answer
        self._dispatch(b"", length)

    # ---- the app ----

    def _dispatch(self, body: bytes, length: int):
        req = self.request
        env = self.environ.copy()
        path, query = req.path, req.query
        env["REQUEST_METHOD"] = req.method.decode("ascii")
        env["PATH_INFO"] = unquote_to_bytes(path).decode("latin-1")
        env["QUERY_STRING"] = query.decode("latin-1")
        env["RAW_URI"] = (req.target if req.target[:1] == b"/" else
                          path + b"?" + query if query else path).decode("latin-1")
        env["SERVER_PROTOCOL"] = "HTTP/" + req.version
        env["CONTENT_LENGTH"] = str(length)
        for name, value in req.headers:
            if b"_" in name:  # ambiguous with '-' once in the environ: dropped, as gunicorn does
                continue
            if name == b"content-type":
                env["CONTENT_TYPE"] = value.decode("latin-1")
            elif name != b"content-length" and name != b"transfer-encoding":  # the body is whole: its length is known
                key = "HTTP_" + name.decode("latin-1").upper().replace("-", "_")
                text = value.decode("latin-1")
                env[key] = env[key] + "," + text if key in env else text
        env["wsgi.input"] = io.BytesIO(body)
        self.dispatched = True
        self.state = BUSY
        self.busy_since = self.loop.time()
        if self.collecting:
            self.deadline = 0.0  # read in full: the app has it; no client deadline until the answer is out
            if self.transport is not None:
                self.transport.pause_reading()
        self.site.worker.nr += 1
        threads = self.site.worker.threads
        if self.site.tls and length <= INLINE_LIMIT:
            # A small review is answered here, on the loop: two thread hand-overs (and their wake-ups) cost
            # more than the review. The app may not block here; a cache miss that needs a live read raises
            # WouldBlock and the request goes to a thread after all.
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
        """Called on the loop with the app's answer: written, then the app's result closed, then the next
        request (or a close of the connection)."""
        if self.state == CLOSED:
            _closed(close, self.site.worker.log)
            return
        keep = self.keep_alive and self.site.worker.alive
        try:
            try:
                head = _head(status, headers, len(body), keep)
            except ValueError as e:  # a header no HTTP/1.1 message can carry: a fault of the app's
                self.site.worker.log.error("the application's answer cannot be sent: %s", e)
                head, body, keep = _head("500 Internal Server Error", _JSON, len(_INTERNAL), False), _INTERNAL, False
            self._send(head + body if body and self.request.method != b"HEAD" else head)
        finally:
            _closed(close, self.site.worker.log)
        self.served += 1
        self.busy_since = 0.0
        self.idle_since = self.loop.time()
        if not keep:
            req = self.request
            if req.chunked and not self.body_done and not self.collecting and self.site.worker.alive:
                # An over-limit chunked body: dropped to its last chunk (bounded), then closed, so the
                # client is not reset before it reads the answer
                self.state = READING
                if self.transport is not None:
                    self.transport.resume_reading()
                return
            self.close()
        elif self.body_done:
            self._next_cycle()
        else:  # still dropping an over-limit body, under the request's deadline
            self.state = READING
            if self.transport is not None:
                self.transport.resume_reading()

    def _next_cycle(self):
        """Ready for the next request on this connection (and on to it, if it has already arrived)."""
        self.request, self.chunks, self.size, self.collecting, self.dispatched = None, [], 0, True, False
        self.body_done, self.fed, self.chunked_body = False, 0, bytearray()
        self.state = IDLE
        self.idle_since = self.loop.time()
        self.deadline = self.idle_since + self.site.keepalive
        if self.transport is not None:
            self.transport.resume_reading()
        if self.buffer:  # a pipelined request already arrived
            self.state = READING
            self.deadline = self.loop.time() + self.site.options.request_timeout
            self._read()

    # ---- writing and closing ----

    def _send(self, data: bytes):
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _refuse(self, code: int, message: str):
        """Answer a request the worker refuses itself (bad framing, head over the limits), then close."""
        _count_bad(code)
        if self.state == READING and not self.dispatched:  # nothing answered this request yet
            body = _error_body(code, message)
            self._send(_head(f"{code} {_REASONS.get(code, 'Bad Request')}", _JSON, len(body), False) + body)
        self.close()

    def expire(self, now: float):
        """A deadline passed: handshake, request or write too slow, or idle too long."""
        if self.write_deadline and now >= self.write_deadline:
            _count_timeout("write")
        elif self.state == READING or (self.state == BUSY and not self.collecting) or (
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
        self._gone()

    def abort(self):
        if self.transport is not None:
            self.transport.abort()
        elif self.handshake is not None:
            self.handshake.cancel()
        self._gone()

    def _gone(self):
        self.state = CLOSED
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
            status, headers, body, close = self._call(app, environ)
            try:
                call_soon(conn.respond, status, headers, body, close)  # closed on the loop, once written
            except RuntimeError:  # the loop is closed: the worker is exiting
                _closed(close, self.log)
                return

    def call(self, app: WSGIApp, environ: dict, passthrough: type[BaseException] | tuple = ()) -> Answer:
        """Run the app on the caller's thread; `passthrough` exceptions reach the caller."""
        return self._call(app, environ, passthrough)

    def _call(self, app: WSGIApp, environ: dict, passthrough: type[BaseException] | tuple = ()) -> Answer:
        """(status, headers, body, close): the result's `close` (PEP 3333: called once the request is complete)
        is handed back, to be called on the loop after the answer is written, so the app's after-work
        (metrics, the log line) is not on the client's clock."""
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
            if written:
                body = b"".join(written) + body
            return started[0], started[1], body, close
        except passthrough:
            _closed(close, self.log)
            raise
        except Exception:
            _closed(close, self.log)
            self.log.exception("Error handling request %s", environ.get("PATH_INFO"))
            return ("500 Internal Server Error", [("Content-Type", "application/json")],
                    _error_body(500, "internal error"), None)


def _closed(close: Callable[[], object] | None, log) -> None:
    """Call a WSGI result's close(); its faults are logged, never raised into the loop or a thread."""
    if close is not None:
        try:
            close()
        except Exception:
            log.exception("Error closing a response")


_BARE_LF = re.compile(rb"(?<!\r)\n")
_TOKEN = frozenset(b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")


def _origin_form(target: bytes) -> tuple[bytes, bytes]:
    """(path, query) of a request target; an absolute-form one is reduced to its path and query.
    ValueError for a target urlsplit cannot read (`http://[::1/`)."""
    if target[:1] != b"/":  # absolute-form, or '*'
        parts = urlsplit(target)
        target = (parts.path or b"/") + (b"?" + parts.query if parts.query else b"")
    path, _, query = target.partition(b"?")
    return path, query


def _parser_error(e: Exception) -> str:
    """llhttp's reason, without its offsets: 'Invalid method encountered' and the like."""
    text = str(e) or type(e).__name__
    return text if len(text) <= 200 else text[:200]


def _count_timeout(stage: str) -> None:
    try:
        from . import metrics
        metrics.CLIENT_TIMEOUTS.labels(stage).inc()
    except Exception:
        pass


def _count_bad(code: int) -> None:
    try:
        from . import metrics
        metrics.BAD_REQUESTS.labels(str(code)).inc()
    except Exception:
        pass
