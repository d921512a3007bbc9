"""The audit's OpenReports (issue 37, item 1): a result per object and rule, bounded whatever a namespace holds."""

from __future__ import annotations

import gc
import io
import json
import weakref
from datetime import UTC, datetime

import kubernetes.client
import pytest
from kubernetes.client.exceptions import ApiException

from tests.helpers import runtime, trainjob
from webhook.commands import audit
from webhook.core.errors import ErrInvalid, ErrNotFound, ErrUnavailable, ErrUnsupported, Reason
from webhook.core.settings import Settings
from webhook.inspection import reports
from webhook.inspection.audit import Finding, Verdict
from webhook.kube import client as kube_client
from webhook.kube.audit_reads import ClusterUnreadable
from webhook.kube.reports_writer import OpenReports

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


WIDE = "\U0001f600"  # 4 bytes of UTF-8, 12 as the client escapes it (\ud83d\ude00)


def test_a_namespace_report_stays_under_the_byte_limit_whatever_its_results():
    """9 runtimes of 240 KB once made a Report of 2.2 MB UTF-8 (5.5 MB escaped): now the document as the client
    sends it stays under MAX_REPORT_BYTES, failures are kept before passes, and the summary and an annotation
    say how many were left out."""
    wide = Reason(ErrInvalid, WIDE * 4000, WIDE * 60_000, "R5")
    b = reports.ReportBuilder("team-a" + "a" * 57, NOW)
    for i in range(2000):
        b.add(job(f"ok-{i:05d}-" + "n" * 200, Verdict.OK))
        b.add(Finding("TrainingRuntime", "team-a", f"rt-{i:05d}-" + "r" * 200, Verdict.CANNOT_CARRY,
                      (wide, wide._replace(rule="R4"), wide._replace(rule="R3"))))
        assert b._bytes <= reports.MAX_REPORT_BYTES - reports.ENVELOPE
    doc = b.document()
    sent = json.dumps(doc)  # as the kubernetes client serializes a body
    assert len(sent) <= reports.MAX_REPORT_BYTES, len(sent)
    assert len(sent.encode("utf-8")) == len(sent), "escaped: the bytes sent are the characters counted"
    kept, statuses = len(doc["results"]), [r["result"] for r in doc["results"]]
    assert 0 < kept < 1000 and statuses == sorted(statuses, key=reports.ORDER.index)
    fail_size = min(reports.size(r) for r in doc["results"] if r["result"] == "fail")
    passes = sum(reports.size(r) + 2 for r in doc["results"] if r["result"] == "pass")
    assert passes < fail_size, "passes keep only the room no failure could use"
    assert doc["summary"] == {"pass": 2000, "fail": 6000, "warn": 0, "error": 0, "skip": 0}
    assert doc["metadata"]["annotations"] == {reports.DROPPED: str(8000 - kept)}
    assert len(json.dumps(doc, ensure_ascii=False).encode("utf-8")) < len(sent), "UTF-8 is never more"


def test_a_message_is_cut_in_bytes_between_characters():
    b = reports.ReportBuilder("team-a", NOW)
    b.add(job("wide", Verdict.VIOLATION, Reason(ErrInvalid, "x" + WIDE * 1000, WIDE * 1000, "S2")))
    [result] = b.document()["results"]
    for text in (result["message"], result["properties"]["field"]):
        raw = text.encode("utf-8")
        assert len(raw) <= reports.MAX_MESSAGE and text.endswith("...")
        assert raw.decode("utf-8") == text  # no character cut in half
    assert reports.MAX_MESSAGE - 6 <= len(result["message"].encode()) <= reports.MAX_MESSAGE


def test_a_failure_displaces_passes_only_while_it_fits():
    """At the byte budget, a failure takes the room of passes (the last kept first); when dropping every pass
    would not make room, the failure is dropped and the passes kept."""
    b = reports.ReportBuilder("team-a", NOW)
    for i in range(5):
        b.add(job(f"ok-{i}", Verdict.OK))
    one_pass = b._kept["pass"][0][1]
    budget = reports.MAX_REPORT_BYTES - reports.ENVELOPE
    b._bytes = budget  # as if the report were full
    b.add(job("bad", Verdict.VIOLATION, S3))
    [(_, one_fail)] = b._kept["fail"]
    evicted = -(-one_fail // one_pass)  # as many passes as make room, no more
    assert 0 < evicted < 5
    assert [r["resources"][0]["name"] for r, _ in b._kept["pass"]] == [f"ok-{i}" for i in range(5 - evicted)]
    assert b._bytes <= budget and b.dropped == evicted
    b._bytes = budget + 10_000  # no pass left could make room: the newcomer goes, the passes stay
    b.add(job("worse", Verdict.VIOLATION, S3))
    assert len(b._kept["pass"]) == 5 - evicted and len(b._kept["fail"]) == 1 and b.dropped == evicted + 1


class FakeReportsAPI:
    """The CustomObjectsApi calls OpenReports makes, on a dict; `refuse` maps a namespace to the ApiException
    its writes get ("" for the ClusterReport)."""

    def __init__(self, held=(), refuse=None, refuse_list=None):
        self.held: dict[tuple[str, str], dict] = {k: {"metadata": {"name": k[1], "namespace": k[0],
                                                                     "resourceVersion": "1"}} for k in held}
        self.refuse, self.refuse_list = refuse or {}, refuse_list
        self.calls: list[tuple[str, str]] = []

    def _write(self, verb, namespace, body):
        self.calls.append((verb, namespace))
        if namespace in self.refuse:
            raise self.refuse[namespace]
        if verb == "create" and (namespace, body["metadata"]["name"]) in self.held:
            raise ApiException(status=409, reason="Conflict")
        self.held[(namespace, body["metadata"]["name"])] = body

    def create_namespaced_custom_object(self, group, version, namespace, plural, body, **kw):
        self._write("create", namespace, body)

    def create_cluster_custom_object(self, group, version, plural, body, **kw):
        self._write("create", "", body)

    def get_namespaced_custom_object(self, group, version, namespace, plural, name, **kw):
        return self.held[(namespace, name)]

    def replace_namespaced_custom_object(self, group, version, namespace, plural, name, body, **kw):
        self._write("replace", namespace, body)

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name, **kw):
        self.calls.append(("delete", namespace))
        if namespace in self.refuse:
            raise self.refuse[namespace]
        del self.held[(namespace, name)]

    def list_cluster_custom_object(self, group, version, plural, **kw):
        if self.refuse_list is not None:
            raise self.refuse_list
        cluster = plural == "clusterreports"
        return {"items": [v for (ns, _), v in self.held.items() if bool(ns) != cluster]}


def _open_reports(api, namespaces, err):
    written = OpenReports(None, None, err)
    written.api = api
    for ns in namespaces:
        written.add(job("j", Verdict.OK, namespace=ns))
    return written


def test_one_failing_write_does_not_stop_the_others():
    """A report refused (too large, a 500) is logged and counted; the later namespaces' reports are written and
    a stale report is still deleted."""
    too_large = ApiException(status=500, reason="Internal Server Error")
    too_large.body = json.dumps({"message": "etcdserver: request is too large"})
    api = FakeReportsAPI(held=[("team-b", "dispatch-admission"), ("gone", "dispatch-admission")],
                         refuse={"team-a": too_large})
    err = io.StringIO()
    written = _open_reports(api, ["team-a", "team-b", "team-c"], err)
    assert written.write() == ["team-b/dispatch-admission", "team-c/dispatch-admission"]
    assert written.failed == 1
    assert "audit: write team-a/dispatch-admission: write OpenReports: 500 Internal Server Error:" \
           " etcdserver: request is too large" in err.getvalue()
    assert ("gone", "dispatch-admission") not in api.held, "the stale report is deleted after the failure"
    assert ("team-b", "dispatch-admission") in api.held and ("team-c", "dispatch-admission") in api.held
    assert ("replace", "team-b") in api.calls


def test_a_failing_delete_or_list_is_counted_and_the_rest_done():
    api = FakeReportsAPI(held=[("gone-1", "dispatch-admission"), ("gone-2", "dispatch-admission")],
                         refuse={"gone-1": ApiException(status=403, reason="Forbidden")})
    err = io.StringIO()
    assert _open_reports(api, ["team-a"], err).write() == ["team-a/dispatch-admission"]
    assert ("gone-2", "dispatch-admission") not in api.held and "delete gone-1/dispatch-admission" in err.getvalue()
    api = FakeReportsAPI(refuse_list=ApiException(status=503, reason="Service Unavailable"))
    written = _open_reports(api, ["team-a"], io.StringIO())
    assert written.write() == ["team-a/dispatch-admission"] and written.failed == 1


def test_without_the_crds_nothing_is_tried_further():
    """A 404 that is no namespace's (the CRDs are missing) stops the writing with what to install."""
    api = FakeReportsAPI(refuse={"team-a": ApiException(status=404, reason="Not Found")})
    with pytest.raises(ClusterUnreadable, match="OpenReports CRDs are not installed"):
        _open_reports(api, ["team-a", "team-b"], io.StringIO()).write()
    assert api.calls == [("create", "team-a")]
    gone = ApiException(status=404, reason="Not Found")
    gone.body = json.dumps({"message": 'namespaces "team-a" not found', "details": {"name": "team-a",
                                                                                    "kind": "namespaces"}})
    api = FakeReportsAPI(refuse={"team-a": gone})
    written = _open_reports(api, ["team-a", "team-b"], io.StringIO())
    assert written.write() == ["team-b/dispatch-admission"] and written.failed == 1


class Raw(dict):
    """A part of a list item that can be watched (a weak reference): is it still held?"""


def test_the_audit_holds_what_the_report_needs_not_every_raw_runtime(monkeypatch):
    """Runtimes are taken a page at a time (what the rules read, and the uid): by the time the TrainJobs are
    listed, no raw runtime object is held; the reports carry the uids and are each under the byte limit."""
    held: list[weakref.ref] = []
    big = "x" * 240_000

    class API(FakeReportsAPI):
        def list_cluster_custom_object(self, group, version, plural, **kw):
            if group == reports.GROUP_REPORTS:
                return super().list_cluster_custom_object(group, version, plural, **kw)
            if plural == "trainjobs":
                gc.collect()
                assert all(r() is None for r in held), "a raw runtime is still held while TrainJobs are judged"
                return {"items": [trainjob(name="j", namespace="team-a", runtime_name="rt-0", kind="TrainingRuntime")]}
            if plural == "clustertrainingruntimes":
                return {"items": []}
            i = int(kw.get("_continue") or 0)
            obj = runtime(f"rt-{i}", kind="TrainingRuntime", namespace="team-a")
            obj["metadata"] = Raw(obj["metadata"], uid=f"uid-{i}", annotations={"bulk": big})
            held.append(weakref.ref(obj["metadata"]))  # a list item is copied, its metadata shared
            return {"items": [obj], "metadata": {"continue": str(i + 1)} if i < 8 else {}}

    class Core:
        def list_secret_for_all_namespaces(self, **kw):
            return type("Response", (), {"data": json.dumps({"items": []})})()

    api = API()
    monkeypatch.setattr(kube_client, "api_client", lambda *a, **kw: None)
    monkeypatch.setattr(kubernetes.client, "CustomObjectsApi", lambda connection=None: api)
    monkeypatch.setattr(kubernetes.client, "CoreV1Api", lambda connection=None: Core())
    out, err = io.StringIO(), io.StringIO()
    assert audit.run(Settings(), None, None, "table", 1, out, err, report=True) == 0, out.getvalue()
    assert len(held) == 9
    report = api.held[("team-a", reports.NAME)]
    assert {r["resources"][0].get("uid") for r in report["results"]} == {f"uid-{i}" for i in range(9)} | {None}
    assert reports.size(report) <= reports.MAX_REPORT_BYTES


def test_an_unwritten_report_fails_the_audit_after_the_rest_are_written(monkeypatch):
    """The Job fails (exit 2, whatever --exit-zero) when a report could not be written: kube-state-metrics'
    job failure is the count an alert reads; the log names each failure."""
    class API(FakeReportsAPI):
        def list_cluster_custom_object(self, group, version, plural, **kw):
            if group == reports.GROUP_REPORTS:
                return super().list_cluster_custom_object(group, version, plural, **kw)
            if plural == "trainingruntimes":
                return {"items": [runtime("rt", kind="TrainingRuntime", namespace=ns) for ns in ("a", "b")]}
            return {"items": []}

    api = API(refuse={"a": ApiException(status=413, reason="Request Entity Too Large")})
    monkeypatch.setattr(kube_client, "api_client", lambda *a, **kw: None)
    monkeypatch.setattr(kubernetes.client, "CustomObjectsApi", lambda connection=None: api)
    monkeypatch.setattr(kubernetes.client, "CoreV1Api", lambda connection=None: None)
    err = io.StringIO()
    assert audit.run(Settings(), None, None, "table", 10, io.StringIO(), err, report=True) == audit.EXIT_UNWRITTEN
    assert ("b", reports.NAME) in api.held
    assert "audit: write a/dispatch-admission: write OpenReports: 413 Request Entity Too Large" in err.getvalue()
    assert "audit: 1 OpenReports call(s) failed" in err.getvalue()
