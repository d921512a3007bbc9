"""A cluster for `verify` without one (tests/unit/test_verify*.py): stored TrainJobs, pods, events and nodes as
the API server returns them, a fake cluster that answers the run, and a clock that sleeps by counting."""

from __future__ import annotations

import io
import json

from tests.helpers import IMAGE, ROUTE1, ROUTE2
from webhook.commands import verify as adapter
from webhook.core.patch import Entry
from webhook.core.settings import parse
from webhook.inspection import verify_probe as vp

S1 = parse(json.dumps(ROUTE1))
S2 = parse(json.dumps(ROUTE2))
ENTRY1 = Entry.build(S1, ["node"]).as_dict("2026-11-29T12:00:00Z")
ENTRY2 = Entry.build(S2, ["node"]).as_dict("2026-11-29T12:00:00Z")
NOT_FOUND = ('failed to create containerd task: failed to create shim task: OCI runtime create failed: runc create '
             'failed: unable to start container process: error during container init: exec: "/opt/dispatch/publish": '
             'stat /opt/dispatch/publish: no such file or directory: unknown')


def stored(entry: dict | None = ENTRY1, suspend=None) -> dict:
    spec = {"runtimeRef": {"name": "torch"}, "runtimePatches": [entry] if entry else []}
    if suspend is not None:
        spec["suspend"] = suspend
    return {"metadata": {"name": "verify-1", "namespace": "ns"}, "spec": spec}


def pod(scheduled=True, node_state=None, node_last=None, init_state=None, route2=False, volume_image=IMAGE,
        read_only=True, phase="Pending", unschedulable_message=None) -> dict:
    spec = {"containers": [{"name": "node", "volumeMounts": [
        {"name": "dispatch-publish", "mountPath": "/opt/dispatch", "readOnly": read_only}]}],
        "volumes": [{"name": "dispatch-publish", "emptyDir": {}} if route2 else
                    {"name": "dispatch-publish", "image": {"reference": volume_image}}]}
    if route2:
        spec["initContainers"] = [{"name": "dispatch-publish", "volumeMounts": [
            {"name": "dispatch-publish", "mountPath": "/opt/dispatch"}]}]
    if scheduled:
        spec["nodeName"] = "node-a"
    cond = {"type": "PodScheduled", "status": "True"} if scheduled else {
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": unschedulable_message}
    status: dict = {"phase": phase, "conditions": [cond]}
    if node_state is not None or node_last is not None:
        status["containerStatuses"] = [{"name": "node", "state": node_state or {}, "lastState": node_last or {}}]
    if init_state is not None:
        status["initContainerStatuses"] = [{"name": "dispatch-publish", "state": init_state, "lastState": {}}]
    return {"metadata": {"name": "verify-1-node-0-0-abcde", "creationTimestamp": "2026-12-01T10:00:00Z"},
            "spec": spec, "status": status}


def event(reason: str, message: str, pod_name="verify-1-node-0-0-abcde") -> dict:
    return {"reason": reason, "message": message, "involvedObject": {"name": pod_name},
            "lastTimestamp": "2026-12-01T10:00:05Z"}


def cluster_node(name, ready="True", unschedulable=False, taints=()):
    return {"metadata": {"name": name}, "spec": {"unschedulable": unschedulable, "taints": list(taints)},
            "status": {"conditions": [{"type": "Ready", "status": ready}]}}


class FakeApiException(Exception):
    pass


class FakeCluster:
    """Answers as a cluster would; `script` gives the pods of each poll."""

    def __init__(self, runtime=None, script=None, create_error=None, on_poll=None, secrets=("s3-credentials",),
                 events=None, nodes=None):
        self.rt = runtime if runtime is not None else {"spec": {"template": {"spec": {"replicatedJobs": [
            {"name": "node", "template": {"spec": {"template": {"spec": {"containers": [{"name": "node"}]}}}}}]}}}}
        self.script = list(script or [])
        self.create_error, self.on_poll = create_error, on_poll
        self.secrets = set(secrets) if secrets is not None else None  # None: the user may not read them
        self.script_events = events or []
        self.node_list = nodes if nodes is not None else [cluster_node("n1")]
        self.jobs: dict[str, dict] = {}
        self.deleted: list[str] = []
        self.dry_runs = 0
        self.polls = 0
        self.date = "Wed, 02 Dec 2026 10:00:00 GMT"

    def default_namespace(self, kubeconfig):
        return "ns"

    def runtime(self, kind, namespace, name):
        return self.rt if name != "missing" else None

    def nodes(self):
        return self.node_list

    def create(self, namespace, doc, dry_run=False):
        if self.create_error:
            raise self.create_error
        job = json.loads(json.dumps(doc))
        job["spec"].setdefault("runtimePatches", []).append(ENTRY1)
        if dry_run:
            self.dry_runs += 1
            return job
        job["metadata"].update(uid=f"uid-{doc['metadata']['name']}", creationTimestamp="2026-12-02T09:59:00Z")
        self.jobs[doc["metadata"]["name"]] = job
        return job

    def probes(self, namespace):
        return [j for j in self.jobs.values() if vp.PROBE_LABEL in j["metadata"].get("labels", {})], self.date

    def secret_exists(self, namespace, name):
        if self.secrets is None:
            return None, 'secrets "s3-credentials" is forbidden: User "u" cannot get resource "secrets"'
        return name in self.secrets, ""

    def trainjob(self, namespace, name):
        return self.jobs.get(name)

    def pods(self, namespace, name):
        if name in self.deleted:  # the garbage collector took them with the TrainJob
            return []
        self.polls += 1
        if self.on_poll:
            self.on_poll(self.polls)
        return self.script[min(self.polls, len(self.script)) - 1] if self.script else []

    def events(self, namespace, pod):
        return self.script_events

    def log_tail(self, namespace, pod, container, previous, lines):
        return "publish ran from /opt/dispatch/publish\n"

    def delete(self, namespace, name, uid):
        job = self.jobs.get(name)
        if job is not None and job["metadata"]["uid"] != uid:
            return False  # the precondition: another object has the name
        self.deleted.append(name)
        self.jobs.pop(name, None)
        return True


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


def run(cluster, **kw):
    out, err, clock = io.StringIO(), io.StringIO(), Clock()
    opts = adapter.Options(runtime="ClusterTrainingRuntime/torch", **kw)
    code = adapter.Verify(opts, cluster, out, err, progress=False, clock=clock, sleep=clock.sleep).run()
    return code, out.getvalue(), err.getvalue()
