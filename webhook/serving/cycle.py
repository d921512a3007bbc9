"""One request and its answer on a connection (webhook.serving.connection), as uvicorn's `RequestResponseCycle`
beside its `HttpToolsProtocol`: the body kept (or dropped) as it comes, the parsed form's bound taken from the
worker's budget before the app parses it, the request handed to the app (on the loop, its threads, or the
threads its site sets aside), and its answer written. A review path (the site's `reviews`) gets the method,
Content-Type and body alone; any other path a WSGI environ.

A cycle has a `BodyPhase` (its body kept, dropped, or received to its end) and an `AnswerPhase` (waiting, with
the app, answered). What it holds in the worker's budget (webhook.serving.room) is `held`: room for its answer
(room.ANSWER, from its first byte), its head, its body as received, then its parsed form's bound. Its answer
is counted in place of all that (room.Room.answer), then by the connection until the transport has sent it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from ..process import metrics
from ..process.blocking import NoBlocking
from .codec import parsed_bound
from .room import ANSWER
from .wsgi import INTERNAL, JSON, close_result, error_answer, error_body, request_environ, response_head

if TYPE_CHECKING:
    from .listener import ReviewPaths, Site

INLINE_LIMIT = 64 * 1024  # a review body up to this size is answered on the loop (a larger one on a thread)


class BodyPhase(enum.Enum):
    """What becomes of a request's body as it comes."""

    KEEPING = enum.auto()   # its bytes kept for the app (counted in the worker's budget)
    DROPPING = enum.auto()  # over max_body (413 from the app) or no room (503 here): its bytes dropped
    RECEIVED = enum.auto()  # read (or dropped) to its end


class AnswerPhase(enum.Enum):
    """Where a request is on its way to its answer."""

    WAITING = enum.auto()   # being read, or ready and waiting for the app
    WITH_APP = enum.auto()  # with the app, on the loop or its threads (or answered here)
    ASIDE = enum.auto()     # with the site's threads set aside (/metrics): never counts as the worker stuck
    ANSWERED = enum.auto()  # its answer written


class Cycle:
    """A request whose head has been read, its body (kept unless over the limit) following, and its answer.
    `conn` is the connection (webhook.serving.connection.Connection): it frames, the cycle answers."""

    __slots__ = ("conn", "method", "target", "version", "headers", "length", "keep_alive", "refused", "body",
                 "body_phase", "answer_phase", "held", "since", "size")

    def __init__(self, conn: Any, *, method: bytes, target: bytes, version: str, headers: list[tuple[bytes, bytes]],
                 length: int, keep_alive: bool, over_limit: bool, since: float, held: int, refused: str = ""):
        self.conn = conn
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
        self.held = held    # its answer's room, head, body, parsed bound: counted in the worker's budget until answered
        self.since = since  # its first byte
        self.size = held + length  # its answer's room, head and Content-Length

    @property
    def site(self) -> Site:
        return self.conn.site

    def on_body(self, data: bytes) -> bool:
        """A piece of the body: kept when it fits in the budget (True); False when it does not (the caller
        drops the rest)."""
        if self.body_phase is BodyPhase.DROPPING:
            return True
        worker = self.site.worker
        if not worker.room.take(len(data), self.size, self.site.loop.time(), worker.readers, self.conn):
            return False
        self.held += len(data)
        self.body.append(data)
        return True

    def drop(self, why: str) -> None:
        """Answered 503 (`why`) here, after the answers before it; the rest of its body dropped as it comes."""
        self.refused = why
        self.body_phase = BodyPhase.DROPPING
        self.body = []
        self.headers = []
        self.site.worker.room.give_back(self.held - ANSWER)  # its answer's room kept for the 503
        self.held = ANSWER

    def dispatch(self) -> None:
        """To the app: answered here if refused (503: no room; 413/429: its parsed form would not fit), else on
        the loop (a small review), the app's threads, or the threads its site sets aside."""
        body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        self.body = []
        self.answer_phase = AnswerPhase.WITH_APP
        if self.refused:  # no room for its body: 503 (the client reads it while its body is dropped)
            return self._answer_here(503, self.refused)
        if body and (refusal := self._hold_parsed(body)):
            return self._answer_here(*refusal)
        site, worker = self.site, self.site.worker
        worker.nr += 1
        reviews = site.reviews
        route = reviews.paths.get(self.target.partition(b"?")[0]) if reviews is not None else None
        if route is not None:
            assert reviews is not None
            return self._review(reviews, route, body)
        env = request_environ(self.conn.environ, self.method, self.target, self.version, self.length,
                              self.headers, body)
        if site.aside(env["PATH_INFO"]):  # e.g. /metrics: may wait on the API server; threads of its own
            self.answer_phase = AnswerPhase.ASIDE
            scrapes = worker.metrics_threads
            if not scrapes.offer(self, partial(scrapes.call, site.app, env)):
                self._answer_here(503, f"{scrapes.waiting} scrapes are being answered: try again")
            return
        if site.tls and self.length <= INLINE_LIMIT:  # a small request on the loop, where it may not block
            with NoBlocking():
                answer = worker.threads.call(site.app, env)
            site.loop.call_soon(self.respond, *answer)
            return
        worker.threads.offer(self, partial(worker.threads.call, site.app, env))

    def _review(self, reviews: ReviewPaths, route: object, body: bytes) -> None:
        """A review: a small one answered here, on the loop (two thread hand-overs cost more than the review),
        where it may not block: a read it would block on (a runtime not in the cache) is made on a thread,
        which goes on with the review from there. A larger one on a thread from the start."""
        site, threads = self.site, self.site.worker.threads
        content_type = next((v for k, v in self.headers if k == b"content-type"), b"")
        if site.tls and self.length <= INLINE_LIMIT:
            with NoBlocking():
                got = reviews.begin(route, self.method, content_type, body, self.length)
            if isinstance(got, tuple):
                site.loop.call_soon(self.respond, *got)
            else:
                threads.offer(self, got)
            return
        threads.offer(self, partial(reviews.answer, route, self.method, content_type, body, self.length))

    def _hold_parsed(self, body: bytes) -> tuple[int, str] | None:
        """The bound of the body's parsed form (webhook.serving.codec.parsed_bound: four counts of its bytes,
        nothing parsed) taken from the budget; (413, why) when it could never fit beside the request's own
        bytes, (429, why) when it does not fit now, even once slow readers have given way."""
        worker = self.site.worker
        room, bound = worker.room, parsed_bound(body)
        if self.held + bound > room.cap:
            return 413, (f"this body would take up to {bound} bytes once parsed (its {len(body)} bytes as a"
                         f" JSON document, counted before parsing); this worker holds at most {room.cap} bytes"
                         " for requests: send fewer values or a shallower document")
        if not room.take(bound, self.held + bound, self.site.loop.time(), worker.readers, self.conn):
            return 429, f"no room in this worker to parse this body now ({room.full})"
        self.held += bound
        return None

    def _answer_here(self, code: int, why: str) -> None:
        metrics.get().bad_requests.labels(str(code)).inc()
        status = {413: "413 Content Too Large", 429: "429 Too Many Requests"}.get(code, "503 Service Unavailable")
        headers = JSON + [("Retry-After", "1")] if code == 429 else JSON
        self.site.loop.call_soon(self.respond, status, headers, error_body(code, why))

    def respond(self, status: str, headers: list[tuple[str, str]], body: bytes,
                close: Callable[[], object] | None = None) -> None:
        """On the loop, with the app's answer: written and counted in place of what the request held (a 503
        instead when it is larger and the difference does not fit), then the app's result closed, then the
        connection goes on."""
        conn, log = self.conn, self.site.worker.log
        if conn.closed:
            close_result(close, log)
            return
        self.answer_phase = AnswerPhase.ANSWERED
        keep = self.keep_alive and self.site.worker.alive
        try:
            try:
                head = response_head(status, headers, len(body), keep)
            except ValueError as e:  # a header no HTTP/1.1 message can carry: a fault of the app's
                log.error("the application's answer cannot be sent: %s", e)
                keep, body = False, INTERNAL
                head = response_head("500 Internal Server Error", JSON, len(INTERNAL), keep)
            answer = head + body if body and self.method != b"HEAD" else head
            room, worker = self.site.worker.room, self.site.worker
            if not room.answer(self, len(answer), self.site.loop.time(), worker.readers, conn):
                metrics.get().bad_requests.labels("503").inc()
                answer = error_answer(503, f"no room in this worker to hold this answer of {len(answer)} bytes"
                                      f" until it is sent ({room.full})", keep, self.held)
                room.answer(self, len(answer), self.site.loop.time(), worker.readers, conn)  # fits in its room
            conn.send(answer)
        finally:
            close_result(close, log)
        conn.answered(self, keep)
