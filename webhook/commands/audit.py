"""`dispatch-admission audit` (SPEC 8.2): judge the cluster's runtimes and TrainJobs with the webhook's own
rules (`inspection.audit`) and print the findings. The list calls are `kube.audit_reads`' (list calls only;
nothing is written but the OpenReports of `--report`, `kube.reports_writer`); this module wires them and prints.

TrainJobs are judged as their pages arrive, so 50,000 of them fit in bounded memory. A progress bar goes to
stderr when it is a terminal.

Then the credentials' Secrets the TrainJobs mount, and a `secret-missing` finding per namespace lacking one.
Without the right to list Secrets, audit says so on stderr and judges the rest.

With `--report`, the findings are also written as OpenReports (`inspection.reports` makes them,
`kube.reports_writer` writes them): a failure is logged, the rest written, and the audit exits 2.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import IO

from ..core.admission import Admission
from ..core.settings import Settings
from ..inspection.audit import CredentialSecrets, Finding, Verdict, judge_runtime, judge_trainjob
from ..kube.audit_reads import AuditReads, ClusterUnreadable, uid_of
from ..kube.reports_writer import OpenReports

__all__ = ["ClusterUnreadable", "Report", "run"]

EXIT_OK, EXIT_FINDINGS = 0, 1
EXIT_UNWRITTEN = 2  # a report could not be written or a stale one deleted: the Job fails, whatever --exit-zero


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


def run(settings: Settings, kubeconfig: str | None, namespace: str | None, output: str, limit: int,
        out: IO[str], err: IO[str], report: bool = False) -> int:
    reads = AuditReads(kubeconfig)
    index, uids = reads.runtimes(namespace, limit)
    admission = Admission(settings, index)
    printed = Report(output, out)
    written = OpenReports(reads.connection, namespace, err) if report else None

    def add(finding: Finding, uid: str = "") -> None:
        printed.add(finding)
        if written is not None:
            written.add(finding, uid)

    for rt in index:
        add(judge_runtime(admission, rt), uids.get(rt.key, ""))
    mounted = CredentialSecrets(settings.manager)
    with _progress(err) as bar:
        for items, remaining in reads.trainjobs(namespace, limit):
            if remaining is not None:
                bar.total = bar.n + len(items) + remaining
            for job in items:
                add(judge_trainjob(admission, job), uid_of(job))
                mounted.add(job)
            bar.update(len(items))
    try:
        present = reads.secrets(mounted.secrets(), namespace, limit)
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


def _progress(err: IO[str]):
    from tqdm import tqdm

    return tqdm(desc="TrainJobs", unit="job", file=err, disable=not err.isatty(), leave=False)
