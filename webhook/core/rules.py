"""The walks the rules share: a TrainJob walked once, a runtime judged once per settings.

A TrainJob is walked once (`scan`): every runtimePatches entry but the webhook's own is walked, and the
hooks of the rules in force (`registry`, `rule.Point`) are called on each volume, mount and env on the
way; the webhook's own entry is picked out for S4, S5 and SPEC 6.3. A runtime is read once, when a source
takes it (`runtimes.Runtime`), and judged once per settings and rules in force (`runtime_facts`). Every
reason is made through the rule that found it (SPEC 8.1's `rule` label); what cannot be walked is
`registry.MALFORMED`'s. Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, cast

from . import paths, registry
from .errors import ErrInvalid, Reasons
from .registry import MAX_RUNTIME_PATCHES, NODE_CONTAINER
from .rule import Checks, Hook, Point, Rule
from .runtimes import CLUSTER_KIND, GROUP, KINDS, NAMESPACED_KIND, Runtime, RuntimeFacts, RuntimeRef
from .settings import Settings

CONTAINER_LISTS = ("initContainers", "containers")


class Walk:
    """Typed access to an object that may be malformed: a wrong type is a reason, never an exception.

    Mutating webhooks see objects before the API server's schema validation, so nothing is assumed.
    """

    def __init__(self, reasons: Reasons):
        self.reasons = reasons

    def bad(self, path: str, text: str) -> None:
        self.reasons.append(registry.MALFORMED.refuse(path, text))

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


class _EntryHooks(NamedTuple):
    """The hooks of the rules in force for another entry's pod, looked up once per walk."""

    volume: tuple[tuple[Rule, Hook], ...]
    mount_path: tuple[tuple[Rule, Hook], ...]
    mount_name: tuple[tuple[Rule, Hook], ...]
    env: tuple[tuple[Rule, Hook], ...]


def scan(spec: dict[str, Any], settings: Settings, reasons: Reasons, checks: Checks | None = None) -> Scan:
    """Walk spec.runtimePatches and spec.trainer.env once, calling the hooks of the rules in force (`checks`,
    by default `registry.in_force()`) on the way."""
    checks = checks or registry.in_force()
    manager = settings.manager
    walk = Walk(reasons)
    patches = spec.get("runtimePatches")
    own: Own | None = None
    hooks: _EntryHooks | None = None
    for i, entry in walk.items(patches, "spec.runtimePatches"):
        if entry.get("manager") == manager:
            if own is None:
                own = Own(i, entry)
            elif checks.on(registry.S4):
                reasons.append(registry.S4.refuse(f"spec.runtimePatches[{i}].manager",
                                                  f"{manager!r} appears more than once"))
            continue
        if hooks is None:
            hooks = _EntryHooks(checks.at(Point.ENTRY_VOLUME), checks.at(Point.ENTRY_MOUNT_PATH),
                                checks.at(Point.ENTRY_MOUNT_NAME), checks.at(Point.ENTRY_ENV))
        for pod in entry_pod_specs(entry, f"spec.runtimePatches[{i}]", walk):
            _walk_entry_pod(pod, settings, walk, reasons, hooks)
    env = _trainer_env(spec, reasons)
    if env:
        on_env = checks.at(Point.TRAINER_ENV)
        for path, name in env:
            for rule, hook in on_env:
                hook(rule, reasons, settings, f"{path}.name", name)
    count = len(patches) if isinstance(patches, list) else 0
    return Scan(count, patches is None or isinstance(patches, list), own, tuple(env))


def _walk_entry_pod(pod: PodSpec, settings: Settings, walk: Walk, reasons: Reasons, hooks: _EntryHooks) -> None:
    """Another entry's pod: its volumes, each container's mounts (path, then volume name) and env."""
    for path, vol in volumes(pod, walk):
        for rule, hook in hooks.volume:
            hook(rule, reasons, settings, f"{path}.name", vol.get("name"))
    for _, cpath, container in containers(pod, walk):
        for mpath, mount in mounts(container, cpath, walk):
            mount_path = walk.string(mount.get("mountPath"), f"{mpath}.mountPath")
            if mount_path is not None and hooks.mount_path:
                normal = paths.normalise(mount_path)  # once per mount: every hook compares it with its roots
                looks = normal if mount_path.isascii() else paths.normalise(paths.skeleton(mount_path))
                for rule, hook in hooks.mount_path:
                    hook(rule, reasons, settings, f"{mpath}.mountPath", mount_path, normal, looks)
            for rule, hook in hooks.mount_name:
                hook(rule, reasons, settings, f"{mpath}.name", mount.get("name"))
        for i, env in walk.items(container.get("env"), f"{cpath}.env"):
            for rule, hook in hooks.env:
                hook(rule, reasons, settings, f"{cpath}.env[{i}].name", env.get("name"))


def _trainer_env(spec: dict[str, Any], reasons: Reasons) -> list[tuple[str, str]]:
    """(path, name) of every spec.trainer.env entry; read once per review, for the hooks (S3, R7)."""
    walk = Walk(reasons)
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


def runtime_ref(spec: dict[str, Any], namespace: str, reasons: Reasons,
                checks: Checks | None = None) -> RuntimeRef | None:
    """R1: the reference, with Trainer's defaults where a field is absent; None (with reasons) when it
    cannot be followed. An explicit "" is not absent: the CRD's defaulting would keep it, so it is refused."""
    ref = spec.get("runtimeRef")
    if ref.__class__ is dict:  # the usual shape, decided without a walk
        name, group, kind = ref.get("name"), ref.get("apiGroup"), ref.get("kind")
        if name and name.__class__ is str and group in (None, GROUP) and (kind is None or kind in KINDS):
            return RuntimeRef(GROUP, kind or CLUSTER_KIND, name, namespace)
    r1 = registry.R1
    on = (checks or registry.in_force()).on(r1)
    walk = Walk(reasons)
    ref = walk.obj(spec.get("runtimeRef"), "spec.runtimeRef")
    if ref is None:
        if on and ("runtimeRef" not in spec or spec.get("runtimeRef") is None):
            reasons.append(r1.refuse("spec.runtimeRef", "required", sentinel=ErrInvalid))
        return None
    ok = True
    name = ref.get("name")
    if name is None or name == "":
        if on:
            reasons.append(r1.refuse("spec.runtimeRef.name", "required", sentinel=ErrInvalid))
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
    if on and group_ok and group != GROUP:
        reasons.append(r1.refuse("spec.runtimeRef.apiGroup", f"{group!r} is not supported: use {GROUP}"))
    if on and kind_ok and kind not in KINDS:
        reasons.append(r1.refuse("spec.runtimeRef.kind",
                                 f"{kind!r} is not supported: use {CLUSTER_KIND} or {NAMESPACED_KIND}"))
    if not (ok and group_ok and kind_ok and group == GROUP and kind in KINDS):
        return None
    return RuntimeRef(group, kind, cast(str, name), namespace)  # ok: a non-empty string


def not_found(ref: RuntimeRef, reasons: Reasons, checks: Checks | None = None) -> None:
    """R2."""
    if (checks or registry.in_force()).on(registry.R2):
        where = f" in namespace {ref.namespace}" if ref.kind == NAMESPACED_KIND else ""
        reasons.append(registry.R2.refuse("spec.runtimeRef.name", f"{ref.kind} {ref.name!r} not found{where}"))


def runtime_facts(runtime: Runtime | dict[str, Any], settings: Settings, checks: Checks | None = None) -> RuntimeFacts:
    """The hooks of the rules in force (R3, R4, R5) on one runtime (an object is taken as a `Runtime` first).
    Each reason's text starts with the runtime (`subject`), and says what to change."""
    checks = checks or registry.in_force()
    runtime = Runtime.of(runtime)
    reasons = Reasons()
    if runtime.oversize:  # not held whole, so nothing else can be checked
        checks.call(Point.RUNTIME_OVERSIZE, reasons, settings, runtime)
        return RuntimeFacts((), runtime.policies, tuple(reasons))
    targets = [j for j in runtime.jobs if NODE_CONTAINER in j.containers]
    checks.call(Point.RUNTIME, reasons, settings, runtime, targets)
    return RuntimeFacts(tuple(j.name for j in targets), runtime.policies, tuple(reasons))


def trainjob_runtime_rules(spec: dict[str, Any], ref: RuntimeRef, facts: RuntimeFacts, env: Any, reasons: Reasons,
                           settings: Settings, checks: Checks | None = None) -> None:
    """What the TrainJob asks of the runtime (R6, R7; R8 depends on the mutation and is checked with it)."""
    (checks or registry.in_force()).call(Point.TRAINJOB_RUNTIME, reasons, settings, spec, ref, facts, env)


def room_for_entry(count: int, reasons: Reasons, checks: Checks | None = None) -> bool:
    """R8: adding one entry must not take runtimePatches past its CRD limit (no room even while R8 is off)."""
    if count + 1 > MAX_RUNTIME_PATCHES:
        if (checks or registry.in_force()).on(registry.R8):
            reasons.append(registry.R8.refuse(
                "spec.runtimePatches",
                f"has {count} entries; the webhook's entry would exceed the limit of {MAX_RUNTIME_PATCHES}"))
        return False
    return True
