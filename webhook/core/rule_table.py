"""The rules of SPEC 5 by id: what each refuses and with which sentinel.

The checks themselves are in rules.py and admission.py, each reason tagged with one of these ids (SPEC
8.1's `rule` label). This table is what the docs and `tests/unit/test_docs.py` read: a rule id found in the
code but not here (or here but not in the code) fails that test. It gives way to a rule registry when one
lands (issue 24).
"""

from __future__ import annotations

from typing import NamedTuple

from .errors import RULE_INTERNAL, RULE_SETTINGS, RULE_UNAVAILABLE, RULE_UPDATE, ErrInvalid, ErrNotFound, ErrUnsupported, Sentinel


class RuleDoc(NamedTuple):
    id: str
    sentinel: Sentinel
    refuses: str


RULES: tuple[RuleDoc, ...] = (
    RuleDoc("S1", ErrInvalid,
            "a volume named `dispatch-publish` in another manager's entry; also a mount of that volume there (route 2's"
            " emptyDir is writable: it would let another container replace the binary)"),
    RuleDoc("S2", ErrInvalid,
            "a `volumeMounts[].mountPath` at or under `/opt/dispatch` in any container or init container of another"
            " entry (`subPath` or not); an object nested too deeply to walk"),
    RuleDoc("S3", ErrInvalid,
            "a `spec.trainer.env` name starting with `DISPATCH_`; also such an env in another entry's containers (it"
            " could redirect route 2's copy)"),
    RuleDoc("S4", ErrInvalid,
            "the webhook's own entry differing (time aside, compared as JSON values) from what the settings produce;"
            " two entries under its manager"),
    RuleDoc("S5", ErrInvalid,
            "on CREATE, with publish or credentials configured, a TrainJob without the entry reaching `/validate`"
            " (the mutation was bypassed)"),
    RuleDoc("S6", ErrInvalid,
            "another entry defining a volume named like a credential, or mounting at or under a credential's"
            " `mountPath` (Trainer merges volumes by name and mounts by path: a later entry would replace them)"),
    RuleDoc("R1", ErrUnsupported,
            "`runtimeRef.apiGroup` other than `trainer.kubeflow.org`, `kind` other than the two runtime kinds; the"
            " defaults apply only where a field is absent: an explicit `\"\"` is refused (a missing `runtimeRef` or"
            " name is `ErrInvalid`)"),
    RuleDoc("R2", ErrNotFound,
            "a runtime that does not exist (TrainingRuntime: in the TrainJob's namespace)"),
    RuleDoc("R3", ErrUnsupported,
            "a runtime with no replicated job holding a container named `node`"),
    RuleDoc("R4", ErrUnsupported,
            "route 2: a target job without the named init container (each one named)"),
    RuleDoc("R5", ErrUnsupported,
            "a runtime that already defines `dispatch-publish` or a credential's volume name, or mounts at or under"
            " `/opt/dispatch`"),
    RuleDoc("R6", ErrUnsupported,
            "`spec.trainer.numProcPerNode` on a runtime whose `mlPolicy` has none of `torch`, `mpi`, `flux` (Trainer"
            " reads it as processes per node, MPI slots or Flux tasks, and ignores it elsewhere)"),
    RuleDoc("R7", ErrInvalid,
            "on a torch runtime, `spec.trainer.env` setting `PET_NNODES`, `PET_NPROC_PER_NODE`, `PET_NODE_RANK`,"
            " `PET_MASTER_ADDR` or `PET_MASTER_PORT`"),
    RuleDoc("R8", ErrUnsupported,
            "no room for the entry (`runtimePatches` holds at most 16)"),
)

# The other values of the `rule` label: reasons that come from no SPEC 5 rule.
OTHER_LABELS: tuple[tuple[str, str], ...] = (
    (RULE_UPDATE, "SPEC 6.3: the webhook's entry removed or edited on UPDATE"),
    (RULE_UNAVAILABLE, "the runtime could not be read now (`ErrUnavailable`)"),
    (RULE_INTERNAL, "a fault of the webhook itself (`ErrInternal`)"),
    (RULE_SETTINGS, "the settings document refused (`ErrInvalid`); never a review's label"),
)
