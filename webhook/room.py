"""The request bytes one worker holds at once (issues 25 and 33): what keeps a burst of large reviews, or a
thousand clients that each send part of a request and stall, from taking a worker past its memory.

Every byte a worker holds for a request counts, from the request's first byte until it is answered or its
connection is gone: the head as it is buffered (each slice fed while the head is incomplete, then the
parsed head's size), then the body: one over `small` (64 KiB) by its declared Content-Length, taken at the
head (a large body that cannot fit is refused before it is sent), a smaller one as its bytes come. The sum
never passes `cap`, whatever the number of connections.

Where bytes do not fit, requests still being read give way if that makes room: those read at under
`min_rate` since their first byte, or for longer than `patience`, the slowest first. Each is answered 503
(a body: the rest of it dropped, the connection kept; a head: the connection closed after the answer). If
giving way would not make room, nobody does and the newcomer is refused the same way. Requests read whole
(with the app, or waiting for it) never give way. So a client that stalls holds its room only until
someone needs it, and a flood that keeps the API server's reviews out must keep sending: over `cap` /
`patience` bytes a second to one worker, each request at `min_rate` or more.
"""

from __future__ import annotations

from typing import Callable, Iterable, Protocol

HEADROOM = 1024 * 1024  # the default cap is the largest body and this: small reviews fit beside a large one
MIN_RATE = 1024 * 1024  # bytes/s since a request's first byte: a request read slower gives way when room is needed
PATIENCE = 1.0          # seconds: a request still being read after this long gives way when room is needed


class Reader(Protocol):
    """A connection, as the room sees it."""

    def reading(self) -> tuple[int, int, float] | None:
        """(bytes held, bytes received, when its first byte came) of the request being read, or None."""

    def give_way(self, why: str) -> None:
        """Answer the request being read 503 (`why`) and hold nothing more for it."""


class Room:
    """`used`: the bytes held now; `peak`: the most held at once since the worker started."""

    def __init__(self, cap: int, small: int, min_rate: float = MIN_RATE, patience: float = PATIENCE):
        self.cap, self.small, self.min_rate, self.patience = cap, small, min_rate, patience
        self.used = self.peak = 0

    @property
    def full(self) -> str:
        """Why a newcomer is refused."""
        return f"over {self.cap} bytes of requests in flight in this worker: try again"

    def take(self, n: int, now: float, readers: Callable[[], Iterable[Reader]], newcomer: Reader) -> bool:
        """`n` more bytes for `newcomer`'s request: True when counted (slow readers having given way if
        needed), False when they cannot fit (nothing counted: the caller refuses the newcomer)."""
        if self.used + n > self.cap and not self._make_room(n, now, readers(), newcomer):
            return False
        self.used += n
        if self.used > self.peak:
            self.peak = self.used
        return True

    def give_back(self, n: int) -> None:
        self.used -= n

    def _make_room(self, n: int, now: float, readers: Iterable[Reader], newcomer: Reader) -> bool:
        slow = []
        for reader in readers:
            state = reader.reading() if reader is not newcomer else None
            if state is None or not state[0]:
                continue
            held, received, since = state
            age = now - since
            if age >= self.patience or received < self.min_rate * age:
                slow.append((received / max(age, 1e-6), held, reader))
        slow.sort(key=lambda t: t[0])
        freed, giving = 0, []
        for _, held, reader in slow:
            if self.used - freed + n <= self.cap:
                break
            freed += held
            giving.append(reader)
        if self.used - freed + n > self.cap:
            return False  # not enough even if they all gave way: they keep their room
        why = (f"this worker's room for requests ({self.cap} bytes) was needed, and this one was read at under"
               f" {self.min_rate:.0f} bytes/s or for over {self.patience:g}s: try again")
        for reader in giving:
            reader.give_way(why)
        return self.used + n <= self.cap
