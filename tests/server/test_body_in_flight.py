"""Request bodies a worker holds at once are capped (issue 25, item 1): over the cap, 503 at the head.

Against the real server process (one worker, so every connection meets the same count) over TLS on
loopback: a large review stalled mid-body holds its Content-Length; a second large one is refused 503
and closed, a small one (up to 64 KiB) is never refused, and once the first is answered the second goes
through.
"""

from __future__ import annotations

import json
import socket
import ssl
import time

import pytest
import requests

from tests.helpers import EXAMPLES, review, trainjob
from tests.process import webhook_server

SETTINGS = str(EXAMPLES / "settings" / "route1.json")
RUNTIME_ARGS = [a for p in sorted((EXAMPLES / "runtimes").glob("*.yaml")) for a in ("--runtime", str(p))]
MAX_BODY = 400_000
IN_FLIGHT = 600_000  # room for one body of MAX_BODY, not two


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
    with webhook_server(tmp_path_factory.mktemp("in-flight"), "--settings", SETTINGS, *RUNTIME_ARGS,
                        "--workers", "1", "--max-body", str(MAX_BODY), "--max-body-in-flight", str(IN_FLIGHT),
                        "--read-timeout", "20", "--log-level", "warning") as s:
        yield s


def test_bodies_over_the_in_flight_cap_are_503_until_room_is_made(server, request):
    base, ca, _, _ = server
    port = int(base.rsplit(":", 1)[1])
    ctx = ssl.create_default_context(cafile=ca)
    body = large_review()
    assert len(body) <= MAX_BODY and 2 * len(body) > IN_FLIGHT

    # The first large review: its head and half its body, then it waits (the worker holds its length).
    first = ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=20), server_hostname="127.0.0.1")
    request.addfinalizer(first.close)  # a failure below must not leave it holding the worker's room
    first.sendall(head(len(body)) + body[: len(body) // 2])
    time.sleep(0.5)

    # A second large one does not fit beside it: 503 with a JSON error naming the cap, and the connection closed.
    second = ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=20), server_hostname="127.0.0.1")
    second.sendall(head(len(body)))
    status, data = read_status(second)
    assert status == 503, data[:300]
    assert f"over {IN_FLIGHT} bytes of request bodies in flight".encode() in data
    second.close()

    # A mid-size body that still fits is held too, and the room is full...
    mid = ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=20), server_hostname="127.0.0.1")
    request.addfinalizer(mid.close)
    mid.sendall(head(IN_FLIGHT - len(body) - 10) + b"{")
    time.sleep(0.5)
    # ... yet a small review is never refused (a client stalling large bodies cannot turn the API server's
    # usual reviews away), and is judged: no entry, so refused by the rules.
    small = requests.post(base + "/validate", json=review(trainjob()), verify=ca, timeout=20)
    assert small.status_code == 200 and small.json()["response"]["uid"] == "uid-1"
    mid.close()
    time.sleep(0.5)

    # The first is answered in full once its body is in; then a large review fits again.
    first.sendall(body[len(body) // 2:])
    status, data = read_status(first)
    assert status == 200, data[:300]
    first.close()
    again = requests.post(base + "/validate", data=body, headers={"Content-Type": "application/json"},
                          verify=ca, timeout=20)
    assert again.status_code == 200 and "response" in again.json()


def test_a_body_dropped_mid_way_gives_its_room_back(server):
    """A client that goes away mid-body does not leave its length counted: a large review fits afterwards."""
    base, ca, _, _ = server
    port = int(base.rsplit(":", 1)[1])
    ctx = ssl.create_default_context(cafile=ca)
    body = large_review()
    for _ in range(3):
        gone = ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=20), server_hostname="127.0.0.1")
        gone.sendall(head(len(body)) + body[:1000])
        time.sleep(0.2)
        gone.close()
    time.sleep(0.5)
    r = requests.post(base + "/validate", data=body, headers={"Content-Type": "application/json"}, verify=ca,
                      timeout=20)
    assert r.status_code == 200, r.text[:300]
