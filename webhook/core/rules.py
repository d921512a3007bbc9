"""The rules of SPEC 5, each reporting every violation it finds, with the walkers they share.

A TrainJob is walked once (`scan`): every runtimePatches entry but the webhook's own is checked by
S1, S2, S3 and S6 on the way, and the webhook's own entry is picked out for S4, S5 and SPEC 6.3.
A runtime is read once, when a source takes it (`runtimes.Runtime`), and judged once per settings
(`runtime_facts`: R3, R4, R5). Every reason carries the rule that found it (SPEC 8.1's `rule` label).
Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

from . import paths
from .errors import ErrInvalid, ErrNotFound, ErrUnsupported, Reason, Reasons, Sentinel
from .runtimes import CLUSTER_KIND, GROUP, KINDS, NAMESPACED_KIND, Job, Runtime
from .settings import PUBLISH_VOLUME, ROUTE_INIT_CONTAINER, Settings

NODE_CONTAINER = "node"
MAX_RUNTIME_PATCHES = 16
RESERVED_ENV_PREFIX = "DISPATCH_"
TORCH_RESERVED_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
# The mlPolicy sources that read numProcPerNode: processes per node, MPI slots, Flux tasks (R6).
PROC_POLICIES = ("torch", "mpi", "flux")
CONTAINER_LISTS = ("initContainers", "containers")


class Walk:
    """Typed access to an object that may be malformed: a wrong type is a reason, never an exception.

    Mutating webhooks see objects before the API server's schema validation, so nothing is assumed.
    """

    def __init__(self, reasons: Reasons, sentinel: Sentinel = ErrInvalid, rule: str = ""):
        self.reasons, self.sentinel, self.rule = reasons, sentinel, rule

    def bad(self, path: str, text: str) -> None:
        self.reasons.add(self.sentinel, path, text, self.rule)

    def obj(self, value: Any, path: str) -> dict[str, Any] | None:
        if value is None or isinstance(value, dict):
            return value
        self.bad(path, "must be an object")
        return None

    def items(self, value: Any, path: str) -> list[tuple[int, dict[str, Any]]]:
        if value is None:
            return []
        if not isinstance(value, list):
            self.bad(path, "must be a list")
            return []
        out = []
        for i, item in enumerate(value):
            if isinstance(item, dict):
                out.append((i, item))
            else:
                self.bad(f"{path}[{i}]", "must be an object")
        return out

    def dig(self, value: Any, path: str, *keys: str) -> tuple[dict[str, Any] | None, str]:
        """Follow `keys` through nested objects; (None, path) where one is absent or not an object."""
        value = self.obj(value, path)
        for k in keys:
            if value is None:
                break
            path = f"{path}.{k}"
            value = self.obj(value.get(k), path)
        return value, path

    def string(self, value: Any, path: str) -> str | None:
        if value is None or isinstance(value, str):
            return value
        self.bad(path, "must be a string")
        return None


@dataclass(frozen=True)
class PodSpec:
    """A pod spec inside a replicated job, of a runtime template or a runtimePatches entry."""

    job: str
    path: str
    spec: dict[str, Any]


def entry_pod_specs(entry: dict[str, Any], path: str, walk: Walk) -> list[PodSpec]:
    jobs_parent, jobs_path = walk.dig(entry, path, "trainingRuntimeSpec", "template", "spec")
    return _job_pod_specs(jobs_parent, jobs_path, walk)


def _job_pod_specs(parent: dict[str, Any] | None, path: str, walk: Walk) -> list[PodSpec]:
    if parent is None:
        return []
    out = []
    for j, job in walk.items(parent.get("replicatedJobs"), f"{path}.replicatedJobs"):
        spec, spec_path = walk.dig(job, f"{path}.replicatedJobs[{j}]", "template", "spec", "template", "spec")
        if spec is not None:
            name = job.get("name")
            out.append(PodSpec(name if isinstance(name, str) else "", spec_path, spec))
    return out


def containers(pod: PodSpec, walk: Walk) -> list[tuple[str, str, dict[str, Any]]]:
    """(list name, path, container) for every init container and container of a pod spec."""
    return [
        (lst, f"{pod.path}.{lst}[{i}]", c)
        for lst in CONTAINER_LISTS
        for i, c in walk.items(pod.spec.get(lst), f"{pod.path}.{lst}")
    ]


def mounts(container: dict[str, Any], path: str, walk: Walk) -> list[tuple[str, dict[str, Any]]]:
    return [(f"{path}.volumeMounts[{i}]", m) for i, m in walk.items(container.get("volumeMounts"),
                                                                    f"{path}.volumeMounts")]


def volumes(pod: PodSpec, walk: Walk) -> list[tuple[str, dict[str, Any]]]:
    return [(f"{pod.path}.volumes[{i}]", v) for i, v in walk.items(pod.spec.get("volumes"), f"{pod.path}.volumes")]


def container_names(pod: PodSpec, lst: str) -> set[Any]:
    found = pod.spec.get(lst)
    return {c.get("name") for c in found if isinstance(c, dict)} if isinstance(found, list) else set()


# ---- the TrainJob, walked once: S1, S2, S3, S6, and the webhook's own entry ----


class Own(NamedTuple):
    """The webhook's entry in a TrainJob: its index in runtimePatches and its content."""

    index: int  # type: ignore[assignment]  # the field shadows tuple.index, as a NamedTuple field may
    entry: dict[str, Any]


class Scan(NamedTuple):
    """What one walk of a TrainJob's spec found."""

    count: int  # type: ignore[assignment]  # runtimePatches entries (of any type); shadows tuple.count
    readable: bool                  # runtimePatches is absent or a list (else a reason says it is not)
    own: Own | None                 # the first entry under the webhook's manager
    env: tuple[tuple[str, str], ...]  # (path, name) of spec.trainer.env


def find_own(spec: Any, manager: str) -> Own | None:
    """The webhook's entry in a spec, without judging anything (for the old object of an UPDATE)."""
    patches = spec.get("runtimePatches") if isinstance(spec, dict) else None
    if isinstance(patches, list):
        for i, entry in enumerate(patches):
            if isinstance(entry, dict) and entry.get("manager") == manager:
                return Own(i, entry)
    return None


def scan(spec: dict[str, Any], settings: Settings, reasons: Reasons) -> Scan:
    """Walk spec.runtimePatches and spec.trainer.env once, applying S1, S2, S3 and S6 on the way."""
    manager = settings.manager
    walk = Walk(reasons, rule="S2")  # a malformed entry is found while looking for mounts in it
    patches = spec.get("runtimePatches")
    own: Own | None = None
    for i, entry in walk.items(patches, "spec.runtimePatches"):
        if entry.get("manager") == manager:
            if own is None:
                own = Own(i, entry)
            else:
                reasons.add(ErrInvalid, f"spec.runtimePatches[{i}].manager", f"{manager!r} appears more than once",
                            "S4")
            continue
        for pod in entry_pod_specs(entry, f"spec.runtimePatches[{i}]", walk):
            _entry_pod_rules(pod, settings, walk, reasons)
    env = _trainer_env(spec, reasons)
    for path, name in env:
        if _is_reserved_env(name):  # S3
            reasons.add(ErrInvalid, f"{path}.name",
                        f"{name!r}: names starting with {RESERVED_ENV_PREFIX} are reserved for the dispatch adapter",
                        "S3")
    count = len(patches) if isinstance(patches, list) else 0
    return Scan(count, patches is None or isinstance(patches, list), own, tuple(env))


def _entry_pod_rules(pod: PodSpec, settings: Settings, walk: Walk, reasons: Reasons) -> None:
    creds = settings.credentials
    for path, vol in volumes(pod, walk):
        name = vol.get("name")
        if _is_publish_volume(name):  # S1
            reasons.add(ErrInvalid, f"{path}.name",
                        f"volume name {name!r} is (or looks like) {PUBLISH_VOLUME!r}, "
                        "reserved for the webhook's publish volume",
                        "S1")
        for cred in creds:
            if _looks_like(name, cred.name):  # S6: Trainer merges volumes by name
                reasons.add(ErrInvalid, f"{path}.name",
                            f"volume name {name!r} is (or looks like) credential {cred.name!r}'s volume,"
                            " which only the webhook's entry defines", "S6")
    for _, cpath, container in containers(pod, walk):
        for mpath, mount in mounts(container, cpath, walk):
            mount_path = walk.string(mount.get("mountPath"), f"{mpath}.mountPath")
            if mount_path is not None:
                normal = paths.normalise(mount_path)  # once per mount: S2 and S6 compare it with their roots
                looks = normal if mount_path.isascii() else paths.normalise(paths.skeleton(mount_path))
                if paths.within(normal, paths.PUBLISH_DIR):  # S2
                    reasons.add(ErrInvalid, f"{mpath}.mountPath",
                                f"{mount_path!r} is at or under {paths.PUBLISH_DIR}, reserved for the publish mount",
                                "S2")
                elif paths.within(looks, paths.PUBLISH_DIR):  # S2, look-alikes
                    reasons.add(ErrInvalid, f"{mpath}.mountPath",
                                f"{mount_path!r} looks like a path under {paths.PUBLISH_DIR} (look-alike characters)",
                                "S2")
                for cred in creds:  # S6: Trainer merges mounts by path
                    if paths.within(normal, cred.mount_root) or paths.within(looks, cred.mount_root):
                        reasons.add(ErrInvalid, f"{mpath}.mountPath",
                                    f"{mount_path!r} is at or under credential {cred.name!r}'s mountPath"
                                    f" {cred.mount_path}, which only the webhook's entry mounts", "S6")
            if _is_publish_volume(mount.get("name")):  # S1: the reserved volume is mounted by its owner only
                reasons.add(ErrInvalid, f"{mpath}.name",
                            f"volume {PUBLISH_VOLUME!r} may be mounted only by the webhook's own entry", "S1")
        for i, env in walk.items(container.get("env"), f"{cpath}.env"):
            name = env.get("name")
            if _is_reserved_env(name):  # S3, for patched containers too
                reasons.add(ErrInvalid, f"{cpath}.env[{i}].name",
                            f"{name!r}: names starting with {RESERVED_ENV_PREFIX} "
                            "are reserved for the dispatch adapter", "S3")


def _looks_like(name: object, reserved: str) -> bool:
    return isinstance(name, str) and (name == reserved or paths.skeleton(name) == reserved)


def _is_publish_volume(name: object) -> bool:
    return _looks_like(name, PUBLISH_VOLUME)


def _is_reserved_env(name: object) -> bool:
    return isinstance(name, str) and (name.startswith(RESERVED_ENV_PREFIX)
                                      or paths.skeleton(name).startswith(RESERVED_ENV_PREFIX))


def _trainer_env(spec: dict[str, Any], reasons: Reasons) -> list[tuple[str, str]]:
    """(path, name) of every spec.trainer.env entry; read once per review, used by S3 and R7."""
    walk = Walk(reasons, rule="S3")
    trainer = walk.obj(spec.get("trainer"), "spec.trainer")
    if trainer is None:
        return []
    out = []
    for i, env in walk.items(trainer.get("env"), "spec.trainer.env"):
        name = env.get("name")
        if isinstance(name, str):
            out.append((f"spec.trainer.env[{i}]", name))
        elif name is not None:
            walk.bad(f"spec.trainer.env[{i}].name", "must be a string")
    return out


# ---- runtime requirements (R1 to R8) ----


class RuntimeRef(NamedTuple):
    api_group: str
    kind: str
    name: str
    namespace: str

    def __str__(self) -> str:
        where = f"{self.namespace}/" if self.kind == NAMESPACED_KIND else ""
        return f"{self.kind} {where}{self.name}"


def runtime_ref(spec: dict[str, Any], namespace: str, reasons: Reasons) -> RuntimeRef | None:
    """R1: the reference, with Trainer's defaults where a field is absent; None (with reasons) when it
    cannot be followed. An explicit "" is not absent: the CRD's defaulting would keep it, so it is refused."""
    ref = spec.get("runtimeRef")
    if ref.__class__ is dict:  # the usual shape, decided without a walk
        name, group, kind = ref.get("name"), ref.get("apiGroup"), ref.get("kind")
        if name and name.__class__ is str and group in (None, GROUP) and (kind is None or kind in KINDS):
            return RuntimeRef(GROUP, kind or CLUSTER_KIND, name, namespace)
    walk = Walk(reasons, rule="R1")
    ref = walk.obj(spec.get("runtimeRef"), "spec.runtimeRef")
    if ref is None:
        if "runtimeRef" not in spec or spec.get("runtimeRef") is None:
            reasons.add(ErrInvalid, "spec.runtimeRef", "required", "R1")
        return None
    ok = True
    name = ref.get("name")
    if name is None or name == "":
        reasons.add(ErrInvalid, "spec.runtimeRef.name", "required", "R1")
        ok = False
    elif not isinstance(name, str):
        walk.bad("spec.runtimeRef.name", "must be a string")
        ok = False
    group = walk.string(ref.get("apiGroup"), "spec.runtimeRef.apiGroup")
    kind = walk.string(ref.get("kind"), "spec.runtimeRef.kind")
    group_ok = isinstance(ref.get("apiGroup"), (str, type(None)))
    kind_ok = isinstance(ref.get("kind"), (str, type(None)))
    group = GROUP if group is None else group
    kind = CLUSTER_KIND if kind is None else kind
    if group_ok and group != GROUP:
        reasons.add(ErrUnsupported, "spec.runtimeRef.apiGroup", f"{group!r} is not supported: use {GROUP}", "R1")
    if kind_ok and kind not in KINDS:
        reasons.add(ErrUnsupported, "spec.runtimeRef.kind",
                    f"{kind!r} is not supported: use {CLUSTER_KIND} or {NAMESPACED_KIND}", "R1")
    if not (ok and group_ok and kind_ok and group == GROUP and kind in KINDS):
        return None
    return RuntimeRef(group, kind, cast(str, name), namespace)  # ok: a non-empty string


def not_found(ref: RuntimeRef, reasons: Reasons) -> None:
    """R2."""
    where = f" in namespace {ref.namespace}" if ref.kind == NAMESPACED_KIND else ""
    reasons.add(ErrNotFound, "spec.runtimeRef.name", f"{ref.kind} {ref.name!r} not found{where}", "R2")


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


def runtime_facts(runtime: Runtime | dict[str, Any], settings: Settings) -> RuntimeFacts:
    """R3, R4 and R5 for one runtime (an object is taken as a `Runtime` first). Each reason's text starts with
    the runtime (`subject`), and says what to change."""
    runtime = Runtime.of(runtime)
    reasons = Reasons()
    what = str(runtime)

    def unsupported(text: str, *, rule: str) -> None:
        reasons.append(Reason(ErrUnsupported, "spec.runtimeRef", f"{what}: {text}", rule, what))

    if runtime.oversize:  # R5: not held whole, so it cannot be checked
        unsupported(f"too large to check: {runtime.oversize}", rule="R5")
        return RuntimeFacts((), runtime.policies, tuple(reasons))
    targets = [j for j in runtime.jobs if NODE_CONTAINER in j.containers]
    if not targets:  # R3
        unsupported(f"no replicated job has a container named {NODE_CONTAINER!r}", rule="R3")
    publish = settings.publish
    if publish is not None and publish.via == ROUTE_INIT_CONTAINER:  # R4
        for job in targets:
            if publish.init_container not in job.init_containers:
                unsupported(f"job {job.name!r} lacks init container {publish.init_container!r}"
                            " (route 2)", rule="R4")
    _r5(runtime, targets, settings, unsupported)
    return RuntimeFacts(tuple(j.name for j in targets), runtime.policies, tuple(reasons))


def _r5(runtime: Runtime, targets: list[Job], settings: Settings, unsupported: Callable[..., None]) -> None:
    """R5: what the runtime defines that the webhook's entry would collide with, volumes by name and mounts by
    path, as Trainer and JobSet merge them."""
    creds = {c.name: c for c in settings.credentials}
    for name in runtime.claims:  # JobSet adds a volume of each claim template's name to the pods that mount it
        if name == PUBLISH_VOLUME:
            unsupported(f"rename volumeClaimPolicies claim template {name!r}: JobSet makes it a volume of that"
                        " name, which the webhook reserves", rule="R5")
        elif name in creds:
            unsupported(f"rename credential {name!r} or the volumeClaimPolicies claim template of that name: JobSet"
                        " makes the template a volume, and two volumes would share the name", rule="R5")
    for job in runtime.jobs:
        for name in job.volumes:
            if name == PUBLISH_VOLUME or name in creds:
                unsupported(f"replicated job {job.name!r} already defines volume {name!r},"
                            " a name the webhook reserves", rule="R5")
        for container, mp in job.publish_mounts:
            unsupported(f"replicated job {job.name!r} container {container!r}"
                        f" mounts {mp!r}, at or under {paths.PUBLISH_DIR}", rule="R5")
    for job in targets:  # where the credentials are mounted: Trainer merges mounts by path
        for mp in job.node_mounts:
            for cred in settings.credentials:
                if paths.within(mp, cred.mount_root):
                    unsupported(f"move credential {cred.name!r} ({cred.mount_path}) or the mount at {mp!r} of"
                                f" replicated job {job.name!r} container {NODE_CONTAINER!r}: one would replace"
                                " the other", rule="R5")
    if runtime.ssh_path:
        for cred in settings.credentials:
            if paths.overlaps(runtime.ssh_path, cred.mount_root):
                unsupported(f"move credential {cred.name!r} ({cred.mount_path}): it overlaps"
                            f" mlPolicy.mpi.sshAuthMountPath {runtime.ssh_path!r}, where MPI's SSH keys go", rule="R5")


def trainjob_runtime_rules(spec: dict[str, Any], ref: RuntimeRef, facts: RuntimeFacts,
                           env: Iterable[tuple[str, str]], reasons: Reasons) -> None:
    """R6 and R7: what the TrainJob asks of the runtime (R8 depends on the mutation and is checked with it)."""
    trainer = spec.get("trainer")
    if not isinstance(trainer, dict):
        trainer = {}
    if trainer.get("numProcPerNode") is not None and not facts.policies & set(PROC_POLICIES):  # R6
        reasons.add(ErrUnsupported, "spec.trainer.numProcPerNode",
                    f"{ref} has none of mlPolicy.torch, mpi or flux, so nothing reads numProcPerNode", "R6")
    if facts.torch:  # R7
        for path, name in env:
            if name in TORCH_RESERVED_ENV:
                reasons.add(ErrInvalid, f"{path}.name",
                            f"{name!r} is set by Trainer's torch plugin ({ref} uses mlPolicy.torch)", "R7")


def room_for_entry(count: int, reasons: Reasons) -> bool:
    """R8: adding one entry must not take runtimePatches past its CRD limit."""
    if count + 1 > MAX_RUNTIME_PATCHES:
        reasons.add(ErrUnsupported, "spec.runtimePatches",
                    f"has {count} entries; the webhook's entry would exceed the limit of {MAX_RUNTIME_PATCHES}", "R8")
        return False
    return True
