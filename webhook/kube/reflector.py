"""The runtime keeper's list and watch of one kind (webhook.kube.keeper runs one Reflector per kind): list, then
watch from the list's resourceVersion, relist on 410 Gone and, with backoff, on errors; and what its reads did
(`ReadStats`), which the keeper writes into the store for the serving container to export.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from ..core.runtimes import KINDS, Runtime
from ..process import heap

log = logging.getLogger(__name__)


class Gone(Exception):
    """The watch's resourceVersion is too old (HTTP 410): list again."""


class Backoff:
    def __init__(self, initial: float = 0.5, ceiling: float = 30.0):
        self.initial, self.ceiling, self.current = initial, ceiling, initial

    def next(self) -> float:
        delay, self.current = self.current, min(self.current * 2, self.ceiling)
        return delay

    def reset(self) -> None:
        self.current = self.initial


ListFn = Callable[[str], tuple[list[dict], str]]
WatchFn = Callable[[str, str], Iterable[dict]]


def slim(obj: dict, kind: str) -> Runtime:
    """What the rules read of a runtime, with its kind (list items may omit it)."""
    return Runtime.of(obj, kind)


class ReadStats:
    """What the keeper's reads of the API server did, for the serving container to export (webhook.kube.keeper writes
    a snapshot into the store each second): requests and errors per verb and kind, per kind when it last
    completed a list and when its cache was last confirmed current (a list, any watch event, a bookmark, a
    watch the server ended), the runtimes held, and the live reads' outcomes."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self._lock = threading.Lock()
        self.requests: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.live: dict[str, int] = {}
        self.kinds: dict[str, dict] = {k: {"size": 0, "listed": 0.0, "confirmed": 0.0, "synced": False} for k in KINDS}

    def request(self, verb: str, kind: str) -> None:
        self._bump(self.requests, f"{verb}\x1f{kind}")

    def error(self, verb: str, kind: str) -> None:
        self._bump(self.errors, f"{verb}\x1f{kind}")

    def live_read(self, outcome: str) -> None:
        self._bump(self.live, outcome)

    def _bump(self, table: dict, key: str) -> None:
        with self._lock:
            table[key] = table.get(key, 0) + 1

    def listed(self, kind: str, size: int) -> None:
        now = self.clock()
        with self._lock:
            self.kinds[kind].update(size=size, listed=now, confirmed=now, synced=True)

    def confirmed(self, kind: str, size: int) -> None:
        with self._lock:
            self.kinds[kind].update(size=size, confirmed=self.clock())

    def snapshot(self) -> dict:
        with self._lock:
            return {"requests": dict(self.requests), "errors": dict(self.errors), "live": dict(self.live),
                    "kinds": {k: dict(v) for k, v in self.kinds.items()}}

    def resume(self, state: dict) -> None:
        """Go on from a snapshot (a keeper started again over the store it left): counters stay monotonic for the
        pod's life, and each kind stays listed as the store holds it, confirmed when it last was."""
        with self._lock:
            for name in ("requests", "errors", "live"):
                table = getattr(self, name)
                for k, v in (state.get(name) or {}).items():
                    table[k] = table.get(k, 0) + int(v)
            for kind, found in (state.get("kinds") or {}).items():
                if kind in self.kinds and isinstance(found, dict):
                    self.kinds[kind].update({k: found[k] for k in ("size", "listed", "confirmed", "synced")
                                             if k in found})


class Reflector:
    """List, then watch from the list's resourceVersion; relist on 410 Gone and, with backoff, on errors."""

    def __init__(self, kind: str, index, list_fn: ListFn, watch_fn: WatchFn,
                 sleep: Callable[[float], None] = time.sleep, backoff: Backoff | None = None,
                 stats: ReadStats | None = None):
        """`index`: where runtimes go (a RuntimeIndex, or the pod's StoreWriter): put, delete, replace, count."""
        self.kind, self.index, self.list_fn, self.watch_fn, self.sleep = kind, index, list_fn, watch_fn, sleep
        self.backoff = backoff or Backoff()
        self.stats = stats or ReadStats()
        self.synced = threading.Event()
        self.stopped = threading.Event()

    def run(self, rounds: int | None = None) -> None:
        """Loop until stopped; `rounds` bounds the list-and-watch cycles (for tests)."""
        while not self.stopped.is_set() and (rounds is None or rounds > 0):
            rounds = None if rounds is None else rounds - 1
            try:
                listed = self.list_fn(self.kind)  # (items, version), or a Listing: its version once read
                items, version = listed if isinstance(listed, tuple) else (listed, None)
                # Taken one by one as the pages arrive: a large list never sits in memory whole.
                count = self.index.replace(self.kind, (slim(i, self.kind) for i in items))
                version = listed.version if version is None else version
                heap.trim()
                self.synced.set()
                self.stats.listed(self.kind, count)
                self.backoff.reset()
                self._watch(version)
            except Gone:
                log.info("%s watch expired (410 Gone): relisting", self.kind)
            except Exception as e:  # API unreachable, bad answer, store full: keep serving the cache, retry later
                self.stats.error("list/watch", self.kind)
                delay = self.backoff.next()
                log.warning("%s list/watch failed (%s): retrying in %.1fs", self.kind, str(e)[:300], delay)
                self.sleep(delay)

    def _watch(self, version: str) -> None:
        while not self.stopped.is_set():
            for event in self.watch_fn(self.kind, version):
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone()
                    raise RuntimeError(f"watch error: {obj.get('message', obj)}")
                version = (obj.get("metadata") or {}).get("resourceVersion") or version
                if kind in ("ADDED", "MODIFIED"):
                    self.index.put(slim(obj, self.kind))
                elif kind == "DELETED":
                    self.index.delete(slim(obj, self.kind))
                self.stats.confirmed(self.kind, self.index.count(self.kind))  # bookmarks confirm too
                if self.stopped.is_set():
                    return
            # A watch the server ends (its timeout) was current until then; resume from the last version seen.
            self.stats.confirmed(self.kind, self.index.count(self.kind))
