"""One test (at least) per rule of SPEC 5: each fails when its rule is removed."""

import pytest
import yaml

from tests.helpers import (
    CREDS,
    IMAGE,
    ROUTE1,
    ROUTE2,
    admission,
    answer,
    fields,
    forged,
    mount_patch,
    pod_patch,
    runtime,
    sentinels,
    trainjob,
)
from webhook.core.runtimes import RuntimeIndex


def denied(resp, code, sentinel):
    assert resp["allowed"] is False
    st = resp["status"]
    assert st["code"] == code and st["message"].startswith(sentinel + ": ")
    return st


# ---- S1 ----

@pytest.mark.parametrize("endpoint", ["mutate", "validate"])
def test_s1_reserved_volume_in_another_entry(endpoint):
    job = trainjob(patches=[pod_patch("example.com/other",
                                      {"volumes": [{"name": "dispatch-publish", "emptyDir": {}}]})])
    st = denied(answer(admission(), job, endpoint), 422, "ErrInvalid")
    assert st["details"]["causes"][0]["field"].endswith("volumes[0].name")


def test_s1_reserved_volume_mounted_by_another_entry():
    job = trainjob(patches=[pod_patch("example.com/other", {"containers": [
        {"name": "node", "volumeMounts": [{"name": "dispatch-publish", "mountPath": "/tmp/p"}]}]})])
    st = denied(answer(admission(ROUTE2), job), 422, "ErrInvalid")
    assert "volumeMounts[0].name" in st["message"]


def test_s1_own_entry_may_use_the_reserved_volume():
    resp = answer(admission(), trainjob())
    assert resp["allowed"]


# ---- S2 ----

@pytest.mark.parametrize("path", ["/opt/dispatch", "//opt//dispatch", "/opt/./dispatch/", "/opt/x/../dispatch",
                                  "opt/dispatch", "/opt/dispatch/publish", "/../opt/dispatch/sub/"])
@pytest.mark.parametrize("lst", ["containers", "initContainers"])
def test_s2_mount_at_or_under_opt_dispatch(path, lst):
    job = trainjob(patches=[mount_patch(path, container_list=lst)])
    st = denied(answer(admission(), job), 422, "ErrInvalid")
    assert st["details"]["causes"][0]["field"].endswith(f"{lst}[0].volumeMounts[0].mountPath")


@pytest.mark.parametrize("extra", [{"subPath": "x"}, {"subPathExpr": "$(POD)"}, {"readOnly": True}])
def test_s2_sub_path_variants(extra):
    job = trainjob(patches=[mount_patch("/opt/dispatch/publish", **extra)])
    denied(answer(admission(), job), 422, "ErrInvalid")


@pytest.mark.parametrize("path", ["/opt/dispatcher", "/opt", "/opt/Dispatch", "/data"])
def test_s2_neighbours_allowed(path):
    assert answer(admission(), trainjob(patches=[mount_patch(path)]))["allowed"]


def test_s2_applies_without_publish_configured():
    denied(answer(admission({}), trainjob(patches=[mount_patch("/opt/dispatch")])), 422, "ErrInvalid")


# ---- S3 ----

def test_s3_dispatch_env_names():
    job = trainjob(env=[{"name": "OK", "value": "1"}, {"name": "DISPATCH_X", "value": "1"}])
    st = denied(answer(admission(), job), 422, "ErrInvalid")
    assert fields({"status": st}) == ["spec.trainer.env[1].name"]


def test_s3_dispatch_env_in_another_entry():
    job = trainjob(patches=[pod_patch("example.com/other", {"initContainers": [
        {"name": "dispatch-publish", "env": [{"name": "DISPATCH_PUBLISH_DEST", "value": "/tmp"}]}]})])
    denied(answer(admission(ROUTE2), job), 422, "ErrInvalid")


def test_s3_similar_names_allowed():
    assert answer(admission(),
                  trainjob(env=[{"name": "dispatch_x", "value": "1"}, {"name": "XDISPATCH_", "value": ""}]))["allowed"]


# ---- S4 ----

def test_s4_forged_entry_refused_by_validate():
    st = denied(answer(admission(), trainjob(patches=[forged()]), "validate"), 422, "ErrInvalid")
    assert fields({"status": st}) == ["spec.runtimePatches[0]"]


def test_s4_forged_entry_replaced_by_mutate_with_warning():
    resp = answer(admission(), trainjob(patches=[{"manager": "a.io/x"}, forged()]))
    assert resp["allowed"]
    from tests.helpers import ops_of
    ops = ops_of(resp)
    assert [o["op"] for o in ops] == ["replace"] and ops[0]["path"] == "/spec/runtimePatches/1"
    assert ops[0]["value"]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"][
        "template"]["spec"]["volumes"][0]["image"]["reference"] == IMAGE
    assert any("replaced" in w for w in resp["warnings"])


def test_s4_entry_without_settings_is_refused():
    st = denied(answer(admission({}), trainjob(patches=[forged()]), "validate"), 422, "ErrInvalid")
    assert "not allowed" in st["message"]


# ---- S5 ----

def test_s5_validate_refuses_a_create_without_the_entry():
    st = denied(answer(admission(), trainjob(), "validate"), 422, "ErrInvalid")
    assert "bypassed" in st["message"] and fields({"status": st}) == ["spec.runtimePatches"]


def test_s5_credentials_alone_also_require_the_entry():
    denied(answer(admission(CREDS), trainjob(), "validate"), 422, "ErrInvalid")


def test_s5_nothing_configured_requires_nothing():
    assert answer(admission({}), trainjob(), "validate")["allowed"]


# ---- R1 ----

@pytest.mark.parametrize("ref,field", [
    ({"apiGroup": "kubeflow.org", "name": "torch-distributed"}, "spec.runtimeRef.apiGroup"),
    ({"kind": "JobSet", "name": "torch-distributed"}, "spec.runtimeRef.kind"),
])
def test_r1_unknown_group_or_kind(ref, field):
    job = trainjob()
    job["spec"]["runtimeRef"] = ref
    st = denied(answer(admission(), job), 403, "ErrUnsupported")
    assert field in fields({"status": st})


def test_r1_defaults_apply_where_the_fields_are_absent():
    job = trainjob()
    job["spec"]["runtimeRef"] = {"name": "torch-distributed"}
    assert answer(admission(), job)["allowed"]


@pytest.mark.parametrize("key", ["apiGroup", "kind"])
def test_r1_an_explicit_empty_string_is_not_absent(key):
    """SPEC 5 R1: a default applies only where the field is absent, as the CRD's defaulting does."""
    job = trainjob()
    job["spec"]["runtimeRef"] = {"name": "torch-distributed", key: ""}
    st = denied(answer(admission(), job), 403, "ErrUnsupported")
    assert fields({"status": st}) == [f"spec.runtimeRef.{key}"]


# ---- R2 ----

def test_r2_missing_cluster_runtime():
    st = denied(answer(admission(), trainjob(runtime_name="nope")), 404, "ErrNotFound")
    assert st["reason"] == "NotFound" and fields({"status": st}) == ["spec.runtimeRef.name"]


def test_r2_training_runtime_is_looked_up_in_the_trainjob_namespace():
    rts = RuntimeIndex([runtime("mine", kind="TrainingRuntime", namespace="team-b")])
    assert answer(admission(runtimes=rts),
                  trainjob(namespace="team-b", runtime_name="mine", kind="TrainingRuntime"))["allowed"]
    denied(answer(admission(runtimes=rts), trainjob(namespace="team-a", runtime_name="mine", kind="TrainingRuntime")),
           404, "ErrNotFound")
    # A ClusterTrainingRuntime of the same name is not a TrainingRuntime.
    denied(answer(admission(runtimes=rts), trainjob(namespace="team-b", runtime_name="mine")), 404, "ErrNotFound")


# ---- R3 ----

def test_r3_no_node_container():
    rts = RuntimeIndex([runtime(jobs={"worker": {"containers": [{"name": "trainer"}]}})])
    st = denied(answer(admission(runtimes=rts), trainjob()), 403, "ErrUnsupported")
    assert "'node'" in st["message"]


def test_r3_every_job_with_a_node_container_is_targeted():
    rts = RuntimeIndex([runtime(jobs={
        "launcher": {"containers": [{"name": "node"}]},
        "worker": {"containers": [{"name": "sidecar"}]},
        "node": {"containers": [{"name": "x"}, {"name": "node"}]},
    })])
    from tests.helpers import ops_of
    entry = ops_of(answer(admission(runtimes=rts), trainjob()))[0]["value"][0]
    jobs = [j["name"] for j in entry["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]]
    assert jobs == ["launcher", "node"]


# ---- R4 ----

def test_r4_route2_needs_the_init_container_in_every_target_job():
    rts = RuntimeIndex([runtime(jobs={
        "node": {"initContainers": [{"name": "dispatch-publish"}], "containers": [{"name": "node"}]},
        "launcher": {"containers": [{"name": "node"}]},
        "other": {"containers": [{"name": "node"}], "initContainers": [{"name": "copy"}]},
    })])
    st = denied(answer(admission(ROUTE2, runtimes=rts), trainjob()), 403, "ErrUnsupported")
    assert len(st["details"]["causes"]) == 2
    assert "'launcher'" in st["message"] and "'other'" in st["message"] and "'node'" not in st["message"]


def test_r4_route1_does_not_need_it():
    assert answer(admission(ROUTE1), trainjob())["allowed"]


# ---- R5 ----

@pytest.mark.parametrize("pod", [
    {"volumes": [{"name": "dispatch-publish", "emptyDir": {}}], "containers": [{"name": "node"}]},
    {"volumes": [{"name": "checkpoint-store", "emptyDir": {}}], "containers": [{"name": "node"}]},
    {"containers": [{"name": "node", "volumeMounts": [{"name": "v", "mountPath": "/opt/dispatch"}]}]},
    {"containers": [{"name": "node"}],
     "initContainers": [{"name": "i", "volumeMounts": [{"name": "v", "mountPath": "//opt/dispatch/x/"}]}]},
])
def test_r5_runtime_already_uses_the_reserved_names_or_path(pod):
    rts = RuntimeIndex([runtime(jobs={"node": pod})])
    denied(answer(admission({**ROUTE1, **CREDS}, runtimes=rts), trainjob()), 403, "ErrUnsupported")


def test_r5_other_jobs_of_the_runtime_count_too():
    rts = RuntimeIndex([runtime(jobs={"node": {"containers": [{"name": "node"}]},
                                      "init": {"containers": [{"name": "x",
                                                               "volumeMounts": [{"name": "v",
                                                                                 "mountPath": "/opt/dispatch"}]}]}})])
    denied(answer(admission(runtimes=rts), trainjob()), 403, "ErrUnsupported")


def claim_runtime(claim: str, **kw) -> dict:
    """A runtime declaring a volume through the JobSet template's volumeClaimPolicies, as Trainer's torchtune
    runtimes declare `initializer`."""
    rt = runtime(**kw)
    rt["spec"]["template"]["spec"]["volumeClaimPolicies"] = [
        {"templates": [{"metadata": {"name": claim}, "spec": {"accessModes": ["ReadWriteOnce"]}}]}]
    return rt


@pytest.mark.parametrize("claim,credential", [("dispatch-publish", "checkpoint-store"), ("initializer", "initializer")])
def test_r5_claim_templates_are_volumes(claim, credential):
    """SPEC 5 R5: JobSet adds a volume of each claim template's name to the pods that mount it, and the entry
    mounts its volumes on `node`: two volumes of one name."""
    creds = {"credentials": [{"name": credential, "secret": "s3-credentials", "mountPath": "/var/run/dispatch/creds"}]}
    rts = RuntimeIndex([claim_runtime(claim)])
    st = denied(answer(admission({**ROUTE1, **creds}, runtimes=rts), trainjob()), 403, "ErrUnsupported")
    [cause] = st["details"]["causes"]
    assert cause["field"] == "spec.runtimeRef" and "rename" in cause["message"] and repr(claim) in cause["message"]


def test_r5_a_claim_template_of_another_name_is_fine():
    rts = RuntimeIndex([claim_runtime("initializer")])
    assert answer(admission({**ROUTE1, **CREDS}, runtimes=rts), trainjob())["allowed"]


def node_mounting(path: str, container: str = "node") -> dict:
    return runtime(jobs={"node": {"containers": [{"name": "node"}] * (container != "node") + [
        {"name": container, "volumeMounts": [{"name": "data", "mountPath": path}]}]}})


@pytest.mark.parametrize("path",
                         ["/var/run/dispatch/creds", "/var/run/dispatch/creds/sub", "//var/run/dispatch/creds/"])
def test_r5_a_node_mount_at_or_under_a_credentials_path(path):
    """SPEC 5 R5: Trainer merges mounts by path, so the credential and the runtime's mount would replace one another."""
    rts = RuntimeIndex([node_mounting(path)])
    st = denied(answer(admission({**ROUTE1, **CREDS}, runtimes=rts), trainjob()), 403, "ErrUnsupported")
    assert "move credential 'checkpoint-store'" in st["message"] and "'node'" in st["message"], st["message"]


@pytest.mark.parametrize("path,container", [("/var/run", "node"), ("/var/run/dispatch/credentials", "node"),
                                            ("/var/run/dispatch/creds", "sidecar")])
def test_r5_node_mounts_beside_a_credential_or_in_other_containers_are_fine(path, container):
    rts = RuntimeIndex([node_mounting(path, container)])
    assert answer(admission({**ROUTE1, **CREDS}, runtimes=rts), trainjob())["allowed"]


def mpi_runtime(ssh_path: str | None = None) -> dict:
    rt = runtime(torch=False)
    rt["spec"]["mlPolicy"]["mpi"] = {"sshAuthMountPath": ssh_path} if ssh_path else {}
    return rt


@pytest.mark.parametrize("ssh_path,cred_path", [(None, "/root/.ssh"), (None, "/root"), (None, "/root/.ssh/keys"),
                                                ("/home/mpi/.ssh", "/home/mpi")])
def test_r5_mpi_ssh_auth_mount_path_overlapping_a_credential(ssh_path, cred_path):
    creds = {"credentials": [{"name": "keys", "secret": "s", "mountPath": cred_path}]}
    rts = RuntimeIndex([mpi_runtime(ssh_path)])
    st = denied(answer(admission({**ROUTE1, **creds}, runtimes=rts), trainjob()), 403, "ErrUnsupported")
    assert "sshAuthMountPath" in st["message"] and "move credential 'keys'" in st["message"], st["message"]


@pytest.mark.parametrize("ssh_path,cred_path,mpi",
                         [(None, "/root/.sshkeys", True), ("/home/mpi/.ssh", "/root/.ssh", True),
                                                     (None, "/root/.ssh", False)])
def test_r5_ssh_paths_beside_a_credential_or_without_mpi_are_fine(ssh_path, cred_path, mpi):
    creds = {"credentials": [{"name": "keys", "secret": "s", "mountPath": cred_path}]}
    rts = RuntimeIndex([mpi_runtime(ssh_path) if mpi else runtime(torch=False)])
    assert answer(admission({**ROUTE1, **creds}, runtimes=rts), trainjob())["allowed"]


def trainer_runtime(path: str) -> dict:
    """A runtime shipped in the Trainer Go module (the toolchain downloads it before the tests run)."""
    from tests.e2e import toolchain

    return yaml.safe_load((toolchain.trainer_module() / "manifests" / "base" / "runtimes" / path).read_text())


@pytest.mark.parametrize("credential,fragment", [
    ({"name": "initializer", "secret": "s", "mountPath": "/var/run/dispatch/creds"}, "rename credential 'initializer'"),
    ({"name": "store", "secret": "s", "mountPath": "/workspace"}, "move credential 'store' (/workspace)"),
])
def test_r5_trainers_stock_torchtune_runtime(credential, fragment):
    """The two collisions found on Trainer v2.3.0's torchtune runtimes (issue 34), refused; its defaults admitted."""
    rt = trainer_runtime("torchtune/llama3_2/llama3_2_1B.yaml")
    rts = RuntimeIndex([rt])
    job = trainjob(runtime_name=rt["metadata"]["name"])
    assert answer(admission({**ROUTE1, **CREDS}, runtimes=rts), job)["allowed"]
    st = denied(answer(admission({**ROUTE1, "credentials": [credential]}, runtimes=rts), job), 403, "ErrUnsupported")
    assert fragment in st["message"], st["message"]


def route2_runtime(**mounts: list[str]) -> dict:
    """A route-2 runtime (its `node` job has the init container `dispatch-publish` that ROUTE2 names) whose
    containers mount the volumes given by name ({container: [volume, ...]}; `init` is the init container)."""
    def mounting(name: str) -> list[dict]:
        return [{"name": v, "mountPath": f"/x/{i}"} for i, v in enumerate(mounts.get(name, []))]

    pod = {"initContainers": [{"name": "dispatch-publish", "volumeMounts": mounting("init")}],
           "containers": [{"name": "node", "volumeMounts": mounting("node")},
                          {"name": "sidecar", "volumeMounts": mounting("sidecar")}]}
    return runtime(jobs={"trainer": pod})


def test_r5_a_sidecar_mounting_the_publish_volume_by_name():
    """SPEC 5 R5: after the merge the sidecar would mount the entry's emptyDir read-write and could write over
    the copied binary; the runtime defines no such volume, so only the mount by name says it."""
    rt = route2_runtime(sidecar=["dispatch-publish"])
    rt["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][1][
        "volumeMounts"][0]["mountPath"] = "/x"
    st = denied(answer(admission(ROUTE2, runtimes=RuntimeIndex([rt])), trainjob()), 403, "ErrUnsupported")
    [cause] = st["details"]["causes"]
    assert cause["field"] == "spec.runtimeRef"
    assert "unmount 'dispatch-publish' from job 'trainer' container 'sidecar'" in cause["message"]
    denied(answer(admission(ROUTE1, runtimes=RuntimeIndex([rt])), trainjob()), 403, "ErrUnsupported")


def test_r5_a_sidecar_mount_is_seen_beside_a_runtime_alike_in_every_other_name():
    """Jobs alike in every field are shared (runtimes._interned): one that differs only in what its sidecar mounts
    by name is another job. (Keyed by some of the fields, the second runtime took the first's clean job.)"""
    clean = RuntimeIndex([route2_runtime(sidecar=["scratch"])])
    assert answer(admission(ROUTE2, runtimes=clean), trainjob())["allowed"]
    mounting = RuntimeIndex([route2_runtime(sidecar=["dispatch-publish"])])
    denied(answer(admission(ROUTE2, runtimes=mounting), trainjob()), 403, "ErrUnsupported")
    assert answer(admission(ROUTE2, runtimes=clean), trainjob())["allowed"]


def test_r5_a_container_without_a_string_name_mounting_the_publish_volume_is_seen():
    """A runtime file `check` or `verify` reads goes through no CRD schema: a container named by a number (or not
    at all) still mounts, and R5 says so rather than skip it."""
    rt = route2_runtime(sidecar=["dispatch-publish"])
    pod = rt["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["containers"][1]["name"] = 7
    st = denied(answer(admission(ROUTE2, runtimes=RuntimeIndex([rt])), trainjob()), 403, "ErrUnsupported")
    assert any("unmount 'dispatch-publish'" in c["message"] for c in st["details"]["causes"]), st


@pytest.mark.parametrize("container", ["node", "sidecar", "init"])
def test_r5_a_container_mounting_a_credentials_volume_by_name(container):
    """SPEC 5 R5: the credential would reach a container not named `node` (or be mounted twice on `node`)."""
    rts = RuntimeIndex([route2_runtime(**{container: ["scratch", "checkpoint-store"]})])
    st = denied(answer(admission({**ROUTE2, **CREDS}, runtimes=rts), trainjob()), 403, "ErrUnsupported")
    [cause] = st["details"]["causes"]
    what = "init container 'dispatch-publish'" if container == "init" else f"container {container!r}"
    assert f"unmount 'checkpoint-store' from job 'trainer' {what}" in cause["message"], cause["message"]
    assert answer(admission(ROUTE2, runtimes=rts), trainjob())["allowed"], "no such credential: any name is fine"


def test_r5_route2s_own_init_container_gets_its_mount_from_the_entry_only():
    """SPEC 5 R5: the init container publish.initContainer names, not mounting dispatch-publish, is what route 2
    needs; one that mounts it in the runtime is refused like any other container."""
    assert answer(admission(ROUTE2, runtimes=RuntimeIndex([route2_runtime(init=["scratch"])])), trainjob())["allowed"]
    rts = RuntimeIndex([route2_runtime(init=["dispatch-publish"])])
    st = denied(answer(admission(ROUTE2, runtimes=rts), trainjob()), 403, "ErrUnsupported")
    assert "init container 'dispatch-publish'" in st["message"], st["message"]


def test_r5_mounts_by_name_are_judged_wherever_the_runtime_is_judged():
    """The same facts serve the runtime warnings (SPEC 8.3), the audit's cannot-carry (8.2) and the stored form
    the workers read (webhook.kube.store)."""
    from tests.unit.test_rollout import runtime_review
    from webhook.core.runtimes import Runtime
    from webhook.inspection.audit import Verdict, judge_runtime

    rt = route2_runtime(sidecar=["dispatch-publish"])
    adm = admission(ROUTE2)
    warnings = adm.review(runtime_review(rt), "runtimes")[0]["response"]["warnings"]
    assert [w.split(":")[0] for w in warnings] == ["R5"] and "'sidecar'" in warnings[0] and len(warnings[0]) <= 120
    finding = judge_runtime(adm, rt)
    assert finding.verdict is Verdict.CANNOT_CARRY and [r.rule for r in finding.causes] == ["R5"]
    taken = Runtime.of(rt)
    stored = Runtime.from_bytes(taken.to_bytes())
    assert stored == taken and stored.jobs[0].mounters == taken.jobs[0].mounters
    assert [(m.name, m.init, m.volumes) for m in stored.jobs[0].mounters] == [("sidecar", False, ("dispatch-publish",))]


def test_r5_too_large_to_check_says_which_bound():
    from webhook.core.runtimes import MAX_JOBS, MAX_STORED_BYTES

    many_jobs = runtime(jobs={f"j{i}": {"containers": [{"name": "node"}]} for i in range(MAX_JOBS + 1)})
    long_names = runtime(jobs={"node": {"containers": [{"name": "node"}],
                                        "volumes": [{"name": f"{i:04d}" + "v" * 500} for i in range(200)]}})
    long_path = node_mounting("/data/" + "x" * 5000)
    for rt, said in ((many_jobs, f"more than {MAX_JOBS}"), (long_names, f"more than {MAX_STORED_BYTES} bytes"),
                     (long_path, "longer than 4096")):
        st = denied(answer(admission(runtimes=RuntimeIndex([rt])), trainjob()), 403, "ErrUnsupported")
        assert "too large to check" in st["message"] and said in st["message"], st["message"]
    fits = runtime(jobs={f"j{i}": {"containers": [{"name": "node"}]} for i in range(MAX_JOBS)})
    assert answer(admission(runtimes=RuntimeIndex([fits])), trainjob())["allowed"]


# ---- R6 ----

def test_r6_num_proc_per_node_needs_torch():
    rts = RuntimeIndex([runtime(torch=False)])
    st = denied(answer(admission(runtimes=rts), trainjob(numProcPerNode=4)), 403, "ErrUnsupported")
    assert fields({"status": st}) == ["spec.trainer.numProcPerNode"]
    assert answer(admission(), trainjob(numProcPerNode=4))["allowed"]
    assert answer(admission(runtimes=rts), trainjob(numNodes=2))["allowed"]


# ---- R7 ----

@pytest.mark.parametrize("name",
                         ["PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"])
def test_r7_torch_reserved_env(name):
    st = denied(answer(admission(), trainjob(env=[{"name": name, "value": "1"}])), 422, "ErrInvalid")
    assert fields({"status": st}) == ["spec.trainer.env[0].name"]


def test_r7_only_on_torch_runtimes():
    rts = RuntimeIndex([runtime(torch=False)])
    assert answer(admission(runtimes=rts), trainjob(env=[{"name": "PET_NNODES", "value": "1"}]))["allowed"]


# ---- R8 ----

def test_r8_no_room_for_the_entry():
    full = [{"manager": f"example.com/m{i}"} for i in range(16)]
    st = denied(answer(admission(), trainjob(patches=full)), 403, "ErrUnsupported")
    assert "16" in st["message"]
    assert answer(admission(), trainjob(patches=full[:15]))["allowed"]


def test_r8_replacing_own_entry_needs_no_room():
    full = [{"manager": f"example.com/m{i}"} for i in range(15)] + [forged()]
    assert answer(admission(), trainjob(patches=full))["allowed"]


# ---- the error table ----

def test_every_reason_named_and_code_from_the_first_sentinel():
    rts = RuntimeIndex([runtime(torch=False)])
    job = trainjob(env=[{"name": "DISPATCH_A", "value": "1"}], numProcPerNode=2,
                   patches=[mount_patch("/opt/dispatch"), mount_patch("/opt/dispatch/x", manager="b.io/y")])
    resp = answer(admission(runtimes=rts), job)
    st = denied(resp, 422, "ErrInvalid")
    assert st["reason"] == "Invalid"
    assert sorted(sentinels(resp)) == ["ErrInvalid"] * 3 + ["ErrUnsupported"]
    assert st["message"].count("; ") == 3
    assert "ErrUnsupported: " in st["message"]
    assert st["details"]["group"] == "trainer.kubeflow.org" and st["details"]["kind"] == "TrainJob"
    assert st["details"]["name"] == "job"


def test_unsupported_and_not_found_together_give_403():
    job = trainjob(runtime_name="nope")
    job["spec"]["runtimeRef"]["kind"] = "Other"
    st = denied(answer(admission(), job), 403, "ErrUnsupported")
    assert st["reason"] == "Forbidden"


def test_a_runtime_is_taken_as_what_the_rules_read_of_it():
    """Sources keep a `Runtime` (names and the mounts under /opt/dispatch), never the object: every rule
    reads the same of it, and a huge runtime is not held whole (R5: too large to check)."""
    import yaml

    from tests.e2e import toolchain
    from tests.helpers import EXAMPLES, runtime, settings
    from webhook.core.registry import runtime_facts
    from webhook.core.runtimes import MAX_NAMES, Runtime

    found = [d for f in sorted((EXAMPLES / "runtimes").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    # Trainer's stock runtimes too (the Go module `make test` downloads before the tests run).
    stock = toolchain.trainer_module() / "manifests" / "base" / "runtimes"
    found += [d for f in sorted(stock.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    assert len(found) > 10
    odd = runtime("odd", jobs={"node": {"containers": "not a list", "volumes": [{"name": "dispatch-publish"}]}})
    odd["spec"]["template"]["spec"]["replicatedJobs"].append("not a job")
    found.append(odd)
    for s in (settings(ROUTE1), settings(ROUTE2), settings({**ROUTE1, **CREDS})):
        for rt in found:
            taken = Runtime.of(rt)
            assert Runtime.of(taken) is taken
            assert runtime_facts(taken, s) == runtime_facts(rt, s), rt["metadata"]["name"]
    odd_facts = runtime_facts(odd, settings(ROUTE1))
    assert [r.rule for r in odd_facts.reasons] == ["R3", "R5"]
    huge = runtime("huge", jobs={"node": {"containers": [{"name": "node"}],
                                          "volumes": [{"name": f"v{i}"} for i in range(MAX_NAMES + 1)]}})
    taken = Runtime.of(huge)
    assert taken.jobs == () and f"more than {MAX_NAMES}" in taken.oversize
    [reason] = runtime_facts(taken, settings(ROUTE1)).reasons
    assert reason.rule == "R5" and "too large to check" in reason.text
