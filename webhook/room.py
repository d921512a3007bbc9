"""The request-body bytes one worker holds at once (issue 25): what keeps a burst of large reviews, or
a client that declares large bodies and stalls, from taking a worker past its memory.

Only bodies over `small` (the size answered on the loop, 64 KiB) are counted, from their head until they
are answered or their connection is gone; the smaller ones the API server usually sends are never
refused (gunicorn's worker_connections bounds them). A large body that would go past `cap` first makes
held bodies give way that are still being read and slower than `min_rate` since their head (a client
holding the room with a declared length it does not send): each is answered 503 and the rest of its body
dropped. If the new one still does not fit, it is refused (503) the same way."""

from __future__ import annotations

from typing import Callable, Iterable, Protocol

HEADROOM = 1024 * 1024  # the default cap is the largest body and this: small reviews fit beside a large one


class Held(Protocol):
    length: int       # the declared Content-Length
    held: int         # what is counted for it (0: nothing)
    received: int     # body bytes read so far
    since: float      # when its head was read (loop time)
    dispatched: bool  # read whole and handed to the app
    over_limit: bool  # over max_body: answered 413, its body dropped, nothing held


class Room:
    def __init__(self, cap: int, small: int, min_rate: float = 1024 * 1024, grace: float = 1.0):
        self.cap, self.small, self.min_rate, self.grace = cap, small, min_rate, grace
        self.used = 0

    def admit(self, length: int, now: float, reading: Callable[[], Iterable[tuple[Held, object]]]) -> bool:
        """Room for a body of `length`? `reading()`: (request, its connection) for the requests whose bodies
        are being read, called only when the body does not fit; the slow ones give way (their connection's
        give_way(why): answered 503, the rest of the body dropped) to make room."""
        if length <= self.small or not self.used or self.used + length <= self.cap:
            return True
        slow = sorted(((req.received / max(now - req.since, 1e-6), req, conn) for req, conn in reading()
                       if req.held and not req.dispatched and now - req.since >= self.grace),
                      key=lambda t: t[0])
        for rate, _, conn in slow:
            if rate >= self.min_rate or self.used + length <= self.cap:
                break
            conn.give_way(f"its body came at under {self.min_rate:.0f} bytes/s while this worker's room for request"
                          f" bodies ({self.cap} bytes) was needed: try again")
        return not self.used or self.used + length <= self.cap

    def hold(self, req: Held) -> None:
        if req.length > self.small and not req.over_limit:
            req.held, self.used = req.length, self.used + req.length

    def release(self, req: Held | None) -> None:
        if req is not None and req.held:
            self.used, req.held = self.used - req.held, 0
