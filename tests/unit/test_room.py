"""webhook.serving.room: who gives way when a worker's request bytes would pass its cap (issue 33, item 4). The
server tests (tests/server/test_held_bytes.py, test_body_in_flight.py) run it in the real worker."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.process import ROOT
from webhook.serving.room import GRACE, MIN_RATE, PATIENCE, Room

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


def test_the_room_gauges_write_no_files_without_a_metrics_directory(tmp_path):
    """The worker sets the room's gauges whatever the app (bench/baseline.py serves its own with
    PROMETHEUS_MULTIPROC_DIR set empty): without start(), the families stay in one process and no
    prometheus_client file lands in the working directory."""
    code = "from webhook.process import metrics; metrics.get().request_bytes_held.set(5); print('set')"
    got = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": "", "PYTHONPATH": str(ROOT)})
    assert got.stdout.strip() == "set", got.stderr
    assert list(tmp_path.iterdir()) == []
