"""The audit (SPEC 8.2): judge what already exists with the webhook's own rules, nothing written.

A runtime is judged by the facts a TrainJob review reads (R3, R4, R5); a TrainJob by the plan a review
of its creation would make (S1 to S3, S6, R1 to R8) and by its entry against the one the settings
produce now. The same code as the webhook: no second copy of a rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from . import rules
from .admission import Admission
from .errors import Reason, Reasons
from .runtimes import Runtime


class Verdict(str, Enum):
    OK = "ok"
    CANNOT_CARRY = "cannot-carry"
    NO_ENTRY = "no-entry"
    STALE_ENTRY = "stale-entry"
    VIOLATION = "violation"
    RUNTIME_MISSING = "runtime-missing"


@dataclass(frozen=True)
class Finding:
    kind: str
    namespace: str
    name: str
    verdict: Verdict
    causes: tuple[Reason, ...] = ()

    def as_json(self) -> dict:
        return {"kind": self.kind, "namespace": self.namespace, "name": self.name, "verdict": self.verdict.value,
                "causes": [{"sentinel": r.sentinel.name, "field": r.field, "message": r.text} for r in self.causes]}


def _meta(obj: dict) -> tuple[str, str]:
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


def judge_runtime(admission: Admission, runtime: Runtime | dict) -> Finding:
    """`ok`, or `cannot-carry` with the R3, R4 and R5 reasons a TrainJob naming it would get."""
    runtime = Runtime.of(runtime)
    facts, _ = admission.facts(runtime)
    verdict = Verdict.OK if facts.can_carry else Verdict.CANNOT_CARRY
    return Finding(runtime.kind, runtime.namespace, runtime.name, verdict, facts.reasons)


def judge_trainjob(admission: Admission, trainjob: dict) -> Finding:
    """`ok`, `no-entry`, `stale-entry`, `violation` or `runtime-missing` (the first that applies, in the
    order runtime-missing, violation, no-entry, stale-entry), with every reason found."""
    namespace, name = _meta(trainjob)
    plan = admission.plan({"uid": "audit", "operation": "CREATE", "namespace": namespace, "name": name,
                           "object": trainjob})
    causes = Reasons(plan.reasons)
    if plan.own is None and plan.configured and plan.entry is not None:
        rules.room_for_entry(plan.count, causes)  # R8: the entry would not fit
    if any(r.rule == "R2" for r in causes):
        verdict = Verdict.RUNTIME_MISSING
    elif causes:
        verdict = Verdict.VIOLATION
    elif plan.own is None:
        verdict = Verdict.NO_ENTRY if plan.configured else Verdict.OK
    elif plan.stale(plan.own.entry):
        verdict = Verdict.STALE_ENTRY
    else:
        verdict = Verdict.OK
    return Finding("TrainJob", namespace, name, verdict, tuple(causes))
