"""The rules of SPEC 5, each reporting every violation it finds, plus the walkers they share.

Shape rules (S1 to S3) read only the TrainJob; runtime requirements (R1 to R8) read the runtime it
names. S4 and S5 compare the webhook's own entry with the computed one, and live in `admission`
beside the mutation they mirror. Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import paths
from .errors import ErrInvalid, ErrNotFound, ErrUnsupported, Reasons, Sentinel
from .runtimes import CLUSTER_KIND, GROUP, KINDS, NAMESPACED_KIND
from .settings import PUBLISH_VOLUME, ROUTE_INIT_CONTAINER, Settings

NODE_CONTAINER = "node"
MAX_RUNTIME_PATCHES = 16
RESERVED_ENV_PREFIX = "DISPATCH_"
TORCH_RESERVED_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
CONTAINER_LISTS = ("initContainers", "containers")


class Walk:
    """Typed access to an object that may be malformed: a wrong type is a reason, never an exception.

    Mutating webhooks see objects before the API server's schema validation, so nothing is assumed.
    """

    def __init__(self, reasons: Reasons, sentinel: Sentinel = ErrInvalid):
        self.reasons = reasons
        self.sentinel = sentinel

    def obj(self, value, path: str) -> dict | None:
        if value is None or isinstance(value, dict):
            return value
        self.reasons.add(self.sentinel, path, "must be an object")
        return None

    def items(self, value, path: str) -> list[tuple[int, dict]]:
        if value is None:
            return []
        if not isinstance(value, list):
            self.reasons.add(self.sentinel, path, "must be a list")
            return []
        out = []
        for i, item in enumerate(value):
            if isinstance(item, dict):
                out.append((i, item))
            else:
                self.reasons.add(self.sentinel, f"{path}[{i}]", "must be an object")
        return out

    def dig(self, value, path: str, *keys: str) -> tuple[dict | None, str]:
        """Follow `keys` through nested objects; (None, path) where one is absent or not an object."""
        value = self.obj(value, path)
        for k in keys:
            if value is None:
                break
            path = f"{path}.{k}"
            value = self.obj(value.get(k), path)
        return value, path

    def string(self, value, path: str) -> str | None:
        if value is None or isinstance(value, str):
            return value
        self.reasons.add(self.sentinel, path, "must be a string")
        return None


@dataclass(frozen=True)
class PodSpec:
    """A pod spec inside a replicated job, of a runtime template or a runtimePatches entry."""

    job: str
    path: str
    spec: dict


def entry_pod_specs(entry: dict, path: str, walk: Walk) -> list[PodSpec]:
    jobs_parent, jobs_path = walk.dig(entry, path, "trainingRuntimeSpec", "template", "spec")
    return _job_pod_specs(jobs_parent, jobs_path, walk)


def runtime_pod_specs(runtime: dict, walk: Walk) -> list[PodSpec]:
    jobs_parent, jobs_path = walk.dig(runtime, "runtime", "spec", "template", "spec")
    return _job_pod_specs(jobs_parent, jobs_path, walk)


def _job_pod_specs(parent: dict | None, path: str, walk: Walk) -> list[PodSpec]:
    if parent is None:
        return []
    out = []
    for j, job in walk.items(parent.get("replicatedJobs"), f"{path}.replicatedJobs"):
        spec, spec_path = walk.dig(job, f"{path}.replicatedJobs[{j}]", "template", "spec", "template", "spec")
        if spec is not None:
            name = job.get("name")
            out.append(PodSpec(name if isinstance(name, str) else "", spec_path, spec))
    return out


def containers(pod: PodSpec, walk: Walk) -> list[tuple[str, str, dict]]:
    """(list name, path, container) for every init container and container of a pod spec."""
    return [
        (lst, f"{pod.path}.{lst}[{i}]", c)
        for lst in CONTAINER_LISTS
        for i, c in walk.items(pod.spec.get(lst), f"{pod.path}.{lst}")
    ]


def mounts(container: dict, path: str, walk: Walk) -> list[tuple[str, dict]]:
    return [(f"{path}.volumeMounts[{i}]", m) for i, m in walk.items(container.get("volumeMounts"), f"{path}.volumeMounts")]


def volumes(pod: PodSpec, walk: Walk) -> list[tuple[str, dict]]:
    return [(f"{pod.path}.volumes[{i}]", v) for i, v in walk.items(pod.spec.get("volumes"), f"{pod.path}.volumes")]


def container_names(pod: PodSpec, lst: str) -> set[str]:
    found = pod.spec.get(lst)
    return {c.get("name") for c in found if isinstance(c, dict)} if isinstance(found, list) else set()


# ---- shape rules (S1 to S3): the TrainJob alone ----


def shape_rules(spec: dict, own_manager: str, env: list[tuple[str, str]], reasons: Reasons) -> None:
    """S1, S2 and S3 over every runtimePatches entry but the webhook's own, and spec.trainer.env."""
    walk = Walk(reasons)
    for i, entry in walk.items(spec.get("runtimePatches"), "spec.runtimePatches"):
        if entry.get("manager") == own_manager:
            continue
        for pod in entry_pod_specs(entry, f"spec.runtimePatches[{i}]", walk):
            _entry_pod_rules(pod, walk, reasons)
    for path, name in env:
        if _is_reserved_env(name):  # S3
            reasons.add(ErrInvalid, f"{path}.name",
                        f"{name!r}: names starting with {RESERVED_ENV_PREFIX} are reserved for the dispatch adapter")


def _entry_pod_rules(pod: PodSpec, walk: Walk, reasons: Reasons) -> None:
    for path, vol in volumes(pod, walk):
        if _is_publish_volume(vol.get("name")):  # S1
            reasons.add(ErrInvalid, f"{path}.name",
                        f"volume name {vol.get('name')!r} is (or looks like) {PUBLISH_VOLUME!r},"
                        " reserved for the webhook's publish volume")
    for _, cpath, container in containers(pod, walk):
        for mpath, mount in mounts(container, cpath, walk):
            mount_path = walk.string(mount.get("mountPath"), f"{mpath}.mountPath")
            if mount_path is not None and paths.under_publish_dir(mount_path):  # S2
                reasons.add(ErrInvalid, f"{mpath}.mountPath",
                            f"{mount_path!r} is at or under {paths.PUBLISH_DIR}, reserved for the publish mount")
            elif mount_path is not None and paths.looks_under_publish_dir(mount_path):  # S2, look-alikes
                reasons.add(ErrInvalid, f"{mpath}.mountPath",
                            f"{mount_path!r} looks like a path under {paths.PUBLISH_DIR} (look-alike characters)")
            if _is_publish_volume(mount.get("name")):  # S1: the reserved volume is mounted by its owner only
                reasons.add(ErrInvalid, f"{mpath}.name",
                            f"volume {PUBLISH_VOLUME!r} may be mounted only by the webhook's own entry")
        for i, env in walk.items(container.get("env"), f"{cpath}.env"):
            name = env.get("name")
            if _is_reserved_env(name):  # S3, for patched containers too
                reasons.add(ErrInvalid, f"{cpath}.env[{i}].name",
                            f"{name!r}: names starting with {RESERVED_ENV_PREFIX} are reserved for the dispatch adapter")


def _is_publish_volume(name) -> bool:
    return isinstance(name, str) and (name == PUBLISH_VOLUME or paths.skeleton(name) == PUBLISH_VOLUME)


def _is_reserved_env(name) -> bool:
    return isinstance(name, str) and (name.startswith(RESERVED_ENV_PREFIX)
                                      or paths.skeleton(name).startswith(RESERVED_ENV_PREFIX))


def trainer_env_names(spec: dict, walk: Walk) -> list[tuple[str, str]]:
    """(path, name) of every spec.trainer.env entry; read once per review, used by S3 and R7."""
    trainer = walk.obj(spec.get("trainer"), "spec.trainer")
    if trainer is None:
        return []
    out = []
    for i, env in walk.items(trainer.get("env"), "spec.trainer.env"):
        name = env.get("name")
        if isinstance(name, str):
            out.append((f"spec.trainer.env[{i}]", name))
        elif name is not None:
            walk.reasons.add(walk.sentinel, f"spec.trainer.env[{i}].name", "must be a string")
    return out


# ---- runtime requirements (R1 to R8) ----


@dataclass(frozen=True)
class RuntimeRef:
    api_group: str
    kind: str
    name: str
    namespace: str

    def __str__(self) -> str:
        where = f"{self.namespace}/" if self.kind == NAMESPACED_KIND else ""
        return f"{self.kind} {where}{self.name}"


def runtime_ref(spec: dict, namespace: str, reasons: Reasons) -> RuntimeRef | None:
    """R1: the reference, with Trainer's defaults; None (with reasons) when it cannot be followed."""
    walk = Walk(reasons)
    ref = walk.obj(spec.get("runtimeRef"), "spec.runtimeRef")
    if ref is None:
        reasons.add(ErrInvalid, "spec.runtimeRef", "required")
        return None
    name = walk.string(ref.get("name"), "spec.runtimeRef.name")
    group = walk.string(ref.get("apiGroup"), "spec.runtimeRef.apiGroup")
    kind = walk.string(ref.get("kind"), "spec.runtimeRef.kind")
    group = GROUP if group in (None, "") else group
    kind = CLUSTER_KIND if kind in (None, "") else kind
    ok = True
    if not name:
        reasons.add(ErrInvalid, "spec.runtimeRef.name", "required")
        ok = False
    if group != GROUP:
        reasons.add(ErrUnsupported, "spec.runtimeRef.apiGroup", f"{group!r} is not supported: use {GROUP}")
        ok = False
    if kind not in KINDS:
        reasons.add(ErrUnsupported, "spec.runtimeRef.kind",
                    f"{kind!r} is not supported: use {CLUSTER_KIND} or {NAMESPACED_KIND}")
        ok = False
    return RuntimeRef(group, kind, name, namespace) if ok else None


def not_found(ref: RuntimeRef, reasons: Reasons) -> None:
    """R2."""
    where = f" in namespace {ref.namespace}" if ref.kind == NAMESPACED_KIND else ""
    reasons.add(ErrNotFound, "spec.runtimeRef.name", f"{ref.kind} {ref.name!r} not found{where}")


def target_jobs(runtime: dict, reasons: Reasons) -> list[PodSpec]:
    """R3: every replicated job whose pod template has a container named node; at least one."""
    walk = Walk(Reasons(), ErrUnsupported)  # the runtime was admitted by its CRD; stray shapes just do not match
    targets = [p for p in runtime_pod_specs(runtime, walk) if NODE_CONTAINER in container_names(p, "containers")]
    if not targets:
        reasons.add(ErrUnsupported, "spec.runtimeRef",
                    f"the runtime has no replicated job with a container named {NODE_CONTAINER!r}")
    return targets


@dataclass(frozen=True)
class RuntimeFacts:
    """What a runtime alone decides (R3, R4, R5, torch or not), worked out once per runtime object."""

    targets: tuple[PodSpec, ...]
    torch: bool
    reasons: tuple


def runtime_facts(ref: RuntimeRef, runtime: dict, settings: Settings) -> RuntimeFacts:
    reasons = Reasons()
    targets = target_jobs(runtime, reasons)  # R3
    walk = Walk(Reasons(), ErrUnsupported)
    publish = settings.publish
    if publish is not None and publish.via == ROUTE_INIT_CONTAINER:  # R4
        for pod in targets:
            if publish.init_container not in container_names(pod, "initContainers"):
                reasons.add(ErrUnsupported, "spec.runtimeRef",
                            f"{ref}: replicated job {pod.job!r} has no init container {publish.init_container!r}"
                            " (publish.via is initContainer)")
    reserved = {PUBLISH_VOLUME} | {c.name for c in settings.credentials}
    for pod in runtime_pod_specs(runtime, walk):  # R5
        for _, vol in volumes(pod, walk):
            if vol.get("name") in reserved:
                reasons.add(ErrUnsupported, "spec.runtimeRef",
                            f"{ref}: replicated job {pod.job!r} already defines volume {vol.get('name')!r},"
                            " a name the webhook reserves")
        for _, cpath, container in containers(pod, walk):
            for _, mount in mounts(container, cpath, walk):
                mp = mount.get("mountPath")
                if isinstance(mp, str) and paths.under_publish_dir(mp):
                    reasons.add(ErrUnsupported, "spec.runtimeRef",
                                f"{ref}: replicated job {pod.job!r} container {container.get('name')!r}"
                                f" mounts {mp!r}, at or under {paths.PUBLISH_DIR}")
    spec = runtime.get("spec")
    policy = spec.get("mlPolicy") if isinstance(spec, dict) else None
    torch = isinstance(policy, dict) and policy.get("torch") is not None
    return RuntimeFacts(tuple(targets), torch, tuple(reasons))


def trainjob_runtime_rules(spec: dict, ref: RuntimeRef, facts: RuntimeFacts, env: list[tuple[str, str]],
                           reasons: Reasons) -> None:
    """R6 and R7: what the TrainJob asks of the runtime (R8 depends on the mutation and is checked with it)."""
    trainer = spec.get("trainer") if isinstance(spec.get("trainer"), dict) else {}
    if trainer.get("numProcPerNode") is not None and not facts.torch:  # R6
        reasons.add(ErrUnsupported, "spec.trainer.numProcPerNode",
                    f"{ref} has no mlPolicy.torch, so numProcPerNode cannot be set")
    if facts.torch:  # R7
        for path, name in env:
            if name in TORCH_RESERVED_ENV:
                reasons.add(ErrInvalid, f"{path}.name", f"{name!r} is set by Trainer's torch plugin ({ref} uses mlPolicy.torch)")


def room_for_entry(count: int, reasons: Reasons) -> bool:
    """R8: adding one entry must not take runtimePatches past its CRD limit."""
    if count + 1 > MAX_RUNTIME_PATCHES:
        reasons.add(ErrUnsupported, "spec.runtimePatches",
                    f"has {count} entries; the webhook's entry would exceed the limit of {MAX_RUNTIME_PATCHES}")
        return False
    return True
