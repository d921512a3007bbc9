"""The reading side of a worker's connection (webhook.serving.connection): llhttp, through httptools' callbacks,
frames the stream (where a head ends, a Content-Length body and the next request), each head checked against the
limits and counted in the worker's budget (webhook.serving.room) as it comes, each request read made a `Cycle`.
A request the worker refuses from its head raises `Refused`, which the connection answers itself. `Framing` is
the connection's base: it holds what is being read; the connection, what is answered, flow and deadlines.
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httptools

from .cycle import AnswerPhase, BodyPhase, Cycle
from .room import ANSWER

if TYPE_CHECKING:
    from .listener import Site

DRAIN_LIMIT = 64 * 1024 * 1024  # an over-limit body longer than this is not read to its end: closed after the 413
HEAD_LIMIT = 64 * 1024          # a head not complete within this many bytes is refused (431)
SLICE = 16 * 1024               # data reaches the parser in slices this size: a head's size is known within one
# Outside a body of known length (a head, a chunked body), data reaches the parser in slices this size: the parser
# cannot stop at a message's end, so a slice of tiny pipelined requests makes a cycle of each (at most 512 / 18,
# the shortest request, past IN_FLIGHT), each holding its answer's room (16 KiB of them made 480: ~0.5 MB a connection).
HEAD_SLICE = 512
IN_FLIGHT = 8                   # requests read and waiting behind the one with the app; past them, reading waits


class Phase(enum.Enum):
    """A connection's phase."""

    HANDSHAKE = enum.auto()  # accepted, the TLS handshake under way
    IDLE = enum.auto()       # between requests (or before the first): kept alive under a deadline
    READING = enum.auto()    # a request's bytes being read, under the request deadline
    BUSY = enum.auto()       # a request with the app (or its answer being written)
    CLOSED = enum.auto()


class Refused(Exception):
    """Refused(code, message): a request the worker answers itself (bad framing, a head over the limits)."""


class Fields:
    """What a head's fields say of its framing, checked against the limits."""

    @classmethod
    def of_head(cls, cfg: Any, method: bytes, target: bytes, version: str, fields: list[tuple[bytes, bytes]]) -> Fields:
        """A head's request line and fields checked against gunicorn's limits (`cfg`), and what its fields say."""
        if cfg.limit_request_line and len(method) + len(target) + 10 > cfg.limit_request_line:
            raise Refused(414, f"the request line is over {cfg.limit_request_line} bytes")
        if cfg.limit_request_fields and len(fields) > cfg.limit_request_fields:
            raise Refused(431, f"more than {cfg.limit_request_fields} header fields")
        if version not in ("1.1", "1.0"):
            raise Refused(505, f"HTTP/{version} is not served: HTTP/1.1 only")
        if method == b"CONNECT":
            raise Refused(400, "CONNECT is not served")
        return cls(fields, version, cfg.limit_request_field_size)

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


class Framing:
    """What a connection is reading: the head under way, the request whose body is coming, the requests read and
    waiting for the app (`ready`), and the bytes kept unparsed past them. llhttp calls the `on_*` methods."""

    site: Site
    loop: asyncio.AbstractEventLoop
    phase: Phase
    served: int
    deadline: float

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        # The head being read: its target (None between heads), fields, bytes fed (in the budget), first byte
        self.url: bytearray | None = None
        self.fields: list[tuple[bytes, bytes]] = []
        self.head_fed = 0
        self.head_since = 0.0
        self.answer_room = 0  # ANSWER bytes held for the answer of the request begun, until its head is read
        self.request: Cycle | None = None    # the cycle whose body is being read
        self.ready: deque[Cycle] = deque()   # cycles ready for the app, in order: at most IN_FLIGHT
        self.unfed = b""   # bytes received past IN_FLIGHT requests, not yet parsed (counted in the budget)
        self.body_left = 0  # what is still to come of the body being read, by its Content-Length (0: none, chunked)
        self.last = False  # nothing more is read (Connection: close, an upgrade, a refusal)

    # what the connection does for its reading side

    def _refuse(self, code: int, message: str) -> None:
        raise NotImplementedError

    def _drop_body(self, why: str) -> None:
        raise NotImplementedError

    def _idle(self) -> None:
        raise NotImplementedError

    def reading(self) -> tuple[int, float] | None:
        raise NotImplementedError

    def give_way(self, why: str) -> None:
        raise NotImplementedError

    def _stash(self, data: bytes) -> None:
        """Bytes past the in-flight requests kept unparsed, counted; or the client refused when they cannot fit."""
        room = self.site.worker.room
        if room.take(len(data), len(data), self.loop.time(), self.site.worker.readers, self):
            self.unfed += data
        else:
            self._refuse(503, f"pipelined past {IN_FLIGHT} requests, with no room to hold the rest: {room.full}")

    def _read(self, data: bytes) -> None:
        """Feed the parser, a slice at a time, until IN_FLIGHT requests wait: the rest is kept unparsed."""
        try:
            at = 0
            while at < len(data):
                if len(self.ready) >= IN_FLIGHT:  # pipelined past the limit: not parsed until the queue drains
                    self._stash(data[at:])
                    break
                n = min(SLICE, self.body_left) if self.body_left else HEAD_SLICE  # a body's bytes in large slices
                self._feed(memoryview(data)[at:at + n])
                at += n
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

    def _feed(self, data: memoryview) -> None:
        self.parser.feed_data(data)
        if self.url is not None:  # a head still incomplete after this slice: the slice is held for it
            if self.head_fed + len(data) > HEAD_LIMIT:
                raise Refused(431, f"the request head is over {HEAD_LIMIT} bytes")
            self._take(len(data), self.head_fed + len(data))
            self.head_fed += len(data)

    def _take(self, n: int, size: int) -> None:
        """Count `n` more bytes in the worker's budget for a request of `size`, or refuse it (503) when they do
        not fit."""
        room = self.site.worker.room
        if not room.take(n, size, self.loop.time(), self.site.worker.readers, self):
            raise Refused(503, room.full)

    # llhttp's callbacks (httptools)

    def on_message_begin(self) -> None:
        if not self.answer_room:  # room for its answer first: a request that could not be answered is not read
            self._take(ANSWER, ANSWER)
            self.answer_room = ANSWER
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
        max_body = self.site.options.max_body
        target = bytes(self.url)
        self.url = None
        method = self.parser.get_method()
        version = self.parser.get_http_version()
        framing = Fields.of_head(self.site.cfg, method, target, version, self.fields)
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
        cycle = Cycle(self, method=method, target=target, version=version, headers=[] if refused else self.fields,
                      length=framing.length, keep_alive=keep, over_limit=over, since=self.head_since,
                      held=self.answer_room + (0 if refused else head), refused=refused)
        self.answer_room = 0  # the cycle's now
        self.request = cycle
        self.body_left = framing.length
        if over:  # answered from its head (413 by the app, 503 here), its body dropped as it comes
            self.ready.append(cycle)

    def _hold_head(self, head: int, length: int) -> str:
        """The head counted in the budget by its size from now on (the slices held while it came given back),
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
        cycle = self.request
        assert cycle is not None
        self.body_left = max(0, self.body_left - len(data))
        if not cycle.on_body(data):
            self._drop_body(self.site.worker.room.full)

    def on_message_complete(self) -> None:
        cycle = self.request
        assert cycle is not None
        self.request = None
        self.body_left = 0
        dropped = cycle.body_phase is BodyPhase.DROPPING
        cycle.body_phase = BodyPhase.RECEIVED
        if not cycle.keep_alive:
            self.last = True
        if not dropped:
            self.ready.append(cycle)
        elif cycle.answer_phase is AnswerPhase.ANSWERED:  # dropped to its end after the 413 went out
            self._idle()
