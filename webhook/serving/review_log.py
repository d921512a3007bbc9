"""The review log: one JSON line per review on stderr, off the event loop."""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from collections import deque

from ..process import metrics


class ReviewLog:
    """One JSON line per review on stderr, written by a thread of its own.

    Not through `logging`: its handler lock and LogRecord cost as much as the review itself under load
    (measured with py-spy). `write` runs on the worker's event loop (in the review's close()): it only
    appends the line to a bounded queue, so a stderr that stops taking lines (a pipe nobody reads) never
    blocks the loop; while the queue is full, lines are dropped and counted
    (dispatch_admission_log_dropped_total). The writer wakes when lines arrive, lets more gather for
    LINGER seconds (a wake-up per line costs more than the line), and writes them in batches of whole
    lines under PIPE_BUF bytes: such a write is atomic, so lines from workers never interleave.
    """

    MAX_LINE = 4000
    QUEUED = 1000   # lines waiting for stderr, at most (4 MB at the longest)
    LINGER = 0.02
    BATCH = 4096    # PIPE_BUF on Linux

    def __init__(self, enabled: bool, fd: int = 2, queued: int = QUEUED):
        self.enabled, self.fd, self.queued = enabled, fd, queued
        self.lines: deque[bytes] = deque()
        self.waiting = threading.Event()
        self.dropped = metrics.get().log_dropped
        self.writer: threading.Thread | None = None
        self.idle = True  # the writer has nothing in hand
        self.starting = threading.Lock()

    def write(self, fields: dict) -> None:
        line = json.dumps(fields, separators=(", ", ": "))
        if len(line) > self.MAX_LINE:
            fields = {**fields, "message": fields.get("message", "")[: self.MAX_LINE // 2] + "..."}
            line = json.dumps(fields, separators=(", ", ": "))[: self.MAX_LINE]
        if self.writer is None:  # started on first use: in the worker, after fork
            with self.starting:
                if self.writer is None:
                    self.writer = threading.Thread(target=self._write, name="review-log", daemon=True)
                    self.writer.start()
                    atexit.register(self.drain)
        if len(self.lines) >= self.queued:
            self.dropped.inc()
            return
        self.lines.append(line.encode() + b"\n")
        if not self.waiting.is_set():
            self.waiting.set()

    def _write(self) -> None:
        lines = self.lines
        while True:
            self.idle = True
            self.waiting.wait()
            self.idle = False
            time.sleep(self.LINGER)
            self.waiting.clear()
            batch = b""
            while lines:
                line = lines.popleft()
                if len(batch) + len(line) > self.BATCH:
                    self._out(batch)
                    batch = b""
                batch += line
            self._out(batch)

    def drain(self, timeout: float = 1.0) -> None:
        """At the worker's exit: the lines still queued written, waiting at most `timeout` (stderr may be stalled)."""
        deadline = time.monotonic() + timeout
        self.waiting.set()
        while (self.lines or not self.idle) and time.monotonic() < deadline:
            time.sleep(0.005)

    def _out(self, data: bytes) -> None:
        try:
            if data:
                os.write(self.fd, data)
        except OSError:
            pass  # stderr gone: never fail a review over a log line
