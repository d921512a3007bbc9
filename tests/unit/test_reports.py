"""The audit's OpenReports (issue 37, item 1): a result per object and rule, bounded whatever a namespace holds."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from webhook.core import reports
from webhook.core.audit import Finding, Verdict
from webhook.core.errors import ErrInvalid, ErrNotFound, ErrUnavailable, ErrUnsupported, Reason

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
S3 = Reason(ErrInvalid, "spec.trainer.env[0].name", "'DISPATCH_X': names starting with DISPATCH_ are reserved", "S3")
R7 = Reason(ErrInvalid, "spec.trainer.env[1].name", "'PET_NNODES' is set by Trainer's torch plugin", "R7")


def job(name: str, verdict: Verdict, *causes: Reason, namespace: str = "team-a") -> Finding:
    return Finding("TrainJob", namespace, name, verdict, tuple(causes))


def test_a_result_per_object_and_rule():
    b = reports.ReportBuilder("team-a", NOW)
    b.add(job("ok", Verdict.OK), uid="u-1")
    b.add(job("bad", Verdict.VIOLATION, S3, R7))
    b.add(job("old", Verdict.NO_ENTRY))
    b.add(job("stale", Verdict.STALE_ENTRY))
    b.add(job("down", Verdict.VIOLATION,
              Reason(ErrUnavailable, "spec.runtimeRef", "cannot be read now", "unavailable")))
    doc = b.document()
    assert doc["apiVersion"] == "openreports.io/v1alpha1" and doc["kind"] == "Report"
    assert doc["metadata"] == {"name": "dispatch-admission", "namespace": "team-a",
                               "labels": {"app.kubernetes.io/managed-by": "dispatch-admission"}}
    assert doc["summary"] == {"pass": 1, "fail": 2, "warn": 2, "error": 1, "skip": 0}
    by = {(r["resources"][0]["name"], r["rule"]): r for r in doc["results"]}
    s3 = by[("bad", "S3")]
    assert s3["result"] == "fail" and s3["category"] == "ErrInvalid" and s3["severity"] == "high"
    assert s3["message"] == "spec.trainer.env[0].name: 'DISPATCH_X': names starting with DISPATCH_ are reserved"
    assert s3["properties"] == {"verdict": "violation", "field": "spec.trainer.env[0].name"}
    assert s3["resources"][0] == {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "name": "bad",
                                  "namespace": "team-a"}
    assert by[("ok", "all")]["result"] == "pass" and by[("ok", "all")]["resources"][0]["uid"] == "u-1"
    assert by[("old", "no-entry")]["result"] == "warn" and by[("stale", "stale-entry")]["result"] == "warn"
    assert by[("down", "unavailable")]["result"] == "error"
    assert [r["result"] for r in doc["results"]] == ["fail", "fail", "error", "warn", "warn", "pass"]
    assert all(r["timestamp"] == {"seconds": int(NOW.timestamp()), "nanos": 0} for r in doc["results"])


def test_where_each_finding_is_reported():
    cluster_rt = Finding("ClusterTrainingRuntime", "", "no-node", Verdict.CANNOT_CARRY,
                         (Reason(ErrUnsupported, "spec.runtimeRef", "no node", "R3"),))
    assert reports.report_namespace(cluster_rt) == ""
    assert reports.report_namespace(Finding("TrainingRuntime", "team-b", "x", Verdict.OK)) == "team-b"
    assert reports.report_namespace(job("j", Verdict.OK, namespace="team-c")) == "team-c"
    missing = Finding("Namespace", "", "team-d", Verdict.SECRET_MISSING,
                      (Reason(ErrNotFound, "credentials[checkpoint-store].secret", "Secret 's3' not found"),))
    assert reports.report_namespace(missing) == "team-d"
    b = reports.ReportBuilder("", NOW)
    b.add(cluster_rt)
    doc = b.document()
    assert doc["kind"] == "ClusterReport" and "namespace" not in doc["metadata"]
    [result] = doc["results"]
    assert result["rule"] == "R3" and result["category"] == "ErrUnsupported" and result["severity"] == "medium"
    b = reports.ReportBuilder("team-d", NOW)
    b.add(missing)
    [result] = b.document()["results"]
    assert result["rule"] == "secret-missing" and result["resources"][0] == {"apiVersion": "v1", "kind": "Namespace",
                                                                             "name": "team-d"}


def test_a_namespace_of_ten_thousand_trainjobs_stays_bounded():
    """Results capped (failures kept first), the summary exact, the document well under the object size limit
    (1.5 MiB), and what the builder holds bounded as the findings come."""
    b = reports.ReportBuilder("team-a", NOW)
    for i in range(10_000):
        if i % 10 == 9:
            b.add(job(f"bad-{i:05d}", Verdict.VIOLATION, S3))
        else:
            b.add(job(f"ok-{i:05d}-" + "n" * 40, Verdict.OK))
        assert sum(len(k) for k in b._kept.values()) <= reports.MAX_RESULTS
    doc = b.document()
    assert doc["summary"] == {"pass": 9000, "fail": 1000, "warn": 0, "error": 0, "skip": 0}
    assert len(doc["results"]) == reports.MAX_RESULTS
    assert all(r["result"] == "fail" for r in doc["results"]), "the failures fill the report before any pass"
    size = len(json.dumps(doc))
    assert size < 1024 * 1024, size


def test_long_messages_are_cut():
    long = Reason(ErrInvalid, "spec.x", "y" * 5000, "S2")
    b = reports.ReportBuilder("team-a", NOW)
    b.add(job("long", Verdict.VIOLATION, long))
    [result] = b.document()["results"]
    assert len(result["message"]) == reports.MAX_MESSAGE and result["message"].endswith("...")
