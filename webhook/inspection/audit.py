"""The audit (SPEC 8.2): judge what already exists with the webhook's own rules, nothing written.

A runtime is judged by the facts a TrainJob review reads (R3, R4, R5); a TrainJob by the plan a review
of its creation would make (S1 to S3, S6, R1 to R8) and by its entry against the one the settings
produce now. The same code as the webhook: no second copy of a rule.

A namespace is judged by the credentials' Secrets its TrainJobs mount (the Secret volumes of their own
entries): one that does not exist there holds every such pod in ContainerCreating for ever, which no
TrainJob status says (`secret-missing`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ..core import rules
from ..core.admission import Admission
from ..core.errors import ErrNotFound, Reason, Reasons
from ..core.patch import entry_secrets
from ..core.runtimes import Runtime

# TrainJobs named per missing Secret (the count says how many mount it): a finding stays one line long
# however many TrainJobs a namespace holds.
NAMED_TRAINJOBS = 5


class Verdict(str, Enum):
    OK = "ok"
    CANNOT_CARRY = "cannot-carry"
    NO_ENTRY = "no-entry"
    STALE_ENTRY = "stale-entry"
    VIOLATION = "violation"
    RUNTIME_MISSING = "runtime-missing"
    SECRET_MISSING = "secret-missing"


@dataclass(frozen=True)
class Finding:
    kind: str
    namespace: str
    name: str
    verdict: Verdict
    causes: tuple[Reason, ...] = ()

    def as_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "namespace": self.namespace, "name": self.name, "verdict": self.verdict.value,
                "causes": [{"sentinel": r.sentinel.name, "field": r.field, "message": r.text} for r in self.causes]}


def _meta(obj: dict[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        meta = {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


def judge_runtime(admission: Admission, runtime: Runtime | dict[str, Any]) -> Finding:
    """`ok`, or `cannot-carry` with the R3, R4 and R5 reasons a TrainJob naming it would get."""
    runtime = Runtime.of(runtime)
    facts, _ = admission.facts(runtime)
    verdict = Verdict.OK if facts.can_carry else Verdict.CANNOT_CARRY
    return Finding(runtime.kind, runtime.namespace, runtime.name, verdict, facts.reasons)


def _verdict_of(admission: Admission, reason: Reason) -> Verdict:
    """What the rule that gave `reason` makes of a TrainJob (`Rule.verdict`: R2's is `runtime-missing`)."""
    rule = admission.registry.find(reason.rule)
    return Verdict(rule.verdict) if rule is not None else Verdict.VIOLATION


def judge_trainjob(admission: Admission, trainjob: dict[str, Any]) -> Finding:
    """`ok`, `no-entry`, `stale-entry`, `violation` or `runtime-missing` (the first that applies, in the
    order runtime-missing, violation, no-entry, stale-entry), with every reason found."""
    namespace, name = _meta(trainjob)
    plan = admission.plan({"uid": "audit", "operation": "CREATE", "namespace": namespace, "name": name,
                           "object": trainjob})
    causes = Reasons(plan.reasons)
    if plan.own is None and plan.configured and plan.entry is not None:
        rules.room_for_entry(plan.count, causes, plan.checks)  # R8: the entry would not fit
    if any(_verdict_of(admission, r) is Verdict.RUNTIME_MISSING for r in causes):
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


@dataclass
class _Mounted:
    volume: str
    count: int = 0
    names: list[str] = field(default_factory=list)


class CredentialSecrets:
    """The Secrets the TrainJobs' own entries mount, per namespace, gathered as the TrainJobs are judged: one
    record per (namespace, Secret), so the memory is bounded by those pairs, not by the TrainJobs."""

    def __init__(self, manager: str):
        self.manager = manager
        self.mounted: dict[tuple[str, str], _Mounted] = {}

    def add(self, trainjob: dict[str, Any]) -> None:
        namespace, name = _meta(trainjob)
        own = next((e for e in (trainjob.get("spec") or {}).get("runtimePatches") or []
                    if isinstance(e, dict) and e.get("manager") == self.manager), None)
        for volume, secret in entry_secrets(own):
            got = self.mounted.setdefault((namespace, secret), _Mounted(volume))
            got.count += 1
            if len(got.names) < NAMED_TRAINJOBS:
                got.names.append(name)

    def secrets(self) -> dict[str, set[str]]:
        """Each Secret name, with the namespaces where TrainJobs mount it."""
        out: dict[str, set[str]] = {}
        for namespace, secret in self.mounted:
            out.setdefault(secret, set()).add(namespace)
        return out

    def missing(self, present: set[tuple[str, str]]) -> list[Finding]:
        """One `secret-missing` finding per namespace lacking a Secret its TrainJobs mount (`present`: the
        (namespace, Secret) pairs that exist), by namespace."""
        causes: dict[str, list[Reason]] = {}
        for (namespace, secret), got in sorted(self.mounted.items()):
            if (namespace, secret) in present:
                continue
            names = ", ".join(got.names) + (", ..." if got.count > len(got.names) else "")
            causes.setdefault(namespace, []).append(Reason(
                ErrNotFound, f"credentials[{got.volume}].secret",
                f"Secret {secret!r} not found in namespace {namespace}: {got.count} TrainJob(s) mount it ({names}); "
                "their pods wait for it and never start"))
        return [Finding("Namespace", "", ns, Verdict.SECRET_MISSING, tuple(reasons)) for ns, reasons in causes.items()]
