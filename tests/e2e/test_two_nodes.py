"""Issue 50: two real nodes. The shared node (conftest.py's `shared_node`) and a second one added for this module
(node.py's `add_node`: its own containerd and kubelet on this machine, its own name, address, pod CIDR and
cgroup root, on the same bridge), then taken away.

The nodes differ: the second node's containerd pulls the local registry's images through a mirror (its hosts.toml
names it) that holds the sandbox, training and webhook images but not the publish image, as a node configured
for another registry mirror would. On them:
- the chart, from the locally built image (test_install's helpers): two webhook replicas, one per node (the
  chart's default soft anti-affinity), and its PodDisruptionBudget;
- `verify --per-node`: the first node `ran`, the second `FAILED at pulled` in the kubelet's words and what to do,
  exit 1; once the node pulls from the registry itself, both `ran`, exit 0;
- drains while a client creates TrainJobs continuously: the node holding one replica (its runtime keeper, a
  native sidecar, goes with it), then the other once the first is back, then a drain the PDB holds (the last
  ready replica) until the test uncordons the other node. Every create is admitted; each drain's p99 printed.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.cluster import LOGS
from tests.e2e.install import (
    FULL,
    RNS,
    Create,
    Installed,
    Load,
    delete_load,
    install_release,
    ready_for_release,
    summarise,
)
from tests.e2e.node import PLACES, Node, add_node
from tests.e2e.node_env import NS, kube
from tests.e2e.registry import Registry
from tests.e2e.test_verify import finish, start
from tests.process import eventually

FIRST, SECOND = PLACES[0].name, PLACES[1].name
BLOCKED = "Cannot evict pod as it would violate the pod's disruption budget"


@dataclass
class Two:
    inst: Installed
    second: Node
    mirror: Registry


def mirrored(mirror: Registry, ref: str) -> None:
    """`ref` (HOST/REPO@DIGEST) copied to the mirror under the same repository: the node asks it by digest."""
    repo = ref.split("/", 1)[1].split("@")[0]
    mirror.crane_run("copy", ref, f"{mirror.host}/{repo}:e2e")


@pytest.fixture(scope="module")
def two(shared_node, tmp_path_factory):
    """The second node (pulling through the mirror), and the chart installed over both nodes."""
    nc = shared_node
    tmp = tmp_path_factory.mktemp("two-nodes")
    with contextlib.ExitStack() as stack:
        webhook_image = ready_for_release(stack, nc)
        mirror = Registry.start(tmp / "mirror")
        stack.callback(mirror.stop)
        LOGS["registry (mirror)"] = mirror.log
        for ref in (nc.images.pause, nc.images.training, webhook_image):  # not the publish image
            mirrored(mirror, ref)
        started = time.monotonic()
        second = add_node(stack, nc, tmp / "node-2", logs=LOGS)
        second.pull_from(nc.registry.host, mirror.host)
        print(f"\nsecond node {SECOND} Ready in {time.monotonic() - started:.0f}s")
        for node in (FIRST, SECOND):  # whatever a failed drain test left
            stack.callback(nc.cluster.kubectl, "uncordon", node, check=False)
        yield Two(install_release(stack, nc, tmp, webhook_image, timeout="5m"), second, mirror)


def nodes_of(pods: list[dict]) -> list[str]:
    return sorted(p["spec"]["nodeName"] for p in pods)


def test_the_chart_spreads_its_two_replicas_one_per_node_under_a_pdb(two):
    pods = two.inst.wait_settled()
    assert nodes_of(pods) == sorted([FIRST, SECOND]), [(p["metadata"]["name"], p["spec"]["nodeName"]) for p in pods]
    keeper = [ctr["name"] for ctr in pods[0]["spec"].get("initContainers", []) if ctr.get("restartPolicy") == "Always"]
    assert keeper, "the runtime keeper is a native sidecar of the webhook pod (it leaves with the pod)"
    pdb = two.inst.cluster.get("poddisruptionbudget", FULL, RNS)
    assert pdb and pdb["spec"]["minAvailable"] == 1, pdb


# ---- the network between the nodes ----

def bare_pod(two, name: str, node: str, script: str, restart: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS},
            "spec": {"nodeName": node, "restartPolicy": restart, "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "main", "image": two.inst.images.training,
                                     "command": ["/bin/sh", "-c", script]}]}}


def test_a_pod_on_each_node_reaches_a_pod_on_the_other_through_the_host(two):
    """Pod to pod across the nodes' bridges, routed by the host inside the guard chains (no Service, no proxy)."""
    c, k = two.inst.cluster, kube(two.inst.cluster)
    servers = {node: f"web-{i}" for i, node in enumerate((FIRST, SECOND))}
    try:
        for node, name in servers.items():
            c.apply(bare_pod(two, name, node, "mkdir -p /tmp/www && echo \"served on $(hostname)\" > "
                             "/tmp/www/index.html && exec httpd -f -p 8080 -h /tmp/www", "Always"))
        ips = {node: eventually(lambda name=name: (k.pod(name, NS) or {}).get("status", {}).get("podIP"),
                                f"{name} has an address", 120, every=0.5) for node, name in servers.items()}
        assert ips[FIRST].startswith("10.217.0.") and ips[SECOND].startswith("10.217.2."), ips
        for i, (node, peer) in enumerate(((SECOND, FIRST), (FIRST, SECOND))):
            # nc, not wget: Debian's busybox-static's wget segfaults (seen here, on the host too)
            ask = f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc {ips[peer]} 8080 > /tmp/got"
            c.apply(bare_pod(two, f"client-{i}", node, f"until {ask} && grep -q served /tmp/got; do sleep 1; done; "
                             "tail -n 1 /tmp/got", "Never"))
        for i, peer in enumerate((FIRST, SECOND)):
            done = eventually(lambda i=i: (k.pod(f"client-{i}", NS) or {}).get("status", {}).get("phase")
                              in ("Succeeded", "Failed") and k.pod(f"client-{i}", NS), f"client-{i} ended", 120,
                              every=0.5)
            assert done["status"]["phase"] == "Succeeded", done["status"]
            got = c.kubectl("logs", "-n", NS, f"client-{i}").stdout
            assert got.strip() == f"served on {servers[peer]}", got
    finally:
        c.kubectl("delete", "pods", "-n", NS, *servers.values(), "client-0", "client-1", "--ignore-not-found",
                  "--grace-period=1", timeout=120)


# ---- verify, node by node ----

def chart_settings(two) -> str:
    """The chart's settings, as a user hands them to verify (its ConfigMap's settings.json)."""
    cm = two.inst.cluster.get("configmap", f"{FULL}-settings", RNS)
    path = two.inst.tmp / "chart-settings.json"
    path.write_text(cm["data"]["settings.json"])
    return str(path)


def verify_per_node(two):
    return finish(start(two.inst.cluster.kubeconfig, "--runtime", "ClusterTrainingRuntime/torch-distributed",
                        "--namespace", NS, "--settings", chart_settings(two), "--per-node", "--timeout", "240"))


def probe_line(run, node: str) -> str:
    lines = [line for line in run.out.splitlines() if line.startswith("verify-") and f" {node} " in line]
    assert len(lines) == 1, run.out
    return lines[0]


def test_verify_per_node_reports_each_node_the_one_that_cannot_pull_the_publish_image_fails_at_pulled(two):
    run = verify_per_node(two)
    assert run.code == 1, run.out + run.err
    good, bad = probe_line(run, FIRST), probe_line(run, SECOND)
    assert good.split()[2:4] == ["ran", "ran,"], good
    publish = two.inst.images.publish
    # the kubelet's words, from its event (`Failed to pull image "..."`) or the container's waiting state
    # (`ErrImagePull: rpc error: ...`), whichever verify reads first: both name the image and say it was not found
    assert "FAILED at pulled: " in bad and publish in bad and "not found" in bad, bad
    block = run.out.split(bad, 1)[1].split("\nverify-", 1)[0]
    assert "what to do: the node cannot pull the image: check that publish.image's digest exists in its registry, " \
           "that the node can reach the registry" in block, block
    assert run.out.rstrip().splitlines()[-1].startswith("FAILED: 1 of 2 probes"), run.out
    assert run.seconds < 120, f"a pull error fails at once, not at --timeout: {run.seconds:.0f}s"

    # What verify says to do, done: the node pulls from the registry itself, and both nodes run the binary.
    two.second.pull_from(two.inst.nc.registry.host, two.inst.nc.registry.host)
    run = verify_per_node(two)
    assert run.code == 0, run.out + run.err
    for node in (FIRST, SECOND):
        assert probe_line(run, node).split()[2] == "ran", run.out
    assert run.out.rstrip().splitlines()[-1].startswith("ok: 2 of 2 probes"), run.out


# ---- drains under load ----

def drain(two, node: str) -> tuple[subprocess.Popen, Path]:
    c = two.inst.cluster
    out = two.inst.tmp / f"drain-{node}-{time.monotonic_ns()}.log"
    with open(out, "wb") as f:
        proc = c.kubectl_follow("drain", node, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=300s",
                                out=f)
    return proc, out


def drained(proc: subprocess.Popen, out: Path, timeout: float = 300) -> str:
    proc.wait(timeout)
    text = out.read_text()
    assert proc.returncode == 0, text
    return text


def window(results: list[Create], began: float, ended: float) -> list[Create]:
    return [r for r in results if began - 2 <= r.started <= ended]


def test_drains_one_node_then_the_other_lose_no_create_and_the_pdb_holds_the_last_replica(two):
    inst, c = two.inst, two.inst.cluster
    pods = inst.wait_settled()
    assert nodes_of(pods) == sorted([FIRST, SECOND])
    load = Load(c, "drains", limit=5000).start()
    phases: list[tuple[str, float, float, dict]] = []
    try:
        load.wait_creates(20)
        # 1. the second node, holding one replica: it moves to the first
        began = load.now()
        drained(*drain(two, SECOND))
        assert nodes_of(inst.wait_settled()) == [FIRST, FIRST]
        phases.append((f"drain {SECOND} (one replica)", began, load.now(), {}))
        c.kubectl("uncordon", SECOND)
        load.wait_creates(10)

        # 2. the first node, now holding both, once the second is back: both move there, one at a time
        began = load.now()
        text = drained(*drain(two, FIRST))
        assert nodes_of(inst.wait_settled()) == [SECOND, SECOND]
        phases.append((f"drain {FIRST} (both replicas, {SECOND} back)", began, load.now(),
                       {"evictions_held_by_the_pdb": text.count(BLOCKED)}))
        load.wait_creates(10)

        # 3. the second node again, the first still cordoned: the last ready replica is held by the PDB
        began = load.now()
        proc, out = drain(two, SECOND)

        def held() -> bool:
            assert proc.poll() is None, out.read_text()
            return BLOCKED in out.read_text()

        eventually(held, "kubectl drain held by the PodDisruptionBudget", 120, every=0.5,
                   detail=lambda: out.read_text())
        ready = inst.ready_pods()
        pending = [p for p in inst.pods() if p["status"].get("phase") == "Pending"]
        held_for = time.monotonic()
        load.wait_creates(40)  # the drain keeps waiting meanwhile, the last replica serving
        assert proc.poll() is None and [p["spec"]["nodeName"] for p in ready] == [SECOND], out.read_text()
        assert pending and not pending[0]["spec"].get("nodeName"), "the evicted replica's replacement has no node"
        c.kubectl("uncordon", FIRST)  # the release: the replacement is scheduled there, and the drain goes on
        text = drained(proc, out)
        assert nodes_of(inst.wait_settled()) == [FIRST, FIRST]
        phases.append((f"drain {SECOND} held by the PDB ({FIRST} cordoned)", began, load.now(),
                       {"held_s": round(time.monotonic() - held_for, 1),
                        "evictions_held_by_the_pdb": text.count(BLOCKED)}))
        c.kubectl("uncordon", SECOND)
        load.wait_creates(10)
    finally:
        results = load.stop()
    for phase, began, ended, extra in phases:
        figures = summarise(phase, window(results, began, ended), began, drain_s=round(ended - began), **extra)
        assert figures["failed"] == 0 and figures["unpatched"] == 0, figures["failures"]
    total = summarise("three drains, all creates", results)
    assert total["failed"] == 0 and total["unpatched"] == 0, total["failures"]
    print(json.dumps({"phases": [p[0] for p in phases]}))
    delete_load(c)
