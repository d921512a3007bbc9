"""The app side of the worker (webhook.serving.worker): threads that run a WSGI app on whole requests, the app's
result read per PEP 3333 (its close() handed back, to be called once the answer is written), and the
HTTP/1.1 response head the worker writes for it.
"""

from __future__ import annotations

import asyncio
import io
import json
import queue
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote_to_bytes

WSGIApp = Callable[[dict, Callable], Any]
Answer = tuple[str, list, bytes, Callable[[], object] | None]  # status, headers, body, the result's close()
Job = Callable[[], Answer]  # what an app thread runs: a WSGI call, or the rest of a review


def error_body(code: int, message: str) -> bytes:
    """The JSON error every refusal carries, the worker's and the app's: {"error": ..., "code": ...}."""
    return json.dumps({"error": message, "code": code}, separators=(",", ":")).encode()


def request_environ(base: dict, method: bytes, target: bytes, version: str, length: int,
                    headers: list[tuple[bytes, bytes]], body: bytes) -> dict:
    """The WSGI environ of one whole request (PEP 3333), from the connection's `base`."""
    env = base.copy()
    path, _, query = target.partition(b"?")
    env["REQUEST_METHOD"] = method.decode("ascii")
    env["PATH_INFO"] = unquote_to_bytes(path).decode("latin-1")
    env["QUERY_STRING"] = query.decode("latin-1")
    env["RAW_URI"] = target.decode("latin-1")
    env["SERVER_PROTOCOL"] = "HTTP/" + version
    env["CONTENT_LENGTH"] = str(length)
    for name, value in headers:
        if b"_" in name:  # ambiguous with '-' once in the environ: dropped, as gunicorn does
            continue
        if name == b"content-type":
            env["CONTENT_TYPE"] = value.decode("latin-1")
        elif name != b"content-length":
            key = "HTTP_" + name.decode("latin-1").upper().replace("-", "_")
            text = value.decode("latin-1")
            env[key] = env[key] + "," + text if key in env else text
    env["wsgi.input"] = io.BytesIO(body)
    return env


JSON = [("Content-Type", "application/json")]
INTERNAL = error_body(500, "internal error")
REASONS = {400: "Bad Request", 411: "Length Required", 413: "Content Too Large", 414: "URI Too Long",
           429: "Too Many Requests", 431: "Request Header Fields Too Large", 503: "Service Unavailable",
           505: "HTTP Version Not Supported"}
_HOP_BY_HOP = frozenset(("connection", "keep-alive", "transfer-encoding", "content-length"))


def response_head(status: str, headers: list[tuple[str, str]], length: int, keep: bool) -> bytes:
    """The response head, written by the worker: the app's headers are checked for what could split the
    response (CR, LF) and framing is the worker's (Content-Length, Connection) whatever the app said."""
    lines = ["HTTP/1.1 ", status, "\r\n"]
    for name, value in headers:
        if name.lower() in _HOP_BY_HOP:
            continue
        if "\n" in value or "\r" in value or "\n" in name or "\r" in name or ":" in name:
            raise ValueError(f"header {name[:40]!r} has a line break or a colon")
        lines += (name, ": ", value, "\r\n")
    lines.append(f"Content-Length: {length}\r\n\r\n" if keep
                 else f"Content-Length: {length}\r\nConnection: close\r\n\r\n")
    return "".join(lines).encode("latin-1")


class AppThreads:
    """The threads that run the app, fed whole requests through a queue (each a `Job`); answers go back to the
    loop."""

    def __init__(self, n: int, loop: asyncio.AbstractEventLoop, log, name: str = "app", waiting: int = 0):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.loop, self.log = loop, log
        self.waiting, self.pending = waiting, 0  # requests queued or running: at most `waiting` (0: no limit)
        self.threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(max(1, n))]
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        for _ in self.threads:
            self.queue.put(None)

    def offer(self, conn, job: Job) -> bool:
        """On the loop: the request's job queued for the threads (its answer to conn.respond, on the loop), or
        False when `waiting` requests are already queued or running."""
        if self.waiting and self.pending >= self.waiting:
            return False
        self.pending += 1
        self.queue.put((conn, job))
        return True

    def _answered(self, conn, answer: Answer) -> None:
        self.pending -= 1
        conn.respond(*answer)

    def _run(self):
        get, call_soon = self.queue.get, self.loop.call_soon_threadsafe
        while (item := get()) is not None:
            conn, job = item
            try:
                answer = job()
            except Exception:  # a fault of the job's own (a WSGI call answers its app's faults itself)
                self.log.exception("Error handling a request")
                answer = "500 Internal Server Error", JSON, INTERNAL, None
            try:
                call_soon(self._answered, conn, answer)  # closed on the loop, once written
            except RuntimeError:  # the loop is closed: the worker is exiting
                close_result(answer[3], self.log)
                return

    def call(self, app: WSGIApp, environ: dict) -> Answer:
        """Run the app on the caller's thread: (status, headers, body, close), where `close` is the result's
        (PEP 3333: called once the request is complete), to be called on the loop after the answer is
        written, so the app's after-work (metrics, the log line) is off the client's clock."""
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
        except Exception:
            close_result(close, self.log)
            self.log.exception("Error handling request %s", environ.get("PATH_INFO"))
            return "500 Internal Server Error", JSON, INTERNAL, None


def close_result(close: Callable[[], object] | None, log) -> None:
    """Call a WSGI result's close(); its faults are logged, never raised into the loop or a thread."""
    if close is not None:
        try:
            close()
        except Exception:
            log.exception("Error closing a response")


def error_answer(code: int, message: str, keep: bool, limit: int) -> bytes:
    """A refusal of the worker's, head and body, in at most `limit` bytes (its room in the worker's budget,
    webhook.serving.room.ANSWER): the message cut to the longest start that fits (found by halving: a
    character takes 1 to 12 bytes once escaped)."""
    headers = JSON + [("Retry-After", "1")] if code == 429 else JSON
    status = f"{code} {REASONS.get(code, 'Bad Request')}"

    def answer(n: int) -> bytes:
        body = error_body(code, message[:n])
        return response_head(status, headers, len(body), keep) + body

    fits, over = 0, len(message) + 1
    if len(answer(len(message))) <= limit:
        fits = len(message)
    while over - fits > 1 and fits < len(message):
        n = (fits + over) // 2
        fits, over = (n, over) if len(answer(n)) <= limit else (fits, n)
    if len(answer(fits)) > limit:
        raise ValueError(f"a refusal of code {code} cannot fit in {limit} bytes")
    return answer(fits)
