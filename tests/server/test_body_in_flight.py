"""Request bytes a worker holds at once are capped (issue 25, item 1; issue 33, item 4; webhook/serving/room.py).

Against the real server process (one worker, so every connection meets the same count) over TLS on
loopback: a large review being read holds its head and the body bytes received, and a second large one that
could not fit beside it is refused 503 at its head (its body read and dropped); a small review still gets in;
a stalled body gives way to a newcomer; the room counts exactly and comes back exactly once requests are
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

from tests.helpers import eventually, metric_series, review, trainjob
from tests.tls import tls_socket
from webhook.serving.codec import parsed_bound
from webhook.serving.room import PATIENCE

MAX_BODY = 2_000_000
IN_FLIGHT = 4_500_000  # room for one body of MAX_BODY with its parsed form (as much again), not two


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
def server(serve_module):
    return serve_module("--workers", "1", "--max-body", str(MAX_BODY), "--max-body-in-flight", str(IN_FLIGHT),
                        "--read-timeout", "20", "--log-level", "warning", metrics=True)


def connect(server, request) -> ssl.SSLSocket:
    sock = tls_socket(server.url, server.ca)
    sock.settimeout(20)
    request.addfinalizer(sock.close)  # a failure must not leave it holding the worker's room
    return sock


def post_large(server, body: bytes) -> requests.Response:
    return server.post("/validate", body, timeout=20)


def held(server) -> float:
    """What the worker's room counts now (sampled every 0.25 s)."""
    [value] = [v for _, v in metric_series(server.metrics(), "dispatch_admission_request_bytes_held")]
    return value


def test_bodies_over_the_in_flight_cap_are_503_until_room_is_made(server, request):
    base, ca = server.url, server.ca
    body = large_review()
    assert len(body) <= MAX_BODY and len(body) + parsed_bound(body) <= IN_FLIGHT < 2 * (len(body) + parsed_bound(body))
    # Connected (handshakes done) first, so the heads below reach the worker together.
    first, second, mid = (connect(server, request) for _ in range(3))

    # The first large review: its head and all but the last 1,000 bytes of its body (sent this fast, it
    # keeps its room for a second, its patience)...
    first.sendall(head(len(body)) + body[:-1000])
    # ... and a mid-size body that fits beside it, sent but for its last byte: the room is full but for a
    # head or two.
    small = json.dumps(review(trainjob())).encode()
    spare = 2 * len(head(len(body)))
    assert len(head(len(small))) + len(small) > spare
    left = IN_FLIGHT - len(head(len(body))) - (len(body) - 1000) - spare
    sent = left - len(head(left + 1))
    mid.sendall(head(sent + 1) + b"{" * sent)
    full = IN_FLIGHT - spare
    eventually(lambda: held(server) == full, f"{full} bytes held")
    # A second large one could not fit (both are read fast, and not for long: neither gives way): 503 at
    # its head, with a JSON error naming the cap.
    second.sendall(head(len(body)))
    status, data = read_status(second)
    assert status == 503, data[:300]
    assert f"over {IN_FLIGHT} bytes of requests in flight".encode() in data
    # Its body is dropped as it comes (not held), then the connection serves the next request: a client
    # sending its whole body before it reads is not reset under the answer. Past the patience, the
    # stalled mid-size body gives way to that small review (the slower of the two being read), so a
    # client stalling large bodies cannot turn the API server's usual reviews away.
    time.sleep(PATIENCE)
    second.sendall(body)
    second.sendall(head(len(small)) + small)
    status, data = read_status(second)
    assert status == 200, data[:300]
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
    """A client that sends part of a large body and stalls cannot hold the room: being read for longer than
    the patience (or, past the grace, slower than the minimum rate), it is answered 503 (the rest of its
    body dropped) to make room for the next large review."""
    body = large_review()
    staller = connect(server, request)
    staller.sendall(head(len(body)) + body[:IN_FLIGHT - len(body)])  # the next one cannot fit beside it
    time.sleep(PATIENCE + 0.2)
    r = post_large(server, body)
    assert r.status_code == 200, r.text[:300]
    status, data = read_status(staller)  # answered, not reset: every client gets an answer
    assert status == 503 and b"this worker's room for requests" in data, data[:300]


def test_the_room_counts_bytes_received_and_comes_back_exactly(server, request):
    """The room counts a request's head by its size and its body by the bytes received, not the length it
    declares; clients that go away mid-body, and answered requests, leave nothing counted, so a request of
    exactly the cap fits beside one being read (one byte counted too many would refuse it)."""
    body = large_review()
    for _ in range(3):
        gone = connect(server, request)
        gone.sendall(head(len(body)) + body[:1000])
        time.sleep(0.2)
        gone.close()
    assert post_large(server, body).status_code == 200
    eventually(lambda: held(server) == 0, "nothing held")
    holder, exact = connect(server, request), connect(server, request)
    holder.sendall(head(len(body)) + body[:-1000])
    counted = len(head(len(body))) + len(body) - 1000
    eventually(lambda: held(server) == counted, f"the holder's {counted} bytes counted")
    length = IN_FLIGHT - counted - len(head(IN_FLIGHT - counted))
    exact.sendall(head(length))  # fits only if nothing else is counted
    holder.sendall(body[-1000:])
    assert read_status(holder)[0] == 200
    exact.sendall(b"x" * length)
    status, data = read_status(exact)
    assert status == 400 and b"JSON" in data, data[:300]  # read whole and answered (not JSON), not refused 503
    exact.close()
    eventually(lambda: held(server) == 0, "nothing held")


def test_the_metrics_port_takes_no_body(server):
    """The metrics port is open to the namespaces Prometheus runs in: a body there is refused at its head
    and holds no room."""
    metrics_port = int(server.metrics_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", metrics_port), timeout=20) as plain:
        plain.sendall(b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 400000\r\n\r\n")
        status, data = read_status(plain)
    assert status == 413 and b"no request body" in data, data[:300]
    assert post_large(server, large_review()).status_code == 200
