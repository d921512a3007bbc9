"""Issue 22: our webhook beside Kueue v0.19.2 (tests/e2e/kueue.py) driving Trainer v2.3.0 on the one-node cluster.

Kueue writes a TrainJob through its life (docs/kueue.md): on create its webhook suspends it
and appends its `kueue.x-k8s.io/manager` entry; on admission it fills that entry (labels, nodeSelector) and
resumes the job; to preempt it suspends the job and empties its entry; it admits it again later. Every one of
those writes passes through our webhooks; the proof is read from a watch of every stored version of each
TrainJob, the Pod objects and the pod logs. The pods run /opt/dispatch/publish (the suite's stand-in prints
its path). One job fits the ClusterQueue at a time, so the tests run their jobs one after another.
"""

from __future__ import annotations

import contextlib
import copy
import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.e2e.cluster import LOGS, ControlPlane
from tests.e2e.kueue import (
    JOB_REQUESTS,
    KUEUE_MANAGER,
    LOCAL_QUEUE,
    MUTATING,
    PRIORITY_LABEL,
    QUEUE_LABEL,
    Kueue,
    start_kueue,
)
from tests.e2e.node import NODE_NAME, Images, NodeCluster
from tests.e2e.node_env import (
    NS,
    PUBLISH,
    RUN_TIMEOUT,
    assert_complete,
    assert_only_our_mount,
    dispatch_mounts,
    kube,
    logs,
    node_pod,
    node_runtimes,
    pods_of,
    reset_workloads,
    webhook_settings,
)
from tests.e2e.webhooks import ROUTE_LABEL, Webhook, start_our_webhooks, webhooks_swapped
from tests.helpers import MANAGER
from tests.process import eventually

STATE = "/state"  # a hostPath directory where a preempted job's first run leaves a mark for its second


@dataclass
class KueueEnv:
    nc: NodeCluster
    cluster: ControlPlane
    images: Images
    route1: Webhook
    route2: Webhook
    kueue: Kueue
    watch: Watch
    tmp: Path


class Watch:
    """Every stored version of every TrainJob in the namespace, from `kubectl get --watch` (one event per write)."""

    def __init__(self, cluster: ControlPlane, namespace: str, path: Path):
        self.path = path
        with open(path, "wb") as out:
            self.proc = cluster.kubectl_follow("get", "trainjobs", "-n", namespace, "--watch",
                                               "--output-watch-events", "-o", "json", out=out,
                                               stderr=subprocess.DEVNULL)

    def versions(self, name: str) -> list[dict]:
        text, decoder, at, found = self.path.read_text(), json.JSONDecoder(), 0, []
        while True:
            while at < len(text) and text[at].isspace():
                at += 1
            if at >= len(text):
                return found
            try:
                event, at = decoder.raw_decode(text, at)
            except json.JSONDecodeError:
                return found  # an event still being written
            obj = event["object"]
            if obj.get("metadata", {}).get("name") == name and event["type"] in ("ADDED", "MODIFIED"):
                if not found or found[-1]["metadata"]["resourceVersion"] != obj["metadata"]["resourceVersion"]:
                    found.append(obj)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def state_runtime(images: Images, name: str, state_dir: Path) -> dict:
    """Trainer's torch runtime as a TrainingRuntime in NS, with the node container given the host directory
    `state_dir` at /state (nothing under /opt/dispatch, so R5 admits it)."""
    torch = copy.deepcopy(node_runtimes(images)[0])
    torch["kind"] = "TrainingRuntime"
    torch["metadata"] = {"name": name, "namespace": NS}
    pod = node_pod(torch)
    pod.setdefault("volumes", []).append({"name": "job-state",
                                          "hostPath": {"path": str(state_dir), "type": "Directory"}})
    pod["containers"][0].setdefault("volumeMounts", []).append({"name": "job-state", "mountPath": STATE})
    return torch


STATE_RUNTIMES = ("torch-state", "torch-edited", "torch-deleted")  # the suite's TrainingRuntimes in NS


@pytest.fixture(scope="module")
def kueue_env(shared_node, tmp_path_factory):
    """Kueue and our webhook on the shared node; after the module, the jobs deleted while Kueue still runs (it
    finalises their Workloads), Kueue and its webhooks gone, the suite's runtimes removed."""
    nc = shared_node
    nc.settle()
    c = nc.cluster
    tmp = tmp_path_factory.mktemp("kueue")
    with contextlib.ExitStack() as stack:
        state = tmp / "job-state"
        state.mkdir()
        stack.callback(c.kubectl, "delete", "trainingruntimes", "-n", NS, *STATE_RUNTIMES, "--ignore-not-found",
                       check=False)
        c.apply(state_runtime(nc.images, "torch-state", state))
        hooks = start_our_webhooks(stack, c, tmp, " (kueue)", webhook_settings(tmp, nc.images))
        watch = Watch(c, NS, tmp / "trainjobs.watch.json")
        stack.callback(watch.stop)
        kueue = start_kueue(stack, c, tmp, NS, LOGS)
        stack.callback(reset_workloads, c, (NS,))
        yield KueueEnv(nc, c, nc.images, hooks[0], hooks[1], kueue, watch, tmp)


# ---- helpers ----

def queued(name: str, command: list[str], priority: str | None = None, runtime: str = "torch-distributed",
           namespaced: bool = False, route2: bool = False) -> dict:
    """A TrainJob for Kueue's LocalQueue, asking for JOB_REQUESTS on its node (the runtime asks for nothing)."""
    labels = {QUEUE_LABEL: LOCAL_QUEUE, **({PRIORITY_LABEL: priority} if priority else {}),
              **({ROUTE_LABEL: "2"} if route2 else {})}
    ref = {"name": runtime, **({"kind": "TrainingRuntime"} if namespaced else {})}
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
            "metadata": {"name": name, "namespace": NS, "labels": labels},
            "spec": {"runtimeRef": ref,
                     "trainer": {"command": command, "resourcesPerNode": {"requests": JOB_REQUESTS}}}}


def preemptible(name: str) -> list[str]:
    """Runs the binary (or says it is absent), then, on its first run, waits to be preempted (exiting on SIGTERM,
    which a shell as PID 1 otherwise ignores); on the run after, it exits 0."""
    script = (f"trap 'exit 143' TERM; "
              f"if [ -e {STATE}/{name} ]; then run=resumed; else run=first; touch {STATE}/{name}; fi; "
              f"if [ -x {PUBLISH} ]; then {PUBLISH} {name} $run; "
              f"else echo \"no {PUBLISH} in this pod: {name} $run\"; fi; "
              "if [ $run = first ]; then while :; do sleep 1; done; fi")
    return ["/bin/sh", "-c", script]


def create(c: ControlPlane, doc: dict) -> tuple[dict, str]:
    """kubectl create: the object as stored by the create (after every mutating webhook), and the warnings."""
    got = c.kubectl("create", "-f", "-", "-o", "json", stdin=yaml.safe_dump(doc))
    return json.loads(got.stdout), got.stderr


def managers(job: dict) -> list[str]:
    return [e["manager"] for e in job["spec"].get("runtimePatches", [])]


def entry_of(job: dict, manager: str) -> dict | None:
    return next((e for e in job["spec"].get("runtimePatches", []) if e["manager"] == manager), None)


def poll(what: str, check, timeout: float = RUN_TIMEOUT, every: float = 0.5):
    return eventually(check, what, timeout, every)


def running_pods(c: ControlPlane, name: str) -> list[dict]:
    return [p for p in pods_of(c, name) if p["status"].get("phase") == "Running"
            and not p["metadata"].get("deletionTimestamp")]


def pod_log(c: ControlPlane, pod: dict) -> str:
    return c.kubectl("logs", "-n", NS, pod["metadata"]["name"], "-c", "node", check=False).stdout


def denied(env: KueueEnv) -> float:
    return sum(h.metric("dispatch_admission_reviews_total", outcome="denied") for h in (env.route1, env.route2))


def assert_our_entry_never_changed(env: KueueEnv, name: str) -> dict:
    """Every stored version of the job carries our entry, equal (time included) to the one it was created with."""
    versions = env.watch.versions(name)
    assert versions, f"the watch saw no version of {name}"
    first = entry_of(versions[0], MANAGER)
    assert first is not None and first.get("time"), versions[0]["spec"]
    changed = [v["metadata"]["resourceVersion"] for v in versions if entry_of(v, MANAGER) != first]
    assert not changed, f"our entry changed in versions {changed} of {name}"
    return first


def suspends(versions: list[dict]) -> list[bool]:
    """The job's suspend flag through its stored versions, repeats folded."""
    seen: list[bool] = []
    for v in versions:
        s = bool(v["spec"].get("suspend"))
        if not seen or seen[-1] != s:
            seen.append(s)
    return seen


def assert_kueue_pods(pod: dict) -> None:
    """Kueue's admission reached the pod: its labels and the flavor's nodeSelector."""
    labels = pod["metadata"]["labels"]
    assert labels.get("kueue.x-k8s.io/cluster-queue-name") == "cq", labels
    assert labels.get("kueue.x-k8s.io/local-queue-name") == LOCAL_QUEUE, labels
    assert labels.get("kueue.x-k8s.io/podset") == "node", labels
    assert pod["spec"].get("nodeSelector") == {"kubernetes.io/hostname": NODE_NAME}, pod["spec"].get("nodeSelector")


def workload_events(c: ControlPlane, reason: str, job: str = "") -> list[str]:
    """Event messages of `reason`, of the Workload of TrainJob `job` when given (named trainjob-JOB-HASH)."""
    got = c.kubectl("get", "events", "-n", NS, "--field-selector", f"reason={reason}", "-o", "json")
    return [e["message"] for e in json.loads(got.stdout)["items"]
            if e["involvedObject"]["name"].startswith(f"trainjob-{job}-" if job else "")]


# ---- (a) admission ----

def test_route1_job_is_suspended_by_kueue_admitted_and_runs_the_binary(kueue_env):
    env, c = kueue_env, kueue_env.cluster
    denied_before = denied(env)
    created, _ = create(c, queued("k-r1", [PUBLISH, "k-r1"]))
    assert created["spec"]["suspend"] is True, "Kueue's webhook suspends the job on create"
    assert managers(created) == [MANAGER, KUEUE_MANAGER], "ours runs first (configurations run in name order)"
    job = assert_complete(c, "k-r1")
    assert managers(job) == [MANAGER, KUEUE_MANAGER]
    [pod] = pods_of(c, "k-r1")
    assert_kueue_pods(pod)
    assert_only_our_mount(pod, env.images, 1)
    assert f"publish ran from {PUBLISH}" in logs(c, pod)
    versions = env.watch.versions("k-r1")
    assert suspends(versions) == [True, False], "created suspended, resumed by Kueue"
    filled = [entry_of(v, KUEUE_MANAGER) for v in versions if v["spec"].get("suspend")]
    assert any("replicatedJobs" in e["trainingRuntimeSpec"]["template"]["spec"] for e in filled), \
        "Kueue filled its entry while the job was suspended"
    assert_our_entry_never_changed(env, "k-r1")
    assert denied(env) == denied_before


def test_route2_job_is_admitted_by_kueue_and_the_init_container_copies_the_binary(kueue_env):
    env, c = kueue_env, kueue_env.cluster
    created, warnings = create(c, queued("k-r2", [PUBLISH, "k-r2"], runtime="torch-init", route2=True))
    assert created["spec"]["suspend"] is True and managers(created) == [MANAGER, KUEUE_MANAGER]
    assert "route 2" in warnings, warnings
    assert_complete(c, "k-r2")
    [pod] = pods_of(c, "k-r2")
    assert_kueue_pods(pod)
    assert_only_our_mount(pod, env.images, 2)
    assert f"publish ran from {PUBLISH}" in logs(c, pod)
    assert suspends(env.watch.versions("k-r2")) == [True, False]
    assert_our_entry_never_changed(env, "k-r2")


# ---- (b), (c) preemption ----

def preempt(env: KueueEnv, low: str, high: str) -> list[str]:
    """`low` is running; a high-priority job `high` arrives. Wait for `low` to be suspended (both webhooks admit
    the write, or it would not be stored) and its pods to go, and for `high` to complete. Returns the uids of
    the pods `low` ran first."""
    c = env.cluster
    first = poll(f"{low} running", lambda: running_pods(c, low))
    poll(f"{low} ran the first time", lambda: f"{low} first" in pod_log(c, first[0]))
    uids = [p["metadata"]["uid"] for p in first]
    preempted_before = len(workload_events(c, "Preempted"))
    create(c, queued(high, [PUBLISH, high], "high"))
    poll(f"{low} suspended by Kueue", lambda: kube(c).trainjob(low)["spec"].get("suspend") is True)
    poll(f"{low}'s pods gone", lambda: not {p["metadata"]["uid"] for p in pods_of(c, low)} & set(uids))
    assert_complete(c, high)
    assert len(workload_events(c, "Preempted")) > preempted_before, "Kueue says it preempted the low job"
    return uids


def test_preempted_job_is_suspended_and_resumes_and_runs_the_binary(kueue_env):
    env, c = kueue_env, kueue_env.cluster
    denied_before = denied(env)
    create(c, queued("k-low", preemptible("k-low"), "low", runtime="torch-state", namespaced=True))
    first = preempt(env, "k-low", "k-high")
    job = assert_complete(c, "k-low")
    [pod] = pods_of(c, "k-low")
    assert pod["metadata"]["uid"] not in first
    assert_kueue_pods(pod)
    assert_only_our_mount(pod, env.images, 1)
    assert f"publish ran from {PUBLISH}" in logs(c, pod) and "publish args: k-low resumed" in logs(c, pod)
    versions = env.watch.versions("k-low")
    assert suspends(versions) == [True, False, True, False], "admitted, preempted, admitted again"
    emptied = [entry_of(v, KUEUE_MANAGER) for v in versions if v["spec"].get("suspend")]
    assert any(e["trainingRuntimeSpec"]["template"]["spec"] == {} for e in emptied[1:]), \
        "Kueue emptied its entry after the preemption"
    assert managers(job) == [MANAGER, KUEUE_MANAGER]
    assert_our_entry_never_changed(env, "k-low")
    assert denied(env) == denied_before


def resume_outcome(env: KueueEnv, name: str, timeout: float = 60) -> str:
    """What happens to a preempted job once Kueue admits it again: completed, or what stops it (for the report)."""
    c = env.cluster
    poll(f"{name} resumed by Kueue", lambda: kube(c).trainjob(name)["spec"].get("suspend") is False)

    def ended() -> bool:
        return any(x["type"] in ("Complete", "Failed") and x["status"] == "True"
                   for x in c.get("trainjob", name, NS).get("status", {}).get("conditions", []))

    with contextlib.suppress(AssertionError):  # not ended in time: the report says what stops it
        eventually(ended, f"{name} complete or failed", timeout, every=1)
    job = c.get("trainjob", name, NS)
    jobset = c.get("jobset", name, NS) or {}
    pods = pods_of(c, name)
    events = json.loads(c.kubectl("get", "events", "-n", NS, "--field-selector", f"involvedObject.name={name}",
                                  "-o", "json").stdout)["items"]
    return json.dumps({
        "trainjob.suspend": job["spec"].get("suspend"),
        "trainjob.conditions": [(x["type"], x["status"], x.get("reason"), x.get("message", "")[:300])
                                for x in job.get("status", {}).get("conditions", [])],
        "jobset.suspend": jobset.get("spec", {}).get("suspend"),
        "pods": [(p["metadata"]["name"], p["status"].get("phase"),
                  [v for v in p["spec"].get("volumes", []) if v["name"] == "dispatch-publish"],
                  pod_log(c, p).strip()[-200:]) for p in pods],
        "warning events": sorted({f"{e['reason']}: {e['message'][:400]}" for e in events if e["type"] == "Warning"}),
    }, indent=1)


def test_preempted_job_whose_runtime_was_edited_or_deleted(kueue_env):
    """SPEC 6.3: a suspend never reads the runtime. The runtime of the running job is edited so it can no longer
    carry the mount (R5: it defines a volume named dispatch-publish): Kueue's suspend and every later write are
    admitted and the job completes. Then, for a second job, the runtime is deleted: neither Kueue nor a user can
    suspend that job (Kueue and Trainer both need the runtime), and our webhooks refuse none of it."""
    env, c = kueue_env, kueue_env.cluster
    denied_before = denied(env)
    state = env.tmp / "job-state"
    outcomes = {}
    for case, change in (("edited", "edit"), ("deleted", "delete")):
        runtime, low = f"torch-{case}", f"k-low-{case}"
        c.apply(state_runtime(env.images, runtime, state))
        create(c, queued(low, preemptible(low), "low", runtime=runtime, namespaced=True))
        poll(f"{low} running", lambda low=low: running_pods(c, low))
        if change == "edit":
            doc = c.get("trainingruntime", runtime, NS)
            node_pod(doc)["volumes"].append({"name": "dispatch-publish", "emptyDir": {}})
            c.apply(doc)
        else:
            c.kubectl("delete", "trainingruntime", runtime, "-n", NS, "--wait=false")
            c.kubectl("patch", "trainingruntime", runtime, "-n", NS, "--type=merge", "-p",
                      '{"metadata": {"finalizers": null}}', check=False)
            poll(f"{runtime} gone", lambda runtime=runtime: c.get("trainingruntime", runtime, NS) is None, 30)
        if change == "edit":
            preempt(env, low, f"k-high-{case}")
            assert suspends(env.watch.versions(low))[:3] == [True, False, True], "the suspend was admitted"
            outcomes[case] = resume_outcome(env, low)
        else:
            # Kueue v0.19.2 cannot stop a TrainJob whose runtime is gone: its reconciler reads the runtime first
            # and fails ("runtime 'torch-deleted' not found"), so the high job waits for a preemption that never
            # comes. A suspend made by hand is refused by Kueue's and Trainer's validating webhooks (both read the
            # runtime on every update), not by ours: ours admits it (SPEC 6.3), and says nothing.
            create(c, queued(f"k-high-{case}", [PUBLISH, f"k-high-{case}"], "high"))
            poll("Kueue waiting on the preemption", lambda case=case: any(
                "Pending the preemption" in m for m in workload_events(c, "Pending", f"k-high-{case}")), 60)
            time.sleep(5)  # what Kueue does meanwhile, for the report (not a wait for a condition)
            assert c.get("trainjob", low, NS)["spec"].get("suspend") is False, "Kueue suspended it after all"
            got = c.kubectl("patch", "trainjob", low, "-n", NS, "--type=merge", "-p", '{"spec": {"suspend": true}}',
                            check=False)
            # Kueue's validator (vtrainjob.kb.io) and Trainer's both refuse it; validating webhooks run in
            # parallel, and the API server reports whichever refusal it has first.
            refusers = ('admission webhook "vtrainjob.kb.io" denied',
                        'admission webhook "validator.trainjob.trainer.kubeflow.org" denied')
            assert got.returncode != 0 and any(r in got.stderr for r in refusers) and "not found" in got.stderr \
                and "dispatch" not in got.stderr, got.stderr
            outcomes[case] = json.dumps({"Kueue": "never suspends it (runtime not found)",
                                         "suspend by hand": got.stderr.strip()})
        print(f"the preempted job whose runtime was {case}: {outcomes[case]}")
        assert_our_entry_never_changed(env, low)
        # Free the ClusterQueue for the next job, whatever happened on resume.
        c.kubectl("delete", "trainjob", low, "-n", NS)
        assert_complete(c, f"k-high-{case}")
    assert denied(env) == denied_before


# ---- (d) a job older than the webhook ----

def test_job_older_than_the_webhook_is_preempted_and_resumed_without_an_entry(kueue_env):
    env, c = kueue_env, kueue_env.cluster
    with webhooks_swapped(c, [env.route1, env.route2], None):
        created, _ = create(c, queued("k-old", preemptible("k-old"), "low", runtime="torch-state", namespaced=True))
        assert managers(created) == [KUEUE_MANAGER]
        poll("k-old running", lambda: running_pods(c, "k-old"))
    denied_before = denied(env)
    got = c.kubectl("label", "trainjob", "k-old", "-n", NS, "seen=yes")
    print(f"what the user sees on k-old once the webhook is in: {got.stderr.strip()}")
    assert "Warning:" in got.stderr and "recreate" in got.stderr, got.stderr
    preempt(env, "k-old", "k-high-old")
    job = assert_complete(c, "k-old")
    assert managers(job) == [KUEUE_MANAGER], "no entry added by any of Kueue's writes"
    assert all(entry_of(v, MANAGER) is None for v in env.watch.versions("k-old"))
    assert suspends(env.watch.versions("k-old")) == [True, False, True, False]
    [pod] = pods_of(c, "k-old")
    assert not dispatch_mounts(pod)
    assert f"no {PUBLISH} in this pod: k-old resumed" in logs(c, pod)
    assert denied(env) == denied_before


# ---- (e) webhook order ----

@contextlib.contextmanager
def kueue_mutating_as(env: KueueEnv, name: str, reinvocation: str | None = None):
    env.kueue.register_webhooks(name, reinvocation)
    try:
        yield
    finally:
        env.kueue.register_webhooks()


def test_kueue_before_ours_stores_one_entry_per_manager_and_runs(kueue_env):
    """Renamed to sort before `dispatch-admission-e2e`, Kueue's mutating configuration runs first."""
    env, c = kueue_env, kueue_env.cluster
    with kueue_mutating_as(env, "a-" + MUTATING):
        created, _ = create(c, queued("k-order", [PUBLISH, "k-order"]))
    assert managers(created) == [KUEUE_MANAGER, MANAGER]
    job = assert_complete(c, "k-order")
    assert managers(job) == [KUEUE_MANAGER, MANAGER]
    [pod] = pods_of(c, "k-order")
    assert_kueue_pods(pod)
    assert_only_our_mount(pod, env.images, 1)
    assert_our_entry_never_changed(env, "k-order")


def test_kueue_webhook_reinvoked_after_ours_or_before_it(kueue_env):
    """reinvocationPolicy IfNeeded on Kueue's trainjob webhook. The API server calls a webhook again only when a
    later one changed the object. After ours: ours (IfNeeded) is called again, changes nothing, so Kueue is not
    called again: one entry each. Before ours: our entry is a change after Kueue's call, so Kueue is called
    again and appends its entry a second time, which the CRD's list-map key refuses."""
    c = kueue_env.cluster
    with kueue_mutating_as(kueue_env, MUTATING, "IfNeeded"):
        created, _ = create(c, queued("k-reinvoked-after", [PUBLISH, "k-reinvoked-after"]))
    print(f"Kueue IfNeeded after ours: stored entries {managers(created)}")
    assert managers(created) == [MANAGER, KUEUE_MANAGER]
    c.kubectl("delete", "trainjob", "k-reinvoked-after", "-n", NS)
    with kueue_mutating_as(kueue_env, "a-" + MUTATING, "IfNeeded"):
        got = c.kubectl("create", "-f", "-", stdin=yaml.safe_dump(queued("k-reinvoked", [PUBLISH])), check=False)
    print(f"Kueue IfNeeded before ours: {got.stdout.strip()} {got.stderr.strip()}")
    assert got.returncode != 0 and "Duplicate value" in got.stderr and KUEUE_MANAGER in got.stderr, got.stderr
    assert c.get("trainjob", "k-reinvoked", NS) is None
