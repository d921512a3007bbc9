"""Request bytes a worker holds at once are capped (issue 25, item 1; issue 33, item 4; issue 47;
webhook/serving/room.py).

Against the real server process (one worker, so every connection meets the same count) over TLS on
loopback, with a room for one large review whole (its answer's room, head, body and parsed bound) and a
little more: a large review being read holds its answer's room, its head and the body bytes received, and a
second large one that could not fit beside it and two bodies filling the rest is refused 503 at its head
(its body read and dropped); a small review still gets in, a stalled filler giving way; a stalled body gives
way to a newcomer that could not be parsed beside it; the room counts exactly and comes back exactly once
requests are answered or their clients go; the metrics port takes no body at all.
tests/server/test_held_bytes.py floods the room with heads and small bodies.
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
from webhook.serving.room import ANSWER, PATIENCE

MAX_BODY = 2_000_000


def large_review(size: int = MAX_BODY - 1000) -> bytes:
    """A TrainJob review padded with an annotation to `size` bytes (by default just under MAX_BODY)."""
    doc = review(trainjob())
    doc["request"]["object"]["metadata"]["annotations"] = {"example.com/pad": ""}
    pad = size - len(json.dumps(doc))
    doc["request"]["object"]["metadata"]["annotations"]["example.com/pad"] = "x" * pad
    return json.dumps(doc).encode()


def head(length: int) -> bytes:
    return (f"POST /validate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


BODY = large_review()
WHOLE = ANSWER + len(head(len(BODY))) + len(BODY) + parsed_bound(BODY)  # what one large review holds at most
IN_FLIGHT = WHOLE + 4096  # room for one large review whole (with a client's longer head), not for a second beside it
SCRAPE = 64 * 1024  # room for a scrape of /metrics and its answer (held() scrapes: it must not make anyone give way)


def filler(held: int) -> bytes:
    """A body that will not be sent whole (its last byte missing), its request holding exactly `held` bytes."""
    sent = held - ANSWER - len(head(held))
    sent += held - ANSWER - len(head(sent + 1)) - sent  # its Content-Length may have a digit fewer than `held`
    data = head(sent + 1) + b"{" * sent
    assert ANSWER + len(data) == held, (held, len(data))
    return data


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
    body = BODY
    assert len(body) <= MAX_BODY and WHOLE <= IN_FLIGHT < WHOLE + ANSWER + len(head(len(body))) + len(body)
    # Connected (handshakes done) first, so the heads below reach the worker together.
    first, second, slower, faster = (connect(server, request) for _ in range(4))

    # The first large review: its head and all but the last 1,000 bytes of its body (sent this fast, it
    # keeps its room for a second, its patience)...
    first.sendall(head(len(body)) + body[:-1000])
    # ... and two bodies that fit beside it, each sent but for its last byte: the room is full but for the
    # answer's room and head of two requests, and a scrape. Each filler holds less than the first (so reads
    # slower), one less than the other: the slower gives way first.
    assert 2 * len(server.metrics()) < SCRAPE
    spare = 2 * (ANSWER + len(head(len(body)))) + SCRAPE
    rest = IN_FLIGHT - spare - (ANSWER + len(head(len(body))) + len(body) - 1000)
    slower.sendall(filler(rest * 45 // 100))
    faster.sendall(filler(rest - rest * 45 // 100))
    full = IN_FLIGHT - spare
    eventually(lambda: held(server) == full, f"{full} bytes held", detail=lambda: str(held(server)))
    # A second large one could not fit (all are read fast, and not for long: none gives way): 503 at its
    # head, with a JSON error naming the cap.
    second.sendall(head(len(body)))
    status, data = read_status(second)
    assert status == 503, data[:300]
    assert f"over {IN_FLIGHT} bytes of requests in flight".encode() in data
    # Its body is dropped as it comes (not held), then the connection serves the next request: a client
    # sending its whole body before it reads is not reset under the answer. Past the patience, the slower
    # stalled filler gives way to that small review (which cannot be read and parsed in what is spare), so
    # a client stalling large bodies cannot turn the API server's usual reviews away.
    time.sleep(PATIENCE)
    second.sendall(body)
    small = large_review(64 * 1024)
    assert ANSWER + len(head(len(small))) + len(small) + parsed_bound(small) > spare
    second.sendall(head(len(small)) + small)
    status, data = read_status(second)
    assert status == 200, data[:300]
    status, data = read_status(slower)
    assert status == 503 and b"this worker's room for requests" in data, data[:300]
    small_review = requests.post(base + "/validate", json=review(trainjob()), verify=ca, timeout=20)
    assert small_review.status_code == 200 and small_review.json()["response"]["uid"] == "uid-1"

    # The first is answered in full once its body is in: its parsed bound does not fit beside the other
    # filler, which gives way too. With the fillers gone, a large review fits.
    first.sendall(body[-1000:])
    status, data = read_status(first)
    assert status == 200, data[:300]
    status, data = read_status(faster)
    assert status == 503 and b"this worker's room for requests" in data, data[:300]
    for sock in (slower, faster, first):
        sock.close()
    eventually(lambda: held(server) == 0, "nothing held")
    assert post_large(server, body).status_code == 200


def test_a_stalled_body_gives_way_to_a_newcomer(server, request):
    """A client that sends part of a large body and stalls cannot hold the room: being read for longer than
    the patience (or, past the grace, slower than the minimum rate), it is answered 503 (the rest of its
    body dropped) to make room for the next large review, which could not be parsed beside it (429)."""
    body = BODY
    staller = connect(server, request)
    part = len(body) // 2
    assert 2 * ANSWER + 2 * len(head(len(body))) + part + len(body) + parsed_bound(body) > IN_FLIGHT
    staller.sendall(head(len(body)) + body[:part])
    time.sleep(PATIENCE + 0.2)
    r = post_large(server, body)
    assert r.status_code == 200, r.text[:300]
    status, data = read_status(staller)  # answered, not reset: every client gets an answer
    assert status == 503 and b"this worker's room for requests" in data, data[:300]


def exact_request(room: int) -> bytes:
    """A request of a body that is not JSON whose answer's room, head, body and parsed bound take exactly
    `room` bytes (an X-Pad field of 0 to 3 bytes makes up what the body's length cannot)."""
    def whole(length: int, pad: int) -> int:
        return ANSWER + len(head(length)) + len(f"X-Pad: {'p' * pad}\r\n") + length + parsed_bound(b"x" * length)

    for pad in range(4):
        length = (room - whole(0, pad)) // 2
        for n in range(length - 8, length + 8):  # the head's Content-Length has more digits than whole(0)'s
            if whole(n, pad) == room:
                data = head(n).replace(b"\r\n\r\n", f"\r\nX-Pad: {'p' * pad}\r\n\r\n".encode()) + b"x" * n
                assert ANSWER + len(data) + parsed_bound(b"x" * n) == room
                return data
    raise AssertionError(f"no request takes exactly {room} bytes")


def test_the_room_counts_bytes_received_and_comes_back_exactly(server, request):
    """The room counts a request's answer's room, its head by its size and its body by the bytes received,
    not the length it declares, then its parsed bound; clients that go away mid-body, and answered requests,
    leave nothing counted, so a request that takes exactly the rest of the room is read and parsed beside
    one being read (one byte counted too many would refuse it: 503 or 429)."""
    body = BODY
    for _ in range(3):
        gone = connect(server, request)
        gone.sendall(head(len(body)) + body[:1000])
        time.sleep(0.2)  # a client that goes away mid-body, read for a moment first: not a wait
        gone.close()
    assert post_large(server, body).status_code == 200
    eventually(lambda: held(server) == 0, "nothing held")
    holder, exact = connect(server, request), connect(server, request)
    holder.sendall(head(len(body)) + body[:-1000])
    counted = ANSWER + len(head(len(body))) + len(body) - 1000
    eventually(lambda: held(server) == counted, f"the holder's {counted} bytes counted")
    exact.sendall(exact_request(IN_FLIGHT - counted))  # fits only if nothing else is counted
    status, data = read_status(exact)
    assert status == 400 and b"JSON" in data, data[:300]  # read whole, parsed and answered, not refused
    holder.sendall(body[-1000:])
    assert read_status(holder)[0] == 200
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
