"""Where runtimes come from: the interface the core asks, and the in-memory index behind every source.

A source answers a runtime object, None when it does not exist, or raises RuntimeUnavailable when it
cannot tell now (SPEC 4: ErrUnavailable). Runtimes read from files (`webhook.files`) and the cluster's
watch cache (`webhook.cluster`) both fill the same index.
"""

from __future__ import annotations

import threading
from typing import Iterable, Protocol

GROUP = "trainer.kubeflow.org"
CLUSTER_KIND = "ClusterTrainingRuntime"
NAMESPACED_KIND = "TrainingRuntime"
KINDS = (CLUSTER_KIND, NAMESPACED_KIND)
TRAINJOB_KIND = "TrainJob"
VERSION = "v1alpha1"  # the Trainer API version read and reviewed
PLURALS = {CLUSTER_KIND: "clustertrainingruntimes", NAMESPACED_KIND: "trainingruntimes", TRAINJOB_KIND: "trainjobs"}

Key = tuple[str, str, str]  # (kind, namespace or "", name)


class RuntimeUnavailable(Exception):
    """The runtime cannot be read now (API unreachable, cache not synced); a retry may succeed."""


class WouldBlock(Exception):
    """The source would have to block (a live read on a cache miss) where its caller forbade it: the
    server answers most reviews on its event loop and runs this one again on a thread that may block."""


class RuntimeSource(Protocol):
    def get(self, kind: str, namespace: str, name: str) -> dict | None: ...

    def ready(self) -> bool: ...


def key(kind: str, namespace: str, name: str) -> Key:
    return (kind, namespace if kind == NAMESPACED_KIND else "", name)


def key_of(obj: dict) -> Key:
    meta = obj.get("metadata") or {}
    return key(obj.get("kind", ""), meta.get("namespace") or "", meta.get("name") or "")


class RuntimeIndex:
    """Runtimes in memory, keyed by kind, namespace and name; safe to read while a watcher writes."""

    def __init__(self, runtimes: Iterable[dict] = ()):
        self._lock = threading.Lock()
        self._items: dict[Key, dict] = {key_of(r): r for r in runtimes}

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        return self._items.get(key(kind, namespace, name))

    def ready(self) -> bool:
        return True

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(list(self._items.values()))

    def count(self, kind: str) -> int:
        return sum(1 for k in self._items if k[0] == kind)

    def put(self, obj: dict) -> None:
        with self._lock:
            self._items[key_of(obj)] = obj

    def delete(self, obj: dict) -> None:
        with self._lock:
            self._items.pop(key_of(obj), None)

    def replace(self, kind: str, objs: Iterable[dict]) -> None:
        """Swap in a fresh list of one kind atomically (after a list or relist)."""
        fresh = {key_of(o): o for o in objs}
        with self._lock:
            items = {k: v for k, v in self._items.items() if k[0] != kind}
            items.update(fresh)
            self._items = items
