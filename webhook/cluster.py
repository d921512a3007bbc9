"""Runtimes from the Kubernetes API: a list-and-watch cache, so a review of a known runtime makes no call.

One cache per pod (webhook.store): the keeper, a process serve's master forks, lists and watches and
writes; the workers read it (`ClusterRuntimes`). Two workers cost one watch and one copy of the runtimes.
A miss is confirmed with one live read by the worker before it is reported as not found (SPEC 7).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Iterable, Iterator

from . import heap, metrics
from .core.runtimes import (CLUSTER_KIND, GROUP, KINDS, PLURALS, VERSION, Key, Runtime, RuntimeUnavailable,
                            WouldBlock, stored_version)

log = logging.getLogger(__name__)

WATCH_SECONDS = 240
LIST_PAGE = 500  # a page is parsed whole before its items are taken: smaller pages, a smaller peak
PAGE_BYTES = 4 << 20  # ... and after a page larger than this, fewer items a page
LIVE_READ_TIMEOUT = (2.0, 3.0)  # connect, read: well inside the API server's webhook timeout
NEGATIVE_SECONDS = 1.0  # a miss the API server confirmed is answered from memory this long (no live GET each time)
NEGATIVE_LIMIT = 10_000  # ... for at most this many names at once (then they are all forgotten)
FOUND_SECONDS = 5.0  # a runtime a live read found is answered from memory this long (the watch brings it meanwhile)


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


_local = threading.local()


def blocking_allowed() -> bool:
    """False on a thread that must not wait on the network (the worker's event loop answering inline)."""
    return not getattr(_local, "no_blocking", False)


class NoBlocking:
    """`with NoBlocking():` a cache miss raises WouldBlock instead of reading the API server."""

    def __enter__(self):
        _local.no_blocking = True

    def __exit__(self, *exc):
        _local.no_blocking = False


ListFn = Callable[[str], tuple[list[dict], str]]
WatchFn = Callable[[str, str], Iterable[dict]]


def slim(obj: dict, kind: str) -> Runtime:
    """What the rules read of a runtime, with its kind (list items may omit it)."""
    return Runtime.of(obj, kind)


class Reflector:
    """List, then watch from the list's resourceVersion; relist on 410 Gone and, with backoff, on errors."""

    def __init__(self, kind: str, index, list_fn: ListFn, watch_fn: WatchFn,
                 sleep: Callable[[float], None] = time.sleep, backoff: Backoff | None = None):
        """`index`: where runtimes go (a RuntimeIndex, or the pod's StoreWriter): put, delete, replace, count."""
        self.kind, self.index, self.list_fn, self.watch_fn, self.sleep = kind, index, list_fn, watch_fn, sleep
        self.backoff = backoff or Backoff()
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
                metrics.get().cache_sync.labels(self.kind).set_to_current_time()
                metrics.get().cache_size.labels(self.kind).set(count)
                self.backoff.reset()
                self._watch(version)
            except Gone:
                log.info("%s watch expired (410 Gone): relisting", self.kind)
            except Exception as e:  # API unreachable, bad answer: keep serving the cache, retry later
                metrics.get().api_errors.labels("list/watch", self.kind).inc()
                delay = self.backoff.next()
                log.warning("%s list/watch failed (%s): retrying in %.1fs", self.kind, e, delay)
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
                    obj = slim(obj, self.kind)
                    self.index.put(obj)
                elif kind == "DELETED":
                    obj = slim(obj, self.kind)
                    self.index.delete(obj)
                metrics.get().cache_size.labels(self.kind).set(self.index.count(self.kind))
                if self.stopped.is_set():
                    return
            # A watch that ends normally (server timeout) resumes from the last version seen.


class Listing:
    """Every runtime of `kind`, page by page (one snapshot: the pages share its resourceVersion), each item
    cut to its essentials as it arrives; `version` is the list's resourceVersion once the pages are read.

    A page holds LIST_PAGE items, fewer after a page of large ones (near PAGE_BYTES of JSON): runtimes near
    the size cap are read a few at a time, not hundreds at once."""

    def __init__(self, api: "RuntimeAPI", kind: str):
        self.api, self.kind, self.version = api, kind, None

    def __iter__(self) -> Iterator[Runtime]:
        import orjson

        token, version, limit = None, "", LIST_PAGE
        while True:
            metrics.get().api_requests.labels("list", self.kind).inc()
            kw = {"_continue": token} if token else {}
            raw = self.api.api.list_cluster_custom_object(GROUP, VERSION, PLURALS[self.kind], limit=limit,
                                                          _request_timeout=(5, 30), _preload_content=False, **kw).data
            got = orjson.loads(raw)
            items = got.get("items") or []
            if len(raw) > PAGE_BYTES and items:
                limit = max(1, min(LIST_PAGE, int(len(items) * PAGE_BYTES / len(raw))))
            meta = got.get("metadata") or {}
            version = meta.get("resourceVersion") or version
            token = meta.get("continue")
            raw = got = None
            while items:
                yield slim(items.pop(), self.kind)
            if not token:
                self.version = version
                return


class RuntimeAPI:
    """The three reads of runtimes the webhook makes: list (in pages), watch, and get one."""

    def __init__(self, api_client):
        from kubernetes import client

        self.api = client.CustomObjectsApi(api_client)

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        from kubernetes.client.exceptions import ApiException

        metrics.get().api_requests.labels("get", kind).inc()
        try:
            if kind == CLUSTER_KIND:
                return self.api.get_cluster_custom_object(GROUP, VERSION, PLURALS[kind], name,
                                                          _request_timeout=LIVE_READ_TIMEOUT)
            return self.api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURALS[kind], name,
                                                         _request_timeout=LIVE_READ_TIMEOUT)
        except ApiException as e:
            if e.status == 404:
                return None
            metrics.get().api_errors.labels("get", kind).inc()
            raise RuntimeUnavailable(f"the API server answered {e.status} {e.reason}") from None
        except Exception as e:
            metrics.get().api_errors.labels("get", kind).inc()
            raise RuntimeUnavailable(f"the API server cannot be reached: {type(e).__name__}") from None

    def list(self, kind: str) -> "Listing":
        return Listing(self, kind)

    def watch(self, kind: str, version: str) -> Iterator[dict]:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        metrics.get().api_requests.labels("watch", kind).inc()
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


class Keeper:
    """The pod's one list-and-watch per kind, writing into the store (run in the keeper process)."""

    def __init__(self, api: RuntimeAPI, store, start: bool = True):
        self.store = store
        self.reflectors = {k: Reflector(k, store, api.list, api.watch) for k in KINDS}
        if start:
            for r in self.reflectors.values():
                threading.Thread(target=r.run, name=f"watch-{r.kind}", daemon=True).start()

    def stop(self) -> None:
        for r in self.reflectors.values():
            r.stopped.set()


class ClusterRuntimes:
    """The RuntimeSource for a cluster, in a worker: the pod's store, with one live read to confirm a miss.

    A runtime found by a live read (created since the keeper last wrote) is kept here for a few seconds,
    until the watch brings it to the store; a confirmed miss is remembered for a second."""

    def __init__(self, store, api: RuntimeAPI | None, clock: Callable[[], float] = time.monotonic):
        self.store, self.api, self.clock = store, api, clock
        self._synced: set[str] = set()
        self._missing: dict[tuple[str, str, str], float] = {}  # key -> until when it is known not to exist
        self._found: dict[tuple[str, str, str], tuple[float, Runtime]] = {}  # key -> (until when, live read)
        self._judged: dict[bytes, tuple[bytes, object, bool]] = {}  # for readiness(): version, settings, verdict

    def synced(self, kind: str) -> bool:
        if kind not in self._synced and self.store.synced(kind):
            self._synced.add(kind)  # a store once listed stays listed (a relist swaps it whole)
        return kind in self._synced

    def ready(self) -> bool:
        return all(self.synced(k) for k in KINDS)

    def __iter__(self):
        return iter(self.store)

    def readiness(self, can_carry: Callable[[Runtime], bool], settings: Callable[[], object]) -> Iterator[tuple[Key, bool]]:
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

    def get(self, kind: str, namespace: str, name: str) -> Runtime | None:
        if not self.synced(kind):
            raise RuntimeUnavailable("the runtime cache has not completed its first list yet")
        found = self.store.get(kind, namespace, name)
        if found is not None:
            return found
        key = (kind, namespace, name)
        now = self.clock()
        until = self._missing.get(key)
        if until is not None and now < until:
            return None  # the negative cache: a name probed again and again costs the API server one GET a second
        live = self._found.get(key)
        if live is not None and now < live[0]:
            return live[1]
        if not blocking_allowed():
            raise WouldBlock(f"{kind} {namespace}/{name} is not in the cache")
        obj = self.api.get(kind, namespace, name) if self.api is not None else None
        for table in (self._missing, self._found):
            if len(table) >= NEGATIVE_LIMIT:
                table.clear()
        if obj is None:
            self._missing[key] = self.clock() + NEGATIVE_SECONDS
            self._found.pop(key, None)
            return None
        self._missing.pop(key, None)
        runtime = slim(obj, kind)
        self._found[key] = (self.clock() + FOUND_SECONDS, runtime)
        return runtime


def keep(directory: str, kubeconfig: str | None, parent: int) -> None:
    """The keeper process: the pod's watch, writing the store in `directory`, until its parent is gone."""
    from .store import StoreWriter

    _die_with_parent(parent)
    for kind in KINDS:  # first: a scrape while the client and the store are made already says "not synced"
        metrics.get().cache_synced.labels(kind).set(0)
    keeper = Keeper(RuntimeAPI(api_client(kubeconfig)), StoreWriter(directory))
    while os.getppid() == parent:
        for kind, reflector in keeper.reflectors.items():
            if reflector.synced.is_set():
                metrics.get().cache_synced.labels(kind).set(1)
        keeper.store.reader_check()
        time.sleep(1)


def _die_with_parent(parent: int) -> None:
    """SIGTERM when the master dies, however it dies (prctl PR_SET_PDEATHSIG); the loop above checks too."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(0)


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
