"""webhook.serving.room: who gives way when a worker's request bytes would pass its cap (issue 33, item 4); parsed
bounds and answers counted under the cap, and given back exactly (issue 47). The server tests
(tests/server/test_held_bytes.py, test_body_in_flight.py, test_bounded_answers.py) run it in the real worker."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from tests.process import ROOT
from webhook.serving.room import ANSWER, GRACE, MIN_RATE, PATIENCE, Room
from webhook.serving.wsgi import error_answer

NOW = 100.0


class Reader:
    def __init__(self, room: Room, held: int, age: float):
        self.room, self.held, self.since, self.why = room, held, NOW - age, None
        room.used += held

    def reading(self):
        return (self.held, self.since) if self.why is None else None

    def give_way(self, why: str) -> None:
        self.why = why
        self.room.give_back(self.held)


def test_bytes_are_taken_up_to_the_cap_and_the_peak_is_kept():
    room, newcomer = Room(100), object()
    assert room.take(60, 60, NOW, list, newcomer) and room.take(40, 100, NOW, list, newcomer)
    assert not room.take(1, 101, NOW, list, newcomer) and room.used == 100
    room.give_back(70)
    assert room.used == 30 and room.peak == 100


def test_the_slowest_readers_give_way_until_the_newcomer_fits():
    room = Room(1000)
    stalled = Reader(room, 400, 0.5)   # 800 bytes/s
    slower = Reader(room, 300, 0.5)    # 600 bytes/s
    fast = Reader(room, 300, 0.0001)   # 3 MB/s
    assert room.used == 1000
    assert room.take(250, 250, NOW, lambda: [stalled, slower, fast], object())
    assert slower.why and "room for requests (1000 bytes)" in slower.why
    assert stalled.why is None and fast.why is None  # one giving way made room enough
    assert room.used == 950


def test_nobody_gives_way_when_that_would_not_make_room():
    room = Room(1000)
    stalled = Reader(room, 300, 0.5)
    fast = Reader(room, 700, 0.0001)
    assert not room.take(400, 400, NOW, lambda: [stalled, fast], object())
    assert not room.make_room(400, 400, NOW, lambda: [stalled, fast], object())
    assert stalled.why is None and room.used == 1000


def test_a_young_request_keeps_its_room_however_slow():
    """The API server's reviews come whole within milliseconds, in one write or a few: a request younger
    than the grace never gives way, whatever its rate so far."""
    room = Room(1000)
    young = Reader(room, 1000, GRACE * 0.9)
    assert not room.take(10, 500, NOW, lambda: [young], object()) and young.why is None


def test_a_young_request_much_bigger_than_the_newcomer_gives_way():
    """A flood of young requests of 50 KiB cannot keep out a review of 2 KiB: a request holding over BIGGER
    times the newcomer's whole request gives way however young; one of the newcomer's size does not."""
    room = Room(100_000)
    big = Reader(room, 50_000, GRACE / 10)
    alike = Reader(room, 50_000, GRACE / 10)
    assert not room.take(2_000, 50_000, NOW, lambda: [big, alike], object()) and big.why is None
    assert room.take(2_000, 2_000, NOW, lambda: [big, alike], object())
    assert [big.why is None, alike.why is None].count(False) == 1


def test_a_request_read_fast_gives_way_after_the_patience():
    room = Room(1000)
    old = Reader(room, 1000, PATIENCE)
    assert 1000 / PATIENCE < 100 * MIN_RATE
    assert room.take(10, 1000, NOW, lambda: [old], object()) and old.why


def test_the_newcomer_and_readers_holding_nothing_are_not_asked():
    room = Room(100)
    newcomer = Reader(room, 100, 5)
    idle = Reader(room, 0, 5)
    assert not room.take(1, 1, NOW, lambda: [newcomer, idle], newcomer)
    assert newcomer.why is None and idle.why is None


class Request:
    """A request as the room sees it: `held`, what is counted for it."""

    def __init__(self, room: Room, held: int):
        assert room.take(held, held, NOW, list, object())
        self.held = held


def test_a_parsed_bound_is_taken_under_the_cap_and_given_back_with_its_request():
    room = Room(10_000)
    request = Request(room, ANSWER + 500)  # its answer's room, head and body
    assert not room.take(10_000 - room.used + 1, 10_000, NOW, list, object()) and room.used == ANSWER + 500
    assert room.take(10_000 - room.used, 10_000, NOW, list, object())  # a bound that fits exactly
    request.held = 10_000
    assert room.used == room.peak == 10_000
    room.release(request)
    room.release(request)  # released twice: nothing more given back
    assert room.used == 0 and request.held == 0 and room.peak == 10_000


def test_an_answer_is_counted_in_place_of_what_its_request_held():
    room = Room(10_000)
    request = Request(room, 4_000)
    assert room.answer(request, 300, NOW, list, object())
    assert room.used == 300 and request.held == 0  # the rest given back; the answer until it is sent
    room.give_back(300)
    assert room.used == 0 and room.peak == 4_000


def test_an_answer_larger_than_its_request_takes_the_difference_under_the_cap_or_nothing():
    room = Room(10_000)
    other = Request(room, 8_000)
    request = Request(room, ANSWER)
    assert not room.answer(request, 10_000 - 8_000 + 1, NOW, list, object())
    assert room.used == 8_000 + ANSWER and request.held == ANSWER  # nothing changed: the caller answers 503
    assert room.answer(request, 10_000 - 8_000, NOW, list, object())
    assert room.used == room.peak == 10_000 and request.held == 0
    room.give_back(2_000)
    room.release(other)
    assert room.used == 0


def test_a_large_answer_makes_slow_readers_give_way():
    room = Room(10_000)
    stalled = Reader(room, 6_000, PATIENCE)
    request = Request(room, 2_000)
    assert room.answer(request, 5_000, NOW, lambda: [stalled], object())
    assert stalled.why and room.used == 5_000


def test_nothing_is_given_back_that_was_not_taken():
    room = Room(1_000)
    assert room.take(100, 100, NOW, list, object())
    for n in (101, -1):
        with pytest.raises(ValueError, match="given back"):
            room.give_back(n)
    assert room.used == 100
    room.give_back(100)
    assert room.used == 0


def test_the_room_never_passes_its_cap_and_comes_back_to_zero():
    """Requests taken, their parsed bounds, answers in their place (some larger), answers sent, requests
    dropped, in a random order: `used` never passes the cap, and is zero once all is given back."""
    rng, room = random.Random(47), Room(50_000)
    requests: list[Request] = []
    unsent = 0
    for _ in range(5_000):
        step = rng.randrange(4)
        if step == 0 and room.take(ANSWER + (n := rng.randrange(20_000)), ANSWER + n, NOW, list, object()):
            requests.append(r := Request.__new__(Request))
            r.held = ANSWER + n
        elif step == 1 and requests and room.take(n := rng.randrange(20_000), n, NOW, list, object()):
            rng.choice(requests).held += n  # a parsed bound
        elif step == 2 and requests:
            request = requests.pop(rng.randrange(len(requests)))
            n = rng.randrange(3 * request.held)
            if room.answer(request, n, NOW, list, object()):
                unsent += n
            else:
                room.release(request)  # answered 503 in its answer's room, given back once sent
        elif step == 3 and unsent:
            sent = rng.randrange(unsent + 1)
            room.give_back(sent)
            unsent -= sent
        assert 0 <= room.used <= room.cap and room.peak <= room.cap
    for request in requests:
        room.release(request)
    room.give_back(unsent)
    assert room.used == 0 and room.peak == room.cap or room.peak < room.cap


@pytest.mark.parametrize("message", ["over 1 bytes: try again", "x" * 5_000, "\x00" * 1_000, "\U0001F600" * 500],
                         ids=["short", "long", "escaped", "astral"])
def test_any_refusal_of_the_workers_fits_in_its_answers_room(message):
    for code in (400, 413, 429, 431, 503):
        for keep in (True, False):
            answer = error_answer(code, message, keep, ANSWER)
            assert len(answer) <= ANSWER, (code, len(answer))
            head, body = answer.split(b"\r\n\r\n", 1)
            assert f"Content-Length: {len(body)}".encode() in head
            got = json.loads(body)
            assert got["code"] == code and message.startswith(got["error"])
            # as much of the message as fits: one character more would not
            assert got["error"] == message or len(error_answer(code, got["error"] + message[len(got["error"])],
                                                               keep, 10 * ANSWER)) > ANSWER


def test_the_room_gauges_write_no_files_without_a_metrics_directory(tmp_path):
    """The worker sets the room's gauges whatever the app (bench/baseline.py serves its own with
    PROMETHEUS_MULTIPROC_DIR set empty): without start(), the families stay in one process and no
    prometheus_client file lands in the working directory."""
    code = "from webhook.process import metrics; metrics.get().request_bytes_held.set(5); print('set')"
    got = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": "", "PYTHONPATH": str(ROOT)})
    assert got.stdout.strip() == "set", got.stderr
    assert list(tmp_path.iterdir()) == []
