"""What users see: kubectl against a real kube-apiserver with Trainer's CRDs and our webhook."""

from __future__ import annotations

import copy
import json
import time

import pytest
import yaml

from tests.e2e.webhooks import ROUTE_LABEL, SKIP_MUTATION_LABEL, webhooks_swapped
from tests.helpers import EXAMPLES, MANAGER, eventually, mount_patch, pod_patch, trainjob
from webhook.commands.files import load_settings as load
from webhook.core import patch, registry

NS = "team-a"


def labelled(job: dict, **labels) -> dict:
    job["metadata"]["labels"] = {**job["metadata"].get("labels", {}), **labels}
    return job


def own_entry(obj: dict) -> dict | None:
    return next((e for e in obj["spec"].get("runtimePatches", []) if e["manager"] == MANAGER), None)


def expected_entry(settings_file: str, runtime_file: str, runtime_name: str, time_text: str) -> dict:
    settings = load(str(EXAMPLES / "settings" / settings_file))
    docs = [d for d in yaml.safe_load_all((EXAMPLES / "runtimes" / runtime_file).read_text()) if d]
    runtime = next(d for d in docs if d["metadata"]["name"] == runtime_name)
    return patch.Entry.build(settings, registry.runtime_facts(runtime, settings).targets).as_dict(time_text)


def refused(env, job, *flags):
    got = env.cluster.apply(job, *flags, check=False)
    assert got.returncode != 0, f"admitted, but should be refused:\n{got.stdout}"
    return got.stderr


def test_raw_trainjob_gets_the_publish_entry_exactly(env):
    env.cluster.apply(trainjob(name="raw-torch", namespace=NS, numNodes=2))
    stored = env.cluster.get("trainjob", "raw-torch", NS)
    entry = own_entry(stored)
    assert entry is not None
    # Exactly SPEC 6.1, as the core computes it: nothing pruned by the CRD's structural schema.
    assert entry == expected_entry("route1.json", "torch-distributed.yaml", "torch-distributed", entry["time"])
    node = entry["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert node["volumes"][0]["image"] == {"reference": load(str(EXAMPLES / "settings" / "route1.json")).publish.image,
                                           "pullPolicy": "IfNotPresent"}
    assert node["containers"][0]["volumeMounts"][0] == {"name": "dispatch-publish", "mountPath": "/opt/dispatch",
                                                        "readOnly": True}
    assert time.strptime(entry["time"], "%Y-%m-%dT%H:%M:%SZ")


def test_mpi_runtime_with_launcher_patches_both_jobs(env):
    env.cluster.apply(trainjob(name="raw-mpi", namespace=NS, runtime_name="mpi-launcher"))
    entry = own_entry(env.cluster.get("trainjob", "raw-mpi", NS))
    jobs = entry["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert [j["name"] for j in jobs] == ["node", "launcher"]


REFUSALS = [
    pytest.param(trainjob(name="bad-mount", namespace=NS, patches=[mount_patch("//opt/./dispatch/tools")]),
                 ["is invalid", "ErrInvalid", "volumeMounts[0].mountPath", "/opt/dispatch"],
                 id="S2-mount-under-opt-dispatch"),
    pytest.param(trainjob(name="bad-volume", namespace=NS, patches=[pod_patch("example.com/sneaky", {
        "volumes": [{"name": "dispatch-publish", "image": {"reference": "registry.example/publish:v1"}}]})]),
                 ["is invalid", "ErrInvalid", "volumes[0].name", "dispatch-publish"],
                 id="S1-tagged-image-reserved-name"),
    pytest.param(labelled(trainjob(name="bad-route2", namespace=NS), **{ROUTE_LABEL: "2"}),
                 ["Forbidden", "ErrUnsupported", "spec.runtimeRef", "init container 'dispatch-publish'"],
                 id="R4-route2-without-init-container"),
    pytest.param(trainjob(name="bad-procs", namespace=NS, runtime_name="plain", kind="TrainingRuntime",
                          numProcPerNode=4),
                 ["Forbidden", "ErrUnsupported", "spec.trainer.numProcPerNode", "mlPolicy.torch"],
                 id="R6-numProcPerNode"),
    pytest.param(trainjob(name="bad-runtime", namespace=NS, runtime_name="does-not-exist"),
                 ["NotFound", "ErrNotFound", "spec.runtimeRef.name", "does-not-exist"], id="R2-missing-runtime"),
    pytest.param(trainjob(name="bad-env", namespace=NS, env=[{"name": "DISPATCH_TOKEN", "value": "x"}]),
                 ["is invalid", "ErrInvalid", "spec.trainer.env[0].name"], id="S3-dispatch-env"),
]


@pytest.mark.parametrize("job,expect", REFUSALS)
def test_refused_through_kubectl(env, job, expect):
    stderr = refused(env, job)
    for fragment in expect:
        assert fragment in stderr, f"{fragment!r} missing from kubectl's error:\n{stderr}"
    assert env.cluster.get("trainjob", job["metadata"]["name"], NS) is None


@pytest.mark.parametrize("job,expect", REFUSALS)
def test_server_dry_run_gives_the_same_answer(env, job, expect):
    stderr = refused(env, job, "--dry-run=server")
    for fragment in expect:
        assert fragment in stderr


def test_server_dry_run_admits_and_stores_nothing(env):
    got = env.cluster.apply(trainjob(name="dry-ok", namespace=NS), "--dry-run=server", "-o", "json")
    assert own_entry(json.loads(got.stdout)) is not None, "the dry run shows the mutation"
    assert env.cluster.get("trainjob", "dry-ok", NS) is None


def test_forged_entry_is_replaced_on_create(env):
    forged = pod_patch(MANAGER,
                       {"volumes": [{"name": "dispatch-publish", "image": {"reference": "evil/publish:latest"}}],
                                 "containers": [{"name": "node", "volumeMounts": [
                                     {"name": "dispatch-publish", "mountPath": "/opt/dispatch"}]}]})
    got = env.cluster.apply(trainjob(name="forged", namespace=NS, patches=[forged]))
    assert "replaced the runtimePatches entry" in got.stderr  # kubectl prints the warning
    entry = own_entry(env.cluster.get("trainjob", "forged", NS))
    assert entry == expected_entry("route1.json", "torch-distributed.yaml", "torch-distributed", entry["time"])


def test_validating_webhook_refuses_a_job_that_missed_its_mutation(env):
    stderr = refused(env, labelled(trainjob(name="unmutated", namespace=NS), **{SKIP_MUTATION_LABEL: "true"}))
    assert "ErrInvalid" in stderr and "bypassed" in stderr and "spec.runtimePatches" in stderr


def test_route2_entry_is_accepted_by_the_crd_schema(env):
    job = labelled(trainjob(name="route2", namespace=NS, runtime_name="torch-init"), **{ROUTE_LABEL: "2"})
    got = env.cluster.apply(job)
    assert "has not been run end to end" in got.stderr
    entry = own_entry(env.cluster.get("trainjob", "route2", NS))
    assert entry == expected_entry("route2.json", "torch-init.yaml", "torch-init", entry["time"])
    pod = entry["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["initContainers"][0]["env"] == [{"name": "DISPATCH_PUBLISH_DEST", "value": "/opt/dispatch"}]


# ---- updates (SPEC 6.3) ----

def test_label_change_on_running_job_passes_untouched(env):
    env.cluster.apply(trainjob(name="upd-label", namespace=NS))
    before = env.cluster.get("trainjob", "upd-label", NS)
    env.cluster.kubectl("label", "trainjob", "upd-label", "-n", NS, "team=vision")
    after = env.cluster.get("trainjob", "upd-label", NS)
    assert after["metadata"]["labels"]["team"] == "vision"
    assert after["spec"] == before["spec"]


def test_editing_the_entry_on_a_running_job_is_refused(env):
    env.cluster.apply(trainjob(name="upd-edit", namespace=NS))
    obj = env.cluster.get("trainjob", "upd-edit", NS)
    i = obj["spec"]["runtimePatches"].index(own_entry(obj))
    ops = [{"op": "replace", "value": False, "path": f"/spec/runtimePatches/{i}/trainingRuntimeSpec/template/spec/"
            "replicatedJobs/0/template/spec/template/spec/containers/0/volumeMounts/0/readOnly"}]
    got = env.cluster.kubectl("patch", "trainjob", "upd-edit", "-n", NS, "--type=json", "-p", json.dumps(ops),
                              check=False)
    assert got.returncode != 0 and "ErrInvalid" in got.stderr and "immutable once written" in got.stderr


def test_suspend_edit_resume(env):
    c = env.cluster
    tuning = pod_patch("example.com/tuning", {"volumes": [{"name": "scratch", "emptyDir": {}}]})
    manifest = trainjob(name="upd-cycle", namespace=NS, patches=[tuning])
    c.apply(manifest)
    first = own_entry(c.get("trainjob", "upd-cycle", NS))
    c.kubectl("patch", "trainjob", "upd-cycle", "-n", NS, "--type=merge", "-p", '{"spec": {"suspend": true}}')
    # Edit while suspended: re-apply the manifest with one more entry. Client-side apply replaces the
    # whole runtimePatches list of a custom resource, dropping ours; the webhook puts it back in place.
    edited = copy.deepcopy(manifest)
    edited["spec"]["suspend"] = True
    edited["spec"]["runtimePatches"].append(pod_patch("example.com/extra",
                                                      {"volumes": [{"name": "x", "emptyDir": {}}]}))
    got = c.apply(edited)
    assert "put back" in got.stderr
    obj = c.get("trainjob", "upd-cycle", NS)
    assert [e["manager"] for e in obj["spec"]["runtimePatches"]] == ["example.com/tuning", MANAGER, "example.com/extra"]
    assert own_entry(obj) == first
    c.kubectl("patch", "trainjob", "upd-cycle", "-n", NS, "--type=merge", "-p", '{"spec": {"suspend": false}}')
    obj = c.get("trainjob", "upd-cycle", NS)
    assert obj["spec"]["suspend"] is False and own_entry(obj) == first, "the entry is never rewritten"


def webhook_uninstalled(env):
    return webhooks_swapped(env.cluster, [env.route1, env.route2], None)


def test_jobs_created_before_the_webhook(env):
    c = env.cluster
    with webhook_uninstalled(env):
        c.apply(trainjob(name="pre-suspended", namespace=NS, suspend=True))
        c.apply(trainjob(name="pre-running", namespace=NS))
    # SPEC 6.3: the entry is written on CREATE only. Resuming a suspended one adds none, with a warning.
    got = c.kubectl("patch", "trainjob", "pre-suspended", "-n", NS, "--type=merge", "-p",
                    '{"spec": {"suspend": false}}')
    assert "runs without /opt/dispatch/publish" in got.stderr, got.stderr
    assert own_entry(c.get("trainjob", "pre-suspended", NS)) is None
    # Nor does any update of a running one: allowed, with the warning.
    got = c.kubectl("label", "trainjob", "pre-running", "-n", NS, "x=y")
    assert own_entry(c.get("trainjob", "pre-running", NS)) is None
    got = c.kubectl("patch", "trainjob", "pre-running", "-n", NS, "--type=merge", "-p",
                    '{"spec": {"activeDeadlineSeconds": 3600}}')
    assert "runs without /opt/dispatch/publish" in got.stderr
    assert own_entry(c.get("trainjob", "pre-running", NS)) is None


# ---- runtimes come and go ----

def test_runtime_created_a_moment_before_its_trainjob(env):
    runtime = yaml.safe_load((EXAMPLES / "runtimes" / "torch-distributed.yaml").read_text())
    runtime["kind"] = "TrainingRuntime"
    runtime["metadata"] = {"name": "just-made", "namespace": NS}
    job = trainjob(name="right-after", namespace=NS, runtime_name="just-made", kind="TrainingRuntime")
    # One kubectl call: the runtime and then at once the TrainJob, before any watch event can arrive.
    env.cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all([runtime, job]))
    assert own_entry(env.cluster.get("trainjob", "right-after", NS)) is not None


def test_deleted_runtime_is_forgotten(env):
    c = env.cluster
    runtime = yaml.safe_load((EXAMPLES / "runtimes" / "torch-distributed.yaml").read_text())
    runtime["metadata"] = {"name": "short-lived"}
    c.apply(runtime)
    c.apply(trainjob(name="before-delete", namespace=NS, runtime_name="short-lived"))
    c.kubectl("delete", "clustertrainingruntime", "short-lived")
    stderr = refused(env, trainjob(name="after-delete", namespace=NS, runtime_name="short-lived"))
    assert "ErrNotFound" in stderr and "short-lived" in stderr


def settled_gets(hook) -> float:
    """The pod's live reads so far, once the keeper's state has caught up (it writes it each second)."""
    def read() -> float:
        return hook.metric("dispatch_admission_api_requests_total", verb="get")

    seen = [read()]

    def unchanged() -> bool:
        now = read()
        settled, seen[0] = now == seen[0], now
        return settled

    time.sleep(1.2)
    eventually(unchanged, "the pod's live reads never settled", 60, 1.2)
    return seen[0]


def test_known_runtimes_are_answered_from_the_cache(env):
    env.cluster.apply(trainjob(name="warm", namespace=NS))
    gets = settled_gets(env.route1)
    for i in range(3):
        env.cluster.apply(trainjob(name=f"cached-{i}", namespace=NS))
    assert settled_gets(env.route1) == gets


def test_zz_apiserver_restart_the_watch_recovers(env):
    c = env.cluster
    c.restart_apiserver(down_for=2)
    runtime = yaml.safe_load((EXAMPLES / "runtimes" / "torch-distributed.yaml").read_text())
    runtime["metadata"] = {"name": "after-restart"}
    c.apply(runtime)
    # The watch has re-established and delivers the new runtime: no live read is needed for it.
    def answered_from_the_cache() -> bool:
        gets = env.route1.metric("dispatch_admission_api_requests_total", verb="get")
        c.apply(trainjob(name=f"post-restart-{int(time.monotonic() * 1000) % 100000}", namespace=NS,
                         runtime_name="after-restart"))
        return env.route1.metric("dispatch_admission_api_requests_total", verb="get") == gets

    eventually(answered_from_the_cache, "the watch did not recover after the API server restart", 60, 2)
