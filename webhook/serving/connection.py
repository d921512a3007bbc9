"""One client connection of the worker (webhook.serving.worker): HTTP/1.1 framing, flow control and deadlines,
as uvicorn's `HttpToolsProtocol`; each request and its answer is a `Cycle` (webhook.serving.cycle).

A connection goes through its phases (`Phase`): TLS handshake, idle, reading a request, busy while one is
with the app, closed. Limits, deadlines and the worker's budget: SPEC 7, webhook.serving.room.

Flow (issue 47): one request is with the app at a time, the next dispatched once its answer is written; at
most IN_FLIGHT requests are read ahead of it (what a client pipelines past them stays unparsed, reading
paused); while the transport's write buffer is over its high-water mark (the client does not read its
answers) nothing more is read or dispatched, and a client that has not taken its answers within the request
deadline is cut off, with a log line. Answers written and not yet sent count in the worker's budget; so do
bytes received past the in-flight requests (or the client is refused 503 when they cannot fit).
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from typing import TYPE_CHECKING, cast
from urllib.parse import urlsplit

import httptools

from ..process import metrics
from .cycle import AnswerPhase, BodyPhase, Cycle
from .room import ANSWER
from .wsgi import error_answer

if TYPE_CHECKING:
    from .listener import Site

__all__ = ["AnswerPhase", "BodyPhase", "Connection", "Cycle", "Phase", "Refused"]

DRAIN_LIMIT = 64 * 1024 * 1024  # an over-limit body longer than this is not read to its end: closed after the 413
HEAD_LIMIT = 64 * 1024          # a head not complete within this many bytes is refused (431)
SLICE = 16 * 1024               # data reaches the parser in slices this size: a head's size is known within one
# Outside a body of known length (a head, a chunked body), data reaches the parser in slices this size: the parser
# cannot stop at a message's end, so a slice of tiny pipelined requests makes a cycle of each (at most 512 / 18,
# the shortest request, past IN_FLIGHT), each holding its answer's room (16 KiB of them made 480: ~0.5 MB a connection).
HEAD_SLICE = 512
IN_FLIGHT = 8                   # requests read and waiting behind the one with the app; past them, reading waits
WRITE_HIGH = 64 * 1024          # answer bytes buffered before the transport pauses writing (and so reading)

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
    and the next request. Each head read makes a `Cycle`; cycles read whole (or over the limit, at their head)
    wait in `ready` and go to the app one at a time; reading pauses while a whole request waits for its answer,
    while `ready` is full and while writing is paused."""

    def __init__(self, site: Site):
        self.site = site
        self.loop = site.loop
        self.transport: asyncio.Transport | None = None
        self.handshake: asyncio.Task[None] | None = None  # the TLS handshake under way
        self.parser = httptools.HttpRequestParser(self)
        self.environ: dict[str, object] = {}
        self.phase = Phase.HANDSHAKE
        self.deadline = 0.0
        self.write_deadline = 0.0  # set while writing is paused: the client must take its answers by then
        self.since = 0.0  # when the phase began (idle: eviction; busy: the stuck check)
        self.served = 0   # answers written
        # The head being read: its target (None between heads), fields, bytes fed (in the budget), first byte
        self.url: bytearray | None = None
        self.fields: list[tuple[bytes, bytes]] = []
        self.head_fed = 0
        self.head_since = 0.0
        self.answer_room = 0  # ANSWER bytes held for the answer of the request begun, until its head is read
        self.request: Cycle | None = None    # the cycle whose body is being read
        self.answering: Cycle | None = None  # the cycle with the app
        self.ready: deque[Cycle] = deque()   # cycles ready for the app, in order: at most IN_FLIGHT
        self.unfed = b""   # bytes received past IN_FLIGHT requests, not yet parsed (counted in the budget)
        self.body_left = 0  # what is still to come of the body being read, by its Content-Length (0: none, chunked)
        self.unsent = 0    # answer bytes written and not yet sent by the transport (counted in the budget)
        self.last = False  # nothing more is read (Connection: close, an upgrade, a refusal)
        self.refusal: bytes | None = None  # sent after the answers before it, then the connection closed

    @property
    def closed(self) -> bool:
        return self.phase is Phase.CLOSED

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Called with the TLS transport once the handshake is done (or the plain one at once)."""
        stream = cast(asyncio.Transport, transport)
        if self.phase is Phase.CLOSED or not self.site.worker.alive:  # closed as the handshake ended, or stopping
            stream.abort()
            self.gone()
            return
        peer = stream.get_extra_info("peername") or ("", 0)
        self.environ = {**self.site.base_environ, "REMOTE_ADDR": str(peer[0]), "REMOTE_PORT": str(peer[1])}
        stream.set_write_buffer_limits(high=WRITE_HIGH)
        self.transport = stream
        self.phase = Phase.IDLE
        # The first request must start soon (nothing sent yet); later ones may wait the keep-alive time.
        self.since = self.loop.time()
        self.deadline = self.since + self.site.options.request_timeout

    def data_received(self, data: bytes) -> None:
        if self.last or self.phase is Phase.CLOSED:
            return
        if self.unfed:  # bytes already wait unparsed (a read under way as reading paused): these go behind them
            self._stash(data)
        else:
            self._read(data)
        self._flow()

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

    def eof_received(self) -> bool:
        request = self.request
        inside = self.url is not None or (request is not None and request.answer_phase is AnswerPhase.WAITING)
        if self.phase is Phase.READING and inside:
            self._refuse(400, "the connection was closed inside a request")
            self._flow()
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone()

    def pause_writing(self) -> None:
        """The client does not take what we write: nothing more is read or dispatched until it does, and it
        has the request timeout to."""
        self.write_deadline = self.loop.time() + self.site.options.request_timeout
        self._steer()

    def resume_writing(self) -> None:
        self.write_deadline = 0.0
        self.settle()
        self._flow()

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

    # Flow: one cycle with the app, the next once its answer is written and the client takes what we write

    def _flow(self) -> None:
        """The next cycle to the app if none is with it and writing is not paused; bytes kept unparsed fed
        once the queue has room; reading paused or resumed to match."""
        if self.phase is Phase.CLOSED:
            return
        writable = not self.write_deadline
        if self.phase is not Phase.BUSY and writable and self.ready:
            self._dispatch(self.ready.popleft())
        if self.unfed and len(self.ready) < IN_FLIGHT:
            data, self.unfed = self.unfed, b""
            self.site.worker.room.give_back(len(data))
            self._read(data)
            if self.phase is not Phase.BUSY and writable and self.ready:
                self._dispatch(self.ready.popleft())
        if self.phase is not Phase.BUSY and writable and not self.ready and self.refusal is not None:
            if self.refusal:  # counted in its room; none when there was no room for it: closed unanswered
                self.site.worker.room.give_back(self.answer_room - len(self.refusal))
                self.answer_room = 0
                self.send(self.refusal)
            self.close()
            return
        self._steer()

    def _steer(self) -> None:
        """Reading on only while the client takes our answers, the queue has room and no whole request waits
        behind the one with the app."""
        if self.transport is None or self.phase is Phase.CLOSED:
            return
        waiting = self.phase is Phase.BUSY and (bool(self.ready) or self._answering_read())
        if waiting:
            self.deadline = 0.0  # read in full: no client deadline until the answer is out
        if waiting or self.write_deadline or self.unfed or len(self.ready) >= IN_FLIGHT:
            self.transport.pause_reading()
        else:
            self.transport.resume_reading()

    def _answering_read(self) -> bool:
        """The cycle with the app has been read to its end."""
        return self.answering is not None and self.answering.body_phase is BodyPhase.RECEIVED

    def _dispatch(self, cycle: Cycle) -> None:
        self.answering = cycle
        self.phase = Phase.BUSY
        self.since = self.loop.time()
        cycle.dispatch()

    def answered(self, cycle: Cycle, keep: bool) -> None:
        """The cycle's answer is written: the connection closed, or what follows read (or idle)."""
        self.answering = None
        self.served += 1
        if not keep:
            self.close()
            return
        if self.ready or cycle.body_phase is not BodyPhase.RECEIVED or self.url is not None or self.request is not None:
            self.phase = Phase.READING  # what follows (or the rest of an over-limit body) is read under a deadline
            self.deadline = self.loop.time() + self.site.options.request_timeout
        else:
            self._idle()
        self._flow()

    def _idle(self) -> None:
        self.phase = Phase.IDLE
        self.since = self.loop.time()
        self.deadline = self.since + self.site.keepalive  # a kept-alive connection waits this long

    def send(self, data: bytes) -> None:
        """Written to the transport: its bytes, counted in the worker's budget already, are given back as
        the transport sends them."""
        self.unsent += len(data)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)
        self.settle()

    def settle(self) -> None:
        """What the transport has sent since given back (on a write, when writing resumes, and at each of the
        worker's sweeps): the transport's write buffer is what is still held."""
        if self.unsent:
            left = 0 if self.transport is None else min(self.unsent, self.transport.get_write_buffer_size())
            self.site.worker.room.give_back(self.unsent - left)
            self.unsent = left

    # webhook.serving.room: what the worker's budget counts for this connection

    def reading(self) -> tuple[int, float] | None:
        """(bytes it would give back, since its first byte) for the request being read, or None: all it holds
        but its answer's room, which its 503 takes."""
        if self.refusal is not None:  # refused already: nothing more to give
            return None
        if self.url is not None:
            return self.head_fed, self.head_since
        cycle = self.request
        if cycle is None or cycle.body_phase is not BodyPhase.KEEPING:
            return None
        return cycle.held - ANSWER, cycle.since

    def give_way(self, why: str) -> None:
        """The budget is needed: the request being read is answered 503: a head, then the connection closed; a
        body, its rest dropped."""
        if self.url is not None:
            self._refuse(503, why)
        else:
            self._drop_body(why)
        self._flow()

    def _drop_body(self, why: str) -> None:
        """The request whose body is being read is answered 503 (after the answers before it), the rest of its
        body dropped as it comes."""
        cycle = self.request
        assert cycle is not None
        cycle.drop(why)
        self.ready.append(cycle)

    def _refuse(self, code: int, message: str) -> None:
        """Answer a request the worker refuses itself, after the answers before it, then close: in the room
        held for its answer (the head's, or taken now); with no room for it, closed unanswered."""
        if self.refusal is not None:
            return
        metrics.get().bad_requests.labels(str(code)).inc()
        room = self.site.worker.room
        room.give_back(self.head_fed + len(self.unfed))  # nothing more is read
        self.head_fed, self.unfed = 0, b""
        self.last = True
        if not self.answer_room:
            if self.request is not None and self.request not in self.ready:  # its body will not come whole
                room.release(self.request)
            if room.take(ANSWER, ANSWER, self.loop.time(), self.site.worker.readers, self):
                self.answer_room = ANSWER
        self.refusal = error_answer(code, message, False, self.answer_room) if self.answer_room else b""

    def expire(self, now: float) -> None:
        """A deadline passed: handshake, request or write too slow (counted; a client that does not take its
        answers logged too), or idle too long."""
        if self.write_deadline and now >= self.write_deadline:
            metrics.get().client_timeouts.labels("write").inc()
            self.settle()
            self.site.worker.log.warning(
                "closing a connection from %s:%s: it has not read its answers for %gs (%d bytes unsent, %d requests"
                " read and waiting, at most %d; what it sent past them unread)", self.environ.get("REMOTE_ADDR"),
                self.environ.get("REMOTE_PORT"), self.site.options.request_timeout, self.unsent, len(self.ready),
                IN_FLIGHT)
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
        for cycle in (self.request, self.answering, *self.ready):
            room.release(cycle)
        room.give_back(self.head_fed + len(self.unfed) + self.unsent + self.answer_room)
        self.head_fed, self.unfed, self.unsent, self.answer_room = 0, b"", 0, 0
        self.phase = Phase.CLOSED
        self.last = True
        self.deadline = 0.0
        self.write_deadline = 0.0
        self.site.worker.connections.discard(self)
