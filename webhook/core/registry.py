"""The rules, by id (SPEC 5 and 6.3): one `Rule` object each, holding its hooks; the one list of rules.

Every reason the core gives is made by a hook, through the rule that found it (`Rule.refuse`), so its id
(the `dispatch_admission_would_deny_total{rule}` label, the audit's causes) and its sentinel are the rule's.
A rule's checks are hooks at typed points (`rule.Point`), each given one context object: `rules.scan` walks
a TrainJob once, `rules.runtime_facts` a runtime once per settings, and the review calls the stage points
(the runtime reference and lookup, the webhook's own entry, an update of it, room for it).
The plans, the audit, the metrics' label and the docs read the registry (`DEFAULT`, a `rule.Registry`).

Adding a rule: one `Rule` here with its hooks, and tests marked for it (`test_<id>_...` or
`@pytest.mark.rules("<id>")`); CONTRIBUTING.md says it step by step. `DEFAULT.registered(rule)` adds one for
a while (tests/unit/test_toy_rule.py), and `DEFAULT.switched_off(id)` removes one for a while (the sweep):
both change what `in_force()` gives an `Admission` built after them; no reason is filtered after it is made.
"""

from __future__ import annotations

from typing import Any

from . import errors, paths, rules
from .errors import ErrInvalid, ErrNotFound, ErrUnsupported
from .patch import same as patch_same
from .rule import (
    AgainstRuntime,
    EntryUpdate,
    InEntry,
    Lookup,
    OfRuntime,
    OwnEntry,
    Point,
    RefGiven,
    Registry,
    Room,
    Rule,
    RuntimeMount,
    TrainerEnv,
    Unreadable,
)
from .rules import MAX_RUNTIME_PATCHES
from .rules import NODE_CONTAINER as NODE_CONTAINER  # re-exported: verify reads it from here
from .runtimes import CLUSTER_KIND, GROUP, KINDS, NAMESPACED_KIND, Runtime, RuntimeFacts
from .settings import PUBLISH_VOLUME, ROUTE_INIT_CONTAINER, Settings

RESERVED_ENV_PREFIX = "DISPATCH_"
TORCH_RESERVED_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
# The mlPolicy sources that read numProcPerNode: processes per node, MPI slots, Flux tasks (R6).
PROC_POLICIES = ("torch", "mpi", "flux")


def _looks_like(name: object, reserved: str) -> bool:
    return isinstance(name, str) and (name == reserved or paths.skeleton(name) == reserved)


def _is_publish_volume(name: object) -> bool:
    return _looks_like(name, PUBLISH_VOLUME)


def _is_reserved_env(name: object) -> bool:
    return isinstance(name, str) and (name.startswith(RESERVED_ENV_PREFIX)
                                      or paths.skeleton(name).startswith(RESERVED_ENV_PREFIX))


# ---- S1, S2, S3, S6: another entry of the TrainJob, and spec.trainer.env ----


def _s1_volume(rule: Rule, c: InEntry) -> None:
    if _is_publish_volume(c.name):
        c.reasons.append(rule.refuse(c.field, f"volume name {c.name!r} is (or looks like) {PUBLISH_VOLUME!r}, reserved"
                                              " for the webhook's publish volume"))


def _s1_mount_name(rule: Rule, c: InEntry) -> None:
    if _is_publish_volume(c.name):  # the reserved volume is mounted by its owner only
        c.reasons.append(rule.refuse(c.field, f"volume {PUBLISH_VOLUME!r} may be mounted only by the webhook's own"
                                              " entry"))


def _s2_mount_path(rule: Rule, c: InEntry) -> None:
    if paths.within(c.normal, paths.PUBLISH_DIR):
        c.reasons.append(rule.refuse(c.field, f"{c.mount_path!r} is at or under {paths.PUBLISH_DIR}, reserved for the"
                                              " publish mount"))
    elif paths.within(c.looks, paths.PUBLISH_DIR):
        c.reasons.append(rule.refuse(c.field, f"{c.mount_path!r} looks like a path under {paths.PUBLISH_DIR}"
                                              " (look-alike characters)"))


def _s3_env(rule: Rule, c: InEntry | TrainerEnv) -> None:
    if _is_reserved_env(c.name):
        c.reasons.append(rule.refuse(c.field, f"{c.name!r}: names starting with {RESERVED_ENV_PREFIX} are reserved for"
                                              " the dispatch adapter"))


def _s6_volume(rule: Rule, c: InEntry) -> None:
    for cred in c.settings.credentials:  # Trainer merges volumes by name
        if _looks_like(c.name, cred.name):
            c.reasons.append(rule.refuse(c.field, f"volume name {c.name!r} is (or looks like) credential"
                                                  f" {cred.name!r}'s volume, which only the webhook's entry defines"))


def _s6_mount_path(rule: Rule, c: InEntry) -> None:
    for cred in c.settings.credentials:  # Trainer merges mounts by path
        if paths.within(c.normal, cred.mount_root) or paths.within(c.looks, cred.mount_root):
            c.reasons.append(rule.refuse(c.field, f"{c.mount_path!r} is at or under credential {cred.name!r}'s"
                                                  f" mountPath {cred.mount_path}, which only the webhook's entry"
                                                  " mounts"))


# ---- S4, S5, UPDATE, R8: the webhook's own entry ----


def _s4(rule: Rule, c: OwnEntry) -> None:
    """Only the entry the settings produce (or, in their grace, the previous settings') is the webhook's."""
    own, manager = c.own, c.settings.manager
    if own is None:
        return
    if c.duplicate is not None:
        c.reasons.append(rule.refuse(f"spec.runtimePatches[{c.duplicate}].manager",
                                     f"{manager!r} appears more than once"))
    elif not c.settings.configured:
        c.reasons.append(rule.refuse(f"spec.runtimePatches[{own.index}]",
                                     f"an entry of manager {manager!r} is not allowed: this webhook has no publish"
                                     " or credentials configured"))
    elif (c.entry is None or not c.entry.matches(own.entry)) and \
            not (c.previous is not None and c.previous.matches(own.entry)):  # SPEC 2.1's grace
        c.reasons.append(rule.refuse(f"spec.runtimePatches[{own.index}]",
                                     f"the entry of manager {manager!r} differs from what the webhook's settings"
                                     " produce"))


def _s5(rule: Rule, c: OwnEntry) -> None:
    if c.create and c.own is None and c.settings.configured and c.readable:  # no list is already a reason
        c.reasons.append(rule.refuse(
            "spec.runtimePatches",
            f"the dispatch-admission mutating webhook was bypassed: no entry of manager {c.settings.manager!r}"))


def _update(rule: Rule, c: EntryUpdate) -> None:
    """The entry once written is never rewritten (Trainer's CRD makes it immutable); a stale one is kept as it
    is, unsaid (SPEC 6.3: `audit` reports it)."""
    manager = c.settings.manager
    if c.own is None:
        c.reasons.append(rule.refuse("spec.runtimePatches",
                                     f"the entry of manager {manager!r} was removed; it is immutable once written"))
    elif not patch_same(c.own.entry, c.old_own.entry):
        c.reasons.append(rule.refuse(f"spec.runtimePatches[{c.own.index}]",
                                     f"the entry of manager {manager!r} is immutable once written; recreate the"
                                     " TrainJob to change it"))


def _r8(rule: Rule, c: Room) -> None:
    c.reasons.append(rule.refuse("spec.runtimePatches", f"has {c.count} entries; the webhook's entry would exceed"
                                                        f" the limit of {MAX_RUNTIME_PATCHES}"))


# ---- R1, R2: the runtime reference and its lookup ----


def _r1(rule: Rule, c: RefGiven) -> None:
    """Trainer's defaults apply only where a field is absent: an explicit "" is refused."""
    if c.ref is None:
        if c.spec.get("runtimeRef") is None:  # absent (a value of another type is malformed, said so)
            c.reasons.append(rule.refuse("spec.runtimeRef", "required", sentinel=ErrInvalid))
        return
    if c.name is None or c.name == "":
        c.reasons.append(rule.refuse("spec.runtimeRef.name", "required", sentinel=ErrInvalid))
    group = GROUP if c.api_group is None else c.api_group
    kind = CLUSTER_KIND if c.kind is None else c.kind
    if c.group_ok and group != GROUP:
        c.reasons.append(rule.refuse("spec.runtimeRef.apiGroup", f"{group!r} is not supported: use {GROUP}"))
    if c.kind_ok and kind not in KINDS:
        c.reasons.append(rule.refuse("spec.runtimeRef.kind",
                                     f"{kind!r} is not supported: use {CLUSTER_KIND} or {NAMESPACED_KIND}"))


def _r2(rule: Rule, c: Lookup) -> None:
    if c.runtime is None:
        ref = c.ref
        where = f" in namespace {ref.namespace}" if ref.kind == NAMESPACED_KIND else ""
        c.reasons.append(rule.refuse("spec.runtimeRef.name", f"{ref.kind} {ref.name!r} not found{where}"))


# ---- R3, R4, R5: the runtime alone; R6, R7: the TrainJob against it ----


def _of_runtime(rule: Rule, c: OfRuntime | RuntimeMount, text: str) -> None:
    """A runtime's reason: field spec.runtimeRef, its text starting with the runtime (`subject`)."""
    what = str(c.runtime)
    c.reasons.append(rule.refuse("spec.runtimeRef", f"{what}: {text}", subject=what))


def _r3(rule: Rule, c: OfRuntime) -> None:
    if not c.targets:
        _of_runtime(rule, c, f"no replicated job has a container named {NODE_CONTAINER!r}")


def _r4(rule: Rule, c: OfRuntime) -> None:
    publish = c.settings.publish
    if publish is not None and publish.via == ROUTE_INIT_CONTAINER:
        for job in c.targets:
            if publish.init_container not in job.init_containers:
                _of_runtime(rule, c, f"job {job.name!r} lacks init container {publish.init_container!r} (route 2)")


def _r5_oversize(rule: Rule, c: OfRuntime) -> None:
    _of_runtime(rule, c, f"too large to check: {c.runtime.oversize}")  # not held whole


def _r5(rule: Rule, c: OfRuntime) -> None:
    """What the runtime defines that the webhook's entry would collide with, volumes by name and mounts by
    path, as Trainer and JobSet merge them."""
    def say(text: str) -> None:
        _of_runtime(rule, c, text)

    runtime, settings = c.runtime, c.settings
    creds = {cred.name for cred in settings.credentials}
    for name in runtime.claims:  # JobSet adds a volume of each claim template's name to the pods that mount it
        if name == PUBLISH_VOLUME:
            say(f"rename volumeClaimPolicies claim template {name!r}: JobSet makes it a volume of that"
                " name, which the webhook reserves")
        elif name in creds:
            say(f"rename credential {name!r} or the volumeClaimPolicies claim template of that name: JobSet"
                " makes the template a volume, and two volumes would share the name")
    for job in runtime.jobs:
        for name in job.volumes:
            if name == PUBLISH_VOLUME or name in creds:
                say(f"replicated job {job.name!r} already defines volume {name!r}, a name the webhook reserves")
        for container, mp in job.publish_mounts:
            say(f"replicated job {job.name!r} container {container!r} mounts {mp!r}, at or under {paths.PUBLISH_DIR}")
    for job in c.targets:  # where the credentials are mounted: Trainer merges mounts by path
        for mp in job.node_mounts:
            for cred in settings.credentials:
                if paths.within(mp, cred.mount_root):
                    say(f"move credential {cred.name!r} ({cred.mount_path}) or the mount at {mp!r} of replicated"
                        f" job {job.name!r} container {NODE_CONTAINER!r}: one would replace the other")
    if runtime.ssh_path:
        for cred in settings.credentials:
            if paths.overlaps(runtime.ssh_path, cred.mount_root):
                say(f"move credential {cred.name!r} ({cred.mount_path}): it overlaps"
                    f" mlPolicy.mpi.sshAuthMountPath {runtime.ssh_path!r}, where MPI's SSH keys go")


def _r5_mount(rule: Rule, c: RuntimeMount) -> None:
    """After the merge, a mount of a volume the entry defines mounts the entry's volume: in route 2 a sidecar could
    write over the copied binary, a credential would reach a container not named `node`. Route 2's own init
    container gets its mount from the entry only."""
    name = c.volume
    if name == PUBLISH_VOLUME or any(name == cred.name for cred in c.settings.credentials):
        what = "init container" if c.container.init else "container"
        _of_runtime(rule, c, f"unmount {name!r} from job {c.job.name!r} {what} {c.container.name!r}: only the"
                             " webhook's entry may mount that volume, as it defines it")


def _r6(rule: Rule, c: AgainstRuntime) -> None:
    trainer = c.spec.get("trainer")
    asked = isinstance(trainer, dict) and trainer.get("numProcPerNode") is not None
    if asked and not c.facts.policies & set(PROC_POLICIES):
        c.reasons.append(rule.refuse("spec.trainer.numProcPerNode", f"{c.ref} has none of mlPolicy.torch, mpi or"
                                                                    " flux, so nothing reads numProcPerNode"))


def _r7(rule: Rule, c: AgainstRuntime) -> None:
    if c.facts.torch:
        for path, name in c.env:
            if name in TORCH_RESERVED_ENV:
                c.reasons.append(rule.refuse(f"{path}.name", f"{name!r} is set by Trainer's torch plugin ({c.ref}"
                                                             " uses mlPolicy.torch)"))


def _malformed(rule: Rule, c: Unreadable) -> None:
    c.reasons.append(rule.refuse(c.field, c.text))


# ---- the rules ----

S1 = Rule(
    "S1", "5", ErrInvalid,
    "a volume named `dispatch-publish` in another manager's entry; also a mount of that volume there (route 2's"
    " emptyDir is writable: it would let another container replace the binary)",
    ("spec.runtimePatches[].…volumes[].name", "spec.runtimePatches[].…volumeMounts[].name"),
    hooks={Point.ENTRY_VOLUME: _s1_volume, Point.ENTRY_MOUNT_NAME: _s1_mount_name})
S2 = Rule(
    "S2", "5", ErrInvalid,
    "a `volumeMounts[].mountPath` at or under `/opt/dispatch` (or a look-alike of it) in any container or init"
    " container of another entry",
    ("spec.runtimePatches[].…volumeMounts[].mountPath",),
    hooks={Point.ENTRY_MOUNT_PATH: _s2_mount_path})
S3 = Rule(
    "S3", "5", ErrInvalid,
    "a `spec.trainer.env` name starting with `DISPATCH_`; also such an env in another entry's containers (it"
    " could redirect route 2's copy)",
    ("spec.trainer.env[].name", "spec.runtimePatches[].…env[].name"),
    hooks={Point.ENTRY_ENV: _s3_env, Point.TRAINER_ENV: _s3_env})
S4 = Rule(
    "S4", "5, 2.1", ErrInvalid,
    "the webhook's own entry differing (time aside, compared as JSON values) from what the settings produce"
    " (or, for 10 minutes after a switch, the previous settings); two entries under its manager",
    ("spec.runtimePatches[manager]", "the settings", "the runtime's target jobs"),
    hooks={Point.OWN_ENTRY: _s4})
S5 = Rule(
    "S5", "5", ErrInvalid,
    "on CREATE, with publish or credentials configured, a TrainJob without the entry reaching `/validate`"
    " (the mutation was bypassed)",
    ("spec.runtimePatches[manager]",),
    hooks={Point.OWN_ENTRY: _s5})
S6 = Rule(
    "S6", "5", ErrInvalid,
    "another entry defining a volume named like a credential, or mounting at or under a credential's"
    " `mountPath` (Trainer merges volumes by name and mounts by path: a later entry would replace them)",
    ("spec.runtimePatches[].…volumes[].name", "spec.runtimePatches[].…volumeMounts[].mountPath",
     "settings.credentials"),
    hooks={Point.ENTRY_VOLUME: _s6_volume, Point.ENTRY_MOUNT_PATH: _s6_mount_path})
R1 = Rule(
    "R1", "5", ErrUnsupported,
    "`runtimeRef.apiGroup` other than `trainer.kubeflow.org`, `kind` other than the two runtime kinds; the"
    " defaults apply only where a field is absent: an explicit `\"\"` is refused (a missing `runtimeRef` or"
    " name is `ErrInvalid`)",
    ("spec.runtimeRef",),
    hooks={Point.RUNTIME_REF: _r1}, also=(ErrInvalid,))
R2 = Rule(
    "R2", "5", ErrNotFound,
    "a runtime that does not exist (TrainingRuntime: in the TrainJob's namespace)",
    ("spec.runtimeRef", "the runtime source"),
    hooks={Point.RUNTIME_LOOKUP: _r2}, verdict="runtime-missing")
R3 = Rule(
    "R3", "5", ErrUnsupported,
    "a runtime with no replicated job holding a container named `node`",
    ("runtime: containers of each replicated job",),
    hooks={Point.RUNTIME: _r3})
R4 = Rule(
    "R4", "5", ErrUnsupported,
    "route 2: a target job without the named init container (each one named)",
    ("runtime: init containers of each target job", "settings.publish.initContainer"),
    hooks={Point.RUNTIME: _r4})
R5 = Rule(
    "R5", "5", ErrUnsupported,
    "a runtime that already defines `dispatch-publish` or a credential's volume name (a volume, or a claim"
    " template of the JobSet template's `volumeClaimPolicies`: JobSet makes each a volume), mounts at or under"
    " `/opt/dispatch`, mounts at or under a credential's `mountPath` on a target job's `node` container, or whose"
    " `mlPolicy.mpi.sshAuthMountPath` overlaps a credential's; a container or init container (route 2's own"
    " too) mounting, by name, `dispatch-publish` or a credential's volume; a runtime too large to check",
    ("runtime: volumes, claim templates, mounts and mounted volume names of each replicated job",
     "runtime: mlPolicy.mpi",
     "settings.credentials"),
    hooks={Point.RUNTIME_OVERSIZE: _r5_oversize, Point.RUNTIME: _r5, Point.RUNTIME_MOUNT: _r5_mount})
R6 = Rule(
    "R6", "5", ErrUnsupported,
    "`spec.trainer.numProcPerNode` on a runtime whose `mlPolicy` has none of `torch`, `mpi`, `flux` (Trainer"
    " reads it as processes per node, MPI slots or Flux tasks, and ignores it elsewhere)",
    ("spec.trainer.numProcPerNode", "runtime: mlPolicy"),
    hooks={Point.TRAINJOB_RUNTIME: _r6})
R7 = Rule(
    "R7", "5", ErrInvalid,
    "on a torch runtime, `spec.trainer.env` setting `PET_NNODES`, `PET_NPROC_PER_NODE`, `PET_NODE_RANK`,"
    " `PET_MASTER_ADDR` or `PET_MASTER_PORT`",
    ("spec.trainer.env[].name", "runtime: mlPolicy"),
    hooks={Point.TRAINJOB_RUNTIME: _r7})
R8 = Rule(
    "R8", "5", ErrUnsupported,
    "no room for the entry (`runtimePatches` holds at most 16)",
    ("spec.runtimePatches (count)",),
    hooks={Point.ROOM: _r8})
UPDATE = Rule(
    errors.RULE_UPDATE, "6.3", ErrInvalid,
    "an UPDATE that edits the webhook's entry, or (at `/validate`) removes it: it is immutable once written",
    ("spec.runtimePatches[manager] of the old and the new object",),
    hooks={Point.ENTRY_UPDATE: _update})

# Not a rule of SPEC: an object the walks cannot read. Its reasons are the sender's fault and are always
# given (a rule switched off must not let a malformed object through unread).
MALFORMED = Rule(
    errors.RULE_MALFORMED, "4", ErrInvalid,
    "an object the webhook cannot walk: a field of the wrong type (not an object, a list or a string where one"
    " is read), or nested too deeply",
    ("every field a rule reads",),
    hooks={Point.UNREADABLE: _malformed}, switchable=False)

RULES: tuple[Rule, ...] = (S1, S2, S3, S4, S5, S6, R1, R2, R3, R4, R5, R6, R7, R8, UPDATE)

# The other values of a reason's `rule` (and of the would_deny metric's label): no rule of SPEC 5 or 6.3.
OTHER_LABELS: tuple[tuple[str, str], ...] = (
    (MALFORMED.id, f"{MALFORMED.refuses} (`{MALFORMED.sentinel.label}`); never switched off"),
    (errors.RULE_UNAVAILABLE, "the runtime could not be read now (`ErrUnavailable`)"),
    (errors.RULE_INTERNAL, "a fault of the webhook itself (`ErrInternal`)"),
    (errors.RULE_SETTINGS, "the settings document refused (`ErrInvalid`); never a review's label"),
)

# The registry a program uses unless it is handed another: `Admission(registry=...)` takes it, the sweep
# switches its rules off, tests register theirs in it for a while.
DEFAULT = Registry(RULES, MALFORMED)


def runtime_facts(runtime: Runtime | dict[str, Any], settings: Settings, registry: Registry = DEFAULT) -> RuntimeFacts:
    """R3, R4 and R5 on one runtime, with the rules in force in `registry` (for those judging a runtime
    without a review: the readiness metric, `verify`, the API)."""
    return rules.runtime_facts(runtime, settings, registry.in_force())
