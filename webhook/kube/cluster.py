"""Runtimes from the Kubernetes API: a list-and-watch cache, so a review of a known runtime makes no call.

One cache per pod (webhook.kube.store): the runtime keeper (webhook.kube.keeper) lists and watches and writes; the
workers read it (`ClusterRuntimes`). Two workers cost one watch and one copy of the runtimes. A miss is
confirmed with one live read before it is reported as not found (SPEC 7), made by the keeper for the whole
pod (webhook.kube.live_reads), so reads of the API server are bounded per pod whatever the reviews name.

What the keeper's reads hold at once is bounded by bytes whatever the runtimes: a list page is parsed item by
item as it streams in (one runtime object at a time, at most the API server's object size), never whole.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..core.runtimes import (
    CLUSTER_KIND,
    GROUP,
    KINDS,
    PENDING,
    PLURALS,
    VERSION,
    Key,
    Pending,
    Runtime,
    RuntimeUnavailable,
    stored_version,
)
from ..process import heap
from ..process.blocking import blocking_allowed

log = logging.getLogger(__name__)

WATCH_SECONDS = 240
LIST_PAGE = 500  # items a list page asks for; a page is parsed item by item as it streams in
STREAM_CHUNK = 64 * 1024  # bytes read from a list answer at a time
EDGE_BYTES = 64 * 1024  # the head and tail of a list answer kept to read its metadata (continue, resourceVersion)
LIVE_READ_TIMEOUT = (2.0, 3.0)  # connect, read: well inside the API server's webhook timeout
NEGATIVE_SECONDS = 1.0  # a miss the keeper confirmed is answered from a worker's memory this long
FOUND_SECONDS = 5.0  # a runtime a live read found is answered from memory this long (the watch brings it meanwhile)
REMEMBERED = 10_000  # names a worker remembers at once (found or missing), least recently used forgotten first


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


class Listing:
    """Every runtime of `kind`, page by page (one snapshot: the pages share its resourceVersion), each item
    parsed as it streams in and cut to its essentials at once; `version` is the list's resourceVersion once
    the pages are read. What is held at once is one item (at most the API server's object size) and the
    parser's buffer, whatever the page holds."""

    version: str | None

    def __init__(self, api: RuntimeAPI, kind: str):
        self.api, self.kind, self.version = api, kind, None

    def __iter__(self) -> Iterator[Runtime]:
        token, version = None, ""
        while True:
            self.api.stats.request("list", self.kind)
            kw: dict[str, Any] = {"_continue": token} if token else {}
            answer = self.api.api.list_cluster_custom_object(GROUP, VERSION, PLURALS[self.kind], limit=LIST_PAGE,
                                                             _request_timeout=(5, 60), _preload_content=False, **kw)
            page = Page(answer)
            try:
                for item in page:
                    yield slim(item, self.kind)
            finally:
                answer.release_conn()
            meta = page.metadata()
            version = meta.get("resourceVersion") or version
            token = meta.get("continue")
            if not token:
                self.version = version
                return


class Page:
    """One list answer read as a stream: its items one at a time (ijson, yajl's C parser), then its metadata,
    found in the first or the last EDGE_BYTES of the answer (the API server puts `metadata` before `items`
    when it streams a list, after them when it sorts an unstructured list's keys)."""

    def __init__(self, stream):
        self.stream = stream
        self.head = bytearray()
        self.tail = b""

    def read(self, size: int = -1) -> bytes:
        if size == 0:  # ijson asks for nothing first, to learn whether the stream gives bytes or text
            return b""
        data = self.stream.read(size if size > 0 else STREAM_CHUNK)
        if len(self.head) < EDGE_BYTES:
            self.head += data[:EDGE_BYTES - len(self.head)]
        self.tail = (self.tail + data)[-EDGE_BYTES:]
        return data

    def __iter__(self) -> Iterator[dict]:
        import ijson

        return ijson.items(self, "items.item", buf_size=STREAM_CHUNK)

    def metadata(self) -> dict:
        import ijson
        import orjson

        try:  # metadata first: the head holds it whole, before the items
            for meta in ijson.items(bytes(self.head), "metadata"):
                return meta if isinstance(meta, dict) else {}
        except ijson.IncompleteJSONError:
            pass
        at = self.tail.rfind(b'"metadata":')  # metadata last: the answer ends with it and the list's `}`
        if at < 0:
            return {}
        try:
            meta = orjson.loads(self.tail[at + len(b'"metadata":'):].rstrip()[:-1])
        except orjson.JSONDecodeError:
            return {}
        return meta if isinstance(meta, dict) else {}


class RuntimeAPI:
    """The three reads of runtimes the keeper makes: list (in pages), watch, and get one."""

    def __init__(self, api_client, stats: ReadStats | None = None):
        from kubernetes import client

        self.api: Any = client.CustomObjectsApi(api_client)  # Any: the client types JSON answers as object
        self.stats = stats or ReadStats()

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        from kubernetes.client.exceptions import ApiException

        self.stats.request("get", kind)
        try:
            return read_runtime(self.api, kind, namespace, name, LIVE_READ_TIMEOUT)
        except ApiException as e:
            if e.status == 404:
                return None
            self.stats.error("get", kind)
            raise RuntimeUnavailable(f"the API server answered {e.status} {e.reason}") from None
        except Exception as e:
            self.stats.error("get", kind)
            raise RuntimeUnavailable(f"the API server cannot be reached: {type(e).__name__}") from None

    def list(self, kind: str) -> Listing:
        return Listing(self, kind)

    def watch(self, kind: str, version: str) -> Iterator[dict]:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        self.stats.request("watch", kind)
        w = watch.Watch()
        try:
            for event in w.stream(self.api.list_cluster_custom_object, GROUP, VERSION, PLURALS[kind],
                                  resource_version=version, timeout_seconds=WATCH_SECONDS,
                                  allow_watch_bookmarks=True, _request_timeout=(5, WATCH_SECONDS + 30)):
                yield {"type": event.get("type"), "object": event.get("raw_object") or event.get("object")}
        except ApiException as e:
            if e.status == 410:
                raise Gone() from None
            raise
        finally:
            w.stop()


class _Remembered:
    """Keys remembered until a time, at most REMEMBERED of them (least recently used forgotten first)."""

    def __init__(self):
        self._items: OrderedDict[Key, tuple[float, Runtime | None]] = OrderedDict()

    def get(self, k: Key, now: float):
        hit = self._items.get(k)
        if hit is None or now >= hit[0]:
            return None
        self._items.move_to_end(k)
        return hit

    def put(self, k: Key, until: float, runtime: Runtime | None) -> None:
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


def read_runtime(api, kind: str, namespace: str, name: str, timeout) -> dict:
    """One runtime by kind and name (a CustomObjectsApi GET); raises the client's ApiException (404: none)."""
    if kind == CLUSTER_KIND:
        return api.get_cluster_custom_object(GROUP, VERSION, PLURALS[kind], name, _request_timeout=timeout)
    return api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURALS[kind], name, _request_timeout=timeout)


def api_client(kubeconfig: str | None, prefer_kubeconfig: bool = False):
    """A Kubernetes API client from --kubeconfig; else in-cluster config, then KUBECONFIG or ~/.kube/config
    (a command run by a person, `prefer_kubeconfig`, tries the kubeconfig before in-cluster config)."""
    import os

    from kubernetes import client, config

    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig)

    def in_cluster():
        cfg = client.Configuration()
        config.load_incluster_config(client_configuration=cfg)
        return client.ApiClient(cfg)

    if os.environ.get("KUBERNETES_SERVICE_HOST") and not prefer_kubeconfig:
        return in_cluster()
    try:
        return config.new_client_from_config()
    except config.ConfigException:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            return in_cluster()
        raise
