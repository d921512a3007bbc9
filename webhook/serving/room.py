"""The bytes one worker holds for its clients at once (issues 25, 33 and 47): what keeps a burst of large reviews,
a thousand clients that each send part of a request and stall, a body that parses to many times its size, or a
client that pipelines requests and reads none of the answers, from taking a worker past its memory.

The budget counts request bytes (below), each request's parsed form by its bound, taken before parsing
(webhook.serving.cycle, webhook.serving.codec.parsed_bound: a body whose bound cannot fit is 413, one that does
not fit now 429), and answers written until the transport has sent them. Every count is taken under the cap,
so `used` never passes it: a request holds ANSWER bytes for its answer from its first byte (a request for
which even they cannot be made room is not answered: its connection is closed), enough for any answer the
worker makes itself (a refusal: webhook.serving.wsgi.error_answer); its answer is counted in place of what it
holds (`answer`), the rest given back, and an answer larger than that takes the difference like any other
bytes, or is replaced by a 503 (webhook.serving.cycle). A connection writes no more while its client does
not read (webhook.serving.connection).

Every byte a worker holds for a request counts, from the request's first byte until it is answered or its
connection is gone: the head as it is buffered (each slice fed while the head is incomplete, then the
parsed head's size), then the body as its bytes come. The sum never passes `cap`, whatever the number of
connections. Only bytes received count: declaring a large Content-Length holds nothing. But a body that
could not fit now is refused at its head, before it is sent.

Where bytes do not fit, requests still being read give way if that makes room, the slowest (bytes held
over age) first: those read for longer than `patience`; those past `grace` read at under `min_rate` since
their first byte; and those holding over `BIGGER` times the newcomer's whole request, however young. Each
is answered 503 (a body: the rest of it dropped, the connection kept; a head: the connection closed after
the answer). If giving way would not make room, nobody does and the newcomer is refused the same way.
Requests read whole (with the app, or waiting for it) never give way.

So a client that stalls holds its room only until someone needs it. The API server's reviews are small
(a head of a few hundred bytes, a body of a few KiB) and come whole within milliseconds: to keep them out,
a flood must fill the room with requests as small as theirs, each younger than `grace`, i.e. send over
`cap` / `grace` bytes a second to each worker. A large review arriving during a flood that fills the room
may be refused (503).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

ANSWER = 1024           # bytes a request holds for its answer from its first byte: any refusal of the worker's fits
BUDGET = 64 * 1024 * 1024  # the default cap: a 7 MiB body with its parsed form (its bound: webhook.serving.codec)
                           # and others beside it; two workers' budgets and their ~45 MiB each fit in 384Mi
GRACE = 0.1             # seconds: a request younger than this keeps its room (unless much bigger than the newcomer)
BIGGER = 2              # ... a request holding over this many times the newcomer's whole request gives way
MIN_RATE = 1024 * 1024  # bytes/s since a request's first byte: one read slower gives way when room is needed
PATIENCE = 1.0          # seconds: a request still being read after this long gives way when room is needed


class Reader(Protocol):
    """A connection, as the room sees it."""

    def reading(self) -> tuple[int, float] | None:
        """(bytes held, when its first byte came) for the request being read, or None."""

    def give_way(self, why: str) -> None:
        """Answer the request being read 503 (`why`) and hold nothing more for it."""


class Room:
    """`used`: the bytes held now; `peak`: the most held at once since the worker started."""

    def __init__(self, cap: int, grace: float = GRACE, min_rate: float = MIN_RATE, patience: float = PATIENCE):
        self.cap, self.grace, self.min_rate, self.patience = cap, grace, min_rate, patience
        self.used = self.peak = 0

    @property
    def full(self) -> str:
        """Why a newcomer is refused."""
        return f"over {self.cap} bytes of requests in flight in this worker: try again"

    def make_room(self, n: int, size: int, now: float, readers: Callable[[], Iterable[Reader]],
                  newcomer: Reader) -> bool:
        """Would `n` more bytes for `newcomer`'s request (`size` bytes whole, as far as known) fit? Readers
        give way if that is needed and enough."""
        return self.used + n <= self.cap or self._give_way(n, size, now, readers(), newcomer)

    def take(self, n: int, size: int, now: float, readers: Callable[[], Iterable[Reader]], newcomer: Reader) -> bool:
        """`n` more bytes for `newcomer`'s request (`size` bytes whole): True when counted, False when they
        cannot fit (nothing counted: the caller refuses the newcomer)."""
        if not self.make_room(n, size, now, readers, newcomer):
            return False
        self.used += n
        if self.used > self.peak:
            self.peak = self.used
        return True

    def give_back(self, n: int) -> None:
        if not 0 <= n <= self.used:  # a count given back twice, or never taken: a fault of the caller's
            raise ValueError(f"{n} bytes given back with {self.used} held")
        self.used -= n

    def release(self, request) -> None:
        """All that is counted for `request` (None, or a request whose `held` is what is counted) given back."""
        if request is not None and request.held:
            self.give_back(request.held)
            request.held = 0

    def answer(self, request, n: int, now: float, readers: Callable[[], Iterable[Reader]], newcomer: Reader) -> bool:
        """`request`'s answer of `n` bytes counted in place of what it holds (the rest given back; the answer
        is given back as it is sent); the difference taken if the answer is larger. False, and nothing
        changed, when the difference cannot fit."""
        if n > request.held and not self.take(n - request.held, n, now, readers, newcomer):
            return False
        self.give_back(max(request.held - n, 0))
        request.held = 0
        return True

    def _give_way(self, n: int, size: int, now: float, readers: Iterable[Reader], newcomer: Reader) -> bool:
        slow = []
        for reader in readers:
            state = reader.reading() if reader is not newcomer else None
            if state is None or not state[0]:
                continue
            held, since = state
            age = max(now - since, 1e-6)
            if age >= self.patience or (age >= self.grace and held < self.min_rate * age) or held > BIGGER * size:
                slow.append((held / age, held, reader))
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
               f" {self.min_rate:.0f} bytes/s, for over {self.patience:g}s, or held much more than the request"
               " that needed it: try again")
        for reader in giving:
            reader.give_way(why)
        return self.used + n <= self.cap
