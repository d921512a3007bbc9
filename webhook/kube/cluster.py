"""Runtimes from the Kubernetes API: a list-and-watch cache, so a review of a known runtime makes no call.

One cache per pod (webhook.kube.store): the runtime keeper (webhook.kube.keeper) lists and watches
(webhook.kube.reflector, through webhook.kube.runtime_api) and writes; the workers read it (`ClusterRuntimes`).
Two workers cost one watch and one copy of the runtimes. A miss is confirmed with one live read before it is
reported as not found (SPEC 7), made by the keeper for the whole pod (webhook.kube.live_reads), so reads of the
API server are bounded per pod whatever the reviews name.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator

from ..core.runtimes import KINDS, PENDING, Key, Pending, Runtime, RuntimeUnavailable, stored_version
from ..process.blocking import blocking_allowed
from .reflector import slim

NEGATIVE_SECONDS = 1.0  # a miss the keeper confirmed is answered from a worker's memory this long
FOUND_SECONDS = 5.0  # a runtime a live read found is answered from memory this long (the watch brings it meanwhile)
REMEMBERED = 10_000  # names a worker remembers at once (found or missing), least recently used forgotten first


class _Remembered:
    """Keys remembered until a time, at most REMEMBERED of them (least recently used forgotten first). Locked: the
    worker's loop reads it while a review waiting on a thread for a live read writes it (a key forgotten between
    a read's lookup and its move to the end raised KeyError)."""

    def __init__(self):
        self._items: OrderedDict[Key, tuple[float, Runtime | None]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, k: Key, now: float):
        with self._lock:
            hit = self._items.get(k)
            if hit is None or now >= hit[0]:
                return None
            self._items.move_to_end(k)
            return hit

    def put(self, k: Key, until: float, runtime: Runtime | None) -> None:
        with self._lock:
            self._items[k] = (until, runtime)
            self._items.move_to_end(k)
            while len(self._items) > REMEMBERED:
                self._items.popitem(last=False)


class ClusterRuntimes:
    """The RuntimeSource for a cluster, in a worker: the pod's store, with one live read to confirm a miss,
    made by the pod's keeper (`live`: webhook.kube.live_reads.LiveReads, bounded per pod; None: none is made).

    What a live read answers is remembered here too, a few seconds for a runtime found (until the watch brings
    it to the store), a second for a miss, so a review answered on the worker's loop rarely needs a thread."""

    def __init__(self, store, live, clock: Callable[[], float] = time.monotonic):
        self.store, self.live, self.clock = store, live, clock
        self._synced: set[str] = set()
        self._known = _Remembered()
        self._judged: dict[bytes, tuple[bytes, object, bool]] = {}  # for readiness(): version, settings, verdict

    def synced(self, kind: str) -> bool:
        if kind not in self._synced and self.store.synced(kind):
            self._synced.add(kind)  # a store once listed stays listed (a relist swaps it whole)
        return kind in self._synced

    def ready(self) -> bool:
        return all(self.synced(k) for k in KINDS)

    def __iter__(self):
        return iter(self.store)

    def readiness(self, can_carry: Callable[[Runtime], bool],
                  settings: Callable[[], object]) -> Iterator[tuple[Key, bool]]:
        """Each runtime's key and `can_carry(runtime)`, judged again only for a runtime whose resourceVersion
        or the settings in use (`settings()`) changed since the last call (a scrape judges 10,000 runtimes)."""
        token, seen = settings(), {}
        for k, raw in self.store.items():
            version = stored_version(raw)
            hit = self._judged.get(k)
            ok = hit[2] if hit is not None and hit[0] == version and hit[1] is token else can_carry(
                Runtime.from_bytes(raw))
            seen[k] = (version, token, ok)
            yield tuple(k.decode().split("\x1f")), ok  # type: ignore[misc]
        self._judged = seen

    def get(self, kind: str, namespace: str, name: str) -> Runtime | Pending | None:
        if not self.synced(kind):
            raise RuntimeUnavailable("the runtime cache has not completed its first list yet")
        found = self.store.get(kind, namespace, name)
        if found is not None:
            return found
        key = (kind, namespace, name)
        known = self._known.get(key, self.clock())
        if known is not None:
            return known[1]  # a name probed again and again costs the pod one live read a second
        if not blocking_allowed():
            return PENDING  # the review waits for this read on a thread (webhook.core.admission.Reviewing)
        got = self.live.get(kind, namespace, name) if self.live is not None else None
        runtime = None if got is None else slim(got, kind)
        self._known.put(key, self.clock() + (NEGATIVE_SECONDS if runtime is None else FOUND_SECONDS), runtime)
        return runtime
