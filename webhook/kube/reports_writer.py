"""The OpenReports `dispatch-admission audit --report` writes (SPEC 8.2), with the official client: a `Report`
named `dispatch-admission` in each namespace holding TrainJobs or TrainingRuntimes, a `ClusterReport` of that
name for the ClusterTrainingRuntimes; a re-run replaces them, and removes its reports of namespaces that hold
nothing now. What each holds, and its bounds, is `webhook.inspection.reports`'s; each is written on its own: a
failure is logged, the rest written, and the audit exits 2.
"""

from __future__ import annotations

import json
from typing import IO, Any

from ..inspection import reports
from ..inspection.audit import Finding
from .audit_reads import ClusterUnreadable


class OpenReports:
    """The findings as OpenReports: one ReportBuilder per namespace (and one for the cluster), each bounded,
    written when the audit ends (`write`). Each report is written, and each stale one deleted, on its own: a call
    that fails is logged on `err` and counted (`failed`), and the others go on (issue 47)."""

    def __init__(self, connection, namespace: str | None, err: IO[str] | None = None):
        from kubernetes import client

        self.api: Any = client.CustomObjectsApi(connection)  # Any: the client types JSON answers as object
        self.scope = namespace  # with --namespace, reports of other namespaces are left as they are
        self.err = err
        self.builders: dict[str, reports.ReportBuilder] = {}
        self.failed = 0

    def add(self, finding: Finding, uid: str = "") -> None:
        where = reports.report_namespace(finding)
        builder = self.builders.get(where)
        if builder is None:
            builder = self.builders[where] = reports.ReportBuilder(where)
        builder.add(finding, uid)

    def write(self) -> list[str]:
        """Create or replace each report, then delete ours that this audit did not write; the names written.
        Raises ClusterUnreadable only when OpenReports' CRDs are missing (nothing can be written)."""
        written, tried = [], set()
        for namespace, builder in sorted(self.builders.items()):
            where = f"{namespace}/{reports.NAME}" if namespace else reports.NAME
            tried.add(where)
            doc = builder.document()
            if builder.dropped:
                self._log(f"{where}: {builder.dropped} of {len(builder)} results left out (the report's bounds:"
                          f" {reports.MAX_RESULTS} results, {reports.MAX_REPORT_BYTES} bytes); its summary counts"
                          " them all")
            if self._attempt(f"write {where}", lambda doc=doc: self._upsert(doc)):
                written.append(where)
        ours: list[tuple[str, str]] = []
        self._attempt("list OpenReports (stale ones were not deleted)", lambda: ours.extend(self._ours()))
        for namespace, name in ours:
            where = f"{namespace}/{name}" if namespace else name
            if where not in tried and (self.scope is None or namespace == self.scope):
                self._attempt(f"delete {where}", lambda namespace=namespace, name=name:
                              self._call("delete", namespace, name))
        return written

    def _attempt(self, what: str, call) -> bool:
        """Run one API call; a failure is logged and counted, and the audit goes on."""
        try:
            call()
        except ClusterUnreadable as e:
            if e.missing_crds:
                raise
            self.failed += 1
            self._log(f"{what}: {e}")
            return False
        except Exception as e:  # unreachable, TLS, timeouts: this call only
            self.failed += 1
            self._log(f"{what}: {type(e).__name__}: {str(e)[:300]}")
            return False
        return True

    def _log(self, text: str) -> None:
        if self.err is not None:
            self.err.write(f"audit: {text}\n")

    def _upsert(self, doc: dict) -> None:
        from kubernetes.client.exceptions import ApiException

        namespace, name = doc["metadata"].get("namespace", ""), doc["metadata"]["name"]
        try:
            self._call("create", namespace, name, doc)
        except ApiException as e:
            if e.status != 409:
                raise self._unwritable(e) from None
            current = self._call("get", namespace, name)
            doc["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            self._call("replace", namespace, name, doc)

    def _ours(self) -> list[tuple[str, str]]:
        """(namespace, name) of every report this tool wrote, by its label."""
        from kubernetes.client.exceptions import ApiException

        selector = ",".join(f"{k}={v}" for k, v in reports.MANAGED_BY.items())
        found = []
        for plural in ("reports", "clusterreports"):
            try:
                got = self.api.list_cluster_custom_object(reports.GROUP_REPORTS, reports.VERSION_REPORTS, plural,
                                                          label_selector=selector, _request_timeout=(5, 60))
            except ApiException as e:
                raise self._unwritable(e) from None
            found += [((i["metadata"].get("namespace") or ""), i["metadata"]["name"]) for i in got.get("items") or []]
        return found

    def _call(self, verb: str, namespace: str, name: str, body: dict | None = None):
        from kubernetes.client.exceptions import ApiException

        cluster = not namespace
        method = getattr(self.api, f"{verb}_{'cluster' if cluster else 'namespaced'}_custom_object")
        args = [reports.GROUP_REPORTS, reports.VERSION_REPORTS, *([] if cluster else [namespace]),
                "clusterreports" if cluster else "reports", *([] if verb == "create" else [name]),
                *([] if body is None else [body])]
        try:
            return method(*args, _request_timeout=(5, 60))
        except ApiException as e:
            if verb == "create" and e.status == 409:
                raise
            raise self._unwritable(e, crds=verb != "delete") from None

    @staticmethod
    def _unwritable(e, crds: bool = True) -> ClusterUnreadable:
        if e.status == 404 and crds and _no_kind(e):
            return ClusterUnreadable("the OpenReports CRDs are not installed (reports.openreports.io and"
                                     " clusterreports.openreports.io, v1alpha1): see docs/rollout.md#reports",
                                     missing_crds=True)
        return ClusterUnreadable(f"write OpenReports: {e.status} {e.reason}{_why(e)}")


def _no_kind(e) -> bool:
    """A 404 for the resource itself (no CRD), not for a namespace deleted meanwhile (its Status names it)."""
    try:
        details = (json.loads(e.body or "{}").get("details") or {})
    except (ValueError, AttributeError):
        return True
    return details.get("kind") != "namespaces"


def _why(e) -> str:
    """The API server's message (`request is too large`, a validation error), cut to one line."""
    try:
        message = str(json.loads(e.body or "{}").get("message") or "")
    except (ValueError, AttributeError):
        return ""
    return f": {message[:300]}" if message else ""
