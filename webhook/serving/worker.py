"""A gunicorn worker that slow or stalled clients cannot starve (SPEC 7).

Gunicorn stays the process manager; this worker replaces `gthread`, where a connection held a thread from
accept to response, so eight clients that sent three bytes and stalled held every thread. Here one event
loop per worker (uvloop's when installed) does all the waiting, and the app only sees whole requests:

- TLS from an accepted socket's first byte, under the handshake deadline, with the context gunicorn's
  `ssl_context` hook answers for this connection (reloaded certificates, client certificates);
- HTTP/1.1 (webhook.serving.connection) framed by one httptools (llhttp, strict) parser per connection, under a
  deadline from a request's first byte (the first request's: from the handshake's end) to its last; heads
  bounded by gunicorn's limit_request_* settings and HEAD_LIMIT, bodies by max_body (413, answered at the head, the
  body then dropped as it comes: the client reads the answer); every request byte one worker holds, heads
  included, by max_body_in_flight (webhook.serving.room: 503). The API server sends Content-Length bodies and
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
import socket
import sys
from collections.abc import Callable

from gunicorn import sock as gunicorn_sock
from gunicorn.workers import base

from ..process import metrics
from .connection import AnswerPhase, Connection, Phase
from .listener import Site, WorkerOptions
from .room import BUDGET, Room
from .wsgi import AppThreads

ACCEPT_PAUSE = 0.002            # after each accept, the next connection is left to the other workers this long
SWEEP_EVERY = 0.25              # deadlines are checked this often: a connection is closed at most this late
METRICS_THREADS = 2             # /metrics is answered on threads of its own (it may wait on the API server's reviews)
METRICS_WAITING = 8             # ... with at most this many scrapes queued or running; past that, 503 at once


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop (a dependency), or asyncio's with DISPATCH_ADMISSION_LOOP=asyncio (to tell a fault of
    uvloop's from ours)."""
    if os.environ.get("DISPATCH_ADMISSION_LOOP", "") == "asyncio":
        return asyncio.new_event_loop()
    import uvloop

    return uvloop.new_event_loop()


class Worker(base.Worker):
    """The gunicorn worker class: `worker_class = "webhook.serving.worker.Worker"`."""

    def __init__(self, *args: object, **kwargs: object):
        super().__init__(*args, **kwargs)
        self.loop: asyncio.AbstractEventLoop  # made after the fork (init_process)
        self.connections: set[Connection] = set()
        self.listening: list[socket.socket] = []
        self.quick = False  # SIGQUIT or SIGINT: stop now
        self.tasks: set[asyncio.Task[None]] = set()  # held until done (the loop keeps only weak references)
        self.options: WorkerOptions = getattr(self.app, "worker_options", None) or WorkerOptions()
        self.room = Room(self.options.max_body_in_flight or BUDGET)

    def init_process(self) -> None:  # gunicorn calls it after fork
        self.loop = new_event_loop()
        asyncio.set_event_loop(self.loop)
        super().init_process()

    def init_signals(self) -> None:
        for s in self.SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        handlers: list[tuple[signal.Signals, Callable[[], object]]] = [
            (signal.SIGTERM, self._stop),
            (signal.SIGQUIT, self._quick),
            (signal.SIGINT, self._quick),
            (signal.SIGUSR1, self.log.reopen_files),
            (signal.SIGWINCH, lambda: None),
            (signal.SIGABRT, self._abort),
        ]
        for s, handler in handlers:
            self.loop.add_signal_handler(s, handler)

    def _stop(self) -> None:
        self.alive = False

    def _quick(self) -> None:
        self.alive = False
        self.quick = True
        self.cfg.worker_int(self)

    def _abort(self) -> None:
        self.alive = False
        self.cfg.worker_abort(self)
        sys.exit(1)

    def load_wsgi(self) -> None:
        super().load_wsgi()
        ops = self.options.metrics_address and hasattr(self.app, "metrics_app")
        self.metrics_wsgi = self.app.metrics_app() if ops else None

    def run(self) -> None:
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

    async def _serve(self) -> None:
        for listener in self.sockets:
            site = self._site(listener.sock)
            listener.sock.setblocking(False)
            self.loop.add_reader(listener.sock.fileno(), self._accept, listener.sock, site)
            self.listening.append(listener.sock)
        stuck_after = max(self.timeout, 1)
        families = metrics.get()
        while self.alive:
            families.request_bytes_held.set(self.room.used)
            families.request_bytes_held_peak.set(self.room.peak)
            if not self._sweep(self.loop.time(), stuck_after):
                self.notify()  # a request with the app past the worker timeout stops this: the master replaces us
            if self.ppid != os.getppid():
                self.log.info("Parent changed, shutting down: %s", self)
                break
            if self.nr >= self.max_requests:
                self.log.info("Autorestarting worker after current request.")
                break
            await asyncio.sleep(SWEEP_EVERY)
        await self._shutdown()

    def _site(self, sock: socket.socket) -> Site:
        """What a listener's connections share: the metrics address is served by metrics_app() (in plain HTTP
        unless given a TLS context), every other listener by the application."""
        want = self.options.metrics_address
        try:
            host, port = sock.getsockname()[:2]
        except (OSError, ValueError):
            host, port = "", 0
        ops = bool(want and port == want[1] and (host == want[0] or want[0] in ("", "0.0.0.0", "::", "localhost")))
        if ops and self.metrics_wsgi is not None:
            return Site(self, self.metrics_wsgi, self.options.metrics_tls, host, port, bodies=False)
        tls = self._ssl_context if self.cfg.is_ssl else None
        return Site(self, self.wsgi, tls, host, port)

    def _ssl_context(self) -> object:
        """The context gunicorn's `ssl_context` hook answers, for each connection (reloaded certificates)."""
        return gunicorn_sock.ssl_context(self.cfg)

    def _accept(self, sock: socket.socket, site: Site) -> None:
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

    def _pause_accepting(self, sock: socket.socket, site: Site, seconds: float) -> None:
        self.loop.remove_reader(sock.fileno())
        self.loop.call_later(seconds, self._resume_accepting, sock, site)

    def _resume_accepting(self, sock: socket.socket, site: Site) -> None:
        if self.alive:
            self.loop.add_reader(sock.fileno(), self._accept, sock, site)

    async def _connected(self, sock: socket.socket, site: Site) -> None:
        conn = Connection(site)
        if not self.admit(conn):
            return sock.close()
        # The handshake counts against worker_connections and can be evicted or closed at shutdown
        # (cancelling this task), under a backstop deadline beside the loop's own.
        conn.handshake = asyncio.current_task()
        conn.deadline = self.loop.time() + site.options.handshake_timeout + 1
        tls: dict[str, object] = {}
        if site.tls:
            tls = {"ssl": site.tls(), "ssl_handshake_timeout": site.options.handshake_timeout,
                   "ssl_shutdown_timeout": site.options.request_timeout}
        try:
            await self.loop.connect_accepted_socket(lambda: conn, sock, **tls)  # type: ignore[arg-type]
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
            conn.settle()  # answer bytes the transport has sent since: given back to the budget
            if (conn.deadline and now >= conn.deadline) or (conn.write_deadline and now >= conn.write_deadline):
                conn.expire(now)
            elif conn.phase is Phase.BUSY and now - conn.since > stuck_after and not self._aside(conn):
                stuck = True
        if stuck:
            self.log.error("a request has been with the application for over %ss: not reporting alive", stuck_after)
        return stuck

    @staticmethod
    def _aside(conn: Connection) -> bool:
        """The connection's request is with the metrics threads (a scrape may wait: never the worker stuck)."""
        return conn.answering is not None and conn.answering.answer_phase is AnswerPhase.ASIDE

    def readers(self) -> list[Connection]:
        """The connections, for the room to find the requests being read that may give way."""
        return list(self.connections)

    def admit(self, conn: Connection) -> bool:
        """Room for one more connection (gunicorn's worker_connections). At the limit the longest-idle
        keep-alive connection gives way, else the waiting one nearest its deadline (handshake or request
        not complete: the likeliest staller); connections with the app are never dropped."""
        if len(self.connections) >= self.cfg.worker_connections:
            idle = [c for c in self.connections if c.phase is Phase.IDLE]
            waiting = [c for c in self.connections if c.phase in (Phase.HANDSHAKE, Phase.READING) and c.deadline]
            if idle:
                min(idle, key=lambda c: c.since).close()
            elif waiting:
                min(waiting, key=lambda c: c.deadline).close(abort=True)
            else:
                return False
        self.connections.add(conn)
        return True

    async def _shutdown(self) -> None:
        for sock in self.listening:
            self.loop.remove_reader(sock.fileno())  # no new connections here; other workers go on accepting
        deadline = self.loop.time() + (0 if self.quick else self.cfg.graceful_timeout)
        while True:
            for conn in list(self.connections):
                if conn.phase in (Phase.IDLE, Phase.HANDSHAKE):
                    conn.close()
                elif conn.deadline and self.loop.time() >= conn.deadline:
                    conn.expire(self.loop.time())
            if not self.connections or self.quick or self.loop.time() >= deadline:
                break
            self.notify()
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            conn.close(abort=True)
