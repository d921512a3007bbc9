"""One client connection of the worker (webhook.serving.worker): HTTP/1.1 framing and the request cycle.

A connection goes through its phases (`Phase`): TLS handshake, idle, reading a request, busy while one is
with the app, closed. Each request read has a `BodyPhase` (its body kept, dropped, or received to its end)
and an `AnswerPhase` (waiting, with the app, answered). Limits, deadlines and the worker's room: SPEC 7.
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, cast
from urllib.parse import urlsplit

import httptools

from ..core.runtimes import WouldBlock
from ..process import metrics
from ..process.blocking import NoBlocking
from .wsgi import INTERNAL, JSON, close_result, error_body, request_environ, response_head

if TYPE_CHECKING:
    from .listener import Site

DRAIN_LIMIT = 64 * 1024 * 1024  # an over-limit body longer than this is not read to its end: closed after the 413
HEAD_LIMIT = 64 * 1024          # a head not complete within this many bytes is refused (431)
SLICE = 16 * 1024               # data reaches the parser in slices this size: a head's size is known within one
INLINE_LIMIT = 64 * 1024        # a review body up to this size is answered on the loop (a larger one on a thread)

REASONS = {400: "Bad Request", 411: "Length Required", 413: "Content Too Large", 414: "URI Too Long",
           431: "Request Header Fields Too Large", 503: "Service Unavailable", 505: "HTTP Version Not Supported"}


class Phase(enum.Enum):
    """A connection's phase."""

    HANDSHAKE = enum.auto()  # accepted, the TLS handshake under way
    IDLE = enum.auto()       # between requests (or before the first): kept alive under a deadline
    READING = enum.auto()    # a request's bytes being read, under the request deadline
    BUSY = enum.auto()       # a request with the app (or its answer being written)
    CLOSED = enum.auto()


class BodyPhase(enum.Enum):
    """What becomes of a request's body as it comes."""

    KEEPING = enum.auto()   # its bytes kept for the app (counted in the worker's room)
    DROPPING = enum.auto()  # over max_body (413 from the app) or no room (503 here): its bytes dropped
    RECEIVED = enum.auto()  # read (or dropped) to its end


class AnswerPhase(enum.Enum):
    """Where a request is on its way to its answer."""

    WAITING = enum.auto()   # being read, or ready and waiting for the app
    WITH_APP = enum.auto()  # with the app, on the loop or its threads (or answered 503 here)
    ASIDE = enum.auto()     # with the metrics threads: never counts as the worker stuck
    ANSWERED = enum.auto()  # its answer written


class Refused(Exception):
    """Refused(code, message): a request the worker answers itself (bad framing, a head over the limits)."""


class Request:
    """A request whose head has been read; its body (kept unless over the limit) follows."""

    __slots__ = ("method", "target", "version", "headers", "length", "keep_alive", "refused", "body",
                 "body_phase", "answer_phase", "held", "since", "size")

    def __init__(self, *, method: bytes, target: bytes, version: str, headers: list[tuple[bytes, bytes]],
                 length: int, keep_alive: bool, over_limit: bool, since: float, held: int, refused: str = ""):
        self.method = method
        self.target = target
        self.version = version
        self.headers = headers
        self.length = length
        self.keep_alive = keep_alive
        self.refused = refused  # why it is answered 503 here (no room for it), or ""
        self.body: list[bytes] = []
        self.body_phase = BodyPhase.DROPPING if over_limit else BodyPhase.KEEPING
        self.answer_phase = AnswerPhase.WAITING
        self.held = held    # its bytes (head, body) counted in the worker's room until answered
        self.since = since  # its first byte
        self.size = held + length  # its head and Content-Length


class Fields:
    """What a head's fields say of its framing, checked against the limits."""

    def __init__(self, fields: list[tuple[bytes, bytes]], version: str, limit_field_size: int):
        self.length = 0
        self.expect = False
        self.size = 0  # bytes as sent: "name: value\r\n" each
        hosts = 0
        for name, value in fields:
            self.size += len(name) + len(value) + 4
            if limit_field_size and len(name) + len(value) + 2 > limit_field_size:
                raise Refused(431, f"a header field is over {limit_field_size} bytes")
            if name == b"content-length":
                self.length = int(value)  # llhttp has checked it: digits, one value
            elif name == b"host":
                hosts += 1
            elif name == b"transfer-encoding":
                raise Refused(411, "Transfer-Encoding is not served: send the body with a Content-Length")
            elif name == b"expect":
                self.expect = True
        if hosts > 1 or (version == "1.1" and not hosts):  # RFC 9112 3.2
            raise Refused(400, "an HTTP/1.1 request needs exactly one Host header")


def origin_form(target: bytes) -> bytes:
    """The target as a path and query: absolute-form (or '*') reduced to its path and query."""
    if target[:1] == b"/":
        return target
    try:
        parts = urlsplit(target)
    except ValueError:
        raise Refused(400, "an invalid request target") from None
    return (parts.path or b"/") + (b"?" + parts.query if parts.query else b"")


class Connection(asyncio.Protocol):
    """One client connection: handshake, read, hand over, answer, and again while kept alive.

    llhttp (through httptools' callbacks, below) frames the stream: where a head ends, a Content-Length body
    and the next request. Requests read whole (or over the limit, at their head) wait in `ready` and go to
    the app one at a time; reading pauses while a whole request waits for its answer."""

    def __init__(self, site: Site):
        self.site = site
        self.loop = site.loop
        self.transport: asyncio.Transport | None = None
        self.handshake: asyncio.Task[None] | None = None  # the TLS handshake under way
        self.parser = httptools.HttpRequestParser(self)
        self.environ: dict[str, object] = {}
        self.phase = Phase.HANDSHAKE
        self.deadline = 0.0
        self.write_deadline = 0.0
        self.since = 0.0  # when the phase began (idle: eviction; busy: the stuck check)
        self.served = 0   # answers written
        # The head being read: its target (None between heads), fields, bytes fed (in the room), first byte
        self.url: bytearray | None = None
        self.fields: list[tuple[bytes, bytes]] = []
        self.head_fed = 0
        self.head_since = 0.0
        self.request: Request | None = None    # the request whose body is being read
        self.answering: Request | None = None  # the request with the app
        self.ready: deque[Request] = deque()   # requests ready for the app, in order
        self.last = False  # nothing more is read (Connection: close, an upgrade, a refusal)
        self.refusal: bytes | None = None  # sent after the answers before it, then the connection closed

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Called with the TLS transport once the handshake is done (or the plain one at once)."""
        stream = cast(asyncio.Transport, transport)
        if self.phase is Phase.CLOSED or not self.site.worker.alive:  # closed as the handshake ended, or stopping
            stream.abort()
            self.gone()
            return
        peer = stream.get_extra_info("peername") or ("", 0)
        self.environ = {**self.site.base_environ, "REMOTE_ADDR": str(peer[0]), "REMOTE_PORT": str(peer[1])}
        self.transport = stream
        self.phase = Phase.IDLE
        # The first request must start soon (nothing sent yet); later ones may wait the keep-alive time.
        self.since = self.loop.time()
        self.deadline = self.since + self.site.options.request_timeout

    def data_received(self, data: bytes) -> None:
        if self.last or self.phase is Phase.CLOSED:
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

    def _feed(self, data: memoryview) -> None:
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

    def eof_received(self) -> bool:
        request = self.request
        inside = self.url is not None or (request is not None and request.answer_phase is AnswerPhase.WAITING)
        if self.phase is Phase.READING and inside:
            self._refuse(400, "the connection was closed inside a request")
            self._flow()
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone()

    def pause_writing(self) -> None:  # the client does not read what we write: it has the request timeout to resume
        self.write_deadline = self.loop.time() + self.site.options.request_timeout

    def resume_writing(self) -> None:
        self.write_deadline = 0.0

    # llhttp's callbacks (httptools)

    def on_message_begin(self) -> None:
        self.url = bytearray()
        self.fields = []
        self.head_fed = 0
        self.head_since = self.loop.time()
        if self.phase is Phase.IDLE:  # blank lines between requests do not begin one
            self.phase = Phase.READING
            if self.served:  # a connection's first request keeps the deadline set at the handshake's end
                self.deadline = self.loop.time() + self.site.options.request_timeout

    def on_url(self, url: bytes) -> None:
        assert self.url is not None
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name.lower(), value.strip(b" \t")))

    def on_headers_complete(self) -> None:
        assert self.url is not None
        cfg = self.site.cfg
        max_body = self.site.options.max_body
        target = bytes(self.url)
        self.url = None
        method = self.parser.get_method()
        version = self.parser.get_http_version()
        if cfg.limit_request_line and len(method) + len(target) + 10 > cfg.limit_request_line:
            raise Refused(414, f"the request line is over {cfg.limit_request_line} bytes")
        if cfg.limit_request_fields and len(self.fields) > cfg.limit_request_fields:
            raise Refused(431, f"more than {cfg.limit_request_fields} header fields")
        if version not in ("1.1", "1.0"):
            raise Refused(505, f"HTTP/{version} is not served: HTTP/1.1 only")
        if method == b"CONNECT":
            raise Refused(400, "CONNECT is not served")
        framing = Fields(self.fields, version, cfg.limit_request_field_size)
        head = len(method) + len(target) + 14 + framing.size  # as sent: "METHOD TARGET HTTP/1.1\r\n", fields, "\r\n"
        target = origin_form(target)
        if framing.length and not self.site.bodies:
            raise Refused(413, "no request body is taken on this port")
        refused = self._hold_head(head, framing.length)
        over = framing.length > max_body or bool(refused)
        # No protocol switch here: an upgrade request is answered, then the connection closed. A client
        # waiting to be told to continue is told 413 (or 503) instead, and will not send the body: closed after.
        keep = (bool(self.site.keepalive) and version == "1.1" and self.parser.should_keep_alive()
                and not self.parser.should_upgrade()
                and not (over and (framing.expect or framing.length > DRAIN_LIMIT)))
        req = Request(method=method, target=target, version=version, headers=[] if refused else self.fields,
                      length=framing.length, keep_alive=keep, over_limit=over, since=self.head_since,
                      held=0 if refused else head, refused=refused)
        self.request = req
        if over:  # answered from its head (413 by the app, 503 here), its body dropped as it comes
            self.ready.append(req)

    def _hold_head(self, head: int, length: int) -> str:
        """The head counted in the room by its size from now on (the slices held while it came given back),
        and room made for a body up to max_body: "" when it fits, else why not (the head given back too: the
        request is answered 503 from its head, its body dropped)."""
        room = self.site.worker.room
        if head > self.head_fed:
            self._take(head - self.head_fed, head)
        else:
            room.give_back(self.head_fed - head)
        self.head_fed = 0
        if length > self.site.options.max_body:
            return ""
        if room.make_room(length, head + length, self.loop.time(), self.site.worker.readers, self):
            return ""
        room.give_back(head)
        return room.full

    def on_body(self, data: bytes) -> None:
        req = self.request
        assert req is not None
        room = self.site.worker.room
        if req.body_phase is BodyPhase.DROPPING:
            return
        if not room.take(len(data), req.size, self.loop.time(), self.site.worker.readers, self):
            return self._drop_body(room.full)
        req.held += len(data)
        req.body.append(data)

    def on_message_complete(self) -> None:
        req = self.request
        assert req is not None
        self.request = None
        dropped = req.body_phase is BodyPhase.DROPPING
        req.body_phase = BodyPhase.RECEIVED
        if not req.keep_alive:
            self.last = True
        if not dropped:
            self.ready.append(req)
        elif req.answer_phase is AnswerPhase.ANSWERED:  # dropped to its end after the 413 went out
            self._idle()

    def _flow(self) -> None:
        """The next request to the app if none is with it; reading paused while a whole request waits."""
        if self.phase is Phase.CLOSED:
            return
        if self.phase is not Phase.BUSY:
            if self.ready:
                self._dispatch(self.ready.popleft())
            elif self.refusal is not None:
                self._send(self.refusal)
                self.close()
                return
        if self.phase is Phase.BUSY and self.transport is not None and (self.ready or self._answering_read()):
            self.deadline = 0.0  # read in full: no client deadline until the answer is out
            self.transport.pause_reading()

    def _answering_read(self) -> bool:
        """The request with the app has been read to its end."""
        return self.answering is not None and self.answering.body_phase is BodyPhase.RECEIVED

    def _dispatch(self, req: Request) -> None:
        body = req.body[0] if len(req.body) == 1 else b"".join(req.body)
        req.body = []
        req.answer_phase = AnswerPhase.WITH_APP
        if req.refused:  # no room for its body: 503 (the client reads it while its body is dropped)
            metrics.get().bad_requests.labels("503").inc()
            self.answering = req
            self.phase = Phase.BUSY
            self.loop.call_soon(self.respond, "503 Service Unavailable", JSON, error_body(503, req.refused))
            return
        env = request_environ(self.environ, req.method, req.target, req.version, req.length, req.headers, body)
        self.answering = req
        self.phase = Phase.BUSY
        self.since = self.loop.time()
        worker = self.site.worker
        worker.nr += 1
        if env["PATH_INFO"] == "/metrics":  # judges every runtime, waits on the API server with --metrics-auth
            req.answer_phase = AnswerPhase.ASIDE
            scrapes = worker.metrics_threads
            if not scrapes.offer(self, self.site.app, env):
                metrics.get().bad_requests.labels("503").inc()
                self.loop.call_soon(self.respond, "503 Service Unavailable", JSON,
                                    error_body(503, f"{scrapes.waiting} scrapes are being answered: try again"))
            return
        if self.site.tls and req.length <= INLINE_LIMIT:
            # A small review is answered here, on the loop: two thread hand-overs cost more than the review.
            # The app may not block here; a cache miss that needs a live read raises WouldBlock and the
            # request goes to a thread after all.
            try:
                with NoBlocking():
                    answer = worker.threads.call(self.site.app, env, passthrough=WouldBlock)
            except WouldBlock:
                env["wsgi.input"].seek(0)
            else:
                self.loop.call_soon(self.respond, *answer)
                return
        worker.threads.offer(self, self.site.app, env)

    def respond(self, status: str, headers: list[tuple[str, str]], body: bytes,
                close: Callable[[], object] | None = None) -> None:
        """On the loop, with the app's answer: written, then the app's result closed, then the next request
        (or a close of the connection)."""
        log = self.site.worker.log
        if self.phase is Phase.CLOSED:
            close_result(close, log)
            return
        req = self.answering
        assert req is not None
        self.answering = None
        req.answer_phase = AnswerPhase.ANSWERED
        self.site.worker.room.release(req)
        keep = req.keep_alive and self.site.worker.alive
        try:
            try:
                head = response_head(status, headers, len(body), keep)
            except ValueError as e:  # a header no HTTP/1.1 message can carry: a fault of the app's
                log.error("the application's answer cannot be sent: %s", e)
                keep = False
                body = INTERNAL
                head = response_head("500 Internal Server Error", JSON, len(INTERNAL), keep)
            self._send(head + body if body and req.method != b"HEAD" else head)
        finally:
            close_result(close, log)
        self.served += 1
        if not keep:
            self.close()
            return
        if self.ready or req.body_phase is not BodyPhase.RECEIVED or self.url is not None or self.request is not None:
            self.phase = Phase.READING  # what follows (or the rest of an over-limit body) is read under a deadline
            self.deadline = self.loop.time() + self.site.options.request_timeout
        else:
            self._idle()
        if self.transport is not None:
            self.transport.resume_reading()
        self._flow()

    def _idle(self) -> None:
        self.phase = Phase.IDLE
        self.since = self.loop.time()
        self.deadline = self.since + self.site.keepalive  # a kept-alive connection waits this long

    def _send(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    # webhook.serving.room: what the worker's room counts for this connection

    def reading(self) -> tuple[int, float] | None:
        """(bytes held, since its first byte) for the request being read, or None."""
        if self.url is not None:
            return self.head_fed, self.head_since
        req = self.request
        if req is None or req.body_phase is not BodyPhase.KEEPING:
            return None
        return req.held, req.since

    def give_way(self, why: str) -> None:
        """The room is needed: the request being read is answered 503: a head, then the connection closed; a
        body, its rest dropped."""
        if self.url is not None:
            self._refuse(503, why)
        else:
            self._drop_body(why)
        self._flow()

    def _drop_body(self, why: str) -> None:
        """The request whose body is being read is answered 503 (after the answers before it), the rest of its
        body dropped as it comes."""
        req = self.request
        assert req is not None
        req.refused = why
        req.body_phase = BodyPhase.DROPPING
        req.body = []
        req.headers = []
        self.site.worker.room.release(req)
        self.ready.append(req)

    def _refuse(self, code: int, message: str) -> None:
        """Answer a request the worker refuses itself, after the answers before it, then close."""
        metrics.get().bad_requests.labels(str(code)).inc()
        self.site.worker.room.give_back(self.head_fed)  # nothing more is read
        self.head_fed = 0
        self.last = True
        body = error_body(code, message)
        self.refusal = response_head(f"{code} {REASONS.get(code, 'Bad Request')}", JSON, len(body), False) + body

    def expire(self, now: float) -> None:
        """A deadline passed: handshake, request or write too slow (counted), or idle too long."""
        if self.write_deadline and now >= self.write_deadline:
            metrics.get().client_timeouts.labels("write").inc()
        elif self._inside_request():
            metrics.get().client_timeouts.labels("request").inc()
        elif self.phase is Phase.HANDSHAKE:
            metrics.get().client_timeouts.labels("handshake").inc()
        self.close(abort=True)

    def _inside_request(self) -> bool:
        """A request begun and not read to its end, or a first request never started."""
        if self.phase is Phase.READING:
            return True
        if self.phase is Phase.BUSY:
            return not self._answering_read()
        return self.phase is Phase.IDLE and not self.served

    def close(self, abort: bool = False) -> None:
        if self.transport is not None:
            if abort:
                self.transport.abort()
            else:
                self.transport.close()
        elif self.handshake is not None:
            self.handshake.cancel()
        self.gone()

    def gone(self) -> None:
        room = self.site.worker.room
        for req in (self.request, self.answering, *self.ready):
            room.release(req)
        room.give_back(self.head_fed)
        self.head_fed = 0
        self.phase = Phase.CLOSED
        self.last = True
        self.deadline = 0.0
        self.write_deadline = 0.0
        self.site.worker.connections.discard(self)
