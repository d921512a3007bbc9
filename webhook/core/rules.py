"""The walks the rules share: a TrainJob walked once, a runtime judged once per settings.

A TrainJob is walked once (`scan`): every runtimePatches entry but the webhook's own is walked, and the
hooks of the rules in force (`rule.Checks`, `rule.Point`) are called on each volume, mount and env on the
way; the webhook's own entry is picked out for S4, S5 and SPEC 6.3. A runtime is read once, when a source
takes it (`runtimes.Runtime`), and judged once per settings and rules in force (`runtime_facts`). Every
reason is made by a hook, through the rule that found it (SPEC 8.1's `rule` label); what cannot be walked
goes to the hooks at `Point.UNREADABLE`. The rules themselves are not known here: a walk is given the
rules in force (`Checks`), which a `registry.Registry` builds. Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from . import paths
from .errors import Reasons
from .rule import (
    AgainstRuntime,
    Checks,
    Hook,
    InEntry,
    OfRuntime,
    Own,
    OwnEntry,
    Point,
    RefGiven,
    Room,
    Rule,
    RuntimeMount,
    TrainerEnv,
    Unreadable,
)
from .runtimes import CLUSTER_KIND, GROUP, KINDS, NODE, Runtime, RuntimeFacts, RuntimeRef
from .settings import Settings

CONTAINER_LISTS = ("initContainers", "containers")
NODE_CONTAINER = NODE           # the trainer node container (SPEC 1, R3)
MAX_RUNTIME_PATCHES = 16        # runtimePatches' CRD limit (R8)

__all__ = ["Own"]  # re-exported: the decision reads it from here


class Walk:
    """Typed access to an object that may be malformed: a wrong type is a reason, never an exception.

    Mutating webhooks see objects before the API server's schema validation, so nothing is assumed.
    """

    def __init__(self, reasons: Reasons, checks: Checks):
        self.reasons = reasons
        self.checks = checks

    def bad(self, path: str, text: str) -> None:
        self.checks.call(Point.UNREADABLE, Unreadable(self.reasons, path, text))

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


class Scan(NamedTuple):
    """What one walk of a TrainJob's spec found."""

    count: int  # type: ignore[assignment]  # runtimePatches entries (of any type); shadows tuple.count
    readable: bool                  # runtimePatches is absent or a list (else a reason says it is not)
    own: Own | None                 # the first entry under the webhook's manager
    env: tuple[tuple[str, str], ...]  # (path, name) of spec.trainer.env


NO_SCAN = Scan(0, True, None, ())  # what a walk that failed found


def find_own(spec: Any, manager: str) -> Own | None:
    """The webhook's entry in a spec, without judging anything (for the old object of an UPDATE)."""
    patches = spec.get("runtimePatches") if isinstance(spec, dict) else None
    if isinstance(patches, list):
        for i, entry in enumerate(patches):
            if isinstance(entry, dict) and entry.get("manager") == manager:
                return Own(i, entry)
    return None


class _EntryHooks(NamedTuple):
    """The hooks of the rules in force for another entry's pod, looked up once per walk."""

    volume: tuple[tuple[Rule, Hook], ...]
    mount_path: tuple[tuple[Rule, Hook], ...]
    mount_name: tuple[tuple[Rule, Hook], ...]
    env: tuple[tuple[Rule, Hook], ...]


def scan(spec: dict[str, Any], settings: Settings, reasons: Reasons, checks: Checks) -> Scan:
    """Walk spec.runtimePatches and spec.trainer.env once, calling the hooks of the rules in force (`checks`)
    on the way; a second entry of the webhook's manager goes to the hooks at `Point.OWN_ENTRY`."""
    manager = settings.manager
    walk = Walk(reasons, checks)
    patches = spec.get("runtimePatches")
    own: Own | None = None
    hooks: _EntryHooks | None = None
    for i, entry in walk.items(patches, "spec.runtimePatches"):
        if entry.get("manager") == manager:
            if own is None:
                own = Own(i, entry)
            else:
                checks.call(Point.OWN_ENTRY, OwnEntry(settings, reasons, own, duplicate=i))
            continue
        if hooks is None:
            hooks = _EntryHooks(checks.at(Point.ENTRY_VOLUME), checks.at(Point.ENTRY_MOUNT_PATH),
                                checks.at(Point.ENTRY_MOUNT_NAME), checks.at(Point.ENTRY_ENV))
        for pod in entry_pod_specs(entry, f"spec.runtimePatches[{i}]", walk):
            _walk_entry_pod(pod, settings, walk, reasons, hooks)
    env = _trainer_env(spec, walk)
    on_env = checks.at(Point.TRAINER_ENV)
    if env and on_env:
        for path, name in env:
            context = TrainerEnv(settings, reasons, spec, f"{path}.name", name)
            for rule, hook in on_env:
                hook(rule, context)
    count = len(patches) if isinstance(patches, list) else 0
    return Scan(count, patches is None or isinstance(patches, list), own, tuple(env))


def _call(hooks: tuple[tuple[Rule, Hook], ...], context: Any) -> None:
    for rule, hook in hooks:
        hook(rule, context)


def _walk_entry_pod(pod: PodSpec, settings: Settings, walk: Walk, reasons: Reasons, hooks: _EntryHooks) -> None:
    """Another entry's pod: its volumes, each container's mounts (path, then volume name) and env."""
    job = pod.job
    for path, vol in volumes(pod, walk):
        if hooks.volume:
            _call(hooks.volume, InEntry(settings, reasons, f"{path}.name", vol.get("name"), vol, job))
    for _, cpath, container in containers(pod, walk):
        for mpath, mount in mounts(container, cpath, walk):
            name = mount.get("name")
            mount_path = walk.string(mount.get("mountPath"), f"{mpath}.mountPath")
            if mount_path is not None and hooks.mount_path:
                normal = paths.normalise(mount_path)  # once per mount: every hook compares it with its roots
                looks = normal if mount_path.isascii() else paths.normalise(paths.skeleton(mount_path))
                _call(hooks.mount_path, InEntry(settings, reasons, f"{mpath}.mountPath", name, mount, job, container,
                                                mount_path, normal, looks))
            if hooks.mount_name:
                _call(hooks.mount_name, InEntry(settings, reasons, f"{mpath}.name", name, mount, job, container,
                                                mount_path or ""))
        for i, env in walk.items(container.get("env"), f"{cpath}.env"):
            if hooks.env:
                _call(hooks.env, InEntry(settings, reasons, f"{cpath}.env[{i}].name", env.get("name"), env, job,
                                         container))


def _trainer_env(spec: dict[str, Any], walk: Walk) -> list[tuple[str, str]]:
    """(path, name) of every spec.trainer.env entry; read once per review, for the hooks (S3, R7)."""
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


def too_deep(reasons: Reasons, checks: Checks) -> Reasons:
    """An object nested deeper than can be walked or compared: the sender's fault, said where walks say it."""
    checks.call(Point.UNREADABLE, Unreadable(reasons, "(object)", "nested too deeply"))
    return reasons


# ---- runtime requirements (R1 to R8) ----


def runtime_ref(spec: dict[str, Any], namespace: str, reasons: Reasons, checks: Checks) -> RuntimeRef | None:
    """The reference, with Trainer's defaults where a field is absent; None (with reasons: the hooks at
    `Point.RUNTIME_REF`, R1's) when it cannot be followed. An explicit "" is not absent: the CRD's
    defaulting would keep it, so it cannot be followed."""
    ref = spec.get("runtimeRef")
    if ref.__class__ is dict:  # the usual shape, decided without a walk
        name, group, kind = ref.get("name"), ref.get("apiGroup"), ref.get("kind")
        if name and name.__class__ is str and group in (None, GROUP) and (kind is None or kind in KINDS):
            return RuntimeRef(GROUP, kind or CLUSTER_KIND, name, namespace)
    walk = Walk(reasons, checks)
    ref = walk.obj(ref, "spec.runtimeRef")
    if ref is None:
        checks.call(Point.RUNTIME_REF, RefGiven(reasons, spec, None, None, None, None, True, True))
        return None
    name = ref.get("name")
    if name is not None and name != "" and not isinstance(name, str):
        walk.bad("spec.runtimeRef.name", "must be a string")
    group = walk.string(ref.get("apiGroup"), "spec.runtimeRef.apiGroup")
    kind = walk.string(ref.get("kind"), "spec.runtimeRef.kind")
    group_ok = isinstance(ref.get("apiGroup"), (str, type(None)))
    kind_ok = isinstance(ref.get("kind"), (str, type(None)))
    checks.call(Point.RUNTIME_REF, RefGiven(reasons, spec, ref, name, group, kind, group_ok, kind_ok))
    group = GROUP if group is None else group
    kind = CLUSTER_KIND if kind is None else kind
    if not (name and isinstance(name, str) and group_ok and kind_ok and group == GROUP and kind in KINDS):
        return None
    return RuntimeRef(group, kind, name, namespace)


def runtime_facts(runtime: Runtime | dict[str, Any], settings: Settings, checks: Checks) -> RuntimeFacts:
    """The hooks of the rules in force (R3, R4, R5) on one runtime (an object is taken as a `Runtime` first):
    the runtime and its target jobs, then each volume each container mounts. Each reason's text starts with
    the runtime (`subject`), and says what to change."""
    runtime = Runtime.of(runtime)
    reasons = Reasons()
    if runtime.oversize:  # not held whole, so nothing else can be checked
        checks.call(Point.RUNTIME_OVERSIZE, OfRuntime(settings, reasons, runtime, ()))
        return RuntimeFacts((), runtime.policies, tuple(reasons))
    targets = tuple(j for j in runtime.jobs if NODE_CONTAINER in j.containers)
    checks.call(Point.RUNTIME, OfRuntime(settings, reasons, runtime, targets))
    on_mount = checks.at(Point.RUNTIME_MOUNT)
    if on_mount:
        for job in runtime.jobs:
            target = any(job is t for t in targets)
            sources = dict(zip(job.volumes, job.sources, strict=False))
            for mounter in job.mounters:
                for volume in mounter.volumes:
                    _call(on_mount, RuntimeMount(settings, reasons, runtime, job, target, mounter, volume,
                                                 sources.get(volume, "")))
    return RuntimeFacts(tuple(j.name for j in targets), runtime.policies, tuple(reasons))


def trainjob_runtime_rules(spec: dict[str, Any], ref: RuntimeRef, facts: RuntimeFacts, env: Any, reasons: Reasons,
                           settings: Settings, checks: Checks) -> None:
    """What the TrainJob asks of the runtime (R6, R7; R8 depends on the mutation and is checked with it)."""
    checks.call(Point.TRAINJOB_RUNTIME, AgainstRuntime(settings, reasons, spec, ref, facts, tuple(env)))


def room_for_entry(count: int, reasons: Reasons, checks: Checks) -> bool:
    """Adding one entry to `count`: the hooks at `Point.ROOM` (R8) say why it cannot be; False when it would
    take runtimePatches past its CRD limit (no room even while R8 is off)."""
    if count + 1 > MAX_RUNTIME_PATCHES:
        checks.call(Point.ROOM, Room(reasons, count))
        return False
    return True
