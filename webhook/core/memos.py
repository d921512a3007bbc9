"""What an Admission keeps of what the rules decided of runtimes (issue 49): one entry per runtime and
resourceVersion, for the settings in use; bounded in entries and in bytes (the runtime held and what was decided).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from .runtimes import Key, Runtime

MEMO_ENTRIES = 4096
MEMO_BYTES = 32 << 20
T = TypeVar("T")


class Memos(Generic[T]):
    """What was decided of a runtime for one `token` (the settings and rules in force), kept by the runtime's key
    and resourceVersion: at most `entries` of them and `size` bytes (the runtime's stored form and `sizeof` of
    what was decided), the oldest written dropped first. Read without a lock (one dict read); written under one."""

    def __init__(self, sizeof: Callable[[T], int], entries: int = MEMO_ENTRIES, size: int = MEMO_BYTES):
        self.sizeof, self.entries, self.size = sizeof, entries, size
        self._items: dict[tuple[Key, str], tuple[Runtime, object, T, int]] = {}
        self._lock = threading.Lock()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, runtime: Runtime, token: object) -> T | None:
        hit = self._items.get((runtime.key, runtime.version))
        if hit is not None and hit[1] is token and (hit[0] is runtime or hit[0] == runtime):
            return hit[2]
        return None

    def put(self, runtime: Runtime, token: object, value: T) -> None:
        k, n = (runtime.key, runtime.version), len(runtime.to_bytes()) + self.sizeof(value)
        with self._lock:
            old = self._items.pop(k, None)
            if old is not None:
                self.bytes -= old[3]
            if n > self.size:
                return  # larger than the whole memo: decided again each time
            while self._items and (len(self._items) >= self.entries or self.bytes + n > self.size):
                self.bytes -= self._items.pop(next(iter(self._items)))[3]
            self._items[k] = (runtime, token, value, n)
            self.bytes += n
