"""Issue 11: the publish binary runs in real pods, on both routes, from a raw `kubectl apply` of a TrainJob.

A one-node cluster (tests/e2e/node.py): containerd + runc + CNI + kubelet, the scheduler, the controller
manager (the Job controller), kube-proxy, JobSet's controller, and Trainer v2.3.0's controller manager,
with our webhook as two local processes registered by URL (route 1 and route 2, chosen by a label, as in
conftest.py), whose settings name the publish image the harness built and pushed to the local registry.
kubectl is the client throughout; the proof is read from the Pod objects, the pod logs and the TrainJob's
conditions.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import yaml

from tests.e2e import toolchain
from tests.e2e.cluster import ControlPlane
from tests.e2e.node import Images
from tests.e2e.node_env import (
    IN_POD_CHECKS,
    NS,
    PUBLISH,
    RUN_TIMEOUT,
    SENTINELS,
    assert_complete,
    assert_in_pod_checks,
    assert_only_our_mount,
    condition,
    dispatch_mounts,
    entry,
    kube,
    logs,
    node_pod,
    pods_of,
    trainjob,
    wait_running_pods,
    webhook_settings,
)
from tests.e2e.webhooks import ROUTE_LABEL, start_our_webhooks, webhooks_swapped
from tests.helpers import EXAMPLES
from tests.process import eventually

# ---- 1. route 1 ----

@pytest.fixture(scope="module")
def started(node_env) -> dict:
    """The TrainJobs that run to their end with no step of a test in between, created together: they run at once
    on the node, and each test waits for its own. kubectl apply's answer, by name."""
    c = node_env.cluster
    c.apply(claim_volume(node_env.tmp, "e2e-claim-pv"))
    c.apply(claim_runtime(node_env.images))
    claim_script = f"{IN_POD_CHECKS} && test -d /workspace && echo 'claim: mounted at /workspace'"
    docs = [trainjob("r1-torch", "torch-distributed", ["/bin/sh", "-c", IN_POD_CHECKS], num_nodes=2),
            trainjob("r1-mpi", "mpi-launcher", [PUBLISH, "mpi-launcher", "--ranks", "2"]),
            trainjob("r2-init", "torch-init", ["/bin/sh", "-c", IN_POD_CHECKS], route2=True),
            trainjob("r2-empty", "torch-init-copies-nothing", [PUBLISH, "never-runs"], route2=True),
            trainjob("r1-claim", "torch-claim", ["/bin/sh", "-c", claim_script])]
    return {doc["metadata"]["name"]: c.apply(doc) for doc in docs}


def test_route1_torch_two_nodes_runs_the_binary_from_the_image_volume(node_env, started):
    c = node_env.cluster
    assert "created" in started["r1-torch"].stdout
    job = assert_complete(c, "r1-torch")
    assert entry(job) is not None
    pods = pods_of(c, "r1-torch")
    assert len(pods) == 2, [p["metadata"]["name"] for p in pods]
    for pod in pods:
        assert pod["spec"]["nodeName"] == "dispatch-e2e-node"
        assert pod["status"]["phase"] == "Succeeded"
        assert_only_our_mount(pod, node_env.images, 1)
        assert_in_pod_checks(logs(c, pod))
    nnodes = sorted(e["value"] for p in pods for e in next(x for x in p["spec"]["containers"] if x["name"] == "node")
                    .get("env", []) if e["name"] == "PET_NNODES")
    assert nnodes == ["2", "2"], "Trainer's torch plugin set up two nodes"


def test_route1_mpi_launcher_and_node_both_run_the_binary(node_env, started):
    c = node_env.cluster
    assert "created" in started["r1-mpi"].stdout
    assert_complete(c, "r1-mpi")
    pods = {p["metadata"]["labels"]["jobset.sigs.k8s.io/replicatedjob-name"]: p for p in pods_of(c, "r1-mpi")}
    assert {"launcher", "node"} <= set(pods)
    for pod in pods.values():
        assert_only_our_mount(pod, node_env.images, 1)
    launcher = logs(c, pods["launcher"])
    assert f"publish ran from {PUBLISH}" in launcher and "publish args: mpi-launcher --ranks 2" in launcher
    assert_in_pod_checks(logs(c, pods["node"]))


# ---- 2. route 2 ----

def test_route2_init_container_copies_the_binary_and_the_node_runs_it(node_env, started):
    c = node_env.cluster
    assert "created" in started["r2-init"].stdout
    assert_complete(c, "r2-init")
    [pod] = pods_of(c, "r2-init")
    assert_only_our_mount(pod, node_env.images, 2)
    init = next(s for s in pod["status"]["initContainerStatuses"] if s["name"] == "dispatch-publish")
    assert init["state"]["terminated"]["exitCode"] == 0
    assert node_env.images.copier.split("@")[1] in init["imageID"], init
    assert_in_pod_checks(logs(c, pod), creds=False)


def test_route2_init_container_that_copies_nothing_fails_the_node_with_not_found(node_env, started):
    c = node_env.cluster
    assert "created" in started["r2-empty"].stdout

    def node_states() -> list[dict]:
        return [s for p in pods_of(c, "r2-empty") for s in p.get("status", {}).get("containerStatuses", [])
                if s["name"] == "node"]

    failed = eventually(lambda: [s for s in node_states() if s.get("state", {}).get("terminated")
                                 or s.get("lastState", {}).get("terminated")],
                        "the node container failed", RUN_TIMEOUT, every=0.5, detail=lambda: json.dumps(node_states()))
    pods = pods_of(c, "r2-empty")
    term = failed[0]["state"].get("terminated") or failed[0]["lastState"]["terminated"]
    message = term.get("message", "")
    print(f"what a user sees when route 2's init container copies nothing: reason={term.get('reason')} "
          f"exitCode={term.get('exitCode')} message={message!r}")
    assert term["exitCode"] != 0
    assert PUBLISH in message and ("not found" in message or "no such file or directory" in message), term
    init_log = logs(c, pods[0], "dispatch-publish")
    assert "copies nothing" in init_log
    # Trainer's pods restart in place (restartPolicy OnFailure), so the Job never counts a failure: the pod
    # sits in CrashLoopBackOff and the TrainJob is neither Complete nor Failed. The user sees that.
    def backing_off() -> dict | None:
        pod = pods_of(c, "r2-empty")[0]
        waiting = next(s for s in pod["status"]["containerStatuses"] if s["name"] == "node")["state"].get("waiting", {})
        return pod if waiting.get("reason") == "CrashLoopBackOff" else None

    pod = eventually(backing_off, "the node container in CrashLoopBackOff", 60, every=0.5,
                     detail=lambda: json.dumps(pods_of(c, "r2-empty")[0]["status"]))
    job = c.get("trainjob", "r2-empty", NS)
    [batch_job] = json.loads(c.kubectl("get", "jobs", "-n", NS, "-l", "jobset.sigs.k8s.io/jobset-name=r2-empty",
                                       "-o", "json").stdout)["items"]
    print(f"TrainJob r2-empty status: {json.dumps(job.get('status'))}; its Job's backoffLimit "
          f"{batch_job['spec'].get('backoffLimit')}, restartPolicy {pod['spec']['restartPolicy']}")
    assert not (condition(job, "Complete") or {}).get("status") == "True"
    assert_only_our_mount(pod, node_env.images, 2)
    c.kubectl("delete", "trainjob", "r2-empty", "-n", NS)


# ---- 3. refused jobs run nothing ----

def refused_examples() -> list[Path]:
    return sorted((EXAMPLES / "trainjobs").glob("refused-*.yaml"))


def assert_nothing_behind(c: ControlPlane, name: str, namespace: str = NS) -> None:
    assert c.get("trainjob", name, namespace) is None
    for kind in ("jobsets", "jobs", "pods"):
        got = c.kubectl("get", kind, "-n", namespace, "-o", "json")
        owned = [o["metadata"]["name"] for o in json.loads(got.stdout)["items"]
                 if o["metadata"]["name"].startswith(name + "-") or o["metadata"]["name"] == name
                 or o["metadata"].get("labels", {}).get("jobset.sigs.k8s.io/jobset-name") == name]
        assert owned == [], f"{kind} left by refused {name}: {owned}"


@pytest.mark.parametrize("example", refused_examples(), ids=lambda p: p.stem)
def test_refused_trainjob_leaves_no_jobset_job_or_pod(node_env, example):
    c = node_env.cluster
    doc = yaml.safe_load(example.read_text())
    if "route2" in example.read_text() or "-r4-" in example.name:
        doc["metadata"].setdefault("labels", {})[ROUTE_LABEL] = "2"
    got = c.apply(doc, check=False)
    assert got.returncode != 0 and any(f"{s}:" in got.stderr for s in SENTINELS), got.stdout + got.stderr
    assert_nothing_behind(c, doc["metadata"]["name"], doc["metadata"].get("namespace", NS))


def test_route2_job_on_a_runtime_without_the_init_container_is_refused_before_it_holds_quota(node_env):
    c = node_env.cluster
    c.apply({"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "training", "namespace": "team-q"},
             "spec": {"hard": {"count/trainjobs.trainer.kubeflow.org": "2", "count/jobsets.jobset.x-k8s.io": "2",
                               "pods": "4"}}})

    def used():
        q = c.get("resourcequota", "training", "team-q")
        return q.get("status", {}).get("used")

    eventually(lambda: used() is not None, "the quota controller computed usage", 60, every=0.5)
    got = c.apply(trainjob("r4-quota", "torch-distributed", [PUBLISH], route2=True, namespace="team-q"), check=False)
    assert got.returncode != 0 and "ErrUnsupported" in got.stderr and "dispatch-publish" in got.stderr, got.stderr
    assert_nothing_behind(c, "r4-quota", "team-q")
    assert used() == {"count/trainjobs.trainer.kubeflow.org": "0", "count/jobsets.jobset.x-k8s.io": "0", "pods": "0"}
    c.kubectl("delete", "resourcequota", "training", "-n", "team-q")  # team-q is test_verify's too


# ---- 4. SPEC 6.3: admitted suspended, edited, resumed ----

def test_spec_6_3_admitted_suspended_edited_and_resumed_runs_with_its_entry(node_env):
    c = node_env.cluster
    c.apply(trainjob("suspended", "torch-distributed", ["/bin/sh", "-c", IN_POD_CHECKS], suspend=True))
    admitted = entry(c.get("trainjob", "suspended", NS))
    assert admitted is not None, "the entry is added when the job is created suspended"
    assert pods_of(c, "suspended") == []
    # The edits a suspended TrainJob takes (Trainer's CRD makes spec.trainer immutable; JobSet lets only
    # labels, annotations, nodeSelector, tolerations and scheduling gates of a suspended JobSet change): a
    # label, and another manager's entry placing the pods, as Kueue does.
    placement = {"manager": "example.com/placement", "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
        {"name": "node", "template": {"spec": {"template": {"spec": {
            "nodeSelector": {"kubernetes.io/hostname": "dispatch-e2e-node"}}}}}}]}}}}
    c.kubectl("patch", "trainjob", "suspended", "-n", NS, "--type=json", "-p",
              json.dumps([{"op": "add", "path": "/spec/runtimePatches/-", "value": placement}]))
    c.kubectl("label", "trainjob", "suspended", "-n", NS, "edited=yes")
    assert entry(c.get("trainjob", "suspended", NS)) == admitted
    c.kubectl("patch", "trainjob", "suspended", "-n", NS, "--type=merge", "-p", '{"spec": {"suspend": false}}')
    job = assert_complete(c, "suspended")
    assert entry(job) == admitted, "the entry it was admitted with, unchanged"
    [pod] = pods_of(c, "suspended")
    assert_only_our_mount(pod, node_env.images, 1)
    assert_in_pod_checks(logs(c, pod))
    assert pod["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "dispatch-e2e-node"}, "the edit reached the pod"


# ---- SPEC 6.3: a running job that predates the webhook is suspended and resumed, and runs without the mount ----

def test_spec_6_3_running_pre_webhook_job_is_suspended_and_resumed_and_runs_without_the_entry(node_env):
    """The entry is written on CREATE only: added on resume, JobSet v0.12 would refuse its volume on the
    JobSet made before it (only labels, annotations, nodeSelector, tolerations and scheduling gates of a
    suspended JobSet's pod template may change) and the job would never resume."""
    c = node_env.cluster
    script = f"if [ -x {PUBLISH} ]; then exec {PUBLISH} resumed; fi; echo 'no publish binary'; exec sleep 600"
    with webhooks_swapped(c, [node_env.route1, node_env.route2], None):
        c.apply(trainjob("pre-webhook", "torch-distributed", ["/bin/sh", "-c", script]))
    assert entry(c.get("trainjob", "pre-webhook", NS)) is None
    first = {p["metadata"]["uid"] for p in wait_running_pods(c, "pre-webhook", set())}
    # The suspend of a running job: Trainer's webhook refuses any runtimePatches change while the node job is
    # active, so ours adds nothing to it, and refuses nothing for what the job already was.
    got = c.kubectl("patch", "trainjob", "pre-webhook", "-n", NS, "--type=merge", "-p", '{"spec": {"suspend": true}}',
                    check=False)
    assert got.returncode == 0, f"suspending the running pre-webhook job was refused:\n{got.stderr}"
    assert "runs without /opt/dispatch/publish" in got.stderr, got.stderr
    assert entry(c.get("trainjob", "pre-webhook", NS)) is None, "no entry is added to the update that suspends"
    got = c.kubectl("patch", "trainjob", "pre-webhook", "-n", NS, "--type=merge", "-p", '{"spec": {"suspend": false}}')
    assert "runs without /opt/dispatch/publish" in got.stderr, got.stderr
    assert entry(c.get("trainjob", "pre-webhook", NS)) is None, "no entry is added to the update that resumes"
    # It runs again, in new pods, without the mount.
    [pod] = wait_running_pods(c, "pre-webhook", first)
    eventually(lambda: "no publish binary" in logs(c, pod), "the resumed pod ran", RUN_TIMEOUT, every=0.5,
               detail=lambda: logs(c, pod))
    assert not dispatch_mounts(pod)
    c.kubectl("delete", "trainjob", "pre-webhook", "-n", NS, "--wait=true", timeout=120)


# ---- the node's network: pods reach the API server, and nothing off this machine ----

def test_pods_reach_the_api_server_through_the_kubernetes_service_and_have_no_default_route(node_env):
    """What an in-cluster webhook needs (its watch of the runtimes): the `kubernetes` Service, through
    kube-proxy, to the API server's advertised address; and no route out of this machine."""
    c = node_env.cluster
    script = ('cat /proc/net/route | sed "s/^/route: /"; '
              'if nc -w 5 "$KUBERNETES_SERVICE_HOST" "$KUBERNETES_SERVICE_PORT" </dev/null; '
              'then echo "connected to $KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT"; '
              'else echo "no connection"; exit 1; fi')
    c.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "net-check", "namespace": NS},
             "spec": {"restartPolicy": "Never", "containers": [
                 {"name": "check", "image": node_env.images.training, "command": ["/bin/sh", "-c", script]}]}})

    def finished() -> str | None:
        phase = ((kube(c).pod("net-check", NS) or {}).get("status") or {}).get("phase")
        return phase if phase in ("Succeeded", "Failed") else None

    phase = eventually(finished, "net-check finished", 120, every=0.5,
                       detail=lambda: json.dumps((kube(c).pod("net-check", NS) or {}).get("status")))
    text = c.kubectl("logs", "-n", NS, "net-check").stdout
    assert phase == "Succeeded", text
    assert f"connected to {c.service_ip}:443" in text, text
    routes = [line.split()[2] for line in text.splitlines() if line.startswith("route: ") and "Iface" not in line]
    assert routes and "00000000" not in routes, f"a pod has a default route: {text}"
    c.kubectl("delete", "pod", "net-check", "-n", NS)


# ---- 5. what the Pods carry ----

def test_pods_carry_nothing_under_opt_dispatch_but_our_mount(node_env, started):
    """Every Pod Trainer and JobSet created in this module (read from the Pod objects, not the templates): those of
    the jobs `started` runs on both routes, waited for here (so this test needs no other before it), and those
    other tests left."""
    c = node_env.cluster
    for name in ("r1-torch", "r1-mpi", "r2-init"):
        assert_complete(c, name)
    pods = json.loads(c.kubectl("get", "pods", "-A", "-l", "jobset.sigs.k8s.io/jobset-name",
                                "-o", "json").stdout)["items"]
    names = {p["metadata"]["labels"]["jobset.sigs.k8s.io/jobset-name"] for p in pods}
    assert {"r1-torch", "r1-mpi", "r2-init"} <= names, names
    for pod in pods:
        job = pod["metadata"]["labels"]["jobset.sigs.k8s.io/jobset-name"]
        if job == "pre-webhook" and not dispatch_mounts(pod):
            continue  # started before the webhook existed: nothing under /opt/dispatch at all
        route = 2 if job.startswith("r2-") else 1
        assert_only_our_mount(pod, node_env.images, route)


# ---- 6. runtimes as Trainer and JobSet build them (issue 34) ----

CLAIM = "initializer"  # the claim template name of Trainer's stock torchtune runtimes


def claim_runtime(images: Images, name: str = "torch-claim") -> dict:
    """Trainer's torch runtime with a JobSet volumeClaimPolicies template named like the torchtune runtimes', its
    volume mounted by the node container at /workspace (JobSet adds the volume to the pods that mount it)."""
    rt = yaml.safe_load((toolchain.trainer_module() / "manifests" / "base" / "runtimes" / "torch_distributed.yaml")
                        .read_text())
    rt["metadata"]["name"] = name
    rt["spec"]["template"]["spec"]["volumeClaimPolicies"] = [{"templates": [{
        "metadata": {"name": CLAIM},
        "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "e2e-static",
                 "resources": {"requests": {"storage": "1Mi"}}}}]}]
    node = node_pod(rt)["containers"][0]
    node["image"] = images.training
    node["volumeMounts"] = [{"name": CLAIM, "mountPath": "/workspace"}]
    return rt


def claim_volume(tmp: Path, name: str) -> dict:
    """A PersistentVolume the claim binds to: a directory of the node (static provisioning)."""
    return {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name},
            "spec": {"capacity": {"storage": "1Mi"}, "accessModes": ["ReadWriteOnce"], "storageClassName": "e2e-static",
                     "persistentVolumeReclaimPolicy": "Retain",
                     "hostPath": {"path": str(tmp / name), "type": "DirectoryOrCreate"}}}


def test_a_runtime_with_a_claim_template_runs_route1_with_our_mount_beside_the_claim(node_env, started):
    c = node_env.cluster
    assert "created" in started["r1-claim"].stdout
    assert_complete(c, "r1-claim")
    [pod] = pods_of(c, "r1-claim")
    assert_only_our_mount(pod, node_env.images, 1)
    names = [v["name"] for v in pod["spec"]["volumes"]]
    assert len(names) == len(set(names)), f"two volumes of one name: {names}"
    claim = next(v for v in pod["spec"]["volumes"] if v["name"] == CLAIM)
    assert claim["persistentVolumeClaim"]["claimName"] == f"{CLAIM}-r1-claim", claim
    text = logs(c, pod)
    assert_in_pod_checks(text)
    assert "claim: mounted at /workspace" in text, text


def test_a_credential_named_like_a_claim_template_is_refused_by_r5_saying_what_to_rename(node_env, tmp_path):
    c = node_env.cluster
    c.apply(claim_runtime(node_env.images))
    route1, route2 = webhook_settings(tmp_path, node_env.images)
    doc = json.loads(route1.read_text())
    doc["credentials"][0]["name"] = CLAIM
    named = tmp_path / "route1-credential-named-like-the-claim.json"
    named.write_text(json.dumps(doc))
    with contextlib.ExitStack() as stack:
        hooks = start_our_webhooks(stack, c, tmp_path, " (claim)", (named, route2))
        with webhooks_swapped(c, [node_env.route1, node_env.route2], hooks):
            got = c.apply(trainjob("r1-claim-cred", "torch-claim"), check=False)
    assert got.returncode != 0 and c.get("trainjob", "r1-claim-cred", NS) is None
    assert "ErrUnsupported" in got.stderr and "spec.runtimeRef" in got.stderr, got.stderr
    assert f"rename credential '{CLAIM}' or the volumeClaimPolicies claim template" in got.stderr, got.stderr


def test_a_credential_at_etc_mpi_is_refused_at_settings_time(node_env, tmp_path):
    """SPEC 2: Trainer's MPI plugin mounts the hostfile at /etc/mpi after the merge; a credential there would vanish
    from the launcher. Such settings never serve: `serve` refuses to start, naming the path."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    route1, _ = webhook_settings(tmp_path, node_env.images)
    doc = json.loads(route1.read_text())
    doc["credentials"][0]["mountPath"] = "/etc/mpi"
    route1.write_text(json.dumps(doc))
    got = subprocess.run([sys.executable, "-m", "webhook", "serve", "--settings", str(route1), "--kubeconfig",
                          node_env.cluster.kubeconfig, "--dev", "--bind", "127.0.0.1:0"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert got.returncode == 1, got
    assert "ErrInvalid: credentials[0].mountPath: '/etc/mpi' overlaps /etc/mpi, which Trainer's MPI (the hostfile)" \
           " plugin mounts" in got.stderr, got.stderr
