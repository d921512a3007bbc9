"""The rules, by id (SPEC 5 and 6.3): one `Rule` object each, holding its checks; the one list of rules.

Every reason the core gives is made through the rule that found it (`Rule.refuse`), so its id (the
`dispatch_admission_would_deny_total{rule}` label, the audit's causes) and its sentinel are the rule's.
A rule's checks are hooks the walks call (`rule.Point`): `rules.scan` walks a TrainJob once,
`rules.runtime_facts` a runtime once per settings. The checks that depend on the review's stage (the
webhook's own entry, updates, the lookup, room for the entry) are in the functions `Rule.checked_in` names.
The plans, the audit, the metrics' label and the docs read this table.

Adding a rule: one `Rule` here with its hooks, and tests marked for it (`test_<id>_...` or
`@pytest.mark.rules("<id>")`); CONTRIBUTING.md says it step by step. `registered(rule)` adds one for a
while (tests/unit/test_toy_rule.py), and `switched_off(id)` removes one for a while (the sweep): both change
what `in_force()` gives a walk built after them; no reason is filtered after it is made.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from . import errors, paths
from .errors import ErrInvalid, ErrNotFound, ErrUnsupported, Reasons
from .rule import Checks, Point, Rule
from .runtimes import Job, Runtime, RuntimeFacts, RuntimeRef
from .settings import PUBLISH_VOLUME, ROUTE_INIT_CONTAINER, Settings

NODE_CONTAINER = "node"
MAX_RUNTIME_PATCHES = 16
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


def _s1_volume(rule: Rule, reasons: Reasons, settings: Settings, field: str, name: object) -> None:
    if _is_publish_volume(name):
        reasons.append(rule.refuse(field, f"volume name {name!r} is (or looks like) {PUBLISH_VOLUME!r}, reserved for"
                                          " the webhook's publish volume"))


def _s1_mount_name(rule: Rule, reasons: Reasons, settings: Settings, field: str, name: object) -> None:
    if _is_publish_volume(name):  # the reserved volume is mounted by its owner only
        reasons.append(rule.refuse(field, f"volume {PUBLISH_VOLUME!r} may be mounted only by the webhook's own entry"))


def _s2_mount_path(rule: Rule, reasons: Reasons, settings: Settings, field: str, mount_path: str, normal: str,
                   looks: str) -> None:
    if paths.within(normal, paths.PUBLISH_DIR):
        reasons.append(rule.refuse(field, f"{mount_path!r} is at or under {paths.PUBLISH_DIR}, reserved for the"
                                          " publish mount"))
    elif paths.within(looks, paths.PUBLISH_DIR):
        reasons.append(rule.refuse(field, f"{mount_path!r} looks like a path under {paths.PUBLISH_DIR} (look-alike"
                                          " characters)"))


def _s3_env(rule: Rule, reasons: Reasons, settings: Settings, field: str, name: object) -> None:
    if _is_reserved_env(name):
        reasons.append(rule.refuse(field, f"{name!r}: names starting with {RESERVED_ENV_PREFIX} are reserved for the"
                                          " dispatch adapter"))


def _s6_volume(rule: Rule, reasons: Reasons, settings: Settings, field: str, name: object) -> None:
    for cred in settings.credentials:  # Trainer merges volumes by name
        if _looks_like(name, cred.name):
            reasons.append(rule.refuse(field, f"volume name {name!r} is (or looks like) credential {cred.name!r}'s"
                                              " volume, which only the webhook's entry defines"))


def _s6_mount_path(rule: Rule, reasons: Reasons, settings: Settings, field: str, mount_path: str, normal: str,
                   looks: str) -> None:
    for cred in settings.credentials:  # Trainer merges mounts by path
        if paths.within(normal, cred.mount_root) or paths.within(looks, cred.mount_root):
            reasons.append(rule.refuse(field, f"{mount_path!r} is at or under credential {cred.name!r}'s mountPath"
                                              f" {cred.mount_path}, which only the webhook's entry mounts"))


# ---- R3, R4, R5: the runtime alone; R6, R7: the TrainJob against it ----


def _of_runtime(rule: Rule, reasons: Reasons, runtime: Runtime, text: str) -> None:
    """A runtime's reason: field spec.runtimeRef, its text starting with the runtime (`subject`)."""
    what = str(runtime)
    reasons.append(rule.refuse("spec.runtimeRef", f"{what}: {text}", subject=what))


def _r3(rule: Rule, reasons: Reasons, settings: Settings, runtime: Runtime, targets: list[Job]) -> None:
    if not targets:
        _of_runtime(rule, reasons, runtime, f"no replicated job has a container named {NODE_CONTAINER!r}")


def _r4(rule: Rule, reasons: Reasons, settings: Settings, runtime: Runtime, targets: list[Job]) -> None:
    publish = settings.publish
    if publish is not None and publish.via == ROUTE_INIT_CONTAINER:
        for job in targets:
            if publish.init_container not in job.init_containers:
                _of_runtime(rule, reasons, runtime, f"job {job.name!r} lacks init container"
                                                    f" {publish.init_container!r} (route 2)")


def _r5_oversize(rule: Rule, reasons: Reasons, settings: Settings, runtime: Runtime) -> None:
    _of_runtime(rule, reasons, runtime, f"too large to check: {runtime.oversize}")  # not held whole


def _r5(rule: Rule, reasons: Reasons, settings: Settings, runtime: Runtime, targets: list[Job]) -> None:
    """What the runtime defines that the webhook's entry would collide with, volumes by name and mounts by
    path, as Trainer and JobSet merge them."""
    def say(text: str) -> None:
        _of_runtime(rule, reasons, runtime, text)

    creds = {c.name: c for c in settings.credentials}
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
        for mounter in job.mounters:  # after the merge it would mount the entry's volume (route 2's init too)
            for name in mounter.volumes:
                if name == PUBLISH_VOLUME or name in creds:
                    what = "init container" if mounter.init else "container"
                    say(f"unmount {name!r} from job {job.name!r} {what} {mounter.name!r}: only the webhook's"
                        " entry may mount that volume, as it defines it")
    for job in targets:  # where the credentials are mounted: Trainer merges mounts by path
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


def _r6(rule: Rule, reasons: Reasons, settings: Settings, spec: dict[str, Any], ref: RuntimeRef,
        facts: RuntimeFacts, env: Iterable[tuple[str, str]]) -> None:
    trainer = spec.get("trainer")
    asked = isinstance(trainer, dict) and trainer.get("numProcPerNode") is not None
    if asked and not facts.policies & set(PROC_POLICIES):
        reasons.append(rule.refuse("spec.trainer.numProcPerNode",
                                   f"{ref} has none of mlPolicy.torch, mpi or flux, so nothing reads numProcPerNode"))


def _r7(rule: Rule, reasons: Reasons, settings: Settings, spec: dict[str, Any], ref: RuntimeRef,
        facts: RuntimeFacts, env: Iterable[tuple[str, str]]) -> None:
    if facts.torch:
        for path, name in env:
            if name in TORCH_RESERVED_ENV:
                reasons.append(rule.refuse(f"{path}.name",
                                           f"{name!r} is set by Trainer's torch plugin ({ref} uses mlPolicy.torch)"))


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
    checked_in=("rules.scan", "decision._s4", "decision._s4_unconfigured"))
S5 = Rule(
    "S5", "5", ErrInvalid,
    "on CREATE, with publish or credentials configured, a TrainJob without the entry reaching `/validate`"
    " (the mutation was bypassed)",
    ("spec.runtimePatches[manager]",),
    checked_in=("decision.validation",))
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
    checked_in=("rules.runtime_ref",), also=(ErrInvalid,))
R2 = Rule(
    "R2", "5", ErrNotFound,
    "a runtime that does not exist (TrainingRuntime: in the TrainJob's namespace)",
    ("spec.runtimeRef", "the runtime source"),
    checked_in=("rules.not_found",), verdict="runtime-missing")
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
    hooks={Point.RUNTIME_OVERSIZE: _r5_oversize, Point.RUNTIME: _r5})
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
    checked_in=("rules.room_for_entry",))
UPDATE = Rule(
    errors.RULE_UPDATE, "6.3", ErrInvalid,
    "an UPDATE that edits the webhook's entry, or (at `/validate`) removes it: it is immutable once written",
    ("spec.runtimePatches[manager] of the old and the new object",),
    checked_in=("decision.validation", "decision._immutable"))

# Not a rule of SPEC: an object the walks cannot read. Its reasons are the sender's fault and are always
# given (a rule switched off must not let a malformed object through unread).
MALFORMED = Rule(
    errors.RULE_MALFORMED, "4", ErrInvalid,
    "an object the webhook cannot walk: a field of the wrong type (not an object, a list or a string where one"
    " is read), or nested too deeply",
    ("every field a rule reads",),
    checked_in=("rules.Walk.bad", "admission._guarded", "admission.Admission.review"), switchable=False)

RULES: tuple[Rule, ...] = (S1, S2, S3, S4, S5, S6, R1, R2, R3, R4, R5, R6, R7, R8, UPDATE)
BY_ID: dict[str, Rule] = {r.id: r for r in RULES}

# The other values of a reason's `rule` (and of the would_deny metric's label): no rule of SPEC 5 or 6.3.
OTHER_LABELS: tuple[tuple[str, str], ...] = (
    (MALFORMED.id, f"{MALFORMED.refuses} (`{MALFORMED.sentinel.label}`); never switched off"),
    (errors.RULE_UNAVAILABLE, "the runtime could not be read now (`ErrUnavailable`)"),
    (errors.RULE_INTERNAL, "a fault of the webhook itself (`ErrInternal`)"),
    (errors.RULE_SETTINGS, "the settings document refused (`ErrInvalid`); never a review's label"),
)

_switched_off: frozenset[str] = frozenset()  # the sweep's, while `switched_off` lasts
_in_force: Checks | None = None              # what in_force() gives until the rules or the off-switch change


def rule(rule_id: str) -> Rule:
    return BY_ID[rule_id]


def find(label: str) -> Rule | None:
    """The rule a reason's label names, the malformed pseudo-rule included; None for the other labels."""
    return MALFORMED if label == MALFORMED.id else BY_ID.get(label)


def in_force() -> Checks:
    """The rules a walk applies now: every registered rule but those switched off. One object while neither
    changes (what is worked out of a runtime is kept per `Checks`)."""
    global _in_force
    if _in_force is None:
        _in_force = Checks(r for r in RULES if r.id not in _switched_off)
    return _in_force


def _changed(rules: tuple[Rule, ...], off: frozenset[str]) -> None:
    global RULES, BY_ID, _switched_off, _in_force
    RULES, BY_ID, _switched_off, _in_force = rules, {r.id: r for r in rules}, off, None


@contextmanager
def registered(*new: Rule) -> Iterator[None]:
    """While inside, `new` are rules like the others (after them, in order): walks built then apply them, the
    audit and the docs list them, the sweep can switch them off."""
    taken = [r.id for r in new if r.id in BY_ID or r.id == MALFORMED.id]
    if taken:
        raise ValueError(f"rule id already used: {', '.join(taken)}")
    _changed(RULES + tuple(new), _switched_off)
    try:
        yield
    finally:
        _changed(tuple(r for r in RULES if r not in new), _switched_off)


@contextmanager
def switched_off(*rule_ids: str) -> Iterator[None]:
    """While inside, walks built then (`in_force`) do not apply the rules named: they give no reason anywhere
    (the sweep's way of removing one)."""
    unknown = [r for r in rule_ids if r not in BY_ID]
    if unknown:
        raise KeyError(f"no such rule (or one that cannot be switched off): {', '.join(unknown)}")
    before = _switched_off
    _changed(RULES, before | frozenset(rule_ids))
    try:
        yield
    finally:
        _changed(RULES, before)
