"""The mount reaches the pods: Kubeflow Trainer v2.3.0's own controller and webhooks beside ours.

A control plane of its own (Trainer's webhooks and controller act on every TrainJob, so they are kept
away from the main suite), JobSet's CRD, Trainer's stock runtimes from its Go module, and Trainer's
controller manager run out of cluster with its webhook server on loopback. No kubelet runs: the proof
is the pod template of the JobSet Trainer creates.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e import toolchain
from tests.e2e.cluster import ControlPlane
from tests.e2e.conftest import start_cluster
from tests.e2e.trainer import start_trainer, trainer_webhooks
from tests.e2e.webhooks import ROUTE_LABEL, start_our_webhooks, webhooks_swapped
from tests.helpers import EXAMPLES, MANAGER, eventually, trainjob
from tests.process import Webhook, stop
from webhook.commands.files import load_settings as load

NS = "team-a"
ROUTE1 = load(str(EXAMPLES / "settings" / "route1.json"))


@dataclass
class TrainerEnv:
    cluster: ControlPlane
    route1: Webhook
    route2: Webhook
    tmp: Path


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainer")
    with contextlib.ExitStack() as stack:
        cluster = start_cluster(stack, tmp, toolchain.trainer_crds() + toolchain.jobset_crds(), " (trainer)")
        runtimes = toolchain.trainer_module() / "manifests" / "base" / "runtimes"
        for f in ("torch_distributed.yaml", "deepspeed_distributed.yaml"):
            cluster.kubectl("apply", "-f", str(runtimes / f))
        cluster.kubectl("apply", "-f", str(EXAMPLES / "runtimes" / "torch-init.yaml"))
        proc, port = start_trainer(cluster, tmp)
        stack.callback(stop, proc)
        ca = (tmp / "k8s-webhook-server" / "serving-certs" / "ca.crt").read_bytes()
        for doc in trainer_webhooks(port, ca):
            cluster.apply(doc)
        hooks = start_our_webhooks(stack, cluster, tmp, " (trainer)")
        yield TrainerEnv(cluster, hooks[0], hooks[1], tmp)


def jobset_pods(cluster: ControlPlane, name: str, timeout: float = 60) -> dict[str, dict]:
    """The pod spec of each replicated job of the JobSet Trainer creates for TrainJob `name`."""
    js = eventually(lambda: cluster.get("jobset", name, NS), f"Trainer created no JobSet for {name}", timeout, 0.5)
    return {rj["name"]: rj["template"]["spec"]["template"]["spec"] for rj in js["spec"]["replicatedJobs"]}


def publish_volume(pod: dict) -> dict:
    return next(v for v in pod.get("volumes", []) if v["name"] == "dispatch-publish")


def node(pod: dict, lst: str = "containers", name: str = "node") -> dict:
    return next(c for c in pod.get(lst, []) if c["name"] == name)


def assert_route1_mount(pod: dict) -> None:
    assert publish_volume(pod)["image"] == {"reference": ROUTE1.publish.image, "pullPolicy": "IfNotPresent"}
    mounts = node(pod)["volumeMounts"]
    assert {"name": "dispatch-publish", "mountPath": "/opt/dispatch", "readOnly": True} in mounts
    assert {"name": "checkpoint-store", "mountPath": "/var/run/dispatch/creds", "readOnly": True} in mounts


def test_raw_trainjob_passes_both_webhooks_and_the_jobset_has_the_mount(trainer):
    c = trainer.cluster
    got = c.apply(trainjob(name="t-torch", namespace=NS, numNodes=2))
    assert "created" in got.stdout
    stored = c.get("trainjob", "t-torch", NS)
    assert any(e["manager"] == MANAGER for e in stored["spec"]["runtimePatches"])
    pods = jobset_pods(c, "t-torch")
    assert_route1_mount(pods["node"])
    # That is the proof the binary would be at /opt/dispatch/publish in the trainer container.
    assert node(pods["node"])["image"].startswith("pytorch/pytorch")


def test_route2_init_container_reaches_the_jobset(trainer):
    c = trainer.cluster
    job = trainjob(name="t-route2", namespace=NS, runtime_name="torch-init")
    job["metadata"]["labels"] = {ROUTE_LABEL: "2"}
    c.apply(job)
    pod = jobset_pods(c, "t-route2")["node"]
    assert publish_volume(pod) == {"name": "dispatch-publish", "emptyDir": {}}
    init = node(pod, "initContainers", "dispatch-publish")
    assert {"name": "DISPATCH_PUBLISH_DEST", "value": "/opt/dispatch"} in init["env"]
    assert {"name": "dispatch-publish", "mountPath": "/opt/dispatch"} in init["volumeMounts"]
    assert init["image"] == "registry.example/dispatch-publish-copier:1", "the runtime's image, not ours"
    assert {"name": "dispatch-publish", "mountPath": "/opt/dispatch", "readOnly": True} in node(pod)["volumeMounts"]


def test_mpi_runtime_node_and_launcher_both_mounted(trainer):
    c = trainer.cluster
    c.apply(trainjob(name="t-mpi", namespace=NS, runtime_name="deepspeed-distributed"))
    pods = jobset_pods(c, "t-mpi")
    assert {"node", "launcher"} <= set(pods)
    for name in ("node", "launcher"):
        assert_route1_mount(pods[name])


def swapped(trainer, replacement):
    return webhooks_swapped(trainer.cluster, [trainer.route1, trainer.route2], replacement)


def test_settings_change_keeps_the_entry_of_an_existing_job(trainer, serve):
    c = trainer.cluster
    c.apply(trainjob(name="t-rollout", namespace=NS))
    before = c.get("trainjob", "t-rollout", NS)
    newer = trainer.tmp / "newer.json"
    doc = json.loads((EXAMPLES / "settings" / "route1.json").read_text())
    doc["publish"]["image"] = doc["publish"]["image"].split("@")[0] + "@sha256:" + "e" * 64
    newer.write_text(json.dumps(doc))
    hook = serve(settings=newer, kubeconfig=c.kubeconfig, env={"PROMETHEUS_MULTIPROC_DIR": ""})
    with swapped(trainer, [hook, trainer.route2]):
        # SPEC 6.3: admitted, the entry kept as it was, nothing said (audit reports the stale entry)
        got = c.kubectl("label", "trainjob", "t-rollout", "-n", NS, "rolled=yes")
        assert "Warning" not in got.stderr, got.stderr
        got = c.kubectl("patch", "trainjob", "t-rollout", "-n", NS, "--type=merge", "-p",
                        '{"spec": {"suspend": true}}')
        assert "Warning" not in got.stderr, got.stderr
    after = c.get("trainjob", "t-rollout", NS)
    assert after["spec"]["runtimePatches"] == before["spec"]["runtimePatches"], "the entry was rewritten"


def test_job_created_before_the_webhook_is_resumed_without_the_entry(trainer):
    """SPEC 6.3: the entry is written on CREATE only; the resume is admitted and the user told."""
    c = trainer.cluster
    with swapped(trainer, None):
        c.apply(trainjob(name="t-before", namespace=NS, suspend=True))
    assert "runtimePatches" not in c.get("trainjob", "t-before", NS)["spec"]
    got = c.kubectl("patch", "trainjob", "t-before", "-n", NS, "--type=merge", "-p", '{"spec": {"suspend": false}}')
    assert "runs without /opt/dispatch/publish" in got.stderr, got.stderr
    assert "runtimePatches" not in c.get("trainjob", "t-before", NS)["spec"]
    # The JobSet Trainer runs on resume carries nothing of ours.
    pod = jobset_pods(c, "t-before")["node"]
    assert not any(v["name"] == "dispatch-publish" for v in pod.get("volumes", [])), pod


def test_running_job_is_never_given_an_entry(trainer):
    c = trainer.cluster
    with swapped(trainer, None):
        c.apply(trainjob(name="t-running", namespace=NS))
    got = c.kubectl("label", "trainjob", "t-running", "-n", NS, "x=y")
    assert "runs without /opt/dispatch/publish" in got.stderr  # Trainer would refuse a runtimePatches change
    assert "runtimePatches" not in c.get("trainjob", "t-running", NS)["spec"]
