"""Runtimes from the Kubernetes API: a list-and-watch cache, so a review of a known runtime makes no call.

Each gunicorn worker keeps its own cache (replicated, not shared): two workers mean two watches,
a small and constant load on the API server, and no cross-process state to get wrong. A miss is
confirmed with one live read before it is reported as not found (SPEC 7).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable, Iterator

from . import metrics
from .core.runtimes import (CLUSTER_KIND, GROUP, NAMESPACED_KIND, Runtime, RuntimeIndex, RuntimeUnavailable, WouldBlock,
                            key_of)

log = logging.getLogger(__name__)

VERSION = "v1alpha1"
PLURALS = {CLUSTER_KIND: "clustertrainingruntimes", NAMESPACED_KIND: "trainingruntimes"}
WATCH_SECONDS = 240
LIST_PAGE = 500  # a page is parsed whole before its items are taken: smaller pages, a smaller peak
LIVE_READ_TIMEOUT = (2.0, 3.0)  # connect, read: well inside the API server's webhook timeout
NEGATIVE_SECONDS = 1.0  # a miss the API server confirmed is answered from memory this long (no live GET each time)
NEGATIVE_LIMIT = 10_000  # ... for at most this many names at once (then the oldest are forgotten)


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


class Readiness:
    """dispatch_admission_runtime_ready from the watch cache (SPEC 8.3): 1 when the runtime can carry the
    publish mount, 0 when TrainJobs naming it are refused; a deleted runtime's series goes away."""

    def __init__(self, can_carry: Callable[[dict], bool]):
        self.can_carry = can_carry

    def put(self, obj) -> None:
        kind, namespace, name = key_of(obj)
        try:
            ready = self.can_carry(obj)
        except Exception:  # a runtime the rules cannot read cannot carry the mount either
            log.exception("judging runtime %s %s/%s", kind, namespace, name)
            ready = False
        metrics.set_runtime_ready(kind, namespace, name, ready)

    def delete(self, obj) -> None:
        metrics.forget_runtime(*key_of(obj))

    def replace(self, kind: str, objs: list) -> None:
        metrics.forget_runtimes(kind)
        for obj in objs:
            self.put(obj)


class Reflector:
    """List, then watch from the list's resourceVersion; relist on 410 Gone and, with backoff, on errors."""

    def __init__(self, kind: str, index: RuntimeIndex, list_fn: ListFn, watch_fn: WatchFn,
                 sleep: Callable[[float], None] = time.sleep, backoff: Backoff | None = None,
                 readiness: Readiness | None = None):
        self.kind, self.index, self.list_fn, self.watch_fn, self.sleep = kind, index, list_fn, watch_fn, sleep
        self.readiness = readiness
        self.backoff = backoff or Backoff()
        self.synced = threading.Event()
        self.stopped = threading.Event()

    def run(self, rounds: int | None = None) -> None:
        """Loop until stopped; `rounds` bounds the list-and-watch cycles (for tests)."""
        while not self.stopped.is_set() and (rounds is None or rounds > 0):
            rounds = None if rounds is None else rounds - 1
            try:
                items, version = self.list_fn(self.kind)
                items = [slim(i, self.kind) for i in items]  # list items may also omit their kind
                self.index.replace(self.kind, items)
                if self.readiness:
                    self.readiness.replace(self.kind, items)
                self.synced.set()
                metrics.CACHE_SYNC.labels(self.kind).set_to_current_time()
                metrics.CACHE_SIZE.labels(self.kind).set(len(items))
                self.backoff.reset()
                self._watch(version)
            except Gone:
                log.info("%s watch expired (410 Gone): relisting", self.kind)
            except Exception as e:  # API unreachable, bad answer: keep serving the cache, retry later
                metrics.API_ERRORS.labels("list/watch", self.kind).inc()
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
                    if self.readiness:
                        self.readiness.put(obj)
                elif kind == "DELETED":
                    obj = slim(obj, self.kind)
                    self.index.delete(obj)
                    if self.readiness:
                        self.readiness.delete(obj)
                metrics.CACHE_SIZE.labels(self.kind).set(self.index.count(self.kind))
                if self.stopped.is_set():
                    return
            # A watch that ends normally (server timeout) resumes from the last version seen.


class ClusterRuntimes:
    """The RuntimeSource for a cluster: the watch cache, with one live read to confirm a miss."""

    def __init__(self, api_client, start: bool = True, can_carry: Callable[[dict], bool] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        from kubernetes import client

        self.api = client.CustomObjectsApi(api_client)
        self.index = RuntimeIndex()
        self.clock = clock
        self._missing: dict[tuple[str, str, str], float] = {}  # key -> until when it is known not to exist
        readiness = Readiness(can_carry) if can_carry else None
        self.reflectors = {k: Reflector(k, self.index, self._list, self._watch, readiness=readiness) for k in PLURALS}
        if start:
            for r in self.reflectors.values():
                threading.Thread(target=r.run, name=f"watch-{r.kind}", daemon=True).start()

    def ready(self) -> bool:
        return all(r.synced.is_set() for r in self.reflectors.values())

    def stop(self) -> None:
        for r in self.reflectors.values():
            r.stopped.set()

    def get(self, kind: str, namespace: str, name: str) -> Runtime | None:
        if not self.reflectors[kind].synced.is_set():
            raise RuntimeUnavailable("the runtime cache has not completed its first list yet")
        found = self.index.get(kind, namespace, name)
        if found is not None:
            return found
        key = (kind, namespace, name)
        until = self._missing.get(key)
        if until is not None and self.clock() < until:
            return None  # the negative cache: a name probed again and again costs the API server one GET a second
        if not blocking_allowed():
            raise WouldBlock(f"{kind} {namespace}/{name} is not in the cache")
        found = self._live_read(kind, namespace, name)
        if found is None:
            if len(self._missing) >= NEGATIVE_LIMIT:
                self._missing.clear()
            self._missing[key] = self.clock() + NEGATIVE_SECONDS
        else:
            self._missing.pop(key, None)
        return found

    def _live_read(self, kind: str, namespace: str, name: str) -> Runtime | None:
        from kubernetes.client.exceptions import ApiException

        metrics.API_REQUESTS.labels("get", kind).inc()
        try:
            if kind == CLUSTER_KIND:
                obj = self.api.get_cluster_custom_object(GROUP, VERSION, PLURALS[kind], name,
                                                         _request_timeout=LIVE_READ_TIMEOUT)
            else:
                obj = self.api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURALS[kind], name,
                                                            _request_timeout=LIVE_READ_TIMEOUT)
        except ApiException as e:
            if e.status == 404:
                return None
            metrics.API_ERRORS.labels("get", kind).inc()
            raise RuntimeUnavailable(f"the API server answered {e.status} {e.reason}") from None
        except Exception as e:
            metrics.API_ERRORS.labels("get", kind).inc()
            raise RuntimeUnavailable(f"the API server cannot be reached: {type(e).__name__}") from None
        obj = slim(obj, kind)
        self.index.put(obj)
        return obj

    def _list(self, kind: str) -> tuple[list, str]:
        """Every runtime of `kind`, in pages (one snapshot: the pages share its resourceVersion), each item
        cut to its essentials as it arrives, so a large list never sits in memory whole."""
        items: list[dict] = []
        token, version = None, ""
        while True:
            metrics.API_REQUESTS.labels("list", kind).inc()
            kw = {"_continue": token} if token else {}
            got = self.api.list_cluster_custom_object(GROUP, VERSION, PLURALS[kind], limit=LIST_PAGE,
                                                      _request_timeout=(5, 30), **kw)
            items += [slim(i, kind) for i in got.get("items") or []]
            meta = got.get("metadata") or {}
            version = meta.get("resourceVersion") or version
            token = meta.get("continue")
            if not token:
                return items, version

    def _watch(self, kind: str, version: str) -> Iterator[dict]:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        metrics.API_REQUESTS.labels("watch", kind).inc()
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
