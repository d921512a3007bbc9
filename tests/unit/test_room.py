"""webhook.room: who gives way when a worker's request bytes would pass its cap (issue 33, item 4). The
server tests (tests/server/test_held_bytes.py, test_body_in_flight.py) run it in the real worker."""

from __future__ import annotations

from webhook.room import MIN_RATE, PATIENCE, Room


class Reader:
    def __init__(self, room: Room, held: int, received: int, since: float):
        self.room, self.held, self.received, self.since, self.why = room, held, received, since, None
        room.used += held

    def reading(self):
        return (self.held, self.received, self.since) if self.why is None else None

    def give_way(self, why: str) -> None:
        self.why = why
        self.room.give_back(self.held)


def test_bytes_are_taken_up_to_the_cap_and_the_peak_is_kept():
    room, newcomer = Room(100, 10), object()
    assert room.take(60, 0.0, list, newcomer) and room.take(40, 0.0, list, newcomer)
    assert not room.take(1, 0.0, list, newcomer) and room.used == 100
    room.give_back(70)
    assert room.used == 30 and room.peak == 100


def test_the_slowest_readers_give_way_until_the_newcomer_fits():
    room, now = Room(1000, 10), 10.0
    stalled = Reader(room, 400, 400, now - 0.5)       # 800 bytes/s
    slower = Reader(room, 300, 10, now - 0.5)         # 20 bytes/s
    fast = Reader(room, 300, 300_000, now - 0.1)      # 3 MB/s, young: keeps its room
    assert room.used == 1000
    assert room.take(250, now, lambda: [stalled, slower, fast], object())
    assert slower.why and "room for requests (1000 bytes)" in slower.why
    assert stalled.why is None and fast.why is None  # one giving way made room enough
    assert room.used == 950


def test_nobody_gives_way_when_that_would_not_make_room():
    room, now = Room(1000, 10), 10.0
    stalled = Reader(room, 300, 0, now - 0.5)
    fast = Reader(room, 700, 700_000, now - 0.1)
    assert not room.take(400, now, lambda: [stalled, fast], object())
    assert stalled.why is None and room.used == 1000


def test_a_request_read_fast_gives_way_after_the_patience():
    room, now = Room(1000, 10), 10.0
    old = Reader(room, 1000, 100 * MIN_RATE, now - PATIENCE)
    assert room.take(10, now, lambda: [old], object()) and old.why


def test_the_newcomer_and_readers_holding_nothing_are_not_asked():
    room, now = Room(100, 10), 10.0
    newcomer = Reader(room, 100, 0, now - 5)
    idle = Reader(room, 0, 0, now - 5)
    assert not room.take(1, now, lambda: [newcomer, idle], newcomer)
    assert newcomer.why is None and idle.why is None
