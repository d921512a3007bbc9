"""The one-node cluster the node suites share (test_node, test_verify, test_kueue, test_install): what each of
them finds on it, and the helpers they read it with.

The session starts the node once (conftest.py's `shared_node`): tests/e2e/node.py's cluster, namespace NS with
the credentials Secret, the node's runtimes and Trainer's controller manager with its webhooks. Each suite adds
what is its own (our webhook processes, Kueue, the chart) in a module fixture and, when done, leaves the node
as it found it (`reset_workloads`): no TrainJob, JobSet, Job or workload pod in its namespaces, no webhook
configuration of ours. A cleanup that only a later suite needs (minutes of the API server's time) is owed to the
node instead (`NodeCluster.owe`): each suite's fixture pays what is owed first (`settle`), and the node drops it
when it stops.

Waits poll objects through the Python client (one connection pool per cluster), not a kubectl process a poll.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.e2e import toolchain
from tests.e2e.cluster import LOGS, ControlPlane
from tests.e2e.node import Images, NodeCluster, start_node_cluster
from tests.e2e.trainer import start_trainer, trainer_webhooks
from tests.e2e.webhooks import ROUTE_LABEL, Webhook, remove_our_webhooks
from tests.helpers import EXAMPLES, MANAGER
from tests.process import eventually, stop

NS = "team-a"
CREDS_PATH = "/var/run/dispatch/creds"
PUBLISH = "/opt/dispatch/publish"
RUN_TIMEOUT = 240
SENTINELS = ("ErrInvalid", "ErrUnsupported", "ErrNotFound")


@dataclass
class NodeEnv:
    nc: NodeCluster
    cluster: ControlPlane
    images: Images
    route1: Webhook
    route2: Webhook
    tmp: Path


def webhook_settings(tmp: Path, images: Images) -> tuple[Path, Path]:
    """Route 1 and route 2 settings naming the publish image the harness pushed, by digest."""
    base = {"manager": MANAGER}
    route1 = {**base, "publish": {"image": images.publish, "via": "imageVolume"},
              "credentials": [{"name": "checkpoint-store", "secret": "s3-credentials", "mountPath": CREDS_PATH}]}
    route2 = {**base, "publish": {"image": images.publish, "via": "initContainer", "initContainer": "dispatch-publish"}}
    paths = tmp / "route1.json", tmp / "route2.json"
    for path, doc in zip(paths, (route1, route2), strict=True):
        path.write_text(json.dumps(doc, indent=2))
    return paths


def node_runtimes(images: Images) -> list[dict]:
    """Trainer's stock torch runtime (its image replaced by the training image), an MPI runtime with a
    launcher (examples/runtimes/mpi-launcher.yaml, modelled on Trainer's deepspeed runtime), the route 2
    runtime whose init container copies the binary (examples/runtimes/torch-init.yaml) and one whose init
    container copies nothing. Their pods end 1 s after a delete."""
    torch = yaml.safe_load((toolchain.trainer_module() / "manifests" / "base" / "runtimes" / "torch_distributed.yaml")
                           .read_text())
    node_pod(torch)["containers"][0]["image"] = images.training

    mpi = yaml.safe_load((EXAMPLES / "runtimes" / "mpi-launcher.yaml").read_text())
    for rj in mpi["spec"]["template"]["spec"]["replicatedJobs"]:
        container = rj["template"]["spec"]["template"]["spec"]["containers"][0]
        container["image"] = images.training
        if rj["name"] == "node":
            # No sshd in the training image: the node runs the binary and the in-pod checks, then stays up
            # (the launcher depends on it being ready) until JobSet's success policy ends it.
            container["command"] = ["/bin/sh", "-c", f"{IN_POD_CHECKS}; exec sleep 3600"]
            container.pop("args", None)

    init = yaml.safe_load((EXAMPLES / "runtimes" / "torch-init.yaml").read_text())
    pod = node_pod(init)
    pod["initContainers"][0]["image"] = images.copier
    pod["containers"][0]["image"] = images.training

    empty = yaml.safe_load((EXAMPLES / "runtimes" / "torch-init.yaml").read_text())
    empty["metadata"]["name"] = "torch-init-copies-nothing"
    pod = node_pod(empty)
    pod["initContainers"][0].update(image=images.training,
                                    command=["/bin/sh", "-c",
                                             "echo dispatch-publish: this init container copies nothing"])
    pod["containers"][0]["image"] = images.training
    runtimes = [torch, mpi, init, empty]
    for runtime in runtimes:  # a shell or `sleep` as PID 1 ignores SIGTERM: every cascade waited the default 30 s
        for rj in runtime["spec"]["template"]["spec"]["replicatedJobs"]:
            rj["template"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 1
    return runtimes


def node_pod(runtime: dict) -> dict:
    return next(rj for rj in runtime["spec"]["template"]["spec"]["replicatedJobs"]
                if rj["name"] == "node")["template"]["spec"]["template"]["spec"]


# Run in the node container after the binary: a write under /opt/dispatch must fail, the mount options and
# the credentials are printed for the test to read back.
IN_POD_CHECKS = (
    f"{PUBLISH} \"$(hostname)\" --checkpoint s3://bucket/run && "
    "if touch /opt/dispatch/written 2>/tmp/touch.err; then echo 'WRITE UNDER /opt/dispatch SUCCEEDED'; exit 3; "
    "else echo \"write refused: $(cat /tmp/touch.err)\"; fi && "
    "grep ' /opt/dispatch ' /proc/mounts | sed 's/^/mount: /' && "
    f"if [ -d {CREDS_PATH} ]; then echo \"creds: $(cat {CREDS_PATH}/access-key)\"; else echo 'creds: none'; fi"
)


# ---- helpers ----

def trainjob(name: str, runtime: str, command: list[str] | None = None, route2: bool = False, num_nodes=None,
             suspend=None, namespace: str = NS) -> dict:
    trainer: dict = {}
    if command is not None:
        trainer["command"] = command
    if num_nodes is not None:
        trainer["numNodes"] = num_nodes
    spec: dict = {"runtimeRef": {"name": runtime}}
    if trainer:
        spec["trainer"] = trainer
    if suspend is not None:
        spec["suspend"] = suspend
    meta: dict = {"name": name, "namespace": namespace}
    if route2:
        meta["labels"] = {ROUTE_LABEL: "2"}
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": meta, "spec": spec}


def condition(obj: dict, kind: str) -> dict | None:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind), None)


def wait_finished(c: ControlPlane, name: str, timeout: float = RUN_TIMEOUT, namespace: str = NS) -> dict:
    """Wait for the TrainJob's Complete or Failed condition; return the TrainJob."""
    def finished():
        job = kube(c).trainjob(name, namespace)
        return job if any((condition(job or {}, kind) or {}).get("status") == "True"
                          for kind in ("Complete", "Failed")) else None

    def detail() -> str:
        pods = c.kubectl("get", "pods", "-n", namespace, "-o", "wide", check=False).stdout
        events = c.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp", check=False).stdout
        return f"{json.dumps((kube(c).trainjob(name, namespace) or {}).get('status'))}\n{pods}\n{events[-6000:]}"

    return eventually(finished, f"TrainJob {name} finished", timeout, every=0.5, detail=detail)


def wait_all_finished(c: ControlPlane, names: list[str], timeout: float = RUN_TIMEOUT,
                      namespace: str = NS) -> dict[str, dict]:
    """wait_finished for TrainJobs created together: they run at once, so one timeout bounds them all."""
    deadline = time.monotonic() + timeout
    return {n: wait_finished(c, n, max(1.0, deadline - time.monotonic()), namespace) for n in names}


def assert_complete(c: ControlPlane, name: str) -> dict:
    job = wait_finished(c, name)
    cond = condition(job, "Complete")
    assert cond and cond["status"] == "True", f"TrainJob {name} failed: {json.dumps(job.get('status'))}\n" + \
        c.kubectl("get", "pods", "-n", NS, "-o", "wide", check=False).stdout
    return job


def pods_of(c: ControlPlane, name: str, namespace: str = NS) -> list[dict]:
    return kube(c).pods(namespace, f"jobset.sigs.k8s.io/jobset-name={name}")


def logs(c: ControlPlane, pod: dict, container: str = "node") -> str:
    return c.kubectl("logs", "-n", pod["metadata"]["namespace"], pod["metadata"]["name"], "-c", container).stdout


def entry(job: dict) -> dict | None:
    return next((e for e in job["spec"].get("runtimePatches", []) if e.get("manager") == MANAGER), None)


def dispatch_mounts(pod: dict) -> list[tuple[str, str, dict]]:
    """Every mount at or under /opt/dispatch in the Pod object: (list, container, mount)."""
    found = []
    for lst in ("initContainers", "containers"):
        for ctr in pod["spec"].get(lst, []):
            for m in ctr.get("volumeMounts", []):
                path = m["mountPath"].rstrip("/")
                if path == "/opt/dispatch" or path.startswith("/opt/dispatch/"):
                    found.append((lst, ctr["name"], m))
    return found


def assert_only_our_mount(pod: dict, images: Images, route: int) -> None:
    """The Pod carries nothing under /opt/dispatch but our entry's mount: read-only on node containers;
    route 1 an image volume pinned to the publish digest, route 2 the emptyDir its init container fills."""
    name = pod["metadata"]["name"]
    mounts = dispatch_mounts(pod)
    assert mounts, f"{name}: no mount under /opt/dispatch"
    for lst, ctr, m in mounts:
        assert m["name"] == "dispatch-publish" and m["mountPath"] == "/opt/dispatch" and not m.get("subPath"), \
            f"{name}/{ctr}: a mount under /opt/dispatch that is not ours: {m}"
        if lst == "containers":
            assert ctr == "node" and m.get("readOnly") is True, f"{name}/{ctr}: {m}"
        else:
            assert route == 2 and ctr == "dispatch-publish", f"{name}: init container {ctr} mounts {m}"
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "dispatch-publish")
    if route == 1:
        assert volume == {"name": "dispatch-publish",
                          "image": {"reference": images.publish, "pullPolicy": "IfNotPresent"}}
    else:
        assert volume == {"name": "dispatch-publish", "emptyDir": {}}


def assert_in_pod_checks(text: str, creds: bool = True) -> None:
    assert f"publish ran from {PUBLISH}" in text, text
    assert "write refused:" in text and "Read-only file system" in text, text
    mount = next(line for line in text.splitlines() if line.startswith("mount: "))
    options = mount.split()[4].split(",")
    assert "ro" in options and "noexec" not in options, mount
    assert ("creds: e2e-access-key" if creds else "creds: none") in text, text


def wait_running_pods(c: ControlPlane, name: str, not_these: set) -> list[dict]:
    """The TrainJob's running pods, other than those whose UIDs are `not_these`, once there is one."""
    return eventually(lambda: [p for p in pods_of(c, name) if p["status"].get("phase") == "Running"
                               and not p["metadata"].get("deletionTimestamp")
                               and p["metadata"]["uid"] not in not_these],
                      f"{name} has a new running pod", RUN_TIMEOUT, every=0.5)


# ---- reading the cluster through the Python client ----

TRAINER = ("trainer.kubeflow.org", "v1alpha1")


class Kube:
    """The cluster's API through the `kubernetes` client, as plain dicts (the JSON kubectl prints)."""

    def __init__(self, c: ControlPlane):
        from kubernetes import client

        self.api = c.client()  # the control plane's own client: one connection pool per cluster
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.batch = client.BatchV1Api(self.api)

    def _read(self, call, *args, **kwargs):
        from kubernetes.client.rest import ApiException

        try:
            return json.loads(call(*args, _preload_content=False, **kwargs).data)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def trainjob(self, name: str, namespace: str = NS) -> dict | None:
        return self._read(self.custom.get_namespaced_custom_object, *TRAINER, namespace, "trainjobs", name)

    def custom_list(self, group: str, version: str, plural: str, namespace: str, selector: str = "") -> list[dict]:
        got = self._read(self.custom.list_namespaced_custom_object, group, version, namespace, plural,
                         label_selector=selector)
        return (got or {}).get("items", [])

    def custom_list_all(self, group: str, version: str, plural: str, selector: str = "") -> list[dict]:
        """Every object of the kind in every namespace."""
        got = self._read(self.custom.list_cluster_custom_object, group, version, plural, label_selector=selector)
        return (got or {}).get("items", [])

    def pods_all(self, selector: str = "") -> list[dict]:
        return self._read(self.core.list_pod_for_all_namespaces, label_selector=selector)["items"]

    def pod(self, name: str, namespace: str) -> dict | None:
        return self._read(self.core.read_namespaced_pod, name, namespace)

    def pods(self, namespace: str, selector: str = "") -> list[dict]:
        return self._read(self.core.list_namespaced_pod, namespace, label_selector=selector)["items"]


def kube(c: ControlPlane) -> Kube:
    """The cluster's client, made once."""
    if getattr(c, "_kube", None) is None:
        c._kube = Kube(c)  # type: ignore[attr-defined]
    return c._kube  # type: ignore[attr-defined]


# ---- the shared node ----

def start_trainer_on_node(stack: contextlib.ExitStack, tmp: Path) -> NodeCluster:
    """The one-node cluster with what a TrainJob here needs: namespace NS holding the credentials Secret, the
    node's runtimes and examples/runtimes/team-a.yaml's (the namespaced runtimes R3, R5, R6 name), and Trainer's
    controller manager with its webhooks."""
    nc = start_node_cluster(stack, tmp, toolchain.trainer_crds() + toolchain.jobset_crds(), LOGS)
    c = nc.cluster
    ensure_namespaces(c, NS)
    c.kubectl("create", "secret", "generic", "s3-credentials", "-n", NS, "--from-literal=access-key=e2e-access-key")
    for doc in node_runtimes(nc.images):
        c.apply(doc)
    c.kubectl("apply", "-f", str(EXAMPLES / "runtimes" / "team-a.yaml"))
    proc, port = start_trainer(c, tmp)
    stack.callback(stop, proc)
    for doc in trainer_webhooks(port, (tmp / "k8s-webhook-server" / "serving-certs" / "ca.crt").read_bytes()):
        c.apply(doc)
    return nc


def ensure_namespaces(c: ControlPlane, *names: str) -> None:
    for name in names:
        c.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})


WORKLOADS = (("trainer.kubeflow.org", "v1alpha1", "trainjobs"), ("jobset.x-k8s.io", "v1alpha2", "jobsets"),
             ("batch", "v1", "jobs"))


def reset_workloads(c: ControlPlane, namespaces: tuple[str, ...], timeout: float = 180) -> None:
    """What a suite leaves for the next on the shared node: our webhook configurations gone (first: they fail
    closed, and Trainer's finalizer updates pass through them), then every TrainJob, JobSet, Job and pod in
    `namespaces` deleted (pods with a grace period of 1s: a training shell ignores SIGTERM) and gone, and the
    ResourceQuotas there removed."""
    remove_our_webhooks(c)
    for ns in namespaces:
        for kind in ("trainjobs.trainer.kubeflow.org", "jobsets.jobset.x-k8s.io", "jobs.batch"):
            c.kubectl("delete", kind, "--all", "-n", ns, "--wait=false", "--cascade=background", check=False)
        c.kubectl("delete", "pods", "--all", "-n", ns, "--grace-period=1", "--wait=false", check=False)
        c.kubectl("delete", "resourcequotas", "--all", "-n", ns, check=False)
    k = kube(c)

    def left() -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for ns in namespaces:
            for group, version, plural in WORKLOADS:
                items = (k._read(k.batch.list_namespaced_job, ns)["items"] if group == "batch"
                         else k.custom_list(group, version, plural, ns))
                names = [j["metadata"]["name"] for j in items]
                found.update({f"{ns}/{plural}": names} if names else {})
            pods = [p["metadata"]["name"] for p in k.pods(ns)]
            found.update({f"{ns}/pods": pods} if pods else {})
        return found

    eventually(lambda: not left(), f"the workloads in {namespaces} gone", timeout, every=1,
               detail=lambda: json.dumps(left()))
