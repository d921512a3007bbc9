"""`dispatch-admission audit` (SPEC 8.2): list the cluster's runtimes and TrainJobs in pages and judge each
with the webhook's own rules (`core.audit`). List calls only; nothing is written.

Runtimes are held in memory as the rules read them (names and paths, bounded per runtime; TrainJobs are judged
against them), never as the objects listed; TrainJobs are listed in pages
(`limit`/`continue`) and judged as they arrive, so 50,000 of them fit in bounded memory. A progress bar
goes to stderr when it is a terminal.

Then the credentials' Secrets the TrainJobs mount: one list of Secrets per Secret name (a field selector on
the name, metadata only: never their data), and a `secret-missing` finding per namespace lacking one. Without
the right to list Secrets, audit says so on stderr and judges the rest.

With `--report`, the findings are also written as OpenReports (`core.reports`): a `Report` named
`dispatch-admission` in each namespace holding TrainJobs or TrainingRuntimes, a `ClusterReport` of that name for
the ClusterTrainingRuntimes; a re-run replaces them, and removes its reports of namespaces that hold nothing now.
Each is bounded in bytes (`core.reports`) and written on its own: a failure is logged, the rest written, and the
audit exits 2.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import IO, Any

from ..core import reports
from ..core.admission import Admission
from ..core.audit import CredentialSecrets, Finding, Verdict, judge_runtime, judge_trainjob
from ..core.runtimes import CLUSTER_KIND, GROUP, KINDS, PLURALS, TRAINJOB_KIND, VERSION, Key, RuntimeIndex
from ..core.settings import Settings

EXIT_OK, EXIT_FINDINGS = 0, 1
EXIT_UNWRITTEN = 2  # a report could not be written or a stale one deleted: the Job fails, whatever --exit-zero
# A metadata-only list: which Secrets exist, never their data.
METADATA_LIST = {"Accept": "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"}


class ClusterUnreadable(Exception):
    """The cluster cannot be read (no kubeconfig, unreachable, forbidden): exit 2 with the reason."""

    def __init__(self, message: str, missing_crds: bool = False):
        super().__init__(message)
        self.missing_crds = missing_crds  # OpenReports' CRDs: no report can be written at all


def pages(api, kind: str, namespace: str | None, limit: int) -> Iterator[tuple[list[dict], int | None]]:
    """(items, remaining count or None) per list call, following `continue` to the end."""
    from kubernetes.client.exceptions import ApiException

    token = None
    while True:
        kw = {"limit": limit, "_request_timeout": (5, 60)}
        if token:
            kw["_continue"] = token
        try:
            if namespace and kind != CLUSTER_KIND:
                got = api.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURALS[kind], **kw)
            else:
                got = api.list_cluster_custom_object(GROUP, VERSION, PLURALS[kind], **kw)
        except ApiException as e:
            raise ClusterUnreadable(f"list {PLURALS[kind]}: {e.status} {e.reason}") from None
        except Exception as e:  # unreachable, TLS, timeouts
            raise ClusterUnreadable(f"list {PLURALS[kind]}: {type(e).__name__}: {str(e)[:300]}") from None
        meta = got.get("metadata") or {}
        yield [dict(i, kind=i.get("kind") or kind) for i in got.get("items") or []], meta.get("remainingItemCount")
        token = meta.get("continue")
        if not token:
            return


class Report:
    """Findings out as they come: table rows for those not ok, or a streamed JSON array of every one."""

    def __init__(self, output: str, out: IO[str]):
        self.output, self.out = output, out
        self.counts: Counter = Counter()
        self.first = True

    def add(self, finding: Finding) -> None:
        self.counts[finding.verdict.value] += 1
        if self.output == "json":
            self.out.write(("[\n" if self.first else ",\n") + json.dumps(finding.as_json()))
            self.first = False
        elif finding.verdict is not Verdict.OK:
            where = f"{finding.namespace}/" if finding.namespace else ""
            reasons = "; ".join(f"{r.sentinel.name}: {r.field}: {r.text}" for r in finding.causes)
            self.out.write(f"{finding.verdict.value:<16} {finding.kind} {where}{finding.name}"
                           + (f"  {reasons}" if reasons else "") + "\n")

    def close(self) -> int:
        if self.output == "json":
            self.out.write("[]\n" if self.first else "\n]\n")
        else:
            total = sum(self.counts.values())
            self.out.write(f"{total} objects: " + ", ".join(
                f"{self.counts[v.value]} {v.value}" for v in Verdict if self.counts[v.value]) + "\n")
        return EXIT_OK if self.counts[Verdict.OK.value] == sum(self.counts.values()) else EXIT_FINDINGS


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


def run(settings: Settings, kubeconfig: str | None, namespace: str | None, output: str, limit: int,
        out: IO[str], err: IO[str], report: bool = False) -> int:
    from kubernetes import client

    from ..kube.cluster import api_client

    try:
        connection = api_client(kubeconfig, prefer_kubeconfig=True)
    except Exception as e:
        raise ClusterUnreadable(f"{type(e).__name__}: {str(e)[:300]}") from None
    api: Any = client.CustomObjectsApi(connection)  # Any: the client types JSON answers as object
    index, uids = taken_runtimes(api, namespace, limit)
    admission = Admission(settings, index)
    printed = Report(output, out)
    written = OpenReports(connection, namespace, err) if report else None

    def add(finding: Finding, uid: str = "") -> None:
        printed.add(finding)
        if written is not None:
            written.add(finding, uid)

    for rt in index:
        add(judge_runtime(admission, rt), uids.get(rt.key, ""))
    mounted = CredentialSecrets(settings.manager)
    with _progress(err) as bar:
        for items, remaining in pages(api, TRAINJOB_KIND, namespace, limit):
            if remaining is not None:
                bar.total = bar.n + len(items) + remaining
            for job in items:
                add(judge_trainjob(admission, job), _uid(job))
                mounted.add(job)
            bar.update(len(items))
    try:
        core: Any = client.CoreV1Api(connection)  # Any: the client types JSON answers as object
        present = existing_secrets(core, mounted.secrets(), namespace, limit)
    except ClusterUnreadable as e:
        err.write(f"audit: the credentials' Secrets were not checked: {e} (list on secrets is needed; only their"
                  " metadata is read)\n")
    else:
        for finding in mounted.missing(present):
            add(finding)
    code = printed.close()
    if written is not None:
        names = written.write()
        more = " ..." if len(names) > 10 else ""
        err.write(f"audit: wrote {len(names)} OpenReports: {', '.join(names[:10])}{more}\n")
        if written.failed:
            err.write(f"audit: {written.failed} OpenReports call(s) failed (each logged above); the rest were"
                      " written\n")
            return EXIT_UNWRITTEN
    return code


def taken_runtimes(api, namespace: str | None, limit: int) -> tuple[RuntimeIndex, dict[Key, str]]:
    """The runtimes, a page at a time, as the rules read them, and each one's uid (what a report names): no raw
    object is held past its page (a TrainingRuntime may be 1.5 MB of JSON; Runtime keeps its names and paths)."""
    index, uids = RuntimeIndex(), {}
    for kind in KINDS:
        for items, _ in pages(api, kind, namespace, limit):
            for obj in items:
                uids[index.put(obj).key] = _uid(obj)
    return index, uids


def _uid(obj: dict) -> str:
    return str((obj.get("metadata") or {}).get("uid") or "")


def existing_secrets(core_api, wanted: dict[str, set[str]], namespace: str | None,
                     limit: int) -> set[tuple[str, str]]:
    """(namespace, name) of each Secret in `wanted` (name: the namespaces that mount it) that exists."""
    from kubernetes.client.exceptions import ApiException

    present: set[tuple[Any, str]] = set()  # (namespace as the API gives it, name)
    for secret in sorted(wanted):
        token = None
        while True:
            kw = {"field_selector": f"metadata.name={secret}", "limit": limit, "_headers": METADATA_LIST,
                  "_preload_content": False, "_request_timeout": (5, 60), **({"_continue": token} if token else {})}
            try:
                got = json.loads((core_api.list_namespaced_secret(namespace, **kw) if namespace
                                  else core_api.list_secret_for_all_namespaces(**kw)).data)
            except ApiException as e:
                raise ClusterUnreadable(f"list secrets: {e.status} {e.reason}") from None
            except Exception as e:
                raise ClusterUnreadable(f"list secrets: {type(e).__name__}: {str(e)[:300]}") from None
            present |= {((i.get("metadata") or {}).get("namespace"), secret) for i in got.get("items") or []}
            token = (got.get("metadata") or {}).get("continue")
            if not token:
                break
    return present


def _progress(err: IO[str]):
    from tqdm import tqdm

    return tqdm(desc="TrainJobs", unit="job", file=err, disable=not err.isatty(), leave=False)
