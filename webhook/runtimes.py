"""Where runtimes come from: the interface the core asks, and the in-memory index behind every source.

A source answers a runtime object, None when it does not exist, or raises RuntimeUnavailable when it
cannot tell now (SPEC 4: ErrUnavailable). Runtimes from files live here; the cluster's watch cache,
which needs the Kubernetes client, lives in `cluster` and fills the same index.
"""

from __future__ import annotations

import threading
from typing import Iterable, Protocol

import yaml

GROUP = "trainer.kubeflow.org"
CLUSTER_KIND = "ClusterTrainingRuntime"
NAMESPACED_KIND = "TrainingRuntime"
KINDS = (CLUSTER_KIND, NAMESPACED_KIND)

Key = tuple[str, str, str]  # (kind, namespace or "", name)


class RuntimeUnavailable(Exception):
    """The runtime cannot be read now (API unreachable, cache not synced); a retry may succeed."""


class RuntimeFileError(ValueError):
    """A runtime file that cannot be used: unreadable, not YAML, or not a runtime."""


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


def load_files(paths: Iterable[str]) -> RuntimeIndex:
    """Runtimes from YAML files, each holding one or more ClusterTrainingRuntime or TrainingRuntime documents."""
    found: list[dict] = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                docs = list(yaml.safe_load_all(f))
        except OSError as e:
            raise RuntimeFileError(f"{path}: cannot read: {e.strerror}") from None
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise RuntimeFileError(f"{path}: not YAML: {e}") from None
        for i, doc in enumerate(docs):
            if doc is None:
                continue
            found.append(_check_runtime(doc, f"{path} document {i + 1}"))
    return RuntimeIndex(found)


def _check_runtime(doc, where: str) -> dict:
    if not isinstance(doc, dict):
        raise RuntimeFileError(f"{where}: not a mapping")
    kind, meta = doc.get("kind"), doc.get("metadata")
    if kind not in KINDS:
        raise RuntimeFileError(f"{where}: kind must be {CLUSTER_KIND} or {NAMESPACED_KIND}, not {kind!r}")
    api = str(doc.get("apiVersion", ""))
    if api.split("/")[0] != GROUP:
        raise RuntimeFileError(f"{where}: apiVersion must be {GROUP}/v1alpha1, not {api!r}")
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str) or not meta["name"]:
        raise RuntimeFileError(f"{where}: metadata.name is required")
    if kind == NAMESPACED_KIND and not meta.get("namespace"):
        raise RuntimeFileError(f"{where}: a TrainingRuntime needs metadata.namespace")
    if not isinstance(doc.get("spec", {}), dict):
        raise RuntimeFileError(f"{where}: spec must be a mapping")
    return doc
