"""Rolling out safely (SPEC 8), with kubectl as the client: warn against enforce, the audit of what a
cluster already holds, and the runtime warnings with their readiness gauge."""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e import toolchain
from tests.e2e.cluster import LOGS
from tests.e2e.conftest import start_cluster
from tests.e2e.webhooks import webhooks_swapped
from tests.helpers import EXAMPLES, MANAGER, ROOT, eventually, metric_samples, mount_patch, runtime, trainjob
from tests.process import Webhook
from webhook import api
from webhook.commands.files import load_settings

NS = "team-a"
ROUTE1 = EXAMPLES / "settings" / "route1.json"
ROUTE2 = EXAMPLES / "settings" / "route2.json"


# ---- SPEC 8.1: the same TrainJob under enforce and under warn ----

@pytest.fixture(scope="module")
def warn_hook(env, serve_module):
    hook = serve_module("--enforcement", "warn", kubeconfig=env.cluster.kubeconfig,
                        env={"PROMETHEUS_MULTIPROC_DIR": ""})
    LOGS["webhook warn"] = hook.log
    return hook


def test_spec_8_1_no_node_container_refused_under_enforce_admitted_with_the_warning_under_warn(env, warn_hook):
    job = trainjob(name="rollout-no-node", namespace=NS, runtime_name="no-node", kind="TrainingRuntime")
    got = env.cluster.apply(job, check=False)
    assert got.returncode != 0 and "Forbidden" in got.stderr and "ErrUnsupported" in got.stderr, got.stderr
    assert "no replicated job has a container named 'node'" in got.stderr
    before = warn_hook.metric("dispatch_admission_would_deny_total", sentinel="ErrUnsupported", rule="R3")
    with webhooks_swapped(env.cluster, [env.route1, env.route2], [warn_hook, env.route2]):
        got = env.cluster.apply(job)
    # SPEC 6.4: what to change first, the runtime last
    assert "Warning: would deny: ErrUnsupported: spec.runtimeRef: no replicated job has a container named 'node'" \
        " (TrainingRuntime team-a/n" in got.stderr, got.stderr
    stored = env.cluster.get("trainjob", "rollout-no-node", NS)
    patches = stored["spec"].get("runtimePatches", [])
    assert not any(e["manager"] == MANAGER for e in patches), "warn adds no entry there"
    assert warn_hook.metric("dispatch_admission_would_deny_total", sentinel="ErrUnsupported", rule="R3") == before + 1


def test_spec_8_1_warn_still_mutates_where_enforce_admits(env, warn_hook):
    with webhooks_swapped(env.cluster, [env.route1, env.route2], [warn_hook, env.route2]):
        got = env.cluster.apply(trainjob(name="rollout-warn-ok", namespace=NS))
    assert "would deny" not in got.stderr
    stored = env.cluster.get("trainjob", "rollout-warn-ok", NS)
    assert [e["manager"] for e in stored["spec"]["runtimePatches"]] == [MANAGER]


# ---- SPEC 8.3: a runtime edit that removes route 2's init container ----

def runtime_configuration(hook: Webhook) -> dict:
    bundle = base64.b64encode(Path(hook.ca).read_bytes()).decode()
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": "dispatch-admission-e2e-runtimes"},
            "webhooks": [{"name": "runtimes.dispatch.go.phpboyscout.uk", "admissionReviewVersions": ["v1"],
                          "sideEffects": "None", "timeoutSeconds": 5, "failurePolicy": "Ignore",
                          "rules": [{"apiGroups": ["trainer.kubeflow.org"], "apiVersions": ["v1alpha1"],
                                     "resources": ["clustertrainingruntimes", "trainingruntimes"],
                                     "operations": ["CREATE", "UPDATE"], "scope": "*"}],
                          "clientConfig": {"url": hook.url + "/runtimes", "caBundle": bundle}}]}


def runtime_ready(hook: Webhook, name: str) -> float | None:
    """The cluster runtime `name`'s dispatch_admission_runtime_ready, None while it has no series."""
    found = metric_samples(hook.metrics(), "dispatch_admission_runtime_ready", name=name)
    return found[0] if found else None


def wait_ready_gauge(hook: Webhook, name: str, value: float, timeout: float = 20) -> None:
    """Until the gauge reads `value` (the watch delivers the change)."""
    eventually(lambda: runtime_ready(hook, name) == value, f"dispatch_admission_runtime_ready{{name={name!r}}} "
               f"reads {value}", timeout, 0.3)


def test_spec_8_3_a_runtime_edit_removing_the_init_container_is_warned_and_the_gauge_drops(env):
    c = env.cluster
    c.apply(runtime_configuration(env.route2))
    try:
        rt = yaml.safe_load((EXAMPLES / "runtimes" / "torch-init.yaml").read_text())
        rt["metadata"] = {"name": "rollout-init"}
        got = c.apply(rt)
        assert "Warning" not in got.stderr, got.stderr
        wait_ready_gauge(env.route2, "rollout-init", 1.0)
        edited = copy.deepcopy(rt)
        for job in edited["spec"]["template"]["spec"]["replicatedJobs"]:
            job["template"]["spec"]["template"]["spec"].pop("initContainers", None)
        got = c.apply(edited)
        assert got.returncode == 0  # warnings only, never a denial
        assert "Warning: R4: TrainJobs on this runtime will be refused: job 'node' lacks init container" \
            in got.stderr, got.stderr
        wait_ready_gauge(env.route2, "rollout-init", 0.0)
        # ... and a TrainJob on route 2 naming it is refused, as the warning said.
        job = trainjob(name="rollout-r4", namespace=NS, runtime_name="rollout-init")
        job["metadata"]["labels"] = {"dispatch-e2e/route": "2"}
        refused = c.apply(job, check=False)
        assert refused.returncode != 0 and "ErrUnsupported" in refused.stderr
    finally:
        c.kubectl("delete", "validatingwebhookconfiguration", "dispatch-admission-e2e-runtimes", "--ignore-not-found")
        c.kubectl("delete", "clustertrainingruntime", "rollout-init", "--ignore-not-found")


# ---- SPEC 8.2: the audit of a cluster seeded with good, stale, entry-less and bad objects ----

AUDIT_NS = "audit"


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    """A control plane of its own with no webhook registered, so that anything can be stored."""
    tmp = tmp_path_factory.mktemp("audit")
    settings = load_settings(str(ROUTE1))
    with contextlib.ExitStack() as stack:
        c = start_cluster(stack, tmp, toolchain.trainer_crds(), " (audit)")
        c.kubectl("create", "namespace", AUDIT_NS)
        torch = yaml.safe_load((EXAMPLES / "runtimes" / "torch-distributed.yaml").read_text())
        no_node = runtime("audit-no-node", jobs={"worker": {"containers": [{"name": "trainer", "image": "x"}]}})
        mounts = runtime("audit-mounts", kind="TrainingRuntime", namespace=AUDIT_NS, jobs={"node": {"containers": [
            {"name": "node", "image": "x", "volumeMounts": [{"name": "tools", "mountPath": "/opt/dispatch"}]}],
            "volumes": [{"name": "tools", "emptyDir": {}}]}})
        for rt in (torch, no_node, mounts):
            c.apply(rt)
        good = api.check(settings, trainjob(name="good", namespace=AUDIT_NS), [torch]).trainjob
        stale = copy.deepcopy(good)
        stale["metadata"]["name"] = "stale"
        own = stale["spec"]["runtimePatches"][0]
        own["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
            "volumes"][0]["image"]["reference"] = "registry.example/old/publish@sha256:" + "1" * 64
        bad = copy.deepcopy(good)
        bad["metadata"]["name"] = "bad"
        bad["spec"]["runtimePatches"].insert(0, mount_patch("/opt/dispatch/tools"))
        for job in (good, stale, bad, trainjob(name="no-entry", namespace=AUDIT_NS),
                    trainjob(name="gone", namespace=AUDIT_NS, runtime_name="deleted-runtime"),
                    trainjob(name="on-no-node", namespace=AUDIT_NS, runtime_name="audit-no-node")):
            c.apply(job)
        settings_file = tmp / "settings.json"
        settings_file.write_text(ROUTE1.read_text())
        yield c, settings_file


def audit(cluster, settings_file, *args):
    return subprocess.run([sys.executable, "-m", "webhook", "audit", "--settings", str(settings_file),
                           "--kubeconfig", cluster.kubeconfig, *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


def test_spec_8_2_audit_json_lists_exactly_the_expected_findings(seeded):
    cluster, settings_file = seeded
    got = audit(cluster, settings_file, "--namespace", AUDIT_NS, "--output", "json", "--page-size", "2")
    assert got.returncode == 1, got.stderr
    found = {(f["kind"], f["namespace"], f["name"]): f for f in json.loads(got.stdout)}
    assert {k: f["verdict"] for k, f in found.items()} == {
        ("ClusterTrainingRuntime", "", "torch-distributed"): "ok",
        ("ClusterTrainingRuntime", "", "audit-no-node"): "cannot-carry",
        ("TrainingRuntime", AUDIT_NS, "audit-mounts"): "cannot-carry",
        ("TrainJob", AUDIT_NS, "good"): "ok",
        ("TrainJob", AUDIT_NS, "stale"): "stale-entry",
        ("TrainJob", AUDIT_NS, "bad"): "violation",
        ("TrainJob", AUDIT_NS, "no-entry"): "no-entry",
        ("TrainJob", AUDIT_NS, "gone"): "runtime-missing",
        ("TrainJob", AUDIT_NS, "on-no-node"): "violation",
        ("Namespace", "", AUDIT_NS): "secret-missing",  # good, stale and bad mount s3-credentials; it is not there
    }
    causes = {k[2]: [(c["sentinel"], c["field"]) for c in f["causes"]] for k, f in found.items()}
    assert causes["bad"] == [("ErrInvalid", "spec.runtimePatches[0].trainingRuntimeSpec.template.spec.replicatedJobs[0]"
                                            ".template.spec.template.spec.containers[0].volumeMounts[0].mountPath")]
    assert causes["gone"] == [("ErrNotFound", "spec.runtimeRef.name")]
    assert causes["audit-no-node"] == causes["on-no-node"] == [("ErrUnsupported", "spec.runtimeRef")]
    assert causes["audit-mounts"] == [("ErrUnsupported", "spec.runtimeRef")]
    assert causes["good"] == causes["stale"] == causes["no-entry"] == []
    assert causes[AUDIT_NS] == [("ErrNotFound", "credentials[checkpoint-store].secret")]
    assert found[("Namespace", "", AUDIT_NS)]["causes"][0]["message"] == (
        f"Secret 's3-credentials' not found in namespace {AUDIT_NS}: 3 TrainJob(s) mount it (bad, good, stale); their"
        " pods wait for it and never start")


def test_spec_8_2_audit_table_prints_what_is_not_ok_then_counts(seeded):
    cluster, settings_file = seeded
    got = audit(cluster, settings_file, "--namespace", AUDIT_NS)
    assert got.returncode == 1 and got.stderr == "", got.stderr  # no progress bar when stderr is not a terminal
    lines = got.stdout.splitlines()
    # Runtimes first, then TrainJobs, each in the API server's list order (by namespace and name).
    assert [line.split()[:3] for line in lines[:-1]] == [
        ["cannot-carry", "ClusterTrainingRuntime", "audit-no-node"],
        ["cannot-carry", "TrainingRuntime", "audit/audit-mounts"],
        ["violation", "TrainJob", "audit/bad"],
        ["runtime-missing", "TrainJob", "audit/gone"],
        ["no-entry", "TrainJob", "audit/no-entry"],
        ["violation", "TrainJob", "audit/on-no-node"],
        ["stale-entry", "TrainJob", "audit/stale"],
        ["secret-missing", "Namespace", AUDIT_NS],
    ]
    assert "ErrInvalid: spec.runtimePatches[0]" in lines[2] and "is at or under /opt/dispatch" in lines[2]
    assert lines[-1] == ("10 objects: 2 ok, 2 cannot-carry, 1 no-entry, 1 stale-entry, 2 violation, 1 runtime-missing,"
                         " 1 secret-missing")


def test_audit_names_the_namespace_missing_a_credential_secret_until_it_is_made(seeded):
    """Issue 35: the Secret read by name and metadata only; a user who may not list Secrets is told, and the
    rest of the audit stands."""
    from tests.e2e.node import identity, kubeconfig_for

    cluster, settings_file = seeded
    cert, key = identity(cluster, "auditor", "auditor")
    rules = [{"apiGroups": ["trainer.kubeflow.org"], "resources": ["trainjobs", "trainingruntimes",
                                                                   "clustertrainingruntimes"], "verbs": ["list"]}]
    cluster.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                   "metadata": {"name": "auditor"}, "rules": rules})
    cluster.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                   "metadata": {"name": "auditor"}, "roleRef": {"apiGroup": "rbac.authorization.k8s.io",
                                                                "kind": "ClusterRole", "name": "auditor"},
                   "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "auditor"}]})
    auditor = kubeconfig_for(cluster, "auditor", cert, key)
    got = subprocess.run([sys.executable, "-m", "webhook", "audit", "--settings", str(settings_file), "--kubeconfig",
                          auditor], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert got.returncode == 1 and "secret-missing" not in got.stdout, got.stdout
    assert got.stderr.startswith("audit: the credentials' Secrets were not checked: list secrets: 403 Forbidden"), \
        got.stderr
    cluster.kubectl("create", "secret", "generic", "s3-credentials", "-n", AUDIT_NS, "--from-literal=k=v")
    try:
        got = audit(cluster, settings_file)  # every namespace: the Secret listed cluster-wide by its name
        assert got.returncode == 1 and got.stderr == "", got.stderr
        assert "secret-missing" not in got.stdout, got.stdout
    finally:
        cluster.kubectl("delete", "secret", "s3-credentials", "-n", AUDIT_NS)


def test_spec_8_2_audit_exit_codes(seeded, tmp_path):
    cluster, settings_file = seeded
    bad = tmp_path / "bad.json"
    bad.write_text('{"publish": {"image": "publish:v1"}}')
    got = audit(cluster, bad)
    assert got.returncode == 2 and "ErrInvalid" in got.stderr
    unreachable = tmp_path / "kubeconfig"
    cfg = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    cfg["clusters"][0]["cluster"]["server"] = "https://127.0.0.1:1"
    unreachable.write_text(yaml.safe_dump(cfg))
    got = subprocess.run([sys.executable, "-m", "webhook", "audit", "--settings", str(settings_file), "--kubeconfig",
                          str(unreachable)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert got.returncode == 2 and "cannot read the cluster" in got.stderr, got.stderr
