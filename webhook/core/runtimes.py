"""Where runtimes come from: the interface the core asks, and the in-memory index behind every source.

A source answers a `Runtime`, None when it does not exist, or raises RuntimeUnavailable when it cannot
tell now (SPEC 4: ErrUnavailable). Runtimes read from files (`webhook.commands.files`) and the cluster's watch
cache (`webhook.kube.cluster`) both fill the same index.

A `Runtime` is what the rules read of a runtime object, taken once when a source takes the object: its
kind and name, its mlPolicy sources (and MPI's sshAuthMountPath), the JobSet template's claim template
names and, per replicated job, the names of its containers, init containers and volumes (and each volume's
source), the volumes each
container and init container mounts (by name), its mounts at or under /opt/dispatch and the `node` container's
mount paths. Nothing else of the object is kept (images,
commands, env, resources and managedFields are most of it), so a cache of 10,000 runtimes is small, and
what is kept of one runtime is bounded by counts and bytes (MAX_JOBS, MAX_NAMES, MAX_STORED_BYTES): a
runtime past them is kept as too large to check. What the rules decide of it for given settings
(`rules.runtime_facts`, the entry) is worked out once per settings and kept in `memos.Memos`, which the
`Admission` owns.
"""

from __future__ import annotations

import dataclasses
import enum
import marshal
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from . import paths
from .errors import Reason

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


class Pending(enum.Enum):
    """What a source answers for a runtime it can tell only by blocking (a live read on a cache miss) where its
    caller forbade it (webhook.process.blocking): the review waits at that point for the same `get` made where
    blocking is allowed (webhook.core.admission.Reviewing)."""

    PENDING = "pending"


PENDING = Pending.PENDING


def key(kind: str, namespace: str, name: str) -> Key:
    return (kind, namespace if kind == NAMESPACED_KIND else "", name)


# What is kept of one runtime is bounded, whatever the object (issue 33): a runtime over any of these is held as
# too large to check (R5 refuses TrainJobs naming it, saying which bound it passed), never dropped, and stored as
# its name and that reason alone. A tenant who may create TrainingRuntimes then cannot grow the pod's cache by
# more than MAX_STORED_BYTES a runtime, nor the keeper's work per runtime by more than these counts.
MAX_JOBS = 100            # replicated jobs (Trainer's stock runtimes have 1 to 3)
MAX_NAMES = 2000          # containers, init containers, volumes, mounts, claim templates and mlPolicy sources
MAX_STORED_BYTES = 64 * 1024  # the strings kept, summed in UTF-8 bytes (names and mount paths); stored, a little more
MAX_PATH = 4096           # one mount path, in UTF-8 bytes (Linux's PATH_MAX)
# What one namespace's TrainingRuntimes may take of the pod's store, in stored bytes (issue 47; `keep
# --namespace-share`): past it a runtime is held as its name and the reason (webhook.kube.store), so one tenant
# cannot fill the store for the others. 16 MiB is 256 runtimes at MAX_STORED_BYTES, tens of thousands of ordinary ones.
NAMESPACE_SHARE = 16 << 20
DEFAULT_SSH_AUTH_MOUNT_PATH = "/root/.ssh"  # Trainer's default for mlPolicy.mpi.sshAuthMountPath


class Mounter(NamedTuple):
    """A container or init container of a replicated job and the volumes it mounts, by name (R5: after the
    merge, a mount of a volume the entry defines mounts the entry's volume)."""

    name: str
    init: bool                          # an init container
    volumes: tuple[str, ...]            # the volume names its volumeMounts name, each once, in order


@dataclass(frozen=True)
class Job:
    """One replicated job of a runtime's template, as the rules read it."""

    name: str
    containers: frozenset[str]          # names of the pod's containers
    init_containers: frozenset[str]     # ... and init containers
    volumes: tuple[str, ...]            # names of the pod's volumes
    publish_mounts: tuple[tuple[str, str], ...]  # (container, mountPath) at or under /opt/dispatch
    node_mounts: tuple[str, ...] = ()   # the `node` container's mount paths, normalised (R5: credentials' paths)
    mounters: tuple[Mounter, ...] = ()  # the containers and init containers that mount volumes (R5)
    sources: tuple[str, ...] = ()       # the source of each of `volumes` (`hostPath`, `emptyDir`, ...; "" unknown)


# Jobs alike in every name are one object: runtimes stamped from one template (most of a large cluster's)
# share their jobs instead of holding a copy each. Keyed by a tuple of the job's fields, not the job: a key is
# held strongly, so a job as its own key was never freed (a relist of 1,500 distinct runtimes kept them all).
_JOBS: weakref.WeakValueDictionary[tuple[object, ...], Job] = weakref.WeakValueDictionary()
_JOBS_LOCK = threading.Lock()
_JOB_FIELDS = dataclasses.fields(Job)


def _interned(job: Job) -> Job:
    fields = tuple(getattr(job, f.name) for f in _JOB_FIELDS)  # every field: two jobs differing in one are two
    with _JOBS_LOCK:
        return _JOBS.setdefault(fields, job)


class _TooLarge(Exception):
    """A runtime passed one of the bounds above; the message says which, for R5's reason."""


class _Budget:
    """Counts what `Runtime.of` keeps as it walks, and stops the walk at the first bound passed."""

    def __init__(self) -> None:
        self.names = self.bytes = 0

    def count(self) -> None:
        self.names += 1
        if self.names > MAX_NAMES:
            raise _TooLarge(f"its template names more than {MAX_NAMES} containers, volumes, mounts and claims")

    def name(self, text: str) -> str:
        """`text`, kept: counted as a name and by its bytes."""
        self.count()
        self.bytes += utf8_size(text)  # bytes, not characters: a 4-byte character counts 4
        if self.bytes > MAX_STORED_BYTES:
            raise _TooLarge(f"the names and paths it holds come to more than {MAX_STORED_BYTES} bytes")
        return text


NODE = "node"  # the trainer node container (SPEC 1)


@dataclass(frozen=True)
class Runtime:
    """What the rules read of one ClusterTrainingRuntime or TrainingRuntime object (see the module doc)."""

    kind: str
    namespace: str
    name: str
    version: str = ""                   # metadata.resourceVersion
    policies: frozenset[str] = frozenset()  # the mlPolicy sources set: torch, mpi, flux, ...
    jobs: tuple[Job, ...] = ()
    claims: tuple[str, ...] = ()        # the JobSet template's volumeClaimPolicies claim template names (R5)
    ssh_path: str = ""                  # mlPolicy.mpi's sshAuthMountPath, normalised; "" without mlPolicy.mpi (R5)
    oversize: str = ""                  # why it is too large to check (then nothing but its name is kept)

    @property
    def key(self) -> Key:
        return key(self.kind, self.namespace, self.name)

    def __str__(self) -> str:
        where = f"{self.namespace}/" if self.kind == NAMESPACED_KIND else ""
        return f"{self.kind} {where}{self.name}"

    @classmethod
    def of(cls, obj: Any, kind: str | None = None) -> Runtime:
        """Take a runtime object (as the API or a file gives it; `kind` where a list item omits its own).
        Stray shapes are read as absent, as the rules would find nothing in them."""
        if isinstance(obj, Runtime):
            return obj
        obj = obj if isinstance(obj, dict) else {}
        meta = _obj(obj.get("metadata"))
        spec = _obj(obj.get("spec"))
        found_kind = obj.get("kind") if obj.get("kind") in KINDS else (kind or CLUSTER_KIND)
        namespace = str(meta.get("namespace") or "")[:253] if found_kind == NAMESPACED_KIND else ""
        name, version = str(meta.get("name") or "")[:253], str(meta.get("resourceVersion") or "")[:64]
        try:
            return cls(found_kind, namespace, name, version, **_taken(spec))
        except _TooLarge as e:
            return cls(found_kind, namespace, name, version, oversize=str(e))

    def to_bytes(self) -> bytes:
        """The runtime as stored in the shared cache (webhook.kube.store): its resourceVersion, a NUL, then its
        fields as plain tuples (marshal: the store is written by this program only, never by a client)."""
        jobs = tuple((j.name, tuple(sorted(j.containers)), tuple(sorted(j.init_containers)), j.volumes,
                      j.publish_mounts, j.node_mounts, tuple((m.name, m.init, m.volumes) for m in j.mounters),
                      j.sources) for j in self.jobs)
        return self.version.encode() + b"\0" + marshal.dumps(
            (self.kind, self.namespace, self.name, tuple(sorted(self.policies)), jobs, self.claims, self.ssh_path,
             self.oversize))

    @classmethod
    def from_bytes(cls, raw: bytes) -> Runtime:
        version, _, body = bytes(raw).partition(b"\0")
        kind, namespace, name, policies, jobs, claims, ssh_path, oversize = marshal.loads(body)
        return cls(kind, namespace, name, version.decode(), frozenset(policies),
                   tuple(_interned(Job(n, frozenset(c), frozenset(i), v, m, nm, tuple(Mounter(*t) for t in mt),
                                       tuple(_SOURCES.get(k, "") for k in src)))
                         for n, c, i, v, m, nm, mt, src in jobs),
                   claims, ssh_path, oversize)


def _taken(spec: dict[str, Any]) -> dict[str, Any]:
    """The fields of a Runtime read from a runtime's spec, within the bounds (raises _TooLarge)."""
    budget = _Budget()
    policy = _obj(spec.get("mlPolicy"))
    policies = frozenset(budget.name(k) for k, v in policy.items() if v is not None)
    mpi = policy.get("mpi")
    ssh_path = ""
    if isinstance(mpi, dict):
        given = mpi.get("sshAuthMountPath")
        ssh_path = budget.name(_path(given if isinstance(given, str) and given else DEFAULT_SSH_AUTH_MOUNT_PATH))
    template = _obj(_obj(spec.get("template")).get("spec"))
    claims = tuple(budget.name(n) for n in (
        _obj(_obj(t).get("metadata")).get("name")
        for p in _list(template.get("volumeClaimPolicies")) for t in _list(_obj(p).get("templates")))
        if isinstance(n, str))
    replicated = _list(template.get("replicatedJobs"))
    if len(replicated) > MAX_JOBS:
        raise _TooLarge(f"it has {len(replicated)} replicated jobs, more than {MAX_JOBS}")
    return {"policies": policies, "jobs": tuple(_job(_obj(rj), budget) for rj in replicated), "claims": claims,
            "ssh_path": ssh_path}


def _job(rj: dict[str, Any], budget: _Budget) -> Job:
    pod = _obj(_obj(_obj(_obj(rj.get("template")).get("spec")).get("template")).get("spec"))
    containers = _list(pod.get("containers"))
    inits = _list(pod.get("initContainers"))
    publish_mounts, node_mounts, mounters = [], set(), []
    for listed, are_containers in ((containers, True), (inits, False)):
        for c in listed:
            c = _obj(c)
            container = c.get("name")
            node = are_containers and container == NODE
            mounted: dict[str, None] = {}  # the volume names, each once, in order
            for m in _list(c.get("volumeMounts")):
                m = _obj(m)
                mp, volume = m.get("mountPath"), m.get("name")
                if isinstance(volume, str):  # every mount costs the walk, kept or not: one name each
                    mounted[budget.name(volume)] = None
                else:
                    budget.count()
                if not isinstance(mp, str):
                    continue
                normal = _path(mp)
                if paths.within(normal, paths.PUBLISH_DIR):
                    publish_mounts.append((budget.name(str(container)[:253]), budget.name(mp)))
                if node:
                    node_mounts.add(normal)
            if mounted:  # a container without a string name (no schema checked a runtime file) still mounts
                name = container if isinstance(container, str) else budget.name(str(container)[:253])
                mounters.append(Mounter(name, not are_containers, tuple(mounted)))
    job_name = rj.get("name")
    volumes = [v for v in map(_obj, _list(pod.get("volumes"))) if isinstance(v.get("name"), str)]
    return _interned(Job(budget.name(job_name) if isinstance(job_name, str) else "",
                         frozenset(_names(containers, budget)), frozenset(_names(inits, budget)),
                         tuple(_names(volumes, budget)), tuple(publish_mounts),
                         tuple(budget.name(p) for p in sorted(node_mounts)),  # counted again: kept too
                         tuple(mounters), tuple(_source(v) for v in volumes)))


# The sources a pod's volume may have (Kubernetes' core/v1 Volume): one of these strings is kept per volume, so a
# volume's source costs the stored form a reference, not its bytes.
_SOURCES = {k: k for k in (
    "awsElasticBlockStore", "azureDisk", "azureFile", "cephfs", "cinder", "configMap", "csi", "downwardAPI",
    "emptyDir", "ephemeral", "fc", "flexVolume", "flocker", "gcePersistentDisk", "gitRepo", "glusterfs", "hostPath",
    "image", "iscsi", "nfs", "persistentVolumeClaim", "photonPersistentDisk", "portworxVolume", "projected",
    "quobyte", "rbd", "scaleIO", "secret", "storageos", "vsphereVolume")}


def _source(volume: dict[str, Any]) -> str:
    """The volume's source, by its key (`hostPath`); "" for none this program knows."""
    return next((_SOURCES[k] for k, v in volume.items() if k in _SOURCES and v is not None), "")


def _path(text: str) -> str:
    if len(text) > MAX_PATH or utf8_size(text) > MAX_PATH:  # characters first: no encoding of a huge path
        raise _TooLarge(f"a mount path is longer than {MAX_PATH} bytes")
    return paths.normalise(text)


def utf8_size(text: str) -> int:
    """`text`'s size in UTF-8 bytes, every bound's unit (a lone surrogate, which JSON can carry, counts 3)."""
    return len(text.encode("utf-8", "surrogatepass"))


def stored_version(raw: bytes) -> bytes:
    """The resourceVersion of a stored runtime, without decoding the rest."""
    return bytes(raw[:raw.index(b"\0")])


def _obj(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def _names(items: list[Any], budget: _Budget) -> list[str]:
    return [budget.name(n) for n in (_obj(i).get("name") for i in items) if isinstance(n, str)]


class RuntimeSource(Protocol):
    def get(self, kind: str, namespace: str, name: str) -> Runtime | Pending | None: ...

    def ready(self) -> bool: ...


def key_of(obj: Runtime | dict[str, Any]) -> Key:
    if isinstance(obj, Runtime):
        return obj.key
    meta = obj.get("metadata") or {}
    return key(obj.get("kind", ""), meta.get("namespace") or "", meta.get("name") or "")


class RuntimeIndex:
    """Runtimes in memory, keyed by kind, namespace and name; safe to read while a watcher writes. Objects
    put in are taken as `Runtime`s."""

    def __init__(self, runtimes: Iterable[Any] = ()) -> None:
        self._lock = threading.Lock()
        taken = (Runtime.of(r) for r in runtimes)
        self._items: dict[Key, Runtime] = {r.key: r for r in taken}

    def get(self, kind: str, namespace: str, name: str) -> Runtime | None:
        return self._items.get(key(kind, namespace, name))

    def ready(self) -> bool:
        return True

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Runtime]:
        return iter(list(self._items.values()))

    def count(self, kind: str) -> int:
        return sum(1 for k in self._items if k[0] == kind)

    def put(self, obj: Any) -> Runtime:
        runtime = Runtime.of(obj)
        with self._lock:
            self._items[runtime.key] = runtime
        return runtime

    def delete(self, obj: Runtime | dict[str, Any]) -> None:
        with self._lock:
            self._items.pop(key_of(obj), None)

    def replace(self, kind: str, objs: Iterable[Any]) -> int:
        """Swap in a fresh list of one kind atomically (after a list or relist); how many it holds."""
        fresh = {r.key: r for r in (Runtime.of(o, kind) for o in objs)}
        with self._lock:
            items = {k: v for k, v in self._items.items() if k[0] != kind}
            items.update(fresh)
            self._items = items
        return len(fresh)


# ---- what a TrainJob names and what a runtime decides (the rules make them; the registry's hooks read them) ----

class RuntimeRef(NamedTuple):
    api_group: str
    kind: str
    name: str
    namespace: str

    def __str__(self) -> str:
        where = f"{self.namespace}/" if self.kind == NAMESPACED_KIND else ""
        return f"{self.kind} {where}{self.name}"


@dataclass(frozen=True)
class RuntimeFacts:
    """What a runtime alone decides for one set of settings (R3, R4, R5, its mlPolicy)."""

    targets: tuple[str, ...]  # the replicated jobs whose pod has a `node` container (R3)
    policies: frozenset[str]  # the mlPolicy sources set: torch, mpi, flux, ...
    reasons: tuple[Reason, ...]  # R3, R4 and R5 reasons, field spec.runtimeRef

    @property
    def torch(self) -> bool:
        return "torch" in self.policies

    @property
    def can_carry(self) -> bool:
        return not self.reasons
