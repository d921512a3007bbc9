"""Issue 23 (SPEC 9): `dispatch-admission verify` on the real one-node cluster (conftest.py's `node_env`: the
shared node, Trainer, our webhook as two processes chosen by the label `dispatch-e2e/route`).

Each test reads the stage and the cluster's message from the report, not only the exit code. To keep the wall
time short, the probes that need nothing of their own run at once (the module fixture `batch`); those that
swap the webhook configurations, and the signal ones, run after, one at a time, with short timeouts.
The route-1 probe runs as a user holding only the RBAC docs/verify.md names.

Issue 35: what holds a probe back is named in the kubelet's and the scheduler's words, and verify fails at
once when waiting cannot help (each such probe is given --timeout 240 and must end long before); a
credential's Secret missing from the namespace refuses the run before any probe; the probes carry a TTL that
`verify --cleanup` and the next verify honour, and are deleted with their UID as a precondition.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from tests.e2e.cluster import LOGS
from tests.e2e.node import identity, kubeconfig_for
from tests.e2e.node_env import NS, kube, node_pod
from tests.e2e.webhooks import ROUTE_LABEL, Webhook, webhooks_swapped
from tests.helpers import MANAGER, ROOT
from tests.process import eventually, webhook_server
from webhook.inspection.verify_probe import PROBE_LABEL, TTL_ANNOTATION, VERIFY_MANAGER, probe_trainjob

TOO_BIG = "torch-too-big"
NEEDS_CONFIG = "torch-needs-config"  # mounts a ConfigMap that no namespace has
WAITS_FOR_CLAIM = "torch-waits-for-claim"  # mounts a claim that stays Pending (no class, no volume)
USER_NS, OTHER_NS = NS, "team-q"  # OTHER_NS has no credentials Secret
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
BATCH_FAST = 90  # the batch's processes start at once and contend: well short of --timeout 240 all the same
FAST = 20  # seconds, from the start of the process (alone on the node): what waiting cannot help ends in this

# The RBAC a user of verify needs (docs/verify.md), given to the user `verifier`.
USER_RULES_NS = [
    {"apiGroups": ["trainer.kubeflow.org"], "resources": ["trainjobs"],
     "verbs": ["create", "get", "list", "delete", "watch"]},
    {"apiGroups": ["trainer.kubeflow.org"], "resources": ["trainingruntimes"], "verbs": ["get"]},
    {"apiGroups": [""], "resources": ["pods", "events"], "verbs": ["get", "list"]},
    {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
    {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["s3-credentials"], "verbs": ["get"]},
]
USER_RULES_CLUSTER = [
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list"]},
    {"apiGroups": ["trainer.kubeflow.org"], "resources": ["clustertrainingruntimes"], "verbs": ["get"]},
]


@dataclass
class Run:
    args: list[str]
    code: int
    out: str
    err: str
    seconds: float  # from the start to the end seen (an upper bound in the batch, read in order)

    def json(self) -> list[dict]:
        return json.loads(self.out)


def verify_cmd(kubeconfig: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "webhook", "verify", "--kubeconfig", kubeconfig, *args]


def start(kubeconfig: str, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen(verify_cmd(kubeconfig, *args), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    proc.started = time.monotonic()  # type: ignore[attr-defined]
    return proc


def finish(proc: subprocess.Popen, timeout: float = 400) -> Run:
    out, err = proc.communicate(timeout=timeout)
    run = Run(proc.args, proc.returncode, out, err, time.monotonic() - proc.started)  # type: ignore[attr-defined]
    print(f"\n$ dispatch-admission {' '.join(proc.args[3:])}\n{out}{err}(exit {proc.returncode}, {run.seconds:.0f}s)")
    return run


def line_of(run: Run, probe_prefix: str = "verify-") -> str:
    return next(line for line in run.out.splitlines() if line.startswith(probe_prefix))


def torch_variant(node_env, name: str, **node_container) -> dict:
    """Trainer's torch runtime under another name; `volumes` go on the node pod, the rest on its container."""
    rt = json.loads(json.dumps(node_env.cluster.get("clustertrainingruntime", "torch-distributed")))
    rt["metadata"] = {"name": name}
    if "volumes" in node_container:
        node_pod(rt)["volumes"] = node_container.pop("volumes")
    node_pod(rt)["containers"][0].update(node_container)
    return rt


def too_big_runtime(node_env) -> dict:
    """A request no node has."""
    return torch_variant(node_env, TOO_BIG, resources={"requests": {"cpu": "64"}})


def needs_config_runtime(node_env) -> dict:
    """The node container mounts the ConfigMap `train-config` (in no namespace)."""
    return torch_variant(node_env, NEEDS_CONFIG,
                         volumes=[{"name": "train-config", "configMap": {"name": "train-config"}}],
                         volumeMounts=[{"name": "train-config", "mountPath": "/etc/train"}])


def waits_for_claim_runtime(node_env) -> dict:
    """The pods mount the claim `pending-claim`: no class, no volume, Pending for ever."""
    return torch_variant(node_env, WAITS_FOR_CLAIM,
                         volumes=[{"name": "data", "persistentVolumeClaim": {"claimName": "pending-claim"}}],
                         volumeMounts=[{"name": "data", "mountPath": "/data"}])


def user_kubeconfig(c, user: str = "verifier", namespace: str = USER_NS, rules_ns: list | None = None) -> str:
    cert, key = identity(c, user, user)
    for kind, doc_kind, ns, rules in (("Role", "RoleBinding", namespace, rules_ns or USER_RULES_NS),
                                      ("ClusterRole", "ClusterRoleBinding", None, USER_RULES_CLUSTER)):
        meta = {"name": f"dispatch-verify-{user}", **({"namespace": ns} if ns else {})}
        c.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": kind, "metadata": meta, "rules": rules})
        c.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": doc_kind, "metadata": meta,
                 "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": meta["name"]},
                 "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]})
    return kubeconfig_for(c, user, cert, key)


def left_behind(c) -> dict[str, list[str]]:
    """Every probe TrainJob, JobSet and pod in the cluster (by the label, and by the probes' JobSet names)."""
    k = kube(c)
    jobs = k.custom_list_all("trainer.kubeflow.org", "v1alpha1", "trainjobs", PROBE_LABEL)
    jobsets = k.custom_list_all("jobset.x-k8s.io", "v1alpha2", "jobsets")
    pods = k.pods_all(JOBSET_NAME)
    return {"trainjobs": [j["metadata"]["name"] for j in jobs],
            "jobsets": [j["metadata"]["name"] for j in jobsets if j["metadata"]["name"].startswith("verify-")
                        or PROBE_LABEL in (j["metadata"].get("labels") or {})],
            "pods": [p["metadata"]["name"] for p in pods if p["metadata"]["labels"][JOBSET_NAME].startswith("verify-")
                     or PROBE_LABEL in (p["metadata"].get("labels") or {})]}


def wait_nothing_left(c, timeout: float = 0) -> dict:
    """What is left behind once nothing is, or when `timeout` has passed (for the caller to compare)."""
    with contextlib.suppress(AssertionError):
        eventually(lambda: not any(left_behind(c).values()), "nothing left behind", timeout, every=0.5)
    return left_behind(c)


def wait_mutation(c, what: str, check) -> None:
    """Until the API server's view of the webhook configurations has caught up with a swap: a server-side
    dry-run create comes back as `check` wants (its informer trails the write by a moment)."""
    probe = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
             "metadata": {"name": "swap-check", "namespace": NS}, "spec": {"runtimeRef": {"name": "torch-distributed"}}}
    last: list = []

    def caught_up() -> bool:
        got = c.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", stdin=json.dumps(probe), check=False)
        last[:] = [got]
        return got.returncode == 0 and check(json.loads(got.stdout))

    eventually(caught_up, f"the webhook configurations {what}", 60, every=0.5,
               detail=lambda: f"{last[0].stdout[-2000:]}{last[0].stderr}")


def publish_image(job: dict) -> str | None:
    for e in job["spec"].get("runtimePatches") or []:
        if e["manager"] == MANAGER:
            return json.dumps(e).split('"reference": "')[1].split('"')[0]
    return None


@pytest.fixture(scope="module")
def batch(node_env):
    """The independent probes, all at once; their reports by name."""
    c, tmp = node_env.cluster, node_env.tmp
    for rt in (too_big_runtime(node_env), needs_config_runtime(node_env), waits_for_claim_runtime(node_env)):
        c.apply(rt)
    user = user_kubeconfig(c)
    # a user of team-q who may do all verify needs but read Secrets: the credential check cannot be made
    no_secrets = user_kubeconfig(c, "verifier-q", OTHER_NS, [r for r in USER_RULES_NS if r["resources"] != ["secrets"]])
    r1, r2 = str(tmp / "route1.json"), str(tmp / "route2.json")
    admin = c.kubeconfig
    route2 = f"{ROUTE_LABEL}=2"
    torch = "ClusterTrainingRuntime/torch-distributed"
    procs = {
        "secret-unreadable": start(no_secrets, "--runtime", torch, "--namespace", OTHER_NS, "--settings", r1,
                                   "--timeout", "240"),
        "configmap-missing": start(admin, "--runtime", f"ClusterTrainingRuntime/{NEEDS_CONFIG}", "--namespace", NS,
                                   "--settings", r1, "--timeout", "240"),
        "route1": start(user, "--runtime", "ClusterTrainingRuntime/torch-distributed", "--namespace", USER_NS,
                        "--settings", r1, "--timeout", "240"),
        "route2": start(admin, "--runtime", "ClusterTrainingRuntime/torch-init", "--namespace", NS, "--settings", r2,
                        "--label", route2, "--timeout", "240"),
        "route2-empty": start(admin, "--runtime", "ClusterTrainingRuntime/torch-init-copies-nothing", "--namespace", NS,
                              "--label", route2, "--timeout", "240"),
        "per-node": start(admin, "--runtime", "ClusterTrainingRuntime/torch-distributed", "--namespace", NS,
                          "--settings", r1, "--per-node", "--output", "json", "--keep", "--timeout", "240"),
        "missing": start(admin, "--runtime", "ClusterTrainingRuntime/no-such-runtime", "--namespace", NS),
        "forbidden": start(user, "--runtime", "ClusterTrainingRuntime/torch-distributed", "--namespace", OTHER_NS),
    }
    yield {name: finish(p) for name, p in procs.items()}


def test_route1_torch_runtime_ran_with_exit_code_and_output(batch):
    run = batch["route1"]
    assert run.code == 0, run.out + run.err
    line = line_of(run)
    assert line.split()[1:3] == ["dispatch-e2e-node", "ran"], line
    assert "ran, exit code 0" in line
    assert "output: publish ran from /opt/dispatch/publish | publish args: --help" in run.out
    assert "ok: node container mount: /opt/dispatch read-only" in run.out
    assert "ok: entry: as the settings produce it" in run.out
    assert "ok: image volume: 127.0.0.1:" in run.out and "/dispatch/publish@sha256:" in run.out
    assert run.out.splitlines()[-1].startswith("ok: 1 of 1 probes on ClusterTrainingRuntime/torch-distributed ran")


def test_route2_copying_init_container_ran(batch):
    run = batch["route2"]
    assert run.code == 0, run.out + run.err
    assert line_of(run).split()[2] == "ran"
    assert "output: publish ran from /opt/dispatch/publish" in run.out
    assert "ok: publish volume: emptyDir" in run.out and "ok: init container dispatch-publish mount" in run.out


def test_route2_init_container_copying_nothing_fails_started_with_the_route2_hint(batch):
    run = batch["route2-empty"]
    assert run.code == 1, run.out + run.err
    line = line_of(run)
    assert line.split()[2] == "pulled" and "FAILED at started: " in line, line
    assert "no such file or directory" in line and "/opt/dispatch/publish" in line
    assert "what to do: route 2: the init container copied nothing to /opt/dispatch" in run.out
    assert "(failed at: started)" in run.out.splitlines()[-1]


@pytest.fixture(scope="module")
def alone(batch, node_env):
    """The cases the issue times, one at a time after the batch (eight processes starting at once on two
    cores take 20 s to import their libraries): what waiting cannot help, with --timeout 240."""
    c, r1 = node_env.cluster, str(node_env.tmp / "route1.json")
    torch = "ClusterTrainingRuntime/torch-distributed"
    cases = {
        "secret-missing": (torch, OTHER_NS, "--settings", r1),
        "secret-missing-dry-run": (torch, OTHER_NS),
        "unschedulable": (f"ClusterTrainingRuntime/{TOO_BIG}", NS, "--settings", r1),
    }
    return {name: finish(start(c.kubeconfig, "--runtime", runtime, "--namespace", ns, *rest, "--timeout", "240"))
            for name, (runtime, ns, *rest) in cases.items()}


def test_unschedulable_runtime_fails_at_once_at_scheduled_with_the_scheduler_reason(alone):
    """64 CPUs on a node that has fewer: no pod finishing can make room (the scheduler says preemption is not
    helpful on every node), so verify does not sit out its --timeout."""
    run = alone["unschedulable"]
    assert run.code == 1, run.out + run.err
    line = line_of(run)
    assert line.split()[1:3] == ["-", "admitted"], line
    assert ("FAILED at scheduled: Unschedulable: 0/1 nodes are available: 1 Insufficient cpu. preemption: 0/1 nodes"
            " are available: 1 Preemption is not helpful for scheduling.") in line, line
    assert "what to do: no node can take the probe, however many other pods finish" in run.out
    assert run.seconds < FAST, run.seconds


def test_a_missing_credential_secret_refuses_the_run_at_once_naming_it_and_the_namespace(alone):
    """Issue 35: route-1 settings with a credential, a namespace without its Secret. With --settings the
    credentials are read from them; without, from a server-side dry run of the probe through the webhook."""
    for case in ("secret-missing", "secret-missing-dry-run"):
        run = alone[case]
        assert run.code == 2 and run.out == "" and run.err.count("\n") == 1, (case, run.err)
        assert run.err.startswith(f"dispatch-admission verify: Secret s3-credentials not found in namespace {OTHER_NS}:"
                                  " credential checkpoint-store of the webhook's settings mounts it in every TrainJob"
                                  " there"), (case, run.err)
        assert run.seconds < FAST, (case, run.seconds)


def test_a_secret_the_user_may_not_read_is_named_by_the_kubelet_at_once(batch):
    """The credential check needs `get` on the Secret; without it verify says so, makes the probe, and names
    the kubelet's FailedMount as the cause within seconds (before: `not pulled after 300s: ContainerCreating`)."""
    run = batch["secret-unreadable"]
    assert run.code == 1, run.out + run.err
    assert run.err.startswith(f"verify: cannot tell whether Secret s3-credentials (credential checkpoint-store) exists"
                              f" in namespace {OTHER_NS}: "), run.err
    line = line_of(run)
    assert line.split()[2] == "scheduled", line
    assert ('FAILED at pulled: MountVolume.SetUp failed for volume "checkpoint-store" : secret "s3-credentials"'
            ' not found') in line, line
    assert (f"what to do: create the Secret s3-credentials in namespace {OTHER_NS}: it is credential checkpoint-store"
            " of the webhook's settings") in run.out
    assert run.seconds < BATCH_FAST, run.seconds


def test_a_configmap_the_runtime_mounts_and_nobody_made_fails_at_once(batch):
    run = batch["configmap-missing"]
    assert run.code == 1, run.out + run.err
    line = line_of(run)
    assert 'FAILED at pulled: MountVolume.SetUp failed for volume "train-config" : configmap "train-config" not found' \
        in line, line
    assert f"what to do: create the ConfigMap train-config in namespace {NS} (the runtime's volume train-config" \
        in run.out
    assert run.seconds < BATCH_FAST, run.seconds


def test_per_node_one_probe_pinned_and_json_one_object_per_probe(batch, node_env):
    c = node_env.cluster
    run = batch["per-node"]
    assert run.code == 0, run.out + run.err
    [probe] = run.json()
    assert probe["node"] == "dispatch-e2e-node" and probe["ran"] and probe["reached"] == "ran"
    assert probe["exitCode"] == 0 and "publish args: --help" in probe["output"]
    assert [s["stage"] for s in probe["stages"]] == ["admitted", "scheduled", "pulled", "started", "ran"]
    assert all(s["state"] == "reached" for s in probe["stages"])
    # kept (--keep): the pin is an entry of verify's own manager, beside the webhook's
    job = c.get("trainjob", probe["name"], NS)
    managers = [e["manager"] for e in job["spec"]["runtimePatches"]]
    assert managers == [VERIFY_MANAGER, MANAGER], managers
    [pod] = json.loads(c.kubectl("get", "pods", "-n", NS, "-l", f"{JOBSET_NAME}={probe['name']}", "-o", "json")
                       .stdout)["items"]
    assert pod["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "dispatch-e2e-node"}
    c.kubectl("delete", "trainjob", probe["name"], "-n", NS, "--cascade=foreground")


def test_missing_runtime_exits_2_with_one_line(batch):
    run = batch["missing"]
    assert run.code == 2 and run.out == ""
    assert run.err == "dispatch-admission verify: ClusterTrainingRuntime no-such-runtime not found\n"


def test_namespace_the_user_cannot_create_in_exits_2_with_one_line(batch):
    run = batch["forbidden"]
    assert run.code == 2 and run.out == "" and run.err.count("\n") == 1, run.err
    assert run.err.startswith(f"dispatch-admission verify: cannot create TrainJobs in namespace {OTHER_NS}: ")
    assert 'User "verifier" cannot create resource "trainjobs"' in run.err


def test_the_batch_left_nothing_behind(batch, node_env):
    assert wait_nothing_left(node_env.cluster, timeout=60) == {"trainjobs": [], "jobsets": [], "pods": []}


# ---- one at a time: the webhook configurations swapped, and a signal ----

@pytest.fixture(scope="module")
def pending_claim(node_env):
    """A runtime whose pods wait on a claim that stays Pending: a probe that waits until its --timeout."""
    c = node_env.cluster
    c.apply(waits_for_claim_runtime(node_env))
    c.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
             "metadata": {"name": "pending-claim", "namespace": NS},
             "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "",
                      "resources": {"requests": {"storage": "1Gi"}}}})
    return f"ClusterTrainingRuntime/{WAITS_FOR_CLAIM}"


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_a_signal_in_the_middle_leaves_nothing_behind(node_env, pending_claim, sig, code):
    """SIGINT (Ctrl-C), and SIGHUP (the terminal closed), while the probe waits on its claim."""
    c = node_env.cluster
    proc = start(c.kubeconfig, "--runtime", pending_claim, "--namespace", NS, "--timeout", "300")
    try:

        def in_the_middle() -> bool:  # the TrainJob, its JobSet and its (pending) pod exist
            assert proc.poll() is None, proc.communicate()
            return bool(left_behind(c)["pods"])

        eventually(in_the_middle, "a probe pod appeared", 120, every=0.5, detail=lambda: json.dumps(left_behind(c)))
        time.sleep(3)  # the scheduler's verdict on the pod: waiting on the claim, not an end
        assert proc.poll() is None, proc.communicate()
        print(f"before {sig.name}: {left_behind(c)}")
        proc.send_signal(sig)
        run = finish(proc, timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert run.code == code, run.out + run.err
    assert f"FAILED at scheduled: interrupted by {sig.name} while Unschedulable: 0/1 nodes are available: pod has" \
           " unbound immediate PersistentVolumeClaims" in line_of(run), run.out
    # verify deleted its probe (in the background: the garbage collector takes the JobSet and pods after it)
    assert wait_nothing_left(c, timeout=120) == {"trainjobs": [], "jobsets": [], "pods": []}


def test_publish_digest_not_in_the_registry_fails_at_pulled_with_the_pull_error(node_env):
    c, tmp = node_env.cluster, node_env.tmp
    missing = node_env.images.publish.split("@")[0] + "@sha256:" + "0" * 64
    settings = tmp / "missing-digest.json"
    settings.write_text(json.dumps({"manager": MANAGER, "publish": {"image": missing}}))
    with contextlib.ExitStack() as stack:
        url, ca, log, proc = stack.enter_context(webhook_server(
            tmp / "missing-digest", "--settings", str(settings), "--kubeconfig", c.kubeconfig,
            env={"PROMETHEUS_MULTIPROC_DIR": ""}))
        LOGS["webhook missing-digest (node)"] = log
        installed = [node_env.route1, node_env.route2]
        stack.enter_context(webhooks_swapped(c, installed, [Webhook(url, ca, log, proc), node_env.route2]))
        wait_mutation(c, "pointed at the missing-digest webhook", lambda job: publish_image(job) == missing)
        run = finish(start(c.kubeconfig, "--runtime", "ClusterTrainingRuntime/torch-distributed", "--namespace", NS,
                           "--settings", str(settings), "--timeout", "240"))
    assert run.code == 1, run.out + run.err
    line = line_of(run)
    assert line.split()[2] == "scheduled" and "FAILED at pulled: " in line, line
    assert missing in line and "not found" in line, line
    assert "what to do: the node cannot pull the image: check that publish.image's digest exists" in run.out
    assert run.seconds < FAST, run.seconds


def test_webhook_not_installed_fails_at_admitted(node_env):
    c = node_env.cluster
    with webhooks_swapped(c, [node_env.route1, node_env.route2], None):
        wait_mutation(c, "went", lambda job: publish_image(job) is None)
        run = finish(start(c.kubeconfig, "--runtime", "ClusterTrainingRuntime/torch-distributed", "--namespace", NS,
                           "--timeout", "60"))
    assert run.code == 1, run.out + run.err
    line = line_of(run)
    assert line.split()[1:3] == ["-", "-"], line
    assert "FAILED at admitted: the stored TrainJob has no entry: the webhook did not mutate it" in line
    assert "what to do: install the webhook" in run.out
    assert wait_nothing_left(c, timeout=120) == {"trainjobs": [], "jobsets": [], "pods": []}


# ---- what verify leaves: the TTL, --cleanup, the next run, the UID precondition ----

def probe_doc(name: str, ttl: int | None, verify_entry: bool = True) -> dict:
    """A probe as verify makes it, suspended (no pod), left behind by a run that never came back."""
    doc = probe_trainjob(name, NS, "ClusterTrainingRuntime", "torch-distributed", "gone-run", jobs=["node"], ttl=ttl)
    doc["spec"]["suspend"] = True
    if not verify_entry:
        doc["spec"]["runtimePatches"] = []
    return doc


def test_cleanup_and_the_next_verify_remove_expired_probes_only(node_env):
    c = node_env.cluster
    for doc in (probe_doc("verify-expired", 1), probe_doc("verify-live", 3600),
                probe_doc("labelled-only", 1, verify_entry=False)):
        c.apply(doc)
    assert c.get("trainjob", "verify-live", NS)["metadata"]["annotations"][TTL_ANNOTATION] == "3600"
    time.sleep(2.5)  # past the TTL of 1 s, on the API server's clock
    run = finish(start(c.kubeconfig, "--cleanup", "--namespace", NS))
    assert run.code == 0, run.out + run.err
    rows = {line.split()[1]: line for line in run.out.splitlines()[1:-1]}
    assert set(rows) == {"verify-expired", "verify-live"}, run.out  # the labelled TrainJob is no probe of verify's
    assert rows["verify-expired"].split()[2:] == ["gone-run", rows["verify-expired"].split()[3], "removed"]
    assert "kept: not expired" in rows["verify-live"]
    assert run.out.splitlines()[-1].startswith(f"removed 1 of 2 probes in namespace {NS}")
    assert c.get("trainjob", "verify-expired", NS) is None or \
        c.get("trainjob", "verify-expired", NS)["metadata"].get("deletionTimestamp")
    assert c.get("trainjob", "verify-live", NS) and c.get("trainjob", "labelled-only", NS)
    # the next verify in the namespace removes what has expired before it makes its own probe
    c.apply(probe_doc("verify-expired-2", 1))
    time.sleep(2.5)
    run = finish(start(c.kubeconfig, "--runtime", f"ClusterTrainingRuntime/{TOO_BIG}", "--namespace", NS,
                       "--timeout", "60"))
    assert run.err.startswith(f"verify: removed 1 expired probes in namespace {NS}: verify-expired-2\n"), run.err
    assert run.code == 1 and "FAILED at scheduled" in line_of(run)
    c.kubectl("delete", "trainjob", "verify-live", "labelled-only", "-n", NS)
    assert wait_nothing_left(c, timeout=120) == {"trainjobs": [], "jobsets": [], "pods": []}


def test_a_delete_carries_the_uid_so_a_namesake_made_since_is_left_alone(node_env):
    from webhook.commands.verify import Cluster

    c = node_env.cluster
    c.apply(probe_doc("verify-namesake", None))
    first = c.get("trainjob", "verify-namesake", NS)["metadata"]["uid"]
    c.kubectl("delete", "trainjob", "verify-namesake", "-n", NS)
    # its JobSet gone before the namesake comes: one of the same name made while the GC still held the first's
    # raced, and was left past the wait (a CI run, 2026-12-06). (Not a foreground delete: Trainer makes the JobSet
    # again for a TrainJob that waits on it, webhook.kube.verify_cluster.)
    eventually(lambda: not left_behind(c)["jobsets"], "the first TrainJob's JobSet gone", 120, every=0.5)
    c.apply(probe_doc("verify-namesake", None))  # someone else's, under the name
    second = c.get("trainjob", "verify-namesake", NS)["metadata"]["uid"]
    assert first != second
    cluster = Cluster(c.kubeconfig)
    assert cluster.delete(NS, "verify-namesake", first) is False
    assert c.get("trainjob", "verify-namesake", NS)["metadata"]["uid"] == second
    assert cluster.delete(NS, "verify-namesake", second) is True
    assert wait_nothing_left(c, timeout=120) == {"trainjobs": [], "jobsets": [], "pods": []}
