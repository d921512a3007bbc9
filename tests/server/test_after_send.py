"""The worker calls a WSGI result's close() (PEP 3333) once the answer is written, not before, on its
event loop (for an answer made on an app thread too): the webhook's accounting (metrics, the review's
log line) runs there, off the API server's clock.

The app's close() waits for a file the client writes only after it has read the answer; had close()
run before the answer was written, the answer would arrive only after close() gave up waiting, and
close() leaves a mark when it gives up. No timing is asserted: only which happened first.

Each request names its own marks (the X-Mark header): only a request that names one waits, so no other
request (a readiness probe the client gave up on, still answered late under load) can block the loop
or leave a mark another test reads.
"""

from __future__ import annotations

import sys

import pytest

from tests.helpers import eventually
from tests.process import free_port, running
from tests.tls import read_response, tls_socket
from webhook import certs
from webhook.serving.cycle import INLINE_LIMIT

APP = r'''
import sys, threading, time
from pathlib import Path
from webhook import certs
from webhook.serving.application import Listening, gunicorn_application

MARKS = Path(sys.argv[3])


class Result(list):
    mark = None

    def close(self):
        if self.mark is None:  # not a test's request: nothing to wait for
            return
        released, gave_up, closed = (MARKS / f"{n}-{self.mark}" for n in ("released", "gave-up", "closed"))
        on = threading.current_thread().name  # the worker's loop runs on its main thread
        deadline = time.monotonic() + 20  # the served app's own loop (a child's program): the close() under test
        while not released.exists():
            if time.monotonic() > deadline:
                gave_up.touch()
                break
            time.sleep(0.01)
        closed.write_text(on)


def create_app():
    def app(environ, start_response):
        environ["wsgi.input"].read()
        start_response("200 OK", [("Content-Type", "application/json")])
        result = Result([b'{"ok":true}'])
        mark = environ.get("HTTP_X_MARK", "")
        result.mark = mark if mark.isalnum() else None
        return result
    return app


d = sys.argv[2]
gunicorn_application(create_app, Listening(d + "/tls.crt", d + "/tls.key", bind=sys.argv[1], workers=1),
                     tls=certs.ReloadingContext(d + "/tls.crt", d + "/tls.key")).run()
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("after-send")
    certs.write_dev_pair(tmp / "certs", ["localhost", "127.0.0.1"])
    (tmp / "app.py").write_text(APP)
    port = free_port()
    base, ca = f"https://127.0.0.1:{port}", str(tmp / "certs" / "ca.crt")
    with running([sys.executable, str(tmp / "app.py"), f"127.0.0.1:{port}", str(tmp / "certs"), str(tmp)],
                 tmp / "server.log", base + "/", ca):
        yield base, ca, tmp


@pytest.mark.parametrize("size", [100, INLINE_LIMIT + 1], ids=["answered-on-the-loop", "answered-on-a-thread"])
def test_close_runs_after_the_answer_is_written(server, size):
    base, ca, tmp = server
    mark = f"size{size}"
    released, gave_up, closed = (tmp / f"{n}-{mark}" for n in ("released", "gave-up", "closed"))
    body = b"x" * size
    with tls_socket(base, ca) as sock:
        sock.sendall(b"POST /mutate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"X-Mark: %s\r\nContent-Length: %d\r\n\r\n" % (mark.encode(), len(body)) + body)
        code, _, answer = read_response(sock, bytearray())
        assert (code, answer) == (200, b'{"ok":true}')
        assert not gave_up.exists(), "close() ran (and gave up waiting) before the answer was written"
        released.touch()
        # close() is still called
        eventually(lambda: closed.exists() and closed.read_text(), "close() was never called", 30, 0.01)
    assert not gave_up.exists()
    # on the loop, after the answer was written there: not on an app thread, racing the loop's write
    assert closed.read_text() == "MainThread"
