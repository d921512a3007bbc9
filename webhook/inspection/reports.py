"""The audit's findings as OpenReports (openreports.io/v1alpha1, the Policy Working Group's report API that
Kyverno, Kubescape and Trivy write and dashboards read): one `Report` per namespace for its TrainJobs and
TrainingRuntimes, one `ClusterReport` for the ClusterTrainingRuntimes (issue 37, item 1).

A result per object and rule: `pass` for an object every rule admits, `fail` per reason a rule gives (the rule's
id, our sentinel as its category, `FIELD: TEXT` as its message), `warn` for a TrainJob without the entry or with a
stale one, `error` for a reason that is a fault (ErrUnavailable, ErrInternal). A report is bounded whatever the
namespace holds: at most MAX_RESULTS results and MAX_REPORT_BYTES of JSON as the client sends it, failures first,
then errors, warnings, passes, each message and field at most MAX_MESSAGE bytes of UTF-8; the summary counts every
result, kept or not, and an annotation (DROPPED) says how many were left out. Nothing here does I/O.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from ..core.errors import ErrInternal, ErrInvalid, ErrNotFound, ErrUnavailable, ErrUnsupported, Reason
from ..core.runtimes import CLUSTER_KIND, GROUP, NAMESPACED_KIND, TRAINJOB_KIND, VERSION
from .audit import Finding, Verdict

API_VERSION = "openreports.io/v1alpha1"
GROUP_REPORTS, VERSION_REPORTS = "openreports.io", "v1alpha1"
NAME = "dispatch-admission"        # one report of ours per namespace (and one cluster report): re-runs replace it
SOURCE = "dispatch-admission"
POLICY = "dispatch-admission"
MANAGED_BY = {"app.kubernetes.io/managed-by": "dispatch-admission"}
MAX_RESULTS = 1000
# The document as the client sends it (json.dumps: every non-ASCII character escaped, a 4-byte one as 12 bytes,
# which is never less than its UTF-8), at most 1 MiB: etcd refuses a request over 1.5 MiB (its default
# --max-request-bytes), and the API server adds its metadata (managedFields) to what is stored. 9 runtimes of
# 240 KB once made one Report 2.2 MB. ENVELOPE is kept for all but the results (metadata, summary, configuration).
MAX_REPORT_BYTES = 1024 * 1024
ENVELOPE = 8 * 1024
MAX_MESSAGE = 512                  # bytes of UTF-8, a message or a field
DROPPED = "dispatch-admission.io/results-dropped"  # annotation: results counted in the summary but not kept
ORDER = ("fail", "error", "warn", "pass")  # what a capped report keeps first

SEVERITY = {ErrInvalid: "high", ErrUnsupported: "medium", ErrNotFound: "medium", ErrUnavailable: "low",
            ErrInternal: "low"}
WARNINGS = {Verdict.NO_ENTRY: "the TrainJob has no publish entry: it runs without /opt/dispatch/publish; recreate it",
            Verdict.STALE_ENTRY: "the TrainJob's entry differs from what the settings write now (it keeps the old one)"}


def _cut(text: str) -> str:
    """At most MAX_MESSAGE bytes of UTF-8, cut between characters."""
    raw = text.encode("utf-8", "replace")
    if len(raw) <= MAX_MESSAGE:
        return text
    return raw[:MAX_MESSAGE - 3].decode("utf-8", "ignore") + "..."


def size(value: Any) -> int:
    """Bytes of `value` as JSON the way the Kubernetes client sends it (json.dumps' defaults: non-ASCII escaped,
    `, ` and `: ` between items)."""
    return len(json.dumps(value))


class ReportBuilder:
    """The results of one namespace's objects (or, with namespace "", the cluster's), as they are judged."""

    def __init__(self, namespace: str, now: datetime | None = None):
        self.namespace = namespace
        now = now or datetime.now(UTC)
        self.timestamp = {"seconds": int(now.timestamp()), "nanos": 0}
        self.summary = {status: 0 for status in ("pass", "fail", "warn", "error", "skip")}
        # Each kept result with its size (and its separator) in bytes; `_bytes` their sum.
        self._kept: dict[str, list[tuple[dict[str, Any], int]]] = {status: [] for status in ORDER}
        self._bytes = 0

    def add(self, finding: Finding, uid: str = "") -> None:
        for status, rule, reason, message in _results(finding):
            self.summary[status] += 1
            result = self._result(finding, uid, status, rule, reason, message)
            bytes_ = size(result) + 2  # and its ", "
            if self._room_for(status, bytes_):
                self._kept[status].append((result, bytes_))
                self._bytes += bytes_

    def _room_for(self, status: str, bytes_: int) -> bool:
        """Whether a result of `status` and `bytes_` is kept: while under MAX_RESULTS and the byte budget, or in
        place of results of statuses kept after it (passes give way to a failure), so what is held stays bounded
        in count and bytes as it comes."""
        budget = MAX_REPORT_BYTES - ENVELOPE
        count = sum(len(k) for k in self._kept.values())
        if count < MAX_RESULTS and self._bytes + bytes_ <= budget:
            return True
        lower = list(reversed(ORDER[ORDER.index(status) + 1:]))  # the least kept first
        freeable = sum(b for s in lower for _, b in self._kept[s])
        if self._bytes - freeable + bytes_ > budget or count - sum(len(self._kept[s]) for s in lower) >= MAX_RESULTS:
            return False  # even dropping every lower result would not make room: drop this one, keep them
        for s in lower:
            while self._kept[s] and (count >= MAX_RESULTS or self._bytes + bytes_ > budget):
                _, freed = self._kept[s].pop()
                self._bytes -= freed
                count -= 1
        return True

    @property
    def dropped(self) -> int:
        """Results counted in the summary but not kept."""
        return sum(self.summary.values()) - sum(len(k) for k in self._kept.values())

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
        results = [r for status in ORDER for r, _ in self._kept[status]]
        meta: dict[str, Any] = {"name": NAME, "labels": dict(MANAGED_BY)}
        if self.namespace:
            meta["namespace"] = self.namespace
        if self.dropped:
            meta["annotations"] = {DROPPED: str(self.dropped)}
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
