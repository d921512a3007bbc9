"""The audit's findings as OpenReports (openreports.io/v1alpha1, the Policy Working Group's report API that
Kyverno, Kubescape and Trivy write and dashboards read): one `Report` per namespace for its TrainJobs and
TrainingRuntimes, one `ClusterReport` for the ClusterTrainingRuntimes (issue 37, item 1).

A result per object and rule: `pass` for an object every rule admits, `fail` per reason a rule gives (the rule's
id, our sentinel as its category, `FIELD: TEXT` as its message), `warn` for a TrainJob without the entry or with a
stale one, `error` for a reason that is a fault (ErrUnavailable, ErrInternal). A report is bounded whatever the
namespace holds: at most MAX_RESULTS results, failures first, then warnings, then passes, each message at most
MAX_MESSAGE characters; the summary counts every result, kept or not. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from .audit import Finding, Verdict
from .errors import ErrInternal, ErrInvalid, ErrNotFound, ErrUnavailable, ErrUnsupported, Reason
from .runtimes import CLUSTER_KIND, GROUP, NAMESPACED_KIND, TRAINJOB_KIND, VERSION

API_VERSION = "openreports.io/v1alpha1"
GROUP_REPORTS, VERSION_REPORTS = "openreports.io", "v1alpha1"
NAME = "dispatch-admission"        # one report of ours per namespace (and one cluster report): re-runs replace it
SOURCE = "dispatch-admission"
POLICY = "dispatch-admission"
MANAGED_BY = {"app.kubernetes.io/managed-by": "dispatch-admission"}
MAX_RESULTS = 1000                 # ~600 bytes a result: a report stays well under the API server's 1.5 MiB
MAX_MESSAGE = 512
ORDER = ("fail", "error", "warn", "pass")  # what a capped report keeps first

SEVERITY = {ErrInvalid: "high", ErrUnsupported: "medium", ErrNotFound: "medium", ErrUnavailable: "low",
            ErrInternal: "low"}
WARNINGS = {Verdict.NO_ENTRY: "the TrainJob has no publish entry: it runs without /opt/dispatch/publish; recreate it",
            Verdict.STALE_ENTRY: "the TrainJob's entry differs from what the settings write now (it keeps the old one)"}


def _cut(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE - 3] + "..."


class ReportBuilder:
    """The results of one namespace's objects (or, with namespace "", the cluster's), as they are judged."""

    def __init__(self, namespace: str, now: datetime | None = None):
        self.namespace = namespace
        now = now or datetime.now(UTC)
        self.timestamp = {"seconds": int(now.timestamp()), "nanos": 0}
        self.summary = {status: 0 for status in ("pass", "fail", "warn", "error", "skip")}
        self._kept: dict[str, list[dict[str, Any]]] = {status: [] for status in ORDER}

    def add(self, finding: Finding, uid: str = "") -> None:
        for status, rule, reason, message in _results(finding):
            self.summary[status] += 1
            if self._room_for(status):
                self._kept[status].append(self._result(finding, uid, status, rule, reason, message))

    def _room_for(self, status: str) -> bool:
        """Whether a result of `status` is kept: while fewer than MAX_RESULTS are, or in place of one of a status
        kept after it (a pass gives way to a failure), so what is held stays bounded as it comes."""
        if sum(len(k) for k in self._kept.values()) < MAX_RESULTS:
            return True
        for lower in reversed(ORDER[ORDER.index(status) + 1:]):
            if self._kept[lower]:
                self._kept[lower].pop()
                return True
        return False

    def _result(self, finding: Finding, uid: str, status: str, rule: str, reason: Reason | None,
                message: str) -> dict[str, Any]:
        resource = {"apiVersion": "v1" if finding.kind == "Namespace" else f"{GROUP}/{VERSION}", "kind": finding.kind,
                    "name": finding.name}
        if finding.namespace:
            resource["namespace"] = finding.namespace
        if uid:
            resource["uid"] = uid
        result: dict[str, Any] = {
            "source": SOURCE, "policy": POLICY, "rule": rule, "result": status, "message": _cut(message),
            "resources": [resource], "timestamp": self.timestamp, "scored": True,
            "properties": {"verdict": finding.verdict.value}}
        if reason is not None:
            result["category"] = reason.sentinel.name
            result["severity"] = SEVERITY[reason.sentinel]
            result["properties"]["field"] = _cut(reason.field)
        return result

    def __len__(self) -> int:
        return sum(self.summary.values())

    def document(self) -> dict[str, Any]:
        results = [r for status in ORDER for r in self._kept[status]]
        meta: dict[str, Any] = {"name": NAME, "labels": dict(MANAGED_BY)}
        if self.namespace:
            meta["namespace"] = self.namespace
        return {"apiVersion": API_VERSION, "kind": "Report" if self.namespace else "ClusterReport", "metadata": meta,
                "source": SOURCE, "configuration": {"limits": {"maxResults": MAX_RESULTS}},
                "summary": dict(self.summary), "results": results}


def _results(finding: Finding) -> Iterator[tuple[str, str, Reason | None, str]]:
    """(result, rule, reason, message) of one finding."""
    if finding.verdict is Verdict.OK:
        yield "pass", "all", None, "every rule admits it"
    elif finding.verdict in WARNINGS:
        yield "warn", finding.verdict.value, None, WARNINGS[finding.verdict]
    else:
        for reason in finding.causes:
            status = "error" if reason.sentinel in (ErrUnavailable, ErrInternal) else "fail"
            yield status, reason.rule or finding.verdict.value, reason, f"{reason.field}: {reason.text}"


def report_namespace(finding: Finding) -> str:
    """Where a finding is reported: its namespace's Report, or ("") the ClusterReport; a namespace-level finding
    (a Secret missing) in that namespace's Report."""
    if finding.kind == "Namespace":
        return finding.name
    if finding.kind in (TRAINJOB_KIND, NAMESPACED_KIND):
        return finding.namespace
    assert finding.kind == CLUSTER_KIND, finding.kind
    return ""
