"""`audit --report` writes OpenReports (issue 37, item 1), against the real API server with OpenReports' CRDs from
their Go module: a namespace holding passing and failing TrainJobs gets one `Report`, the ClusterTrainingRuntimes
one `ClusterReport`, as `kubectl get reports -A` shows them to a user; a re-run replaces them (never a second
report), and a namespace that holds nothing any more loses its report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e import toolchain
from tests.e2e.webhooks import webhooks_swapped
from tests.helpers import EXAMPLES, ROOT, runtime, trainjob

NS, EMPTIED = "reports-a", "reports-b"


def audit(env, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "webhook", "audit", "--settings", str(EXAMPLES / "settings" /
                                                                                      "route1.json"),
                           "--kubeconfig", env.cluster.kubeconfig, "--report", *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def reserved_env() -> dict:
    return trainjob("reserved-env", namespace=NS, env=[{"name": "DISPATCH_X", "value": "1"}])


def before_the_webhook(env, *docs: dict) -> None:
    """`docs` created as if before the webhook was installed (its configurations away meanwhile)."""
    with webhooks_swapped(env.cluster, [env.route1, env.route2], None):
        for doc in docs:
            env.cluster.apply(doc)


@pytest.fixture(scope="module")
def reports_env(env):
    c = env.cluster
    c.install_crds(toolchain.openreports_crds())
    for ns in (NS, EMPTIED):
        c.kubectl("create", "namespace", ns)
    c.apply(runtime("reports-no-node", jobs={"worker": {"containers": [{"name": "trainer"}]}}))
    c.apply(trainjob("passes", namespace=NS))  # through the webhook: it gets its entry
    before_the_webhook(env, reserved_env(), trainjob("no-runtime", namespace=NS, runtime_name="not-there"),
                       trainjob("no-entry", namespace=NS), trainjob("elsewhere", namespace=EMPTIED))
    yield env
    for ns in (NS, EMPTIED):
        c.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    c.kubectl("delete", "clustertrainingruntime", "reports-no-node", check=False)


def reports_of(c) -> dict[tuple[str, str], dict]:
    got = json.loads(c.kubectl("get", "reports", "-A", "-o", "json").stdout)["items"]
    return {(r["metadata"]["namespace"], r["metadata"]["name"]): r for r in got}


def test_audit_writes_a_report_per_namespace_and_a_cluster_report(reports_env):
    c = reports_env.cluster
    got = audit(reports_env)
    assert got.returncode == 1, got.stderr  # findings: exit 1, as without --report
    assert "wrote" in got.stderr and f"{NS}/dispatch-admission" in got.stderr, got.stderr
    table = c.kubectl("get", "reports", "-A").stdout
    print("\n$ kubectl get reports -A\n" + table)
    lines = {line.split()[0]: line.split() for line in table.splitlines()[1:]}
    # PASS: passes; FAIL: reserved-env (S3), no-runtime (R2), and the namespace (passes mounts a credential's
    # Secret that is not there: secret-missing); WARN: no-entry
    assert lines[NS][1:5] == ["dispatch-admission", "1", "3", "1"], table  # NAME PASS FAIL WARN
    report = reports_of(c)[(NS, "dispatch-admission")]
    assert report["summary"] == {"pass": 1, "fail": 3, "warn": 1, "error": 0, "skip": 0}
    by = {(r["resources"][0]["name"], r["rule"]): r for r in report["results"]}
    assert by[("passes", "all")]["result"] == "pass" and by[("passes", "all")]["resources"][0]["uid"]
    assert by[("reserved-env", "S3")]["category"] == "ErrInvalid"
    assert by[("reserved-env", "S3")]["message"].startswith("spec.trainer.env[0].name: 'DISPATCH_X'")
    assert by[("no-runtime", "R2")]["category"] == "ErrNotFound"
    assert by[("no-entry", "no-entry")]["result"] == "warn"
    assert by[(NS, "secret-missing")]["resources"][0]["kind"] == "Namespace"
    clusters = json.loads(c.kubectl("get", "clusterreports", "-o", "json").stdout)["items"]
    [cluster] = [r for r in clusters if r["metadata"]["name"] == "dispatch-admission"]
    failed = {r["resources"][0]["name"]: r for r in cluster["results"] if r["result"] == "fail"}
    assert failed["reports-no-node"]["rule"] == "R3", failed
    print(c.kubectl("get", "clusterreports").stdout)


def test_a_rerun_replaces_the_reports_and_drops_those_of_emptied_namespaces(reports_env):
    c = reports_env.cluster
    assert audit(reports_env).returncode == 1
    first = reports_of(c)
    assert (EMPTIED, "dispatch-admission") in first
    c.kubectl("delete", "trainjob", "reserved-env", "-n", NS)
    c.kubectl("delete", "trainjob", "elsewhere", "-n", EMPTIED)
    try:
        assert audit(reports_env).returncode == 1
        second = reports_of(c)
        assert [k for k in second if k[0] == NS] == [(NS, "dispatch-admission")], "replaced, never a second report"
        assert second[(NS, "dispatch-admission")]["metadata"]["uid"] == \
            first[(NS, "dispatch-admission")]["metadata"]["uid"]
        assert second[(NS, "dispatch-admission")]["summary"]["fail"] == 2  # R2 and secret-missing
        assert (EMPTIED, "dispatch-admission") not in second, "a namespace holding nothing any more loses its report"
    finally:  # the fixture's objects back, for the tests that run after this one
        before_the_webhook(reports_env, reserved_env(), trainjob("elsewhere", namespace=EMPTIED))


def test_without_the_crds_audit_says_what_to_install(reports_env, tmp_path):
    c = reports_env.cluster
    c.kubectl("delete", "crd", "reports.openreports.io", "clusterreports.openreports.io")
    try:
        got = audit(reports_env)
        assert got.returncode == 2 and "OpenReports CRDs are not installed" in got.stderr, got.stderr
        assert "Traceback" not in got.stderr
    finally:
        c.install_crds(toolchain.openreports_crds())
