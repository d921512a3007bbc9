"""The rules, by id: one object each (SPEC 5 and 6.3), the one place that says what a rule is.

Every reason the core gives carries the id of the rule that found it (`Reason.rule`): the
`dispatch_admission_would_deny_total{rule}` label, the audit's causes and the docs read these ids and
this table. A rule's check lives where the object is walked once for all of them (`rules.scan` for a
TrainJob's entries and env, `rules.runtime_facts` for a runtime, `admission` for the entry itself and
for updates): `Rule.where` names it.

The sweep (`python -m tests.sweep`) switches each rule off in turn through `switch_off`, and the tests
marked for it must then fail: a rule switched off gives no reason anywhere.

Adding a rule: one entry here, its check where `where` says (its reasons tagged with its id), and tests
marked for it (`test_<id>_...` or `@pytest.mark.rules("<id>")`); CONTRIBUTING.md says it step by step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

from . import errors
from .errors import ErrInvalid, ErrNotFound, ErrUnsupported, Sentinel


class Rule(NamedTuple):
    id: str
    section: str            # where SPEC says it
    sentinel: Sentinel      # what it refuses with (a malformed field it reads may be ErrInvalid instead)
    refuses: str            # what it refuses, for people
    reads: tuple[str, ...]  # the fields and facts it reads
    where: str              # the function holding its check


RULES: tuple[Rule, ...] = (
    Rule("S1", "5", ErrInvalid,
         "a volume named `dispatch-publish` in another manager's entry; also a mount of that volume there (route 2's"
         " emptyDir is writable: it would let another container replace the binary)",
         ("spec.runtimePatches[].…volumes[].name", "spec.runtimePatches[].…volumeMounts[].name"), "rules.scan"),
    Rule("S2", "5", ErrInvalid,
         "a `volumeMounts[].mountPath` at or under `/opt/dispatch` (or a look-alike of it) in any container or init"
         " container of another entry; an object nested too deeply to walk",
         ("spec.runtimePatches[].…volumeMounts[].mountPath",), "rules.scan"),
    Rule("S3", "5", ErrInvalid,
         "a `spec.trainer.env` name starting with `DISPATCH_`; also such an env in another entry's containers (it"
         " could redirect route 2's copy)",
         ("spec.trainer.env[].name", "spec.runtimePatches[].…env[].name"), "rules.scan"),
    Rule("S4", "5, 2.1", ErrInvalid,
         "the webhook's own entry differing (time aside, compared as JSON values) from what the settings produce"
         " (or, for 10 minutes after a switch, the previous settings); two entries under its manager",
         ("spec.runtimePatches[manager]", "the settings", "the runtime's target jobs"), "admission.validation"),
    Rule("S5", "5", ErrInvalid,
         "on CREATE, with publish or credentials configured, a TrainJob without the entry reaching `/validate`"
         " (the mutation was bypassed)",
         ("spec.runtimePatches[manager]",), "admission.validation"),
    Rule("S6", "5", ErrInvalid,
         "another entry defining a volume named like a credential, or mounting at or under a credential's"
         " `mountPath` (Trainer merges volumes by name and mounts by path: a later entry would replace them)",
         ("spec.runtimePatches[].…volumes[].name", "spec.runtimePatches[].…volumeMounts[].mountPath",
          "settings.credentials"), "rules.scan"),
    Rule("R1", "5", ErrUnsupported,
         "`runtimeRef.apiGroup` other than `trainer.kubeflow.org`, `kind` other than the two runtime kinds; the"
         " defaults apply only where a field is absent: an explicit `\"\"` is refused (a missing `runtimeRef` or"
         " name is `ErrInvalid`)",
         ("spec.runtimeRef",), "rules.runtime_ref"),
    Rule("R2", "5", ErrNotFound,
         "a runtime that does not exist (TrainingRuntime: in the TrainJob's namespace)",
         ("spec.runtimeRef", "the runtime source"), "admission.Admission._lookup"),
    Rule("R3", "5", ErrUnsupported,
         "a runtime with no replicated job holding a container named `node`",
         ("runtime: containers of each replicated job",), "rules.runtime_facts"),
    Rule("R4", "5", ErrUnsupported,
         "route 2: a target job without the named init container (each one named)",
         ("runtime: init containers of each target job", "settings.publish.initContainer"), "rules.runtime_facts"),
    Rule("R5", "5", ErrUnsupported,
         "a runtime that already defines `dispatch-publish` or a credential's volume name (a volume, or a claim"
         " template of the JobSet template's `volumeClaimPolicies`: JobSet makes each a volume), mounts at or under"
         " `/opt/dispatch`, mounts at or under a credential's `mountPath` on a target job's `node` container, or whose"
         " `mlPolicy.mpi.sshAuthMountPath` overlaps a credential's; a runtime too large to check",
         ("runtime: volumes, claim templates and mounts of each replicated job", "runtime: mlPolicy.mpi",
          "settings.credentials"), "rules.runtime_facts"),
    Rule("R6", "5", ErrUnsupported,
         "`spec.trainer.numProcPerNode` on a runtime whose `mlPolicy` has none of `torch`, `mpi`, `flux` (Trainer"
         " reads it as processes per node, MPI slots or Flux tasks, and ignores it elsewhere)",
         ("spec.trainer.numProcPerNode", "runtime: mlPolicy"), "rules.trainjob_runtime_rules"),
    Rule("R7", "5", ErrInvalid,
         "on a torch runtime, `spec.trainer.env` setting `PET_NNODES`, `PET_NPROC_PER_NODE`, `PET_NODE_RANK`,"
         " `PET_MASTER_ADDR` or `PET_MASTER_PORT`",
         ("spec.trainer.env[].name", "runtime: mlPolicy"), "rules.trainjob_runtime_rules"),
    Rule("R8", "5", ErrUnsupported,
         "no room for the entry (`runtimePatches` holds at most 16)",
         ("spec.runtimePatches (count)",), "rules.room_for_entry"),
    Rule(errors.RULE_UPDATE, "6.3", ErrInvalid,
         "an UPDATE that edits the webhook's entry, or (at `/validate`) removes it: it is immutable once written",
         ("spec.runtimePatches[manager] of the old and the new object",), "admission._immutable"),
)

BY_ID: dict[str, Rule] = {r.id: r for r in RULES}

# The other values of a reason's `rule` (and of the would_deny metric's label): no rule of SPEC 5 or 6.3.
OTHER_LABELS: tuple[tuple[str, str], ...] = (
    (errors.RULE_UNAVAILABLE, "the runtime could not be read now (`ErrUnavailable`)"),
    (errors.RULE_INTERNAL, "a fault of the webhook itself (`ErrInternal`)"),
    (errors.RULE_SETTINGS, "the settings document refused (`ErrInvalid`); never a review's label"),
)


def rule(rule_id: str) -> Rule:
    return BY_ID[rule_id]


@contextmanager
def switched_off(*rule_ids: str) -> Iterator[None]:
    """While inside, the rules named give no reason anywhere (the sweep's way of removing one)."""
    unknown = [r for r in rule_ids if r not in BY_ID]
    if unknown:
        raise KeyError(f"no such rule: {', '.join(unknown)}")
    before = errors.SWITCHED_OFF
    errors.SWITCHED_OFF = before | frozenset(rule_ids)
    try:
        yield
    finally:
        errors.SWITCHED_OFF = before
