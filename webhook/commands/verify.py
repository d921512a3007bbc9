"""`dispatch-admission verify` (SPEC 9): run probe TrainJobs through the installed webhook on a live cluster and
report the stage each reached (`inspection.verify` judges, `kube.verify_cluster` talks to the API server; this
module wires the two and prints).

Calls made, and the RBAC they need: get of the runtime (ClusterTrainingRuntime, or TrainingRuntime in NS);
list of nodes (--per-node); create, get, list and delete of TrainJobs in NS (the only writes: the probes,
labelled `dispatch.go.phpboyscout.uk/verify`, and the deletes of expired ones, `verify_cleanup`); get of the
credentials' Secrets in NS, metadata only (optional: without it verify says so and goes on); list of pods and
events in NS, and get of pods/log. Progress is polled, once a second: one probe's pods and events are a
handful of small reads.

Before the first probe, verify checks that each credential's Secret exists in NS (the credentials of
--settings, else those the installed webhook adds, read from a server-side dry run of the probe's create):
a TrainJob mounting a missing Secret waits for ever.

The probes are deleted on every path (done, failed, timed out, SIGINT, SIGTERM, SIGHUP) unless --keep, each
with its UID as a precondition (never an object of the same name made since by someone else): their names
are chosen before the create, so a signal that lands mid-create still leaves a name to look up (a probe of
this run carries its run label); the delete cascades in the background (the garbage collector takes the
JobSet, Jobs and pods), and verify waits (bounded) until the TrainJob and its pods are gone.
"""

from __future__ import annotations

import secrets
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO

from ..core.patch import Entry, entry_secrets
from ..core.registry import runtime_facts
from ..core.runtimes import CLUSTER_KIND, KINDS, NAMESPACED_KIND, PLURALS
from ..core.settings import DEFAULT_MANAGER, Settings
from ..inspection import verify as core
from ..inspection import verify_causes as causes
from ..inspection import verify_cleanup as leftovers
from ..inspection import verify_report as report
from ..inspection.verify_probe import (
    DEFAULT_COMMAND,
    RUN_LABEL,
    probe_trainjob,
    runtime_jobs,
    runtime_tolerations,
    schedulable_nodes,
)
from ..inspection.verify_template import expected_entry, template_checks
from ..kube.verify_cluster import Cluster, Unusable, answered, fault
from .verify_cleanup import sweep_before_run

# The names `verify --runtime` takes for a kind: its kind, plural or singular, any case.
KIND_NAMES = {name: kind for kind in KINDS for name in (kind.lower(), PLURALS[kind], PLURALS[kind][:-1])}
POLL_SECONDS = 1.0
GONE_SECONDS = 90.0          # how long cleanup waits for the probes to be gone
EXIT_SIGNAL = {"SIGINT": 130, "SIGTERM": 143, "SIGHUP": 129}
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP (the terminal closed): stop waiting, clean up, report."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


@dataclass
class Options:
    runtime: str
    namespace: str | None = None
    kubeconfig: str | None = None
    settings: Settings | None = None
    per_node: bool = False
    image: str | None = None
    command: list[str] = field(default_factory=lambda: list(DEFAULT_COMMAND))
    labels: dict[str, str] = field(default_factory=dict)
    timeout: float = 300.0
    keep: bool = False
    output: str = "table"
    max_probes: int = leftovers.MAX_PROBES


def parse_runtime(text: str) -> tuple[str, str]:
    """KIND/NAME (KIND: ClusterTrainingRuntime or TrainingRuntime, any case, or their plurals); NAME alone is
    a ClusterTrainingRuntime."""
    kind: str | None
    kind, _, name = text.rpartition("/")
    kind = KIND_NAMES.get(kind.lower()) if kind else CLUSTER_KIND
    if not kind or not name:
        raise Unusable(f"--runtime {text!r}: expected KIND/NAME with KIND ClusterTrainingRuntime or TrainingRuntime")
    return kind, name


def check_arguments(opts: Options) -> None:
    """What the arguments alone show is wrong, said before any call to the cluster."""
    import re

    from ..core.settings import DNS1123_LABEL, DNS1123_SUBDOMAIN

    _, name = parse_runtime(opts.runtime)
    if len(name) > 253 or not re.match(DNS1123_SUBDOMAIN, name):
        raise Unusable(f"--runtime {opts.runtime!r}: {name!r} is not a Kubernetes object name (lower-case letters,"
                       " digits, '-' and '.', at most 253)")
    if opts.namespace is not None and (len(opts.namespace) > 63 or not re.match(DNS1123_LABEL, opts.namespace)):
        raise Unusable(f"--namespace {opts.namespace!r} is not a namespace name (lower-case letters, digits and '-',"
                       " at most 63)")


def parse_labels(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise Unusable(f"--label {item!r}: expected KEY=VALUE")
        out[key] = value
    return out


def _raise_on(name: str):
    def handler(signum, frame):
        raise Interrupted(name)
    return handler


class Verify:
    """One run: the probes made, followed to an end, deleted, reported."""

    def __init__(self, opts: Options, cluster: Cluster, out: IO[str], err: IO[str], progress: bool,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        self.opts, self.cluster, self.out, self.err, self.show_progress = opts, cluster, out, err, progress
        self.clock, self.sleep = clock, sleep
        self.run_id = secrets.token_hex(4)
        self.probes: list[report.Probe] = []
        self.uids: dict[str, str | None] = {}  # every name a create was sent for: its UID, once the answer came
        self.manager = opts.settings.manager if opts.settings is not None else DEFAULT_MANAGER
        self.expected: Entry | None = None

    # -- the run --

    def run(self) -> int:
        kind, name = parse_runtime(self.opts.runtime)
        namespace = self.opts.namespace or self.cluster.default_namespace(self.opts.kubeconfig)
        runtime = self.cluster.runtime(kind, namespace, name)
        if runtime is None:
            where = f" in namespace {namespace}" if kind == NAMESPACED_KIND else ""
            raise Unusable(f"{kind} {name} not found{where}")
        if self.opts.settings is not None:
            self.expected = expected_entry(self.opts.settings, runtime_facts(runtime, self.opts.settings))
        nodes: Sequence[dict | None] = [None]
        if self.opts.per_node:
            nodes = schedulable_nodes(self.cluster.nodes(), runtime_tolerations(runtime))
            if not nodes:
                raise Unusable("--per-node: no schedulable node (Ready, not cordoned, taints tolerated by the runtime)")
        refusal = leftovers.over_cap(len(nodes), self.opts.max_probes, leftovers.runtime_asks(runtime))
        if refusal:
            raise Unusable(refusal)
        sweep_before_run(self.cluster, namespace, self.err)
        self._check_credentials(namespace, self._probe_doc(f"verify-{secrets.token_hex(3)}", kind, name, namespace,
                                                           runtime, nodes[0]))
        previous = {s: signal.getsignal(s) for s in SIGNALS}
        for s in SIGNALS:
            signal.signal(s, _raise_on(signal.Signals(s).name))
        stopped_by = None
        try:
            try:
                for node in nodes:
                    self._create(kind, name, namespace, runtime, node)
                self._follow(namespace)
            except Interrupted as e:
                stopped_by = e.name
                for p in self.probes:
                    p.status = core.interrupted(p.status, e.name)
        finally:
            for s in SIGNALS:  # a second Ctrl-C (or the terminal closing) must not cut the cleanup short
                signal.signal(s, signal.SIG_IGN)
            try:
                deleted = self._cleanup(namespace)
            finally:
                for s, h in previous.items():
                    signal.signal(s, h)
        self._progress_done()
        text = report.render_json(self.probes) if self.opts.output == "json" else \
            report.render_table(self.probes, deleted=deleted)
        self.out.write(text)
        self.out.flush()
        if stopped_by:
            return EXIT_SIGNAL[stopped_by]
        return report.exit_code(self.probes)

    def _probe_doc(self, name: str, kind: str, runtime_name: str, namespace: str, runtime: dict,
                   node: dict | None) -> dict:
        ttl = leftovers.probe_ttl(self.opts.timeout, GONE_SECONDS, self.opts.keep)
        return probe_trainjob(name, namespace, kind, runtime_name, self.run_id, self.opts.command,
                              self.opts.image, self.opts.labels, node, runtime_jobs(runtime), ttl=ttl)

    def _check_credentials(self, namespace: str, doc: dict) -> None:
        """Each credential's Secret must exist in the namespace: the pods of every TrainJob there mount it, and
        wait for it for ever. The credentials are those of --settings, else those the installed webhook adds
        (a server-side dry run of the probe's create: nothing is stored)."""
        if self.opts.settings is not None:
            needed = [(c.name, c.secret) for c in self.opts.settings.credentials]
        else:
            try:
                needed = entry_secrets(core.find_entry(self.cluster.create(namespace, doc, dry_run=True), self.manager))
            except Exception:  # a refusal, no permission, a webhook without dry run: the create itself says why
                return
        for volume, secret in needed:
            exists, why = self.cluster.secret_exists(namespace, secret)
            if exists is False:
                raise Unusable(causes.missing_credential(secret, volume, namespace))
            if exists is None:
                self.err.write(f"verify: cannot tell whether Secret {secret} (credential {volume}) exists in namespace"
                               f" {namespace}: {why}; going on\n")

    def _create(self, kind: str, runtime_name: str, namespace: str, runtime: dict, node: dict | None) -> None:
        name = f"verify-{secrets.token_hex(3)}"
        doc = self._probe_doc(name, kind, runtime_name, namespace, runtime, node)
        probe = report.Probe(name, namespace, f"{kind}/{runtime_name}",
                             pinned=node["metadata"]["name"] if node is not None else "")
        self.uids[name] = None
        try:
            stored = self.cluster.create(namespace, doc)
        except Exception as e:
            message = answered(e)
            if message is None:  # unreachable, TLS, a timeout: verify cannot run
                raise fault(f"cannot create TrainJobs in namespace {namespace}", e) from None
            del self.uids[name]  # the API server answered: nothing was made
            if "denied the request" in message:  # a webhook's refusal: this probe's answer
                probe.status = core.refused(message)
                self.probes.append(probe)
                return
            raise Unusable(f"cannot create TrainJobs in namespace {namespace}: {message}") from None
        self.uids[name] = (stored.get("metadata") or {}).get("uid")
        probe.status = core.classify(stored, [], [], self.manager)
        self.probes.append(probe)

    def _follow(self, namespace: str) -> None:
        started = self.clock()
        deadline = started + self.opts.timeout
        while True:
            for p in self.probes:
                if not p.status.done:
                    self._observe(p, namespace)
            self._progress(self.clock() - started)
            if all(p.status.done for p in self.probes):
                return
            if self.clock() >= deadline:
                for p in self.probes:
                    p.status = core.timed_out(p.status, self.opts.timeout)
                return
            self.sleep(POLL_SECONDS)

    def _ours(self, trainjob: dict | None, name: str) -> bool:
        uid = ((trainjob or {}).get("metadata") or {}).get("uid")
        return trainjob is not None and (self.uids.get(name) is None or uid == self.uids[name])

    def _observe(self, p: report.Probe, namespace: str) -> None:
        try:
            trainjob = self.cluster.trainjob(namespace, p.name)
            if not self._ours(trainjob, p.name):
                p.status = core.Status(p.status.reached, done=True, failure=core.Failure(
                    core.next_stage(p.status.reached), "the probe TrainJob was deleted by someone else",
                    "run verify again"))
                return
            pods = self.cluster.pods(namespace, p.name)
            pod = core.probe_pod(pods)
            events = self.cluster.events(namespace, pod["metadata"]["name"]) if pod else []
        except Interrupted:
            raise
        except Exception as e:  # a transient read error: keep the last status, say why on the progress line
            p.status = core.Status(p.status.reached, waiting=f"cannot read the cluster now: {type(e).__name__}",
                                   pod=p.status.pod, node=p.status.node)
            return
        p.status = core.classify(trainjob, pods, events, self.manager)
        entry = core.find_entry(trainjob, self.manager)
        if entry is not None:
            p.checks = template_checks(pod, entry, self.opts.settings, self.expected)
        if p.status.done and p.status.container:
            p.output = self.cluster.log_tail(namespace, p.status.pod, p.status.container, p.status.previous,
                                             core.OUTPUT_LINES).rstrip("\n")

    def _own_uid(self, namespace: str, name: str) -> str | None:
        """The UID of a probe whose create got no answer: the object of that name, if it is this run's."""
        job = self.cluster.trainjob(namespace, name)
        labels = ((job or {}).get("metadata") or {}).get("labels") or {}
        return job["metadata"].get("uid") if job is not None and labels.get(RUN_LABEL) == self.run_id else None

    def _cleanup(self, namespace: str) -> bool:
        """Delete every probe a create was sent for, each only while it is the object made (its UID); True when
        they are gone (or --keep kept them: False)."""
        if self.opts.keep or not self.uids:
            return not self.opts.keep
        failures, pending = [], {}
        for name, uid in self.uids.items():
            try:
                uid = uid or self._own_uid(namespace, name)
                if uid is not None and self.cluster.delete(namespace, name, uid):
                    pending[name] = uid  # else: never made, or another object has the name now (left alone)
            except Exception as e:
                failures.append(f"{name}: {fault('delete', e)}")
        deadline = self.clock() + GONE_SECONDS
        left = list(pending)
        while left and self.clock() < deadline:
            try:  # gone: the TrainJob, and its pods (the garbage collector deletes the JobSet before them)
                left = [n for n in left if self._still_there(namespace, n, pending[n])]
            except Exception:
                pass
            if left:
                self.sleep(POLL_SECONDS)
        if failures or left:
            what = "; ".join(failures) or "still there: " + ", ".join(left)
            self.err.write(f"verify: could not delete every probe ({what}):"
                           f" kubectl delete trainjobs -n {namespace} -l {RUN_LABEL}={self.run_id}\n")
            return False
        return True

    def _still_there(self, namespace: str, name: str, uid: str) -> bool:
        job = self.cluster.trainjob(namespace, name)
        if job is not None:
            return (job.get("metadata") or {}).get("uid") == uid
        return bool(self.cluster.pods(namespace, name))

    # -- the progress line (stdout a terminal only) --

    def _progress(self, elapsed: float) -> None:
        if self.show_progress:
            line = report.progress_line(self.probes, elapsed)[:200]
            self.err.write("\r\033[K" + line)
            self.err.flush()

    def _progress_done(self) -> None:
        if self.show_progress:
            self.err.write("\r\033[K")
            self.err.flush()


def run(opts: Options, out: IO[str], err: IO[str]) -> int:
    cluster = Cluster(opts.kubeconfig)
    progress = out.isatty() and err.isatty()
    return Verify(opts, cluster, out, err, progress).run()
