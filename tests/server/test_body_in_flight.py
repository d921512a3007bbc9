"""Request bytes a worker holds at once are capped (issue 25, item 1; issue 33, item 4; webhook/room.py).

Against the real server process (one worker, so every connection meets the same count) over TLS on
loopback: a large review being read holds its head and its Content-Length, and a second large one that does
not fit beside it is refused 503 (its body read and dropped); a small review still gets in; a stalled body
gives way to a newcomer; the room comes back exactly (heads counted by their size) once requests are
answered or their clients go; the metrics port takes no body at all. tests/server/test_held_bytes.py floods
the room with heads and small bodies.
"""

from __future__ import annotations

import json
import socket
import ssl
import time

import pytest
import requests

from tests.helpers import EXAMPLES, review, trainjob
from tests.process import free_port, webhook_server
from webhook.room import PATIENCE

SETTINGS = str(EXAMPLES / "settings" / "route1.json")
RUNTIME_ARGS = [a for p in sorted((EXAMPLES / "runtimes").glob("*.yaml")) for a in ("--runtime", str(p))]
MAX_BODY = 2_000_000
IN_FLIGHT = 3_000_000  # room for one body of MAX_BODY, not two


def large_review() -> bytes:
    """A TrainJob review padded with an annotation to just under MAX_BODY."""
    doc = review(trainjob())
    doc["request"]["object"]["metadata"]["annotations"] = {"example.com/pad": ""}
    pad = MAX_BODY - 1000 - len(json.dumps(doc))
    doc["request"]["object"]["metadata"]["annotations"]["example.com/pad"] = "x" * pad
    return json.dumps(doc).encode()


def head(length: int) -> bytes:
    return (f"POST /validate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def read_status(sock: ssl.SSLSocket) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ", 2)[1]), data


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    metrics_port = free_port()
    with webhook_server(tmp_path_factory.mktemp("in-flight"), "--settings", SETTINGS, *RUNTIME_ARGS,
                        "--workers", "1", "--max-body", str(MAX_BODY), "--max-body-in-flight", str(IN_FLIGHT),
                        "--metrics-bind", f"127.0.0.1:{metrics_port}", "--read-timeout", "20",
                        "--log-level", "warning") as (base, ca, log, proc):
        yield base, ca, metrics_port


def connect(server, request) -> ssl.SSLSocket:
    base, ca, _ = server
    ctx = ssl.create_default_context(cafile=ca)
    sock = ctx.wrap_socket(socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])), timeout=20),
                           server_hostname="127.0.0.1")
    request.addfinalizer(sock.close)  # a failure must not leave it holding the worker's room
    return sock


def post_large(server, body: bytes) -> requests.Response:
    base, ca, _ = server
    return requests.post(base + "/validate", data=body, headers={"Content-Type": "application/json"}, verify=ca,
                         timeout=20)


def test_bodies_over_the_in_flight_cap_are_503_until_room_is_made(server, request):
    base, ca, _ = server
    body = large_review()
    assert len(body) <= MAX_BODY and 2 * len(body) > IN_FLIGHT
    # Connected (handshakes done) first, so the heads below reach the worker together.
    first, second, mid = (connect(server, request) for _ in range(3))

    # The first large review: its head and most of its body (the worker holds its length; sent this fast,
    # it keeps its room for a second, its patience)...
    first.sendall(head(len(body)) + body[:-1000])
    # ... and a mid-size body that still fits beside it, stalled: the room is full (10 bytes left).
    left = IN_FLIGHT - len(head(len(body))) - len(body) - 10
    mid.sendall(head(left - len(head(left))) + b"{")
    # A second large one does not fit (the stalled one giving way would not make room enough): 503 at its
    # head, with a JSON error naming the cap.
    second.sendall(head(len(body)))
    status, data = read_status(second)
    assert status == 503, data[:300]
    assert f"over {IN_FLIGHT} bytes of requests in flight".encode() in data
    # Its body is dropped as it comes (not held), then the connection serves the next request: a client
    # sending its whole body before it reads is not reset under the answer.
    second.sendall(body)
    small = json.dumps(review(trainjob())).encode()
    second.sendall(head(len(small)) + small)
    status, data = read_status(second)
    assert status == 200, data[:300]
    # That small review got in: the stalled mid-size body gave way to it (answered 503), so a client stalling
    # large bodies cannot turn the API server's usual reviews away.
    status, data = read_status(mid)
    assert status == 503 and b"this worker's room for requests" in data, data[:300]
    small = requests.post(base + "/validate", json=review(trainjob()), verify=ca, timeout=20)
    assert small.status_code == 200 and small.json()["response"]["uid"] == "uid-1"

    # The first is answered in full once its body is in; with the mid-size one gone, a large review fits.
    first.sendall(body[-1000:])
    status, data = read_status(first)
    assert status == 200, data[:300]
    mid.close()
    first.close()
    time.sleep(0.5)
    assert post_large(server, body).status_code == 200


def test_a_stalled_body_gives_way_to_a_newcomer(server, request):
    """A client that declares a large body and stalls cannot hold the room: read slower than the minimum
    rate (or for longer than the patience), it is answered 503 (the rest of its body dropped) to make room
    for the next large review."""
    body = large_review()
    staller = connect(server, request)
    staller.sendall(head(len(body)) + body[:1000])
    time.sleep(PATIENCE / 2)
    r = post_large(server, body)
    assert r.status_code == 200, r.text[:300]
    status, data = read_status(staller)  # answered, not reset: every client gets an answer
    assert status == 503 and b"this worker's room for requests" in data, data[:300]


def test_the_room_comes_back_exactly(server, request):
    """Clients that go away mid-body, and answered requests, leave nothing counted: a request of exactly the
    cap fits afterwards, heads counted by their size (one byte counted too many would refuse it, and the
    holder would give way to it)."""
    body = large_review()
    for _ in range(3):
        gone = connect(server, request)
        gone.sendall(head(len(body)) + body[:1000])
        time.sleep(0.2)
        gone.close()
    assert post_large(server, body).status_code == 200
    time.sleep(0.5)
    holder, exact = connect(server, request), connect(server, request)
    holder.sendall(head(len(body)) + body[:1000])
    rest = IN_FLIGHT - len(head(len(body))) - len(body)  # what the holder leaves
    length = rest - len(head(rest))
    assert len(head(length)) == len(head(rest))
    exact.sendall(head(length))  # fits only if nothing else is counted
    holder.sendall(body[1000:])
    assert read_status(holder)[0] == 200
    exact.sendall(b"x" * length)
    status, data = read_status(exact)
    assert status == 400 and b"JSON" in data, data[:300]  # read whole and answered (not JSON), not refused 503


def test_the_metrics_port_takes_no_body(server):
    """The metrics port is open to the namespaces Prometheus runs in: a body there is refused at its head
    and holds no room."""
    _, _, metrics_port = server
    with socket.create_connection(("127.0.0.1", metrics_port), timeout=20) as plain:
        plain.sendall(b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 400000\r\n\r\n")
        status, data = read_status(plain)
    assert status == 413 and b"no request body" in data, data[:300]
    assert post_large(server, large_review()).status_code == 200
