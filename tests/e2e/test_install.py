"""Issue 12: the chart installed into the one-node cluster, its webhook running as pods, and its rollout.

The user's path, with no URL shortcut: the image built by BuildKit from the project's Dockerfile (the
session's build, tests/e2e/image.py, pushed by digest to the node's loopback registry), `helm install` of
charts/dispatch-admission with it, then TrainJobs applied with kubectl. The node is tests/e2e/node.py's
(containerd, runc, CNI, kubelet, scheduler, controller manager, kube-proxy, JobSet), with Trainer's
controller manager beside it.

How calls travel here:
- API server -> webhook: the configurations name the chart's Service. kube-apiserver runs with
  `--enable-aggregator-routing=true`, so its service resolver picks a ready endpoint of the Service's
  EndpointSlices and dials the pod IP itself (kube-proxy's ClusterIP rules are not on that path); the test
  reads kube-apiserver's sockets to show which path it took.
- webhook -> API server: in-cluster config, `$KUBERNETES_SERVICE_HOST:443` (the `kubernetes` Service), which
  kube-proxy sends to the API server's advertised address; the test reads the pods' sockets.

Then the rollout and faults, measured as the API server sees them: a client creates TrainJobs (suspended,
so nothing runs) continuously over loopback while the Deployment is restarted, a pod is deleted, the
certificate Secret is deleted and the release upgraded, counting every failed or slow create and timing each.
Each phase prints its row of the figures table (docs/performance.md; run with -s to see it).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import shlex
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from cryptography import x509

from tests.e2e import toolchain
from tests.e2e.cluster import ControlPlane
from tests.e2e.install import (
    CA_SECRET,
    CHART,
    CREDENTIALS,
    FULL,
    INVALID_EDIT,
    LOAD_NS,
    RELEASE,
    RNS,
    SECRET,
    SELECTOR,
    UPGRADE,
    Api,
    Load,
    bundles,
    container_pid,
    delete_load,
    hex_address,
    install_release,
    load_trainjob,
    logged_at,
    netns_connections,
    pod_ip,
    ready_for_release,
    review_lines,
    secret_files,
    sent_again,
    served_certificate,
    serves,
    sockets_of,
    summarise,
)
from tests.e2e.node import NODE_NAME
from tests.e2e.node_env import (
    IN_POD_CHECKS,
    NS,
    assert_complete,
    assert_in_pod_checks,
    assert_only_our_mount,
    ensure_namespaces,
    entry,
    logs,
    pods_of,
    trainjob,
)
from tests.e2e.registry import FileEntry, write_layer
from tests.helpers import EXAMPLES, MANAGER, metric_table, table_total
from tests.process import eventually, stop


@pytest.fixture(scope="module")
def inst(shared_node, tmp_path_factory):
    """The chart installed on the shared node; after the module, the release and every workload gone."""
    with contextlib.ExitStack() as stack:
        webhook_image = ready_for_release(stack, shared_node)
        yield install_release(stack, shared_node, tmp_path_factory.mktemp("install"), webhook_image)


# ---- the install ----

def test_install_runs_two_webhook_pods_from_the_built_image_behind_the_service(inst):
    c = inst.cluster
    deploy = c.get("deployment", FULL, RNS)
    assert deploy["status"].get("availableReplicas") == 2 and deploy["spec"]["replicas"] == 2
    pods = inst.ready_pods()
    assert len(pods) == 2
    digest = inst.image.split("@")[1]
    for pod in pods:
        assert pod["spec"]["nodeName"] == NODE_NAME
        (ctr,) = pod["spec"]["containers"]
        assert ctr["image"] == inst.image, "pinned by digest, from the node's registry"
        (status,) = pod["status"]["containerStatuses"]
        assert status["ready"] and digest in status["imageID"], status
        assert not any("--kubeconfig" in a for a in ctr["args"]), "in-cluster config only"
    # The Service's endpoints are exactly the two pods, ready, on the webhook port.
    slices = json.loads(c.kubectl("get", "endpointslices", "-n", RNS, "-l", f"kubernetes.io/service-name={FULL}",
                                  "-o", "json").stdout)["items"]
    ready = {a for s in slices for e in s.get("endpoints") or [] if e["conditions"].get("ready")
             for a in e["addresses"]}
    assert ready == {pod_ip(p) for p in pods}
    ports = {(p["name"], p["port"]) for s in slices for p in s["ports"]}
    assert ("https", 8443) in ports, ports
    print(c.kubectl("get", "pods,svc,endpointslices,pdb", "-n", RNS, "-o", "wide").stdout)


def test_the_api_server_calls_the_webhook_at_the_service_endpoints(inst):
    """With --enable-aggregator-routing the API server resolves the Service to a ready endpoint and dials the
    pod IP: its sockets go to POD_IP:8443, none to the Service's ClusterIP:443."""
    c = inst.cluster
    api = Api(c)
    try:
        for i in range(6):  # a few creates, so that calls reach the webhook and leave connections behind
            status, body = api.request("POST", f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{LOAD_NS}/trainjobs",
                                       load_trainjob(f"path-{i}", "path"))
            assert status == 201 and entry(body) is not None, body
    finally:
        api.close()
    cluster_ip = c.get("service", FULL, RNS)["spec"]["clusterIP"]
    ips = {pod_ip(p) for p in inst.ready_pods()}
    peers = [peer for _, peer in sockets_of(c.apiserver_proc.pid)]
    to_pods = [p for p in peers if p.rsplit(":", 1)[0] in ips and p.endswith(":8443")]
    to_cluster_ip = [p for p in peers if p.startswith(cluster_ip + ":")]
    print(f"kube-apiserver -> webhook connections: {to_pods} (to the ClusterIP {cluster_ip}: {to_cluster_ip})")
    assert to_pods, f"kube-apiserver holds no connection to a webhook pod: {peers}"
    assert not to_cluster_ip, "the API server went through the ClusterIP (kube-proxy) instead"
    # ... and the reviews were answered by the pods (their logs, through the kubelet).
    eventually(lambda: {"path-0", "path-5"} <= {r["name"] for r in review_lines(
        c.kubectl("logs", "-n", RNS, "-l", SELECTOR, "--tail=-1", "--prefix").stdout)},
               "the pods did not log the reviews")
    # The Service's ClusterIP works too (kube-proxy), for clients that use it: same certificate.
    files = secret_files(c)
    via_service = served_certificate(cluster_ip, 443, files["ca.crt"], f"{FULL}.{RNS}.svc")
    assert via_service == files["tls.crt"]
    delete_load(c)


def test_the_webhook_reaches_the_api_server_through_the_kubernetes_service(inst):
    """In-cluster config: each pod's process has KUBERNETES_SERVICE_HOST = the `kubernetes` Service's IP and
    its network namespace holds connections to that IP:443 (the runtime watches, the Secret reads), which
    kube-proxy sends to the API server: kube-apiserver's sockets show the pods as peers."""
    c = inst.cluster
    service = c.get("service", "kubernetes", "default")["spec"]["clusterIP"]
    assert service == c.service_ip
    apiserver_peers = {peer.rsplit(":", 1)[0] for _, peer in sockets_of(c.apiserver_proc.pid)}
    for pod in inst.ready_pods():
        pid = container_pid(inst, pod["metadata"]["name"])
        environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
                       if "=" in item)
        assert (environ["KUBERNETES_SERVICE_HOST"], environ["KUBERNETES_SERVICE_PORT"]) == (service, "443")
        remote = netns_connections(pid)
        to_service = remote.count(hex_address(service, 443))
        print(f"{pod['metadata']['name']}: {to_service} connection(s) to {service}:443 (the kubernetes Service)")
        assert to_service >= 2, f"the keeper's two watches go to the kubernetes Service: {remote}"
        assert pod_ip(pod) in apiserver_peers, "the API server sees the pod itself as the client"
        direct = hex_address(c.address, c.port)
        assert direct not in remote, "no pod dials the API server's own address"


def test_self_managed_certificates_one_pair_served_by_both_pods_its_ca_in_every_configuration(inst):
    c = inst.cluster
    files = secret_files(c)
    assert set(files) == {"ca.crt", "tls.crt", "tls.key"}, "the controller filled the chart's Secret, no CA key in it"
    assert set(secret_files(c, CA_SECRET)) == {"ca.crt", "ca.key"}
    leaf = x509.load_pem_x509_certificate(files["tls.crt"])
    names = set(leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
                .get_values_for_type(x509.DNSName))
    assert f"{FULL}.{RNS}.svc" in names
    for pod in inst.ready_pods():
        served = served_certificate(pod_ip(pod), 8443, files["ca.crt"], f"{FULL}.{RNS}.svc")
        assert served == files["tls.crt"], f"{pod['metadata']['name']} serves another certificate"
    for hook, found in bundles(c).items():
        assert found == [files["ca.crt"]], f"{hook}: caBundle is not the Secret's CA"
    # Issue 35: the serving pod's own token (the kubelet's projected volume) cannot read the CA's key.
    pod = inst.ready_pods()[0]
    (token,) = (inst.nc.node.dir / "kubelet" / "root" / "pods" / pod["metadata"]["uid"]).glob(
        "volumes/kubernetes.io~projected/kube-api-access-*/token")
    ctx = ssl.create_default_context(cafile=c.ca_file)
    for name, status in ((CA_SECRET, 403), (SECRET, 200)):
        req = urllib.request.Request(f"{c.server}/api/v1/namespaces/{RNS}/secrets/{name}",
                                     headers={"Authorization": f"Bearer {token.read_text().strip()}"})
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
                got = r.status
                assert "ca.key" not in json.loads(r.read())["data"]
        except urllib.error.HTTPError as e:
            got = e.code
        assert got == status, f"the serving pod's token reading Secret {name}: {got}"
    # Both replicas took the Secret as it was: one write by the webhook's ServiceAccount, none since.
    secret = json.loads(c.kubectl("get", "secret", SECRET, "-n", RNS, "-o", "json", "--show-managed-fields").stdout)
    writers = [m for m in secret["metadata"].get("managedFields", []) if m.get("manager") != "helm"]
    print(f"Secret {SECRET} written by: {[(m['manager'], m['operation'], m['time']) for m in writers]}")
    assert len(writers) == 1, writers


def test_a_runtime_edit_is_warned_by_the_in_cluster_runtimes_webhook(inst):
    """The runtime-warnings configuration (its caBundle written by the pods) reaches the pods too."""
    c = inst.cluster
    rt = c.get("clustertrainingruntime", "torch-distributed")
    doc = {"apiVersion": rt["apiVersion"], "kind": rt["kind"], "metadata": {"name": "mounts-opt-dispatch"},
           "spec": rt["spec"]}
    for rj in doc["spec"]["template"]["spec"]["replicatedJobs"]:  # a mount of its own where ours goes
        pod = rj["template"]["spec"]["template"]["spec"]
        pod.setdefault("volumes", []).append({"name": "own", "emptyDir": {}})
        for ctr in pod["containers"]:
            ctr.setdefault("volumeMounts", []).append({"name": "own", "mountPath": "/opt/dispatch"})
    got = c.apply(doc)
    assert "TrainJobs on this runtime will be refused" in got.stderr and "/opt/dispatch" in got.stderr, got.stderr
    c.kubectl("delete", "clustertrainingruntime", "mounts-opt-dispatch")


def test_a_raw_trainjob_is_mutated_by_the_in_cluster_webhook_and_its_pods_run_the_publish_binary(inst):
    c = inst.cluster
    got = c.apply(trainjob("via-chart", "torch-distributed", ["/bin/sh", "-c", IN_POD_CHECKS]))
    assert "created" in got.stdout
    job = assert_complete(c, "via-chart")
    assert entry(job) is not None
    [pod] = pods_of(c, "via-chart")
    assert_only_our_mount(pod, inst.images, 1)
    assert_in_pod_checks(logs(c, pod), creds=False)
    eventually(lambda: any(r["name"] == "via-chart" and r["patched"] for r in review_lines(
        c.kubectl("logs", "-n", RNS, "-l", SELECTOR, "--tail=-1").stdout)), "not logged as mutated by the pods")


# ---- helm test ----

def test_helm_test_passes_with_its_pod(inst):
    got = inst.helm_run("test", RELEASE, "-n", RNS, "--logs", "--timeout", "5m")
    print(got.stdout)
    assert re.search(rf"TEST SUITE:\s+{FULL}-test\s+Last Started:.*\s+Last Completed:.*\s+Phase:\s+Succeeded",
                     got.stdout), got.stdout
    assert f"ok: a TrainJob was admitted with the {MANAGER} entry, and one breaking rule S3 was refused" in got.stdout


def test_helm_test_fails_and_says_why_when_no_webhook_pod_answers(inst):
    c = inst.cluster
    generation = c.get("deployment", FULL, RNS)["metadata"]["generation"]
    inst.helm_run("upgrade", RELEASE, str(CHART), "-n", RNS, "--reuse-values", "--set", "tests.timeoutSeconds=15",
                  "--wait", "--timeout", "5m")
    assert c.get("deployment", FULL, RNS)["metadata"]["generation"] == generation, "no rollout for a test value"
    c.kubectl("scale", f"deployment/{FULL}", "-n", RNS, "--replicas=0")
    try:
        eventually(lambda: not inst.pods(), "the webhook pods gone", 120, every=0.5)
        got = inst.helm_run("test", RELEASE, "-n", RNS, "--logs", "--timeout", "3m", check=False)
        print(got.stdout[-3000:], got.stderr[-3000:])
        assert got.returncode != 0
        assert re.search(r"Phase:\s+Failed", got.stdout), got.stdout + got.stderr
        # The failed pod is deleted (hook-failed); Helm printed its log first (hook-output-log-policy, on stderr).
        out = got.stdout + got.stderr
        assert "FAILED: the webhook did not answer as expected before the deadline" in out, out
        assert "failed calling webhook" in out, "the test's log says what the API server said"
        assert c.get("pod", f"{FULL}-test", RNS) is None, "the failed test pod was left behind"
    finally:
        c.kubectl("scale", f"deployment/{FULL}", "-n", RNS, "--replicas=2")
        inst.wait_settled()
    got = inst.helm_run("test", RELEASE, "-n", RNS, "--timeout", "5m")
    assert re.search(r"Phase:\s+Succeeded", got.stdout), got.stdout


def test_helm_test_runs_verify_and_passes_on_a_good_runtime(inst):
    """tests.verify.runtime (docs/verify.md): the probe runs /opt/dispatch/publish through the chart's webhook."""
    inst.helm_run("upgrade", RELEASE, str(CHART), "-n", RNS, "--reuse-values", "--wait", "--timeout", "5m",
                  "--set", "tests.verify.runtime=ClusterTrainingRuntime/torch-distributed",
                  "--set", "tests.verify.timeoutSeconds=180")
    got = inst.helm_run("test", RELEASE, "-n", RNS, "--logs", "--timeout", "6m")
    print(got.stdout)
    assert re.search(rf"TEST SUITE:\s+{FULL}-verify-{RNS}\s+Last Started:.*\s+Last Completed:.*\s+Phase:\s+Succeeded",
                     got.stdout), got.stdout
    assert "ok: 1 of 1 probes on ClusterTrainingRuntime/torch-distributed ran the binary" in got.stdout
    assert "ok: node container mount: /opt/dispatch read-only" in got.stdout
    for kind in ("serviceaccount", "role", "rolebinding"):  # the test's RBAC went with it
        ns = RNS if kind == "serviceaccount" else NS
        assert inst.cluster.get(kind, f"{FULL}-verify-{RNS}", ns) is None, kind
    assert inst.cluster.get("clusterrole", f"{FULL}-verify-{RNS}") is None


def test_helm_test_verify_fails_on_a_route2_runtime_whose_init_container_copies_nothing(inst):
    c = inst.cluster
    inst.helm_run("upgrade", RELEASE, str(CHART), "-n", RNS, "--reuse-values", "--wait", "--timeout", "5m",
                  "--set", "publish.via=initContainer", "--set", "tests.runtimeRef.name=torch-init",
                  "--set", "tests.verify.runtime=ClusterTrainingRuntime/torch-init-copies-nothing")
    try:
        inst.wait_settled(timeout=400)
        got = inst.helm_run("test", RELEASE, "-n", RNS, "--logs", "--timeout", "6m", check=False)
        print(got.stdout[-4000:], got.stderr[-4000:])
        assert got.returncode != 0
        # The failed pod is deleted (hook-failed); Helm printed its log first (hook-output-log-policy, on stderr).
        out = got.stdout + got.stderr
        assert "FAILED at started: " in out and "no such file or directory" in out, out
        assert "what to do: route 2: the init container copied nothing to /opt/dispatch" in out
        for kind in ("pod", "serviceaccount"):
            assert c.get(kind, f"{FULL}-verify-{RNS}", RNS) is None, f"hook-failed deletes the test's {kind}"
    finally:
        inst.helm_run("upgrade", RELEASE, str(CHART), "-n", RNS, "--reuse-values", "--wait", "--timeout", "5m",
                      "--set", "publish.via=imageVolume", "--set", "tests.runtimeRef.name=torch-distributed",
                      "--set", "tests.verify.runtime=")
        inst.wait_settled(timeout=400)
    left = json.loads(c.kubectl("get", "trainjobs", "-A", "-l", "dispatch.go.phpboyscout.uk/verify", "-o", "json")
                      .stdout)["items"]
    assert left == [], "verify deleted its probes"


# ---- break-glass: every replica down ----

BREAK_GLASS = ("kubectl patch validatingwebhookconfiguration {name} --type=json "
               "-p='[{{\"op\":\"replace\",\"path\":\"/webhooks/0/failurePolicy\",\"value\":\"Ignore\"}}]'")
HOLD = "dispatch-e2e/hold"


def test_break_glass_with_every_replica_down(inst):
    """docs/hardening.md's runbook, run: with all replicas scaled to 0, creates are refused (fail closed) while a
    finalizer removal of a TrainJob being deleted already goes through (the matchCondition); one kubectl line
    (failurePolicy Ignore) lets creates, deletes and finalizer removals through; restoring Fail and the replicas
    brings the webhook back."""
    c = inst.cluster
    shown: list[str] = []

    def run(*args: str, check: bool = True):
        got = c.kubectl(*args, check=check)
        shown.append(f"$ kubectl {' '.join(args)}\n{(got.stdout + got.stderr).strip()}")
        return got

    def held(name: str) -> dict:
        job = trainjob(name, "torch-distributed", suspend=True)
        job["metadata"]["finalizers"] = [HOLD]
        return job

    def until(what: str, check, timeout: float = 60):
        eventually(check, what, timeout, every=0.5)

    c.apply(held("glass-held"))  # while the webhook answers: a TrainJob another controller still holds
    c.kubectl("delete", "trainjob", "glass-held", "-n", NS, "--wait=false")
    assert c.get("trainjob", "glass-held", NS)["metadata"].get("deletionTimestamp")
    c.kubectl("scale", f"deployment/{FULL}", "-n", RNS, "--replicas=0")
    try:
        until("the webhook pods did not go", lambda: not inst.pods(), 120)
        got = c.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(trainjob("glass-before", "torch-distributed",
                                                                          suspend=True)), check=False)
        shown.append(f"$ kubectl apply -f glass-before.yaml\n{(got.stdout + got.stderr).strip()}")
        assert got.returncode != 0 and "failed calling webhook" in got.stderr, got.stdout + got.stderr
        # Not sent to the webhook (being deleted): the finalizer removal goes through with no replica.
        run("patch", "trainjob", "glass-held", "-n", NS, "--type=merge", "-p", '{"metadata":{"finalizers":null}}')
        until("the held TrainJob was not deleted", lambda: c.get("trainjob", "glass-held", NS) is None)

        # The break-glass line.
        line = BREAK_GLASS.format(name=FULL)
        got = c.kubectl(*shlex.split(line)[1:], check=False)  # the documented line's words, as its shell splits them
        shown.append(f"$ {line}\n{(got.stdout + got.stderr).strip()}")
        assert got.returncode == 0, got.stdout + got.stderr
        assert [w["failurePolicy"] for w in c.get("validatingwebhookconfiguration", FULL)["webhooks"]] == ["Ignore"]
        # The API server's informer takes the change in a moment: creates go through from then on.
        until("creates still refused after the break-glass",
              lambda: c.apply(trainjob("glass-create", "torch-distributed", suspend=True), check=False).returncode == 0)
        got = c.kubectl("get", "trainjob", "glass-create", "-n", NS)
        shown.append(f"$ kubectl apply -f glass-create.yaml\ntrainjob.trainer.kubeflow.org/glass-create created\n"
                     f"$ kubectl get trainjob glass-create -n {NS}\n{got.stdout.strip()}")
        assert entry(c.get("trainjob", "glass-create", NS)) is None, "admitted without the webhook's entry"
        got = c.apply(held("glass-held-2"))
        shown.append(f"$ kubectl apply -f glass-held-2.yaml  # finalizers: [{HOLD}]\n{got.stdout.strip()}")
        run("delete", "trainjob", "glass-create", "-n", NS)
        run("delete", "trainjob", "glass-held-2", "-n", NS, "--wait=false")
        run("patch", "trainjob", "glass-held-2", "-n", NS, "--type=merge", "-p", '{"metadata":{"finalizers":null}}')
        until("the second held TrainJob was not deleted", lambda: c.get("trainjob", "glass-held-2", NS) is None)
        assert c.get("trainjob", "glass-create", NS) is None
    finally:
        # Restore: fail closed again, and the replicas.
        c.kubectl("patch", "validatingwebhookconfiguration", FULL, "--type=json",
                  "-p", '[{"op":"replace","path":"/webhooks/0/failurePolicy","value":"Fail"}]')
        shown.append(f"$ kubectl patch validatingwebhookconfiguration {FULL} --type=json "
                     "-p='[{\"op\":\"replace\",\"path\":\"/webhooks/0/failurePolicy\",\"value\":\"Fail\"}]'")
        c.kubectl("scale", f"deployment/{FULL}", "-n", RNS, "--replicas=2")
        shown.append(f"$ kubectl scale deployment/{FULL} -n {RNS} --replicas=2")
        inst.wait_settled()
        print("\n[break-glass]\n" + "\n".join(shown))
    until("a create was not mutated after the restore",
          lambda: c.apply(trainjob("glass-after", "torch-distributed", suspend=True), check=False).returncode == 0)
    assert entry(c.get("trainjob", "glass-after", NS)) is not None, "the webhook is back in the path"
    c.kubectl("delete", "trainjob", "glass-after", "-n", NS)


# ---- rollout and faults, as the API server sees them ----

def test_steady_state_creates_all_admitted(inst):
    load = Load(inst.cluster, "steady").start()
    try:
        load.wait_creates(100)
    finally:
        results = load.stop()
    figures = summarise("steady", results)
    assert figures["failed"] == 0 and figures["unpatched"] == 0, figures["failures"]
    delete_load(inst.cluster)


def test_rollout_restart_loses_no_admission(inst):
    c = inst.cluster
    before = {p["metadata"]["name"] for p in inst.ready_pods()}
    load = Load(c, "restart").start()
    try:
        load.wait_creates(10)
        began = load.now()
        c.kubectl("rollout", "restart", f"deployment/{FULL}", "-n", RNS)
        pods = inst.wait_settled(timeout=400)
        took = load.now() - began
        load.wait_creates(20)
    finally:
        results = load.stop()
    assert not before & {p["metadata"]["name"] for p in pods}, "every pod was replaced"
    figures = summarise("rollout restart", results, began, rollout_s=round(took))
    assert figures["failed"] == 0 and figures["unpatched"] == 0, figures["failures"]
    delete_load(c)


def test_one_webhook_pod_deleted_loses_nothing_beyond_its_requests_in_flight(inst):
    c = inst.cluster
    victim = inst.ready_pods()[0]["metadata"]["name"]
    log_path = inst.tmp / f"{victim}.log"
    with open(log_path, "wb") as out:
        follower = c.kubectl_follow("logs", "-f", "--timestamps", "-n", RNS, victim, out=out)
    load = Load(c, "pod-delete").start()
    try:
        load.wait_creates(10)
        began, in_flight, deleted_at = load.now(), load.in_flight(), time.time()
        c.kubectl("delete", "pod", victim, "-n", RNS, "--wait=true", timeout=120)
        gone = load.now()
        inst.wait_settled()
        load.wait_creates(20)
    finally:
        results = load.stop()
        stop(follower)
    lines = log_path.read_text(errors="replace").splitlines()
    term = next((i for i, line in enumerate(lines) if "Handling signal: term" in line), None)
    assert term is not None, "the deleted pod never logged SIGTERM:\n" + "\n".join(lines[-40:])
    after_delete = [line for line in lines if line[:1].isdigit() and logged_at(line) >= deleted_at]
    figures = summarise("pod deleted", results, began, in_flight_at_delete=in_flight,
                        reviews_by_it_after_its_deletion=len(review_lines("\n".join(after_delete))),
                        reviews_by_it_after_sigterm=len(review_lines("\n".join(lines[term:]))),
                        sigterm_after_s=round(logged_at(lines[term]) - deleted_at, 1),
                        pod_gone_after_s=round(gone - began, 1))
    failed_near = [r for r in results if r.status != 201 and began - 1 <= r.started <= gone + 1]
    assert figures["failed"] == len(failed_near) <= in_flight, figures["failures"]
    assert figures["failed"] == 0, figures["failures"]
    delete_load(c)


def test_certificate_secret_deleted_a_new_pair_is_issued_and_trusted_without_a_failed_admission(inst):
    """The rotation after an incident (docs/hardening.md): both Secrets deleted, a new CA and pair issued."""
    c = inst.cluster
    old = secret_files(c)
    load = Load(c, "secret-delete", workers=2).start()  # a longer phase: the old CA leaves after a minute
    try:
        load.wait_creates(10)
        began = load.now()
        c.kubectl("delete", "secret", CA_SECRET, SECRET, "-n", RNS)
        started = time.monotonic()

        def issued_pair() -> dict | None:  # a replica notices (it reads the Secret every 10 s) and issues a new pair
            new = secret_files(c)
            return new if new and new.get("ca.crt") and new["ca.crt"] != old["ca.crt"] else None

        new = eventually(issued_pair, "a new pair issued", 120, every=0.5)
        issued = load.now() - began

        def both_serve() -> bool:
            pods = inst.ready_pods()
            return len(pods) == 2 and all(serves(p, new) for p in pods)

        eventually(both_serve, "both pods serve the new pair", max(1.0, 120 - (time.monotonic() - started)), every=0.5)
        switched = load.now() - began
        for hook, found in bundles(c).items():
            assert new["ca.crt"] in found, f"{hook}: the new CA is not trusted"
        # then the old CA leaves the bundle (60 s after the replicas switched)
        eventually(lambda: all(found == [new["ca.crt"]] for found in bundles(c).values()),
                   "the old CA gone from the caBundle", 180, every=1, detail=lambda: str(bundles(c).keys()))
        pruned = load.now() - began
        load.wait_creates(20)
    finally:
        results = load.stop()
    figures = summarise("secret deleted", results, began, new_pair_after_s=round(issued, 1),
                        both_pods_serve_it_after_s=round(switched, 1), old_ca_removed_after_s=round(pruned, 1))
    assert figures["failed"] == 0 and figures["unpatched"] == 0, figures["failures"]
    delete_load(c)


# ---- helm upgrade ----

def second_publish_image(inst) -> str:
    """Another release of the publish image: the same binary, another digest (a label of its own)."""
    layer = write_layer(inst.tmp / "publish-v2.tar", {"publish": FileEntry(source=toolchain.stub_bin("publish"),
                                                                             mode=0o755)})
    return inst.nc.registry.push_layers("dispatch/publish", [layer], env={"PUBLISH_RELEASE": "2"}, tag="v2")


def digest_of(image: str) -> str:
    return image.split("@", 1)[1]


def test_upgrade_with_a_new_publish_image_and_credentials_fails_no_create(inst):
    """SPEC 2.1: the replicas follow the settings ConfigMap and switch within a second, without a restart; for
    ten minutes the previous settings' entry is still accepted, so a create mutated by a replica that had not
    switched yet and validated by one that had (or the reverse) is admitted."""
    c = inst.cluster
    c.apply(trainjob("before-upgrade", "torch-distributed", suspend=True))
    admitted = entry(c.get("trainjob", "before-upgrade", NS))
    assert admitted is not None and "s3-credentials" not in json.dumps(admitted)
    old_image, new_image = inst.values["publish"]["image"], second_publish_image(inst)
    pods_before = {p["metadata"]["name"] for p in inst.ready_pods()}
    load = Load(c, "upgrade").start()
    try:
        load.wait_creates(10)
        began = load.now()
        inst.helm_run("upgrade", RELEASE, str(CHART), "-n", RNS, "--reuse-values", "--wait", "--timeout", "8m",
                      values={"credentials": CREDENTIALS, "publish": {"image": new_image}})
        applied = load.now()
        load.wait_creates(40)
    finally:
        results = load.stop()
    figures = summarise(UPGRADE, results, began, helm_upgrade_s=round(applied - began, 1))
    assert figures["failed"] == 0 and figures["unpatched"] == 0, figures["failures"]
    assert {p["metadata"]["name"] for p in inst.ready_pods()} == pods_before, "a settings change rolls no pod"
    # Every create after the switch (a second after helm applied the ConfigMap) carries the new image.
    after = [r for r in results if r.started > applied + 2]
    assert after and all(r.publish == digest_of(new_image) for r in after), \
        sorted({(round(r.started - applied, 1), r.publish[:16]) for r in after if r.publish != digest_of(new_image)})
    assert any(r.publish == digest_of(old_image) for r in results if r.started < began)
    delete_load(c)
    # A new TrainJob gets the new entry, with the credentials; its pod runs the new image's binary and reads them.
    c.apply(trainjob("after-upgrade", "torch-distributed", ["/bin/sh", "-c", IN_POD_CHECKS]))
    job = assert_complete(c, "after-upgrade")
    assert '"secretName": "s3-credentials"' in json.dumps(entry(job)) and new_image in json.dumps(entry(job))
    [pod] = pods_of(c, "after-upgrade")
    assert_in_pod_checks(logs(c, pod), creds=True)
    # The admitted one keeps its entry; an update of it is admitted and says nothing of it (SPEC 6.3).
    assert entry(c.get("trainjob", "before-upgrade", NS)) == admitted
    got = c.kubectl("label", "trainjob", "before-upgrade", "-n", NS, "edited=after-upgrade")
    assert "Warning" not in got.stderr, got.stderr
    assert entry(c.get("trainjob", "before-upgrade", NS)) == admitted
    c.kubectl("delete", "trainjob", "before-upgrade", "after-upgrade", "-n", NS)


def settings_valid(pod: dict) -> float:
    with urllib.request.urlopen(f"http://{pod_ip(pod)}:8080/metrics", timeout=10) as r:
        text = r.read().decode()
    return float(re.search(r"^dispatch_admission_settings_valid(?:\{[^}]*\})? (\S+)$", text, re.M).group(1))


def test_a_settings_configmap_edited_to_invalid_json_fails_no_create(inst):
    """SPEC 2.1: a bad edit is not taken; every replica keeps its last good settings, stays ready and reads 0."""
    c = inst.cluster
    cm = f"{FULL}-settings"
    good = c.get("configmap", cm, RNS)["data"]["settings.json"]
    load = Load(c, "invalid-edit").start()
    try:
        load.wait_creates(10)
        began = load.now()
        c.kubectl("patch", "configmap", cm, "-n", RNS, "--type=merge", "-p",
                  json.dumps({"data": {"settings.json": "{not json"}}))
        eventually(lambda: all(settings_valid(p) == 0 for p in inst.ready_pods()),
                   "dispatch_admission_settings_valid read 0", 60, every=0.5)
        refused_in = load.now() - began
        load.wait_creates(20)
        assert len(inst.ready_pods()) == 2, "a replica stopped being ready"
        c.kubectl("patch", "configmap", cm, "-n", RNS, "--type=merge", "-p",
                  json.dumps({"data": {"settings.json": good}}))
        eventually(lambda: all(settings_valid(p) == 1 for p in inst.ready_pods()),
                   "dispatch_admission_settings_valid back to 1 after the fix", 60, every=0.5)
        load.wait_creates(10)
    finally:
        results = load.stop()
    figures = summarise(INVALID_EDIT, results, began, metric_zero_after_s=round(refused_in, 1))
    assert figures["failed"] == 0 and figures["unpatched"] == 0, figures["failures"]
    logs_ = c.kubectl("logs", "-n", RNS, "-l", SELECTOR, "--tail=400").stdout
    assert "settings refused: the last good settings stay in use" in logs_
    delete_load(c)


# ---- helm uninstall ----

# ---- memory: the chart's own limits under many runtimes and large reviews (issue 25, item 1) ----

HOSTILE_NS, TENANT = "tenant-a", "tenant-a"
HOSTILE_RUNTIMES = 100  # TrainingRuntimes near the object size limit, the three shapes in turn
HOSTILE_SECONDS = 180   # how long the flood pod sends
PATCHES_EVERY = 0.05    # seconds between two patches of one runtime (b)


def test_client_certificates_close_the_webhook_port_through_the_chart(inst):
    """Issue 47: `clientCA` set to the CA of the client certificate the API server presents to webhooks (its
    --admission-control-config-file kubeconfig: cluster.py gives every API server of the harness one, signed by the
    cluster CA). TrainJobs are still admitted through both pods; a client without that certificate (any pod, here
    the host) is refused at the handshake and never reaches a review."""
    c = inst.cluster
    # The subject the harness's API server presents (cluster.py); the chart serves only the subjects it lists.
    values = {**inst.values, "clientCA": {"pem": Path(c.ca_file).read_text(),
                                          "allowedSubjects": ["kube-apiserver-webhook-client"]}}
    inst.helm_run("upgrade", RELEASE, str(CHART), "--namespace", RNS, "--wait", "--timeout", "5m", values=values)
    try:
        pods = inst.wait_settled()
        load = Load(c, "client-ca", workers=2, limit=20).start()
        load.wait_creates(20)
        figures = summarise("client-ca", load.stop())
        assert figures["failed"] == 0 and figures["unpatched"] == 0, figures["failures"]
        ctx = ssl.create_default_context(cafile=c.ca_file)
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        for pod in pods:
            with pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError)):
                conn = http.client.HTTPSConnection(pod_ip(pod), 8443, context=ctx, timeout=10)
                try:
                    conn.request("POST", "/validate", body=b"{}", headers={"Content-Type": "application/json"})
                    conn.getresponse().read()
                finally:
                    conn.close()
    finally:
        inst.helm_run("upgrade", RELEASE, str(CHART), "--namespace", RNS, "--wait", "--timeout", "5m",
                      values=inst.values)
        inst.wait_settled()
        delete_load(c)


def metrics_token(inst) -> str:
    """A token allowed to get /metrics under metrics.auth: a ServiceAccount bound to <fullname>-metrics-reader."""
    c = inst.cluster
    c.kubectl("create", "serviceaccount", "e2e-scraper", "-n", RNS, check=False)
    c.kubectl("create", "clusterrolebinding", "e2e-scraper", f"--clusterrole={FULL}-metrics-reader",
              f"--serviceaccount={RNS}:e2e-scraper", check=False)
    return c.kubectl("create", "token", "e2e-scraper", "-n", RNS).stdout.strip()


def scrape(pod: dict, token: str) -> dict[tuple[str, tuple], float]:
    """A pod's /metrics under metrics.auth, parsed: (name, sorted labels) -> value."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    req = urllib.request.Request(f"https://{pod_ip(pod)}:8080/metrics", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=30, context=ctx) as got:
        return metric_table(got.read().decode())


def metrics_reader(inst):
    """Reads a pod's /metrics as the release serves it now: with the scraper's token under metrics.auth (the
    hostile tenant's test turns it on and leaves it on), in plain HTTP otherwise."""
    if inst.values.get("metrics", {}).get("auth"):
        token = metrics_token(inst)
        return lambda pod: scrape(pod, token)

    def plain(pod: dict) -> dict[tuple[str, tuple], float]:
        with urllib.request.urlopen(f"http://{pod_ip(pod)}:8080/metrics", timeout=30) as got:
            return metric_table(got.read().decode())
    return plain


def test_one_tenant_cannot_stop_admission(inst):
    """Issue 33's hostile tenant, with the chart's defaults and metrics.auth on. Tenant A, whose RBAC is only
    TrainingRuntimes and TrainJobs in its namespace, (a) creates 100 TrainingRuntimes near the object size limit
    (thousands of env entries; 1,990 long names; five thousand replicated jobs), (b) patches one of them in a loop,
    (c) floods the webhook's Service with AdmissionReviews naming random runtimes from a pod, (d) floods the
    metrics port with random bearer tokens. Meanwhile tenant B creates TrainJobs: none may fail, no container is
    OOM-killed, the serving containers never restart, the keeper stays under its limit, and the live reads stay
    under the pod's limit. This node's CNI (the bridge plugin) enforces no NetworkPolicy: the flood pod reaches the
    webhook port, which a cluster with the chart's NetworkPolicy and apiServerCIDRs set would close to it."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.e2e import hostile

    c = inst.cluster
    values = {**inst.values, "metrics": {"auth": True}}
    inst.helm_run("upgrade", RELEASE, str(CHART), "--namespace", RNS, "--wait", "--timeout", "5m", values=values)
    # Kept for the tests after this one (metrics_reader reads it): no upgrade back to the defaults at the end, a rollout
    # whose new pods would first list the tenant's 100 MB of runtimes, not yet deleted (owed to the node).
    inst.values = values
    stopped = threading.Event()
    try:
        pods = inst.wait_settled()
        names = [p["metadata"]["name"] for p in pods]
        token = metrics_token(inst)
        c.kubectl("create", "namespace", HOSTILE_NS)
        for doc in hostile.tenant_rbac(HOSTILE_NS, TENANT):
            c.apply(doc)
        cgroups = {f"{n}/{ctr}": memory_cgroup(inst, n, ctr) for n in names for ctr in ("webhook", "runtime-keeper")}
        peaks = MemoryPeaks(cgroups)
        before = {n: scrape(p, token) for n, p in zip(names, pods, strict=True)}
        service = c.get("service", FULL, RNS)["spec"]["clusterIP"]
        path = f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{HOSTILE_NS}/trainingruntimes"
        created: list[int] = []

        def create(i: int) -> None:
            shape = hostile.SHAPES[i % len(hostile.SHAPES)]
            doc = hostile.large_runtime(shape, f"big-{shape}-{i:03d}", HOSTILE_NS)
            status, got = sent_again(lambda: Api(c, timeout=120, impersonate=TENANT).request("POST", path, doc))
            assert status in (201, 409), (status, str(got)[:300])
            created.append(i)

        patches = [0]

        def patch_loop() -> None:
            api = Api(c, timeout=60, impersonate=TENANT)
            while not stopped.is_set():
                status, _ = api.request("PATCH", f"{path}/small", {"metadata": {"annotations": {"n": str(patches[0])}}})
                assert status == 200, status
                patches[0] += 1
                stopped.wait(PATCHES_EVERY)

        status, got = Api(c, impersonate=TENANT).request("POST", path, hostile.large_runtime("env", "small", HOSTILE_NS,
                                                                                              size=2000))
        assert status == 201, got
        denied, _ = Api(c, impersonate=TENANT).request("POST", RUNTIMES_PATH, big_runtime(0))
        assert denied == 403, "tenant A may not create ClusterTrainingRuntimes"
        load = Load(c, "hostile", workers=2, interval=1.0, limit=100_000)
        began = time.monotonic()
        with peaks:
            load.start()
            patcher = threading.Thread(target=patch_loop, daemon=True)
            patcher.start()
            c.apply(hostile.flood_pod(HOSTILE_NS, inst.image, f"{service}:443",
                                      f"{pod_ip(pods[0])}:8080", HOSTILE_SECONDS))
            with ThreadPoolExecutor(2) as pool:
                list(pool.map(create, range(HOSTILE_RUNTIMES)))
            created_in = time.monotonic() - began
            eventually(lambda: c.get("pod", "flood", HOSTILE_NS)["status"].get("phase") in ("Succeeded", "Failed"),
                       "the flood pod ends", timeout=HOSTILE_SECONDS + 240, every=2)
            flood_seconds = time.monotonic() - began
            stopped.set()
            patcher.join(30)
            results = load.stop()
        flood_ended = time.monotonic()
        eventually(lambda: all(table_total(scrape(p, token), "dispatch_admission_runtime_cache_size",
                                           kind="TrainingRuntime") > HOSTILE_RUNTIMES for p in pods),
                   "each keeper's watch brings every runtime", timeout=180, every=5)
        caught_up = time.monotonic() - flood_ended
        after = {n: scrape(p, token) for n, p in zip(names, inst.pods(), strict=False)}
        flood = json.loads(c.kubectl("logs", "flood", "-n", HOSTILE_NS).stdout.strip().splitlines()[-1])
        figures = summarise("hostile", results)
        report = {"tenant B creates": figures["creates"], "failed": figures["failed"], "p50 ms": figures["p50_ms"],
                  "p99 ms": figures["p99_ms"], "runtimes created": len(created),
                  "runtimes created in s": round(created_in), "caches complete s after the flood": round(caught_up),
                  "patches": patches[0], "flood": flood, "pods": {}}
        for n, pod in zip(names, inst.pods(), strict=False):
            statuses = {s["name"]: s for s in pod["status"].get("containerStatuses", []) +
                        pod["status"].get("initContainerStatuses", [])}
            gets = table_total(after[n], "dispatch_admission_api_requests_total", verb="get") - \
                table_total(before[n], "dispatch_admission_api_requests_total", verb="get")
            oom = {ctr: dict(line.split() for line in (cgroups[f"{n}/{ctr}"] / "memory.oom_control").read_text()
                             .splitlines())["oom_kill"] for ctr in ("webhook", "runtime-keeper")}
            report["pods"][n] = {
                "serving restarts": statuses["webhook"]["restartCount"],
                "keeper restarts": statuses["runtime-keeper"]["restartCount"],
                "oom kills": oom,
                "keeper peak working set MiB": round(peaks.peaks[f"{n}/runtime-keeper"]["working set"]),
                "keeper limit MiB": round(peaks.limits[f"{n}/runtime-keeper"]),
                "webhook peak working set MiB": round(peaks.peaks[f"{n}/webhook"]["working set"]),
                "webhook limit MiB": round(peaks.limits[f"{n}/webhook"]),
                "store MiB": round(table_total(after[n], "dispatch_admission_runtime_store_bytes") / 2**20, 1),
                "live GETs/s": round(gets / flood_seconds, 2),
                "live reads": {ls[0][1]: v for (name, ls), v in after[n].items()
                               if name == "dispatch_admission_runtime_live_reads_total"},
                "cache size": {ls[0][1]: v for (name, ls), v in after[n].items()
                               if name == "dispatch_admission_runtime_cache_size"}}
        print(f"\nhostile tenant: {json.dumps(report, indent=1)}")
        assert figures["failed"] == 0 and figures["unpatched"] == 0, figures["failures"]
        limit = values.get("runtimeKeeper", {}).get("liveReads", {}).get("perSecond", 10)
        for got in report["pods"].values():
            assert got["serving restarts"] == 0 and got["oom kills"] == {"webhook": "0", "runtime-keeper": "0"}, got
            assert got["keeper peak working set MiB"] < got["keeper limit MiB"], got
            # a bucket per namespace (issue 47): the flood names TrainingRuntimes of tenant-a and cluster runtimes,
            # two buckets of `limit` a second each (tenant B's TrainJobs name a runtime the store holds: no read)
            assert got["live GETs/s"] <= 2 * limit * 1.2, got
            assert got["cache size"].get("TrainingRuntime", 0) > HOSTILE_RUNTIMES, got  # with "small"
        answered = {k: v for k, v in flood.items() if k.startswith("review 200")}
        assert sum(answered.values()) > 1000 and set(answered) <= {"review 200 404", "review 200 503"}, flood
    finally:
        stopped.set()
        delete_load(c, timeout=600)
        # This node's API server takes ~1 min to drop 100 runtimes of 1 MB (overlapping it with the rollback
        # overloaded it: kubectl timed out, 2026-12-04): owed to the node's next suite, if any. The tests after
        # this one here run beside the namespace, its runtimes and its finished flood pod.
        inst.nc.owe(f"namespace {HOSTILE_NS} deleted", lambda: c.kubectl(
            "delete", "namespace", HOSTILE_NS, "--wait=true", "--timeout=600s", check=False, timeout=620))


VOLUME_RUNTIMES = 1500    # TrainingRuntimes at the per-runtime byte cap, in one namespace (some 140 MB of JSON)
VOLUME_SECONDS = 30       # each attack alone
TOGETHER_SECONDS = 45     # all of them at once
DRY_RUN_RATE = 100        # dry-run creates a second naming random runtimes (d)
CUT_OFF = "it has not read its answers for"  # the serving log's line for a client cut off


def kill_keepers(inst, names: list[str], reader) -> dict[str, float]:
    """SIGKILL each pod's keeper process in turn (the kubelet restarts the container: a forced restart), and the
    seconds until its new keeper has listed every runtime again (its TrainingRuntimes' last sync after the kill)
    before the next pod's: the other pod serves meanwhile, as during a rollout or a node's trouble."""
    import signal as signals

    def relisted(n: str, killed: float) -> bool:
        with contextlib.suppress(OSError, KeyError, ValueError, StopIteration):
            pod = next(p for p in inst.pods() if p["metadata"]["name"] == n)
            last = table_total(reader(pod), "dispatch_admission_runtime_cache_last_sync_timestamp_seconds",
                         kind="TrainingRuntime")
            return last > killed
        return False

    back = {}
    for n in names:
        pid = container_pid(inst, n, "runtime-keeper")
        killed = time.time()
        os.kill(pid, signals.SIGKILL)
        eventually(lambda n=n, killed=killed: relisted(n, killed), f"{n}'s keeper listed again after its kill",
                   timeout=300, every=0.5)
        back[n] = round(time.time() - killed, 1)
    return back


def pod_output(c: ControlPlane, name: str, namespace: str, timeout: float) -> object:
    """The last line of a script pod's log, as JSON, once it has ended."""
    eventually(lambda: (c.get("pod", name, namespace) or {}).get("status", {}).get("phase") in ("Succeeded", "Failed"),
               f"pod {name} ends", timeout=timeout, every=1)
    return json.loads(c.kubectl("logs", name, "-n", namespace).stdout.strip().splitlines()[-1])


class DryRuns:
    """Tenant A's dry-run creates of TrainJobs naming random runtimes, RATE a second through the API server (as the
    tenant), counted by status and by the sentinel of our webhook's answer."""

    def __init__(self, c: ControlPlane, rate: float = DRY_RUN_RATE, threads: int = 8):
        self.c, self.rate, self.threads = c, rate, threads
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()

    def run(self, seconds: float) -> dict[str, int]:
        from concurrent.futures import ThreadPoolExecutor

        path = f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{HOSTILE_NS}/trainjobs?dryRun=All"
        end, every = time.monotonic() + seconds, self.threads / self.rate

        def one(k: int) -> None:
            api, i = Api(self.c, timeout=30, impersonate=TENANT), 0
            try:
                while time.monotonic() < end:
                    began = time.monotonic()
                    doc = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
                           "metadata": {"name": f"dry-{k}-{i}", "namespace": HOSTILE_NS},
                           "spec": {"runtimeRef": {"name": f"random-{k}-{i}-{time.monotonic_ns()}",
                                                   "kind": "TrainingRuntime"}}}
                    i += 1
                    try:
                        status, got = api.request("POST", path, doc)
                        sentinel = re.search(r"\bErr[A-Z][A-Za-z]+", str(got.get("message", "")))
                        key = f"{status} {sentinel.group(0) if sentinel else str(got.get('message', ''))[:60]}"
                    except (OSError, http.client.HTTPException) as e:
                        api.close()
                        key = f"client {type(e).__name__}"
                    with self.lock:
                        self.counts[key] = self.counts.get(key, 0) + 1
                    time.sleep(max(0.0, every - (time.monotonic() - began)))  # paces the flood: not a wait
            finally:
                api.close()

        with ThreadPoolExecutor(self.threads) as pool:
            list(pool.map(one, range(self.threads)))
        return dict(self.counts)


def test_hostile_tenant_at_volume(inst):
    """Issue 47's tenant at volume, beside issue 33's (above). Tenant A, with RBAC for TrainingRuntimes and TrainJobs
    in its namespace only, in turn and then all at once: (a) creates 1,500 TrainingRuntimes at the per-runtime byte
    cap in its namespace, then every keeper is killed so it lists them all again; (b) runs a pod that pipelines
    /mutate reviews (each answer some 78 KB) to the webhook's Service and never reads; (c) runs a pod that posts
    bodies of nested lists at the size limit; (d) makes dry-run creates naming random runtimes at 100/s. Tenant B
    creates TrainJobs throughout: none may fail; no container is OOM-killed; only the forced keeper restarts; each
    container stays under its limit; A gets the documented answers (the namespace's share: R5's 403 naming its size
    and the share; a client that does not read: cut off, logged; nested bodies: 413; dry runs: ErrNotFound, or
    ErrUnavailable once its namespace's live reads are spent)."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.e2e import hostile

    c = inst.cluster
    pods = inst.wait_settled()
    names = [p["metadata"]["name"] for p in pods]
    reader = metrics_reader(inst)
    ensure_namespaces(c, HOSTILE_NS)
    for doc in hostile.tenant_rbac(HOSTILE_NS, TENANT):
        c.apply(doc)
    path = f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{HOSTILE_NS}/trainingruntimes"
    service = f"{c.get('service', FULL, RNS)['spec']['clusterIP']}:443"
    cut_before = sum(c.kubectl("logs", "-n", RNS, n, "-c", "webhook").stdout.count(CUT_OFF) for n in names)
    status, got = Api(c, impersonate=TENANT).request("POST", path, hostile.wide_runtime("a-wide", HOSTILE_NS))
    assert status in (201, 409), got

    def create(i: int) -> None:
        api = Api(c, timeout=120, impersonate=TENANT)
        try:
            status, got = sent_again(lambda: api.request("POST", path, hostile.runtime_at_cap(f"cap-{i:04d}",
                                                                                                  HOSTILE_NS)))
            assert status in (201, 409), (status, str(got)[:300])
        finally:
            api.close()

    def pod(name: str, script: str, seconds: int, **env: str) -> dict:
        return hostile.script_pod(name, HOSTILE_NS, inst.image, script,
                                  {"TARGET": service, "SECONDS": str(seconds), **env})

    def pipeline(name: str, seconds: int) -> dict:
        return pod(name, hostile.PIPELINE, seconds, COUNT="3000", RUNTIME="a-wide", NAMESPACE=HOSTILE_NS,
                   CONNECTIONS="8")

    def nested(name: str, seconds: int) -> dict:
        return pod(name, hostile.NESTED, seconds, BYTES=str(7 * 1024 * 1024 - 1024), THREADS="2")

    containers = ("webhook", "runtime-keeper")
    peaks = MemoryPeaks({f"{n}/{ctr}": memory_cgroup(inst, n, ctr) for n in names for ctr in containers},
                        resolve=lambda key: memory_cgroup(inst, *key.split("/")))
    load = Load(c, "volume", workers=2, interval=1.0, limit=100_000)
    report: dict = {}
    try:
        with peaks:
            load.start()
            began = time.monotonic()
            with ThreadPoolExecutor(4) as pool:  # (a)
                list(pool.map(create, range(VOLUME_RUNTIMES)))
            report["runtimes created in s"] = round(time.monotonic() - began)
            report["keepers back after a kill, s"] = kill_keepers(inst, names, reader)
            c.apply(pipeline("pipeline", VOLUME_SECONDS))  # (b)
            report["pipeline"] = pod_output(c, "pipeline", HOSTILE_NS, VOLUME_SECONDS + 120)
            c.apply(nested("nested", VOLUME_SECONDS))  # (c)
            report["nested"] = pod_output(c, "nested", HOSTILE_NS, VOLUME_SECONDS + 120)
            report["dry runs"] = DryRuns(c).run(VOLUME_SECONDS)  # (d)
            c.apply(pipeline("pipeline-all", TOGETHER_SECONDS))  # all at once
            c.apply(nested("nested-all", TOGETHER_SECONDS))
            with ThreadPoolExecutor(1) as pool:
                flood = pool.submit(DryRuns(c).run, TOGETHER_SECONDS)
                report["keepers back after a kill under the flood, s"] = kill_keepers(inst, names, reader)
                report["dry runs all at once"] = flood.result()
            report["pipeline all at once"] = pod_output(c, "pipeline-all", HOSTILE_NS, TOGETHER_SECONDS + 120)
            report["nested all at once"] = pod_output(c, "nested-all", HOSTILE_NS, TOGETHER_SECONDS + 120)
            results = load.stop()
        status, over = Api(c, impersonate=TENANT).request(
            "POST", f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{HOSTILE_NS}/trainjobs?dryRun=All",
            {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
             "metadata": {"name": "over", "namespace": HOSTILE_NS},
             "spec": {"runtimeRef": {"name": f"cap-{VOLUME_RUNTIMES - 1:04d}", "kind": "TrainingRuntime"}}})
        report["over the share"] = f"{status} {over.get('message', '')[:400]}"
        figures = summarise("tenant at volume", results)
        report.update({"tenant B creates": figures["creates"], "failed": figures["failed"],
                       "p50 ms": figures["p50_ms"], "p99 ms": figures["p99_ms"]})
        logs_ = {n: c.kubectl("logs", "-n", RNS, n, "-c", "webhook").stdout for n in names}
        report["clients cut off (log lines)"] = sum(t.count(CUT_OFF) for t in logs_.values()) - cut_before
        report["pods"] = {}
        for p in inst.pods():
            statuses = {st["name"]: st for st in p["status"].get("containerStatuses", []) +
                        p["status"].get("initContainerStatuses", [])}  # the keeper is a native sidecar
            n = p["metadata"]["name"]
            report["pods"][n] = {ctr: {
                "restarts": statuses[ctr]["restartCount"],
                "last end": (statuses[ctr].get("lastState", {}).get("terminated") or {}).get("reason", ""),
                "peak working set MiB": round(peaks.peaks[f"{n}/{ctr}"]["working set"]),
                "limit MiB": round(peaks.limits[f"{n}/{ctr}"])} for ctr in containers}
        print(f"\nhostile tenant at volume: {json.dumps(report, indent=1)}")
        assert figures["failed"] == 0 and figures["unpatched"] == 0, figures["failures"]
        for n, got in report["pods"].items():
            assert got["webhook"]["restarts"] == 0, (n, got)
            assert got["runtime-keeper"]["restarts"] == 2, (n, got)  # the two kills, no other
            assert "OOMKilled" not in (got["webhook"]["last end"], got["runtime-keeper"]["last end"]), (n, got)
            for ctr in containers:
                assert got[ctr]["peak working set MiB"] < got[ctr]["limit MiB"], (n, ctr, got)
        assert status == 403 and "ErrUnsupported" in over["message"], report["over the share"]
        assert f"its namespace {HOSTILE_NS} holds" in over["message"] and "share of" in over["message"], over
        assert report["clients cut off (log lines)"] >= 1, report
        for key in ("pipeline", "pipeline all at once"):
            assert report[key] and all(conn["ended"] != "held" for conn in report[key]), report[key]
        for key in ("nested", "nested all at once"):
            assert report[key] and set(report[key]) <= {"flat 413", "deep 413"}, report[key]
        for key in ("dry runs", "dry runs all at once"):
            answered = {k: v for k, v in report[key].items() if not k.startswith(("429", "client", "504"))}
            assert answered and set(answered) <= {"404 ErrNotFound", "503 ErrUnavailable"}, report[key]
    finally:
        load.stop()
        delete_load(c, timeout=600)
        # Deleted here, not owed to the node: with 1,600 runtimes (some 240 MB) still stored, this 2-core node's API
        # server timed out the memory test's creates (504) and the uninstall's pods outlived its wait (2026-12-06).
        # The hostile test's deletion, owed before, then finds nothing to delete.
        started = time.monotonic()
        c.kubectl("delete", "namespace", HOSTILE_NS, "--wait=true", "--timeout=600s", check=False, timeout=620)
        print(f"\nnamespace {HOSTILE_NS} deleted in {time.monotonic() - started:.0f}s")


MEMORY_RUNTIMES = 10_000  # ordinary runtimes, copies of the example torch runtime
MEMORY_BIG = 500          # runtimes near the size cap (webhook.core.runtimes.MAX_NAMES names)
MEMORY_REVIEWS = 32       # reviews of REVIEW_BYTES sent at once, shared between the pods
REVIEW_BYTES = 7 * 1024 * 1024 - 4096  # just under serve's --max-body (7 MiB)


def big_runtime(i: int) -> dict:
    """A runtime just under the size cap: one job whose pod has ~995 volumes and as many mounts (about
    1,991 names of 60 characters: some 200 KiB of JSON), none at /opt/dispatch."""
    from webhook.core.runtimes import MAX_NAMES

    n = (MAX_NAMES - 10) // 2
    volumes = [{"name": f"v{j:05d}-" + "x" * 53, "emptyDir": {}} for j in range(n)]
    mounts = [{"name": v["name"], "mountPath": f"/data/{v['name']}"} for v in volumes]
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "ClusterTrainingRuntime",
            "metadata": {"name": f"mem-big-{i}"},
            "spec": {"mlPolicy": {"numNodes": 1, "torch": {}}, "template": {"spec": {"replicatedJobs": [
                {"name": "node", "replicas": 1, "template": {"spec": {"template": {"spec": {
                    "containers": [{"name": "node", "image": "pytorch", "volumeMounts": mounts}],
                    "volumes": volumes}}}}}]}}}}


RUNTIMES_PATH = "/apis/trainer.kubeflow.org/v1alpha1/clustertrainingruntimes"


def each_runtime(c: ControlPlane, method: str, items, ok: tuple[int, ...]) -> None:
    """POST each runtime doc, or DELETE each runtime name, 12 at a time (one connection per thread)."""
    from concurrent.futures import ThreadPoolExecutor

    local = threading.local()

    def one(item) -> None:
        api = getattr(local, "api", None) or Api(c, timeout=120)
        local.api = api
        path, body = (RUNTIMES_PATH, item) if method == "POST" else (f"{RUNTIMES_PATH}/{item}", None)
        # (a create that went through after its 504: 409, ok)
        status, got = sent_again(lambda: api.request(method, path, body), transient=(429, 504), timeout=300)
        assert status in ok, (method, path, status, str(got)[:300])

    with ThreadPoolExecutor(12) as pool:
        list(pool.map(one, items))


def memory_cgroup(inst, pod: str, container: str = "webhook") -> Path:
    """A container's memory cgroup (cgroup v1 on this node)."""
    pid = container_pid(inst, pod, container)
    line = next(ln for ln in Path(f"/proc/{pid}/cgroup").read_text().splitlines() if ":memory:" in ln)
    return Path("/sys/fs/cgroup/memory") / line.split(":", 2)[2].lstrip("/")


class MemoryPeaks:
    """Samples containers' memory cgroups every 0.2 s: the peaks of their working set (usage less inactive
    page cache, what the kubelet reports and evicts on) and of their anonymous memory (rss: what only the
    OOM killer can take back), in MiB. The kernel's own max_usage_in_bytes counts page cache the kernel
    reclaims at the limit (the runtime store's file among it), so it reaches the limit without any danger."""

    def __init__(self, cgroups: dict[str, Path], resolve: Callable[[str], Path] | None = None):
        """`resolve(name)`: the cgroup of `name` again, for containers that restart meanwhile (a new cgroup)."""
        self.cgroups, self.resolve = cgroups, resolve
        self.peaks = {n: {"working set": 0.0, "rss": 0.0} for n in cgroups}
        self.limits = {n: int((c / "memory.limit_in_bytes").read_text()) / 2**20 for n, c in cgroups.items()}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        for name in list(self.cgroups):
            cgroup = self.cgroups[name]
            if self.resolve is not None and not cgroup.exists():
                with contextlib.suppress(Exception):
                    self.cgroups[name] = cgroup = self.resolve(name)
            stat = dict(line.split() for line in (cgroup / "memory.stat").read_text().splitlines())
            usage = int((cgroup / "memory.usage_in_bytes").read_text())
            now = {"working set": (usage - int(stat["total_inactive_file"])) / 2**20,
                   "rss": int(stat["total_rss"]) / 2**20}
            for k, v in now.items():
                self.peaks[name][k] = max(self.peaks[name][k], v)

    def _run(self) -> None:
        while not self.stop.wait(0.2):
            with contextlib.suppress(OSError):
                self.sample()

    def __enter__(self):
        self.sample()
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.sample()


def large_review(i: int) -> bytes:
    from tests.helpers import review as make_review
    from tests.helpers import trainjob as make_trainjob

    body = make_review(make_trainjob(f"large-{i}", namespace=NS), uid=f"large-{i}")
    raw = json.dumps(body).encode()
    body["request"]["object"]["metadata"]["annotations"] = {"pad": "x" * (REVIEW_BYTES - len(raw) - 32)}
    return json.dumps(body).encode()


def post_review(host: str, ca: bytes, body: bytes) -> int:
    ctx = ssl.create_default_context(cadata=ca.decode())
    conn = http.client.HTTPSConnection(host, 8443, context=ctx, timeout=60)
    try:  # connected here: the address is the pod's, the name checked the Service's
        conn.sock = ctx.wrap_socket(socket.create_connection((host, 8443), timeout=60),
                                    server_hostname=f"{FULL}.{RNS}.svc")
        conn.request("POST", "/mutate", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def test_memory_under_ten_thousand_runtimes_and_large_reviews_stays_in_the_charts_limit(inst):
    """The chart's pods, with the chart's default limits and workers, under 10,000 runtimes of which 500
    are near the size cap, then 32 reviews of 7 MiB at once: no container is OOM-killed or restarted,
    every review is answered (200, or 429/503 where a worker's room for large bodies is full), and the peak
    memory of each webhook container is printed against its limit."""
    from concurrent.futures import ThreadPoolExecutor

    c = inst.cluster
    pods = inst.wait_settled()
    names = [p["metadata"]["name"] for p in pods]
    hosts, ca = [pod_ip(p) for p in pods], secret_files(c)["ca.crt"]
    peaks = MemoryPeaks({n: memory_cgroup(inst, n) for n in names})
    peaks.sample()
    idle = {n: dict(v) for n, v in peaks.peaks.items()}
    base = yaml.safe_load((EXAMPLES / "runtimes" / "torch-distributed.yaml").read_text())

    read = metrics_reader(inst)

    def cached(pod: dict) -> float:
        return table_total(read(pod), "dispatch_admission_runtime_cache_size", kind="ClusterTrainingRuntime")

    started = time.monotonic()
    try:
        with peaks:
            ordinary = []
            for i in range(MEMORY_RUNTIMES - MEMORY_BIG):
                doc = json.loads(json.dumps(base))
                doc["metadata"] = {"name": f"mem-rt-{i}"}
                ordinary.append(doc)
            each_runtime(c, "POST", ordinary, (201, 409))
            each_runtime(c, "POST", (big_runtime(i) for i in range(MEMORY_BIG)), (201, 409))
            created_in = time.monotonic() - started
            eventually(lambda: all(cached(p) >= MEMORY_RUNTIMES for p in pods),
                       "every pod's cache holds the runtimes", timeout=300, every=2)
            bodies = [large_review(i) for i in range(MEMORY_REVIEWS)]  # made first: sent at once, not as made
            with ThreadPoolExecutor(MEMORY_REVIEWS) as pool:
                statuses = list(pool.map(lambda i: post_review(hosts[i % len(hosts)], ca, bodies[i]),
                                         range(MEMORY_REVIEWS)))
            bodies.clear()
            small = [post_review(h, ca, json.dumps(review_of_runtime("mem-big-0")).encode()) for h in hosts]
        # 429: the worker's budget counts a body's parsed bound too (issue 47), and says "not now" when it is full
        assert all(s in (200, 429, 503) for s in statuses), statuses
        assert statuses.count(200) >= len(hosts), statuses  # each pod took at least one whole
        assert small == [200] * len(hosts), small
        for pod in inst.pods():
            for status in pod["status"]["containerStatuses"]:
                assert status["restartCount"] == 0, (pod["metadata"]["name"], status)
                assert "terminated" not in (status.get("lastState") or {}), (pod["metadata"]["name"], status)
        for n, cgroup in peaks.cgroups.items():  # a worker killed is replaced by the master: no restart shows it
            oom = dict(line.split() for line in (cgroup / "memory.oom_control").read_text().splitlines())
            assert oom["oom_kill"] == "0", (n, "a process of the container was OOM-killed", peaks.peaks[n])
        figures = {n: {"idle working set MiB": round(idle[n]["working set"]), "idle rss MiB": round(idle[n]["rss"]),
                       "peak working set MiB": round(peaks.peaks[n]["working set"]),
                       "peak rss MiB": round(peaks.peaks[n]["rss"]),
                       "limit MiB": round(peaks.limits[n])} for n in names}
        print(f"\nmemory per webhook container: {json.dumps(figures)}; answers {sorted(statuses)}; runtimes created in"
              f" {created_in:.0f}s")  # not in FIGURES: that is the rollout phases' table
        for n in names:
            assert peaks.peaks[n]["working set"] < peaks.limits[n], (n, figures[n])
    finally:  # owed to the node's next suite, if any (~1 min); the uninstall test here runs beside them.
        # One by one: a delete of the whole collection outlasts the API server's request timeout.
        inst.nc.owe(f"the memory test's {MEMORY_RUNTIMES} ClusterTrainingRuntimes deleted", lambda: each_runtime(
            c, "DELETE", [f"mem-rt-{i}" for i in range(MEMORY_RUNTIMES - MEMORY_BIG)]
            + [f"mem-big-{i}" for i in range(MEMORY_BIG)], (200, 202, 404)))


def review_of_runtime(name: str) -> dict:
    from tests.helpers import review as make_review
    from tests.helpers import trainjob as make_trainjob

    return make_review(make_trainjob("small", namespace=NS, runtime_name=name))


def test_uninstall_removes_the_configurations_first_blocks_no_trainjob_and_install_works_again(inst):
    c = inst.cluster
    paths = {
        "ValidatingWebhookConfiguration":
            f"/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{FULL}",
        "ValidatingWebhookConfiguration runtimes":
            f"/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{FULL}-runtimes",
        "MutatingWebhookConfiguration": f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{FULL}",
        "Deployment": f"/apis/apps/v1/namespaces/{RNS}/deployments/{FULL}",
        "Service": f"/api/v1/namespaces/{RNS}/services/{FULL}",
        "webhook pods": f"/api/v1/namespaces/{RNS}/pods?labelSelector={SELECTOR.replace('=', '%3D')}",
    }
    gone: dict[str, float] = {}
    done = threading.Event()
    load = Load(c, "uninstall").start()

    def watch():  # times when each object goes (the figures): not a wait
        api = Api(c)
        try:
            while not done.is_set() and len(gone) < len(paths):
                for what, path in paths.items():
                    if what in gone:
                        continue
                    status, body = api.request("GET", path)
                    if status == 404 or (what == "webhook pods" and status == 200 and not body["items"]):
                        gone[what] = load.now()
                time.sleep(0.1)
        finally:
            api.close()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        load.wait_creates(10)
        began = load.now()
        got = inst.helm_run("uninstall", RELEASE, "-n", RNS, "--wait", "--timeout", "5m")
        took = load.now() - began

        def pods_gone() -> bool:  # the pods go after their Deployment, each draining first
            if "webhook pods" in gone:
                return True  # the watcher ends once all it watches are gone
            assert watcher.is_alive(), f"the watcher stopped: {gone}"
            return False

        eventually(pods_gone, "the webhook pods gone", 120, every=0.5, detail=lambda: json.dumps(gone))
        load.wait_creates(20)
    finally:
        done.set()
        results = load.stop()
        watcher.join(10)
    print(got.stdout, got.stderr)
    print({k: round(v - began, 2) for k, v in sorted(gone.items(), key=lambda kv: kv[1])})
    assert set(gone) == set(paths), f"still there after helm uninstall: {set(paths) - set(gone)}"
    last_configuration = max(gone[k] for k in paths if "Configuration" in k)
    assert last_configuration < gone["Deployment"] and last_configuration < gone["Service"], gone
    assert last_configuration < gone["webhook pods"], "no moment with a configuration and no pod"
    figures = summarise("helm uninstall", results, began, uninstall_s=round(took, 1))
    assert figures["failed"] == 0, figures["failures"]
    assert not any("failed calling webhook" in f for f in figures["failures"])
    # (the API server's own view of the configurations trails the deletion by its informer's lag: a margin)
    after = [r for r in results if r.started > last_configuration + 2]
    assert after and not any(r.patched for r in after), "after the hook, nothing calls the webhook"
    # The pre-delete hook ran as a real pod: the Job controller made it, the kubelet started it.
    events = json.loads(c.kubectl("get", "events", "-n", RNS, "-o", "json").stdout)["items"]
    hook_pod = [e for e in events if e["involvedObject"]["kind"] == "Pod"
                and e["involvedObject"]["name"].startswith(f"{FULL}-pre-delete-")]
    reasons = {e["reason"] for e in hook_pod}
    assert {"Scheduled", "Started"} <= reasons, [(e["reason"], e["message"]) for e in hook_pod]
    job_events = {e["reason"] for e in events if e["involvedObject"]["kind"] == "Job"
                  and e["involvedObject"]["name"] == f"{FULL}-pre-delete"}
    assert "Completed" in job_events, job_events
    # And afterwards: a TrainJob is admitted, without our entry.
    got = c.apply(trainjob("after-uninstall", "torch-distributed", suspend=True))
    assert "created" in got.stdout
    assert entry(c.get("trainjob", "after-uninstall", NS)) is None
    c.kubectl("delete", "trainjob", "after-uninstall", "-n", NS)
    delete_load(c)
    # Installed again over what the uninstall left (the certificate Secret, the hook's objects): it serves again, and
    # the module's release is back for any test after this one.
    inst.install()
    got = c.apply(trainjob("after-reinstall", "torch-distributed", suspend=True))
    assert "created" in got.stdout and entry(c.get("trainjob", "after-reinstall", NS)) is not None
    c.kubectl("delete", "trainjob", "after-reinstall", "-n", NS)
