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
from typing import TYPE_CHECKING, cast

from ..process import metrics
from .cycle import AnswerPhase, BodyPhase, Cycle
from .framing import IN_FLIGHT, Framing, Phase, Refused
from .room import ANSWER
from .wsgi import error_answer

if TYPE_CHECKING:
    from .listener import Site

__all__ = ["AnswerPhase", "BodyPhase", "Connection", "Cycle", "Phase", "Refused"]

WRITE_HIGH = 64 * 1024          # answer bytes buffered before the transport pauses writing (and so reading)


class Connection(Framing, asyncio.Protocol):
    """One client connection: handshake, read, hand over, answer, and again while kept alive.

    llhttp (through httptools' callbacks: webhook.serving.framing) frames the stream: where a head ends, a
    Content-Length body and the next request. Each head read makes a `Cycle`; cycles read whole (or over the
    limit, at their head) wait in `ready` and go to the app one at a time; reading pauses while a whole request
    waits for its answer, while `ready` is full and while writing is paused."""

    def __init__(self, site: Site):
        super().__init__()
        self.site = site
        self.loop = site.loop
        self.transport: asyncio.Transport | None = None
        self.handshake: asyncio.Task[None] | None = None  # the TLS handshake under way
        self.environ: dict[str, object] = {}
        self.phase = Phase.HANDSHAKE
        self.deadline = 0.0
        self.write_deadline = 0.0  # set while writing is paused: the client must take its answers by then
        self.since = 0.0  # when the phase began (idle: eviction; busy: the stuck check)
        self.served = 0   # answers written
        self.answering: Cycle | None = None  # the cycle with the app
        self.unsent = 0    # answer bytes written and not yet sent by the transport (counted in the budget)
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
