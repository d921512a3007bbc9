"""What the connections of one listener share (`Site`), and what they read of the worker that serves them
(`Host`, which `webhook.serving.worker.Worker` is): the connections never import the worker."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .room import Room
from .wsgi import Answer, AppThreads, WSGIApp

DEFAULT_READ_TIMEOUT = 5.0          # seconds for the TLS handshake, and for a whole request (SPEC 7)
DEFAULT_MAX_BODY = 7 * 1024 * 1024  # two 3 MiB objects (an UPDATE carries old and new) and the envelope
ASIDE = frozenset({"/metrics"})  # paths answered on threads of their own: /metrics judges every runtime and may
                                 # wait on the API server (--metrics-auth), never holding the reviews' threads


@dataclass(frozen=True, kw_only=True)
class WorkerOptions:
    handshake_timeout: float = DEFAULT_READ_TIMEOUT  # accept to end of the TLS handshake
    request_timeout: float = DEFAULT_READ_TIMEOUT    # first byte of a request to its last
    max_body: int = DEFAULT_MAX_BODY
    max_body_in_flight: int = 0  # the worker's budget (webhook.serving.room); 0: room.BUDGET
    metrics_address: tuple[str, int] | None = None   # a listener served by metrics_app(), in plain HTTP or:
    metrics_tls: Callable[[], object] | None = None  # in HTTPS with the SSLContext this answers


class ReviewPaths(Protocol):
    """Paths a site's app answers outside WSGI (webhook.serving.app.Reviews): the cycle hands each request for
    one of `paths` to `begin` as its method, Content-Type and body; what comes back is its answer, or the rest
    of the work to run on a thread (a read that may block), or, from `answer`, made where blocking is allowed."""

    paths: dict[bytes, Any]

    def begin(self, route: Any, method: bytes, content_type: bytes, body: bytes,
              length: int) -> Answer | Callable[[], Answer]: ...

    def answer(self, route: Any, method: bytes, content_type: bytes, body: bytes, length: int) -> Answer: ...


class Host(Protocol):
    """What a listener's connections read of their worker."""

    alive: bool  # False: finish what is under way, take nothing new
    connections: set[Any]  # every open connection (webhook.serving.connection.Connection)
    log: Any  # gunicorn's logger
    room: Room  # request bytes held at once
    loop: asyncio.AbstractEventLoop
    cfg: Any  # gunicorn's configuration
    options: WorkerOptions
    nr: int  # requests served (gunicorn's max_requests counts them)
    threads: AppThreads  # the application's
    metrics_threads: AppThreads  # /metrics's own (a scrape may wait on the API server)

    def readers(self) -> list[Any]:
        """The connections, for the room to find the requests being read that may give way."""
        ...


class Site:
    """What the connections of one listener share."""

    def __init__(self, worker: Host, app: WSGIApp, tls: Callable[[], object] | None, host: str, port: int,
                 bodies: bool = True):
        self.worker = worker
        self.app = app
        self.tls = tls
        self.loop: asyncio.AbstractEventLoop = worker.loop
        self.cfg = worker.cfg
        self.options = worker.options
        self.bodies = bodies  # False on the metrics listener: it takes no request body
        self.aside_paths = ASIDE
        self.reviews: ReviewPaths | None = getattr(app, "reviews", None)  # the app's paths served without WSGI
        self.keepalive = float(self.cfg.keepalive)
        self.base_environ = {
            "SCRIPT_NAME": "", "SERVER_NAME": str(host), "SERVER_PORT": str(port), "wsgi.version": (1, 0),
            "wsgi.url_scheme": "https" if tls else "http", "wsgi.errors": sys.stderr, "wsgi.multithread": True,
            "wsgi.multiprocess": self.cfg.workers > 1, "wsgi.run_once": False, "wsgi.input_terminated": True}

    def aside(self, path: str) -> bool:
        """The routing choice the connections make: a path answered on the threads set aside for it."""
        return path in self.aside_paths
