"""Issue 23 (SPEC 9): `dispatch-admission verify` on the real one-node cluster (test_node.py's `node_env`: the
node, Trainer, our webhook as two processes chosen by the label `dispatch-e2e/route`).

Each test reads the stage and the cluster's message from the report, not only the exit code. To keep the wall
time short, the probes that need nothing of their own run at once (the module fixture `batch`); those that
swap the webhook configurations, and the SIGINT one, run after, one at a time, with short timeouts.
The route-1 probe runs as a user holding only the RBAC docs/verify.md names.
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
import yaml

from tests.e2e.conftest import ROUTE_LABEL, _LOGS, Webhook, webhooks_swapped
from tests.e2e.node import identity, kubeconfig_for
from tests.e2e.test_node import NS, node_env, node_pod  # noqa: F401 - node_env: the module's node
from tests.helpers import MANAGER, ROOT
from tests.process import webhook_server
from webhook.core.verify import VERIFY_MANAGER, PROBE_LABEL

TOO_BIG = "torch-too-big"
USER_NS, OTHER_NS = NS, "team-q"
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"

# The RBAC a user of verify needs (docs/verify.md), given to the user `verifier`.
USER_RULES_NS = [
    {"apiGroups": ["trainer.kubeflow.org"], "resources": ["trainjobs"], "verbs": ["create", "get", "delete", "watch"]},
    {"apiGroups": ["trainer.kubeflow.org"], "resources": ["trainingruntimes"], "verbs": ["get"]},
    {"apiGroups": [""], "resources": ["pods", "events"], "verbs": ["get", "list"]},
    {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
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

    def json(self) -> list[dict]:
        return json.loads(self.out)


def verify_cmd(kubeconfig: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "webhook", "verify", "--kubeconfig", kubeconfig, *args]


def start(kubeconfig: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(verify_cmd(kubeconfig, *args), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finish(proc: subprocess.Popen, timeout: float = 400) -> Run:
    out, err = proc.communicate(timeout=timeout)
    run = Run(proc.args, proc.returncode, out, err)
    print(f"\n$ dispatch-admission {' '.join(proc.args[3:])}\n{out}{err}(exit {proc.returncode})")
    return run


def line_of(run: Run, probe_prefix: str = "verify-") -> str:
    return next(line for line in run.out.splitlines() if line.startswith(probe_prefix))


def too_big_runtime(node_env) -> dict:  # noqa: F811
    """Trainer's torch runtime with a request no node has."""
    rt = json.loads(json.dumps(node_env.cluster.get("clustertrainingruntime", "torch-distributed")))
    rt["metadata"] = {"name": TOO_BIG}
    node_pod(rt)["containers"][0]["resources"] = {"requests": {"cpu": "64"}}
    return rt


def user_kubeconfig(c) -> str:
    cert, key = identity(c, "verifier", "verifier")
    for kind, doc_kind, ns, rules in (("Role", "RoleBinding", USER_NS, USER_RULES_NS),
                                      ("ClusterRole", "ClusterRoleBinding", None, USER_RULES_CLUSTER)):
        meta = {"name": "dispatch-verify-user", **({"namespace": ns} if ns else {})}
        c.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": kind, "metadata": meta, "rules": rules})
        c.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": doc_kind, "metadata": meta,
                 "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": meta["name"]},
                 "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "verifier"}]})
    return kubeconfig_for(c, "verifier", cert, key)


def left_behind(c) -> dict[str, list[str]]:
    """Every probe TrainJob, JobSet and pod in the cluster (by the label, and by the probes' JobSet names)."""
    jobs = json.loads(c.kubectl("get", "trainjobs", "-A", "-l", PROBE_LABEL, "-o", "json").stdout)["items"]
    jobsets = json.loads(c.kubectl("get", "jobsets", "-A", "-o", "json").stdout)["items"]
    pods = json.loads(c.kubectl("get", "pods", "-A", "-l", JOBSET_NAME, "-o", "json").stdout)["items"]
    return {"trainjobs": [j["metadata"]["name"] for j in jobs],
            "jobsets": [j["metadata"]["name"] for j in jobsets if j["metadata"]["name"].startswith("verify-")
                        or PROBE_LABEL in (j["metadata"].get("labels") or {})],
            "pods": [p["metadata"]["name"] for p in pods if p["metadata"]["labels"][JOBSET_NAME].startswith("verify-")
                     or PROBE_LABEL in (p["metadata"].get("labels") or {})]}


def wait_nothing_left(c, timeout: float = 0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        left = left_behind(c)
        if not any(left.values()) or time.monotonic() >= deadline:
            return left
        time.sleep(1)


def wait_mutation(c, what: str, check) -> None:
    """Until the API server's view of the webhook configurations has caught up with a swap: a server-side
    dry-run create comes back as `check` wants (its informer trails the write by a moment)."""
    probe = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
             "metadata": {"name": "swap-check", "namespace": NS}, "spec": {"runtimeRef": {"name": "torch-distributed"}}}
    deadline = time.monotonic() + 60
    while True:
        got = c.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", stdin=json.dumps(probe), check=False)
        if got.returncode == 0 and check(json.loads(got.stdout)):
            return
        assert time.monotonic() < deadline, f"the webhook configurations never {what}: {got.stdout[-2000:]}{got.stderr}"
        time.sleep(0.5)


def publish_image(job: dict) -> str | None:
    for e in job["spec"].get("runtimePatches") or []:
        if e["manager"] == MANAGER:
            return json.dumps(e).split('"reference": "')[1].split('"')[0]
    return None


@pytest.fixture(scope="module")
def batch(node_env):  # noqa: F811
    """The independent probes, all at once; their reports by name."""
    c, tmp = node_env.cluster, node_env.tmp
    c.apply(too_big_runtime(node_env))
    user = user_kubeconfig(c)
    r1, r2 = str(tmp / "route1.json"), str(tmp / "route2.json")
    admin = c.kubeconfig
    route2 = f"{ROUTE_LABEL}=2"
    procs = {
        "route1": start(user, "--runtime", "ClusterTrainingRuntime/torch-distributed", "--namespace", USER_NS,
                        "--settings", r1, "--timeout", "240"),
        "route2": start(admin, "--runtime", "ClusterTrainingRuntime/torch-init", "--namespace", NS, "--settings", r2,
                        "--label", route2, "--timeout", "240"),
        "route2-empty": start(admin, "--runtime", "ClusterTrainingRuntime/torch-init-copies-nothing", "--namespace", NS,
                              "--label", route2, "--timeout", "240"),
        "unschedulable": start(admin, "--runtime", f"ClusterTrainingRuntime/{TOO_BIG}", "--namespace", NS,
                               "--settings", r1, "--timeout", "30"),
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


def test_unschedulable_runtime_fails_at_scheduled_with_the_scheduler_reason(batch):
    run = batch["unschedulable"]
    assert run.code == 1, run.out + run.err
    line = line_of(run)
    assert line.split()[1:3] == ["-", "admitted"], line
    assert "FAILED at scheduled: not scheduled after 30s: Unschedulable: 0/1 nodes are available: 1 Insufficient cpu" \
        in line, line


def test_per_node_one_probe_pinned_and_json_one_object_per_probe(batch, node_env):  # noqa: F811
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


def test_the_batch_left_nothing_behind(batch, node_env):  # noqa: F811
    assert wait_nothing_left(node_env.cluster, timeout=60) == {"trainjobs": [], "jobsets": [], "pods": []}


# ---- one at a time: the webhook configurations swapped, and a signal ----

def test_sigint_in_the_middle_leaves_nothing_behind(node_env):  # noqa: F811
    c = node_env.cluster
    proc = start(c.kubeconfig, "--runtime", f"ClusterTrainingRuntime/{TOO_BIG}", "--namespace", NS, "--timeout", "300")
    try:
        deadline = time.monotonic() + 120
        while not left_behind(c)["pods"]:  # in the middle: the TrainJob, its JobSet and its (pending) pod exist
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, f"no probe pod appeared: {left_behind(c)}"
            time.sleep(0.5)
        print(f"before SIGINT: {left_behind(c)}")
        proc.send_signal(signal.SIGINT)
        run = finish(proc, timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert run.code == 130, run.out + run.err
    assert "FAILED at scheduled: interrupted by SIGINT" in line_of(run)
    # verify deleted its probe (in the background: the garbage collector takes the JobSet and pods after it)
    assert wait_nothing_left(c, timeout=60) == {"trainjobs": [], "jobsets": [], "pods": []}


def test_publish_digest_not_in_the_registry_fails_at_pulled_with_the_pull_error(node_env):  # noqa: F811
    c, tmp = node_env.cluster, node_env.tmp
    missing = node_env.images.publish.split("@")[0] + "@sha256:" + "0" * 64
    settings = tmp / "missing-digest.json"
    settings.write_text(json.dumps({"manager": MANAGER, "publish": {"image": missing}}))
    with contextlib.ExitStack() as stack:
        url, ca, log, proc = stack.enter_context(webhook_server(
            tmp / "missing-digest", "--settings", str(settings), "--kubeconfig", c.kubeconfig,
            env={"PROMETHEUS_MULTIPROC_DIR": ""}))
        _LOGS["webhook missing-digest (node)"] = log
        installed = [node_env.route1, node_env.route2]
        stack.enter_context(webhooks_swapped(c, installed, [Webhook(url, ca, log, proc), node_env.route2]))
        wait_mutation(c, "pointed at the missing-digest webhook", lambda job: publish_image(job) == missing)
        run = finish(start(c.kubeconfig, "--runtime", "ClusterTrainingRuntime/torch-distributed", "--namespace", NS,
                           "--settings", str(settings), "--timeout", "120"))
    assert run.code == 1, run.out + run.err
    line = line_of(run)
    assert line.split()[2] == "scheduled" and "FAILED at pulled: " in line, line
    assert missing in line and "not found" in line, line
    assert "what to do: the node cannot pull the image: check that publish.image's digest exists" in run.out


def test_webhook_not_installed_fails_at_admitted(node_env):  # noqa: F811
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
    assert wait_nothing_left(c, timeout=60) == {"trainjobs": [], "jobsets": [], "pods": []}
