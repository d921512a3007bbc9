"""Where runtimes come from: the interface the core asks, and the in-memory index behind every source.

A source answers a `Runtime`, None when it does not exist, or raises RuntimeUnavailable when it cannot
tell now (SPEC 4: ErrUnavailable). Runtimes read from files (`webhook.files`) and the cluster's watch
cache (`webhook.cluster`) both fill the same index.

A `Runtime` is what the rules read of a runtime object, taken once when a source takes the object: its
kind and name, its mlPolicy sources and, per replicated job, the names of its containers, init containers
and volumes and its mounts at or under /opt/dispatch. Nothing else of the object is kept (images,
commands, resources and managedFields are most of it), so a cache of 10,000 runtimes is small and a large
runtime stays small. What the rules decide of it for given settings (`rules.runtime_facts`, the entry) is
worked out once per settings and kept with it.
"""

from __future__ import annotations

import marshal
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol

from . import paths

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


def key(kind: str, namespace: str, name: str) -> Key:
    return (kind, namespace if kind == NAMESPACED_KIND else "", name)


# A runtime whose replicated jobs name more containers, volumes and mounts than this is not taken whole:
# it is held as too large to check, and cannot carry the mount (a tenant cannot grow the cache with it).
MAX_NAMES = 2000


@dataclass(frozen=True)
class Job:
    """One replicated job of a runtime's template, as the rules read it."""

    name: str
    containers: frozenset[str]          # names of the pod's containers
    init_containers: frozenset[str]     # ... and init containers
    volumes: tuple[str, ...]            # names of the pod's volumes
    publish_mounts: tuple[tuple[str, str], ...]  # (container, mountPath) at or under /opt/dispatch


# Jobs alike in every name are one object: runtimes stamped from one template (most of a large cluster's)
# share their jobs instead of holding a copy each.
_JOBS: "weakref.WeakValueDictionary[Job, Job]" = weakref.WeakValueDictionary()
_JOBS_LOCK = threading.Lock()


def _interned(job: Job) -> Job:
    with _JOBS_LOCK:
        return _JOBS.setdefault(job, job)


@dataclass(frozen=True)
class Runtime:
    """What the rules read of one ClusterTrainingRuntime or TrainingRuntime object (see the module doc)."""

    kind: str
    namespace: str
    name: str
    version: str = ""                   # metadata.resourceVersion
    policies: frozenset[str] = frozenset()  # the mlPolicy sources set: torch, mpi, flux, ...
    jobs: tuple[Job, ...] = ()
    oversize: int = 0                   # names counted when over MAX_NAMES (then no jobs are kept)
    # What the rules decided of it for one set of settings: (settings, previous settings, decided).
    memo: list = field(default_factory=lambda: [None], compare=False, repr=False)

    @property
    def key(self) -> Key:
        return key(self.kind, self.namespace, self.name)

    def __str__(self) -> str:
        where = f"{self.namespace}/" if self.kind == NAMESPACED_KIND else ""
        return f"{self.kind} {where}{self.name}"

    @classmethod
    def of(cls, obj: Any, kind: str | None = None) -> "Runtime":
        """Take a runtime object (as the API or a file gives it; `kind` where a list item omits its own).
        Stray shapes are read as absent, as the rules would find nothing in them."""
        if isinstance(obj, Runtime):
            return obj
        obj = obj if isinstance(obj, dict) else {}
        meta = _obj(obj.get("metadata"))
        spec = _obj(obj.get("spec"))
        found_kind = obj.get("kind") if obj.get("kind") in KINDS else (kind or CLUSTER_KIND)
        policy = _obj(spec.get("mlPolicy"))
        jobs, names = [], 0
        template = _obj(_obj(spec.get("template")).get("spec"))
        for rj in _list(template.get("replicatedJobs")):
            pod = _obj(_obj(_obj(_obj(_obj(rj).get("template")).get("spec")).get("template")).get("spec"))
            containers = _list(pod.get("containers"))
            inits = _list(pod.get("initContainers"))
            volumes = _list(pod.get("volumes"))
            names += len(containers) + len(inits) + len(volumes)
            mounts = []
            for c in containers + inits:
                for m in _list(_obj(c).get("volumeMounts")):
                    names += 1
                    mp = _obj(m).get("mountPath")
                    if isinstance(mp, str) and paths.under_publish_dir(mp):
                        mounts.append((str(_obj(c).get("name")), mp))
            if names > MAX_NAMES:
                break
            job_name = _obj(rj).get("name")
            jobs.append(_interned(Job(job_name if isinstance(job_name, str) else "", _names(containers),
                                      _names(inits),
                                      tuple(n for n in (_obj(v).get("name") for v in volumes) if isinstance(n, str)),
                                      tuple(mounts))))
        return cls(found_kind, str(meta.get("namespace") or "") if found_kind == NAMESPACED_KIND else "",
                   str(meta.get("name") or ""), str(meta.get("resourceVersion") or ""),
                   frozenset(k for k, v in policy.items() if v is not None),
                   () if names > MAX_NAMES else tuple(jobs), names if names > MAX_NAMES else 0)

    def to_bytes(self) -> bytes:
        """The runtime as stored in the shared cache (webhook.store): its resourceVersion, a NUL, then its
        fields as plain tuples (marshal: the store is written by this program only, never by a client)."""
        jobs = tuple((j.name, tuple(sorted(j.containers)), tuple(sorted(j.init_containers)), j.volumes,
                      j.publish_mounts) for j in self.jobs)
        return self.version.encode() + b"\0" + marshal.dumps(
            (self.kind, self.namespace, self.name, tuple(sorted(self.policies)), jobs, self.oversize))

    @classmethod
    def from_bytes(cls, raw: bytes) -> "Runtime":
        version, _, body = bytes(raw).partition(b"\0")
        kind, namespace, name, policies, jobs, oversize = marshal.loads(body)
        return cls(kind, namespace, name, version.decode(), frozenset(policies),
                   tuple(_interned(Job(n, frozenset(c), frozenset(i), v, m)) for n, c, i, v, m in jobs), oversize)


def stored_version(raw: bytes) -> bytes:
    """The resourceVersion of a stored runtime, without decoding the rest."""
    return bytes(raw[:raw.index(b"\0")])


def _obj(value) -> dict:
    return value if isinstance(value, dict) else {}


def _list(value) -> list:
    return value if isinstance(value, list) else []


def _names(items: list) -> frozenset[str]:
    return frozenset(n for n in (_obj(i).get("name") for i in items) if isinstance(n, str))


class RuntimeSource(Protocol):
    def get(self, kind: str, namespace: str, name: str) -> Runtime | None: ...

    def ready(self) -> bool: ...


def key_of(obj) -> Key:
    if isinstance(obj, Runtime):
        return obj.key
    meta = obj.get("metadata") or {}
    return key(obj.get("kind", ""), meta.get("namespace") or "", meta.get("name") or "")


class RuntimeIndex:
    """Runtimes in memory, keyed by kind, namespace and name; safe to read while a watcher writes. Objects
    put in are taken as `Runtime`s."""

    def __init__(self, runtimes: Iterable = ()):
        self._lock = threading.Lock()
        taken = (Runtime.of(r) for r in runtimes)
        self._items: dict[Key, Runtime] = {r.key: r for r in taken}

    def get(self, kind: str, namespace: str, name: str) -> Runtime | None:
        return self._items.get(key(kind, namespace, name))

    def ready(self) -> bool:
        return True

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(list(self._items.values()))

    def count(self, kind: str) -> int:
        return sum(1 for k in self._items if k[0] == kind)

    def put(self, obj) -> Runtime:
        runtime = Runtime.of(obj)
        with self._lock:
            self._items[runtime.key] = runtime
        return runtime

    def delete(self, obj) -> None:
        with self._lock:
            self._items.pop(key_of(obj), None)

    def replace(self, kind: str, objs: Iterable) -> int:
        """Swap in a fresh list of one kind atomically (after a list or relist); how many it holds."""
        fresh = {r.key: r for r in (Runtime.of(o, kind) for o in objs)}
        with self._lock:
            items = {k: v for k, v in self._items.items() if k[0] != kind}
            items.update(fresh)
            self._items = items
        return len(fresh)
