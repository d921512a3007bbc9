"""Issue 14's findings, each named after the SPEC section that now says what must hold."""

import copy
import json

import pytest

from tests.helpers import (
    CREDS,
    DIGEST,
    MANAGER,
    ROUTE1,
    Faulty,
    admission,
    answer,
    fields,
    mount_patch,
    mutated,
    pod_patch,
    review,
    runtime,
    stock_runtimes,
    trainjob,
)
from webhook.core import errors
from webhook.core import settings as settings_mod
from webhook.core.errors import Denied
from webhook.core.runtimes import RuntimeIndex, RuntimeUnavailable


def suspended_pre_webhook(**kw) -> dict:
    """A TrainJob created before the webhook (no entry), suspended."""
    return trainjob(suspend=True, **kw)


# ---- SPEC 6.3: updates Trainer must accept ----

@pytest.mark.parametrize("old_suspend", [None, False])
def test_spec_6_3_suspending_a_running_job_without_the_entry_adds_nothing(old_suspend):
    """Trainer refuses any runtimePatches change while the JobSet has active pods: the suspend itself would fail."""
    old = trainjob(suspend=old_suspend)
    new = trainjob(suspend=True)
    for verb in ("mutate", "validate"):
        resp = answer(admission(), new, verb, operation="UPDATE", old=old)
        assert resp["allowed"] and "patch" not in resp, (verb, resp)
    assert any("runs without" in w for w in answer(admission(), new, operation="UPDATE", old=old)["warnings"])


def test_spec_6_3_the_resume_of_a_suspended_job_without_the_entry_adds_nothing():
    """JobSet refuses a volume change to an existing JobSet's pod template: an entry added on resume would
    keep the job from ever resuming (the old behaviour, removed)."""
    old = trainjob(suspend=True)
    new = trainjob(suspend=False)
    resp = answer(admission(), new, operation="UPDATE", old=old)
    assert resp["allowed"] and "patch" not in resp
    assert answer(admission(), new, "validate", operation="UPDATE", old=old)["allowed"]


def deleting(job: dict) -> dict:
    job = copy.deepcopy(job)
    job["metadata"]["deletionTimestamp"] = "2026-11-29T12:00:00Z"
    job["metadata"]["finalizers"] = []
    return job


@pytest.mark.parametrize("verb", ["mutate", "validate"])
def test_spec_6_3_an_object_being_deleted_is_never_refused_nor_mutated(verb):
    old = suspended_pre_webhook(env=[{"name": "DISPATCH_X", "value": "1"}], runtime_name="gone")
    old["metadata"]["finalizers"] = ["example.com/cleanup"]
    old["metadata"]["deletionTimestamp"] = "2026-11-29T12:00:00Z"
    new = deleting(old)
    new["spec"]["runtimePatches"] = [mount_patch("/opt/dispatch")]  # even a change that breaks a rule
    resp = answer(admission(), new, verb, operation="UPDATE", old=old)
    assert resp == {"uid": "uid-1", "allowed": True}


@pytest.mark.parametrize("verb", ["mutate", "validate"])
@pytest.mark.parametrize("broken", ["dispatch-env", "runtime-deleted"])
def test_spec_6_3_a_spec_unchanged_update_is_never_refused_for_what_the_object_was(verb, broken):
    old = (suspended_pre_webhook(env=[{"name": "DISPATCH_X", "value": "1"}]) if broken == "dispatch-env"
           else suspended_pre_webhook(runtime_name="deleted-since"))
    new = copy.deepcopy(old)
    new["metadata"]["labels"] = {"team": "a"}
    resp = answer(admission(), new, verb, operation="UPDATE", old=old)
    assert resp["allowed"] and "patch" not in resp, resp
    if verb == "mutate":  # nothing added, and it says so
        assert any("runs without /opt/dispatch/publish" in w for w in resp["warnings"])


def test_spec_6_3_an_entry_an_update_brings_is_judged_by_s4():
    """No update adds the entry; one that a client brings to a job created without it must equal what the
    settings produce (S4), and what else the object already was (a DISPATCH_ env) does not refuse it."""
    old = suspended_pre_webhook(env=[{"name": "DISPATCH_X", "value": "1"}])
    entry = mutated(admission(), suspended_pre_webhook())["spec"]["runtimePatches"][0]
    new = copy.deepcopy(old)
    new["spec"]["runtimePatches"] = [entry]
    for verb in ("mutate", "validate"):
        resp = answer(admission(), new, verb, operation="UPDATE", old=old)
        assert resp["allowed"] and "patch" not in resp, resp
    new["spec"]["runtimePatches"][0] = {**entry, "manager": MANAGER, "trainingRuntimeSpec": {}}
    for verb in ("mutate", "validate"):
        resp = answer(admission(), new, verb, operation="UPDATE", old=old)
        assert not resp["allowed"] and fields(resp) == ["spec.runtimePatches[0]"], resp


def test_spec_6_3_a_spec_unchanged_update_of_a_running_job_is_not_judged():
    old = trainjob(env=[{"name": "DISPATCH_X", "value": "1"}])
    new = copy.deepcopy(old)
    new["metadata"]["labels"] = {"x": "y"}
    assert answer(admission(), new, "validate", operation="UPDATE", old=old) == {"uid": "uid-1", "allowed": True}


# ---- SPEC 5, R6: numProcPerNode is processes, MPI slots or Flux tasks ----

@pytest.mark.parametrize("policy,allowed", [("torch", True), ("mpi", True), ("flux", True), (None, False)])
def test_spec_5_r6_num_proc_per_node_on_runtimes_that_read_it(policy, allowed):
    rt = runtime(name="rt", torch=False)
    if policy:
        rt["spec"]["mlPolicy"][policy] = {}
    adm = admission(runtimes=RuntimeIndex([rt]))
    resp = answer(adm, trainjob(runtime_name="rt", numProcPerNode=4))
    assert resp["allowed"] is allowed
    if not allowed:
        assert resp["status"]["code"] == 403 and fields(resp) == ["spec.trainer.numProcPerNode"]


def test_spec_5_r6_the_examples_deepspeed_and_mlx_runtimes_use_mpi():
    """Trainer's deepspeed and mlx runtimes carry mlPolicy.mpi: numProcPerNode is MPI slots there."""
    rt = runtime(name="deepspeed-distributed", torch=False)
    rt["spec"]["mlPolicy"]["mpi"] = {"numProcPerNode": 1, "mpiImplementation": "OpenMPI"}
    assert answer(admission(runtimes=RuntimeIndex([rt])), trainjob(runtime_name="deepspeed-distributed",
                                                                     numProcPerNode=8))["allowed"]


# ---- SPEC 5, S6: credentials cannot be replaced by a later entry ----

def test_spec_5_s6_credential_volume_and_mount_path_are_the_webhooks():
    adm = admission({**ROUTE1, **CREDS})
    job = trainjob(patches=[
        pod_patch("example.com/other", {"volumes": [{"name": "checkpoint-store", "emptyDir": {}}]}),
        mount_patch("/var/run/dispatch/creds/token"),
        mount_patch("/var/run/dispatch/credsx"),  # a sibling, not under it
    ])
    resp = answer(adm, job, "validate")
    s6 = [c for c in resp["status"]["details"]["causes"] if "credential" in c["message"]]
    assert [c["field"].rsplit(".", 2)[-2:] for c in s6] == [["volumes[0]", "name"], ["volumeMounts[0]", "mountPath"]]
    assert not answer(adm, trainjob(patches=[mount_patch("/var/run/dispatch/credsx")]), "mutate").get("status")


def test_spec_5_s6_applies_only_with_credentials():
    job = trainjob(patches=[pod_patch("example.com/other",
                                      {"volumes": [{"name": "checkpoint-store", "emptyDir": {}}]})])
    assert answer(admission(ROUTE1), job)["allowed"]


# ---- SPEC 4: every reason, once, bounded, with Kubernetes CauseTypes ----

@pytest.mark.parametrize("exc,sentinel",
                         [(KeyError("boom"), "ErrInternal"), (RuntimeUnavailable("down"), "ErrUnavailable")])
def test_spec_4_a_fault_met_while_checking_keeps_the_reasons_found_before_it(exc, sentinel):
    job = trainjob(patches=[mount_patch("/opt/dispatch")], env=[{"name": "DISPATCH_X", "value": "1"}])
    resp = answer(admission(runtimes=Faulty(exc)), job, "validate")
    causes = resp["status"]["details"]["causes"]
    assert resp["status"]["code"] == 422  # ErrInvalid comes first in the table
    assert [c["message"].split(":")[0] for c in causes].count("ErrInvalid") >= 2
    assert sentinel in [c["message"].split(":")[0] for c in causes]


def test_spec_4_cause_reasons_are_kubernetes_cause_types():
    assert {s.name: s.cause_type for s in errors.Sentinel} == {
        "ErrInvalid": "FieldValueInvalid", "ErrUnsupported": "FieldValueNotSupported",
        "ErrNotFound": "FieldValueNotFound", "ErrUnavailable": "UnexpectedServerResponse",
        "ErrInternal": "InternalError"}
    resp = answer(admission(runtimes=Faulty(RuntimeUnavailable("down"))), trainjob())
    assert resp["status"]["details"]["causes"][0]["reason"] == "UnexpectedServerResponse"


def test_spec_4_a_denial_is_bounded():
    """A 3.75 MiB TrainJob breaking a rule 76,800 times gave a 38 MiB answer; now 50 causes, 16 KiB."""
    mounts = [{"name": "v", "mountPath": f"/opt/dispatch/{i}"} for i in range(2000)]
    patches = [pod_patch(f"m{j}.example.com/x", {"containers": [{"name": "node", "volumeMounts": mounts}]})
               for j in range(16)]
    resp = answer(admission(), trainjob(patches=patches, runtime_name="missing"), "validate")
    st = resp["status"]
    causes = st["details"]["causes"]
    assert len(causes) == 50 and causes[-1]["field"] == "(more)"
    assert f"{16 * 2000 + 2 - 49} more reasons left out" in causes[-1]["message"]
    assert len(st["message"].encode()) <= 16 * 1024 and st["message"].startswith("ErrInvalid: ")
    assert st["code"] == 422
    assert len(json.dumps(resp)) < 64 * 1024


def test_spec_4_the_code_comes_from_all_reasons_not_only_those_listed():
    reasons = [errors.Reason(errors.ErrNotFound, f"f{i}", "x") for i in range(60)] + [
        errors.Reason(errors.ErrInvalid, "last", "y")]
    st = errors.status(reasons, "n")
    assert st["code"] == 422 and len(st["details"]["causes"]) == 50


@pytest.mark.parametrize("spec_change,field", [
    ({"runtimePatches": {"a": 1}}, "spec.runtimePatches"),
    ({"runtimeRef": {"name": 7}}, "spec.runtimeRef.name"),
])
def test_spec_4_each_reason_is_reported_once(spec_change, field):
    job = trainjob()
    job["spec"].update(spec_change)
    for verb in ("mutate", "validate"):
        causes = answer(admission(), job, verb)["status"]["details"]["causes"]
        assert [c["field"] for c in causes].count(field) == 1, causes


# ---- SPEC 2: settings ----

def test_spec_2_settings_errors_say_null_as_json_does():
    for doc in ({"publish": {"image": "a@" + DIGEST, "via": None}}, {"manager": None}, {"credentials": [None]}):
        with pytest.raises(Denied) as e:
            settings_mod.parse(json.dumps(doc))
        assert "None" not in str(e.value) and "null" in str(e.value)


@pytest.mark.parametrize("image", [f"[fd00::1]:5000/publish@{DIGEST}", f"[::1]/dispatch/publish@{DIGEST}"])
def test_spec_2_an_ipv6_registry_host_is_accepted(image):
    s = settings_mod.parse(json.dumps({"publish": {"image": image}}))
    assert s.publish.image == image
    import jsonschema
    assert jsonschema.Draft202012Validator(settings_mod.schema()).is_valid({"publish": {"image": image}})


@pytest.mark.parametrize("image", [f"[fd00::1]:5000/publish:v1@{DIGEST}", f"[fd00::zz]/publish@{DIGEST}",
                                   f"fd00::1/publish@{DIGEST}"])
def test_spec_2_ipv6_look_alikes_are_still_refused(image):
    with pytest.raises(Denied):
        settings_mod.parse(json.dumps({"publish": {"image": image}}))


def test_spec_2_a_required_key_is_named_from_the_schema_not_its_message():
    with pytest.raises(Denied) as e:
        settings_mod.parse('{"credentials": [{"name": "a"}]}')
    assert [r.field for r in e.value.reasons] == ["credentials[0].secret", "credentials[0].mountPath"]


def test_review_reads_nothing_of_the_object_to_choose_the_mode():
    """SPEC 8.1: the mode is never read from the object under review."""
    job = trainjob(patches=[mount_patch("/opt/dispatch")])
    job["metadata"]["annotations"] = {"dispatch-admission/enforcement": "warn"}
    job["metadata"]["labels"] = {"enforcement": "warn"}
    assert answer(admission(), job, "validate")["allowed"] is False
    assert stock_runtimes()  # the example runtimes load (used above)
    assert review(job)["request"]["object"] is job
