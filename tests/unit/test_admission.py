"""The AdmissionReview envelope and the create/update semantics of SPEC 6 and 7."""

import copy

import pytest

from tests.helpers import (
    CREDS,
    IMAGE,
    MANAGER,
    NOW_TEXT,
    ROUTE2,
    admission,
    answer,
    forged,
    mutated,
    ops_of,
    pod_patch,
    review,
    runtime,
    trainjob,
)
from webhook.core import patch
from webhook.core.admission import BadReview
from webhook.core.runtimes import RuntimeIndex, RuntimeUnavailable


def node_spec(entry, job=0):
    replicated_job = entry["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][job]
    return replicated_job["template"]["spec"]["template"]["spec"]


# ---- envelope ----

@pytest.mark.parametrize("doc", [
    None, [], "x", {}, {"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": {"uid": "u"}},
    {"apiVersion": "admission.k8s.io/v1", "kind": "Other", "request": {"uid": "u"}},
    {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"},
    {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": []},
    {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {}},
    {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": ""}},
    {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": 5}},
])
def test_bad_reviews_are_a_broken_request(doc):
    with pytest.raises(BadReview):
        admission().review(doc, "mutate")


def test_create_without_object_is_a_broken_request():
    doc = review(trainjob())
    del doc["request"]["object"]
    with pytest.raises(BadReview):
        admission().review(doc, "mutate")


def test_uid_echoed_and_shape():
    resp, outcome = admission().review(review(trainjob(), uid="abc-123"), "mutate")
    assert resp["apiVersion"] == "admission.k8s.io/v1" and resp["kind"] == "AdmissionReview"
    assert resp["response"]["uid"] == "abc-123" and resp["response"]["patchType"] == "JSONPatch"
    assert outcome.allowed and outcome.intercepted


@pytest.mark.parametrize("kw", [
    {"operation": "DELETE"}, {"operation": "CONNECT"}, {"resource": "pods", "group": ""},
    {"sub_resource": "status"}, {"group": "example.com"},
])
def test_other_requests_allowed_unchanged(kw):
    bad = trainjob(patches=[pod_patch("a.io/x", {"volumes": [{"name": "dispatch-publish"}]})])
    resp = answer(admission(), bad, **kw)
    assert resp == {"uid": "uid-1", "allowed": True}


def test_dry_run_gets_the_same_answer():
    adm = admission()
    for job in (trainjob(), trainjob(runtime_name="missing")):
        assert answer(adm, job, dry_run=True) == answer(adm, job, dry_run=False)


def test_validate_never_patches():
    adm = admission()
    resp = answer(adm, mutated(adm, trainjob()), "validate")
    assert resp == {"uid": "uid-1", "allowed": True}


class FailingSource:
    """A runtime source whose every lookup raises `error`."""

    def __init__(self, error: Exception):
        self.error = error

    def get(self, *a):
        raise self.error

    def ready(self):
        return False


def test_internal_fault_is_denied_not_admitted():
    resp = answer(admission(runtimes=FailingSource(KeyError("boom"))), trainjob())
    assert resp["allowed"] is False and resp["status"]["code"] == 500
    assert resp["status"]["reason"] == "InternalError" and "patch" not in resp


def test_unavailable_runtime_source_is_503():
    resp = answer(admission(runtimes=FailingSource(RuntimeUnavailable("cache not yet synced"))), trainjob())
    assert resp["status"]["code"] == 503 and resp["status"]["message"].startswith("ErrUnavailable: spec.runtimeRef: ")


@pytest.mark.parametrize("obj", [
    {"spec": "x"}, {"spec": {"runtimePatches": "x", "runtimeRef": {"name": "torch-distributed"}}},
    {"spec": {"runtimePatches": [1, None], "runtimeRef": {"name": "torch-distributed"}}},
    {"spec": {"runtimeRef": {"name": 5}}}, {"spec": {"runtimeRef": "x"}}, {"spec": {}},
    {"metadata": [], "spec": {"runtimeRef": {"name": "torch-distributed"}, "trainer": {"env": "x"}}},
    {"spec": {"runtimeRef": {"name": "torch-distributed"}, "runtimePatches": [
        {"manager": "a.io/b", "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
            {"name": "node", "template": {"spec": {"template": {"spec": {"containers": [
                {"name": "node", "volumeMounts": [{"mountPath": 7}]}]}}}}}]}}}}]}},
])
def test_malformed_objects_are_invalid_not_errors(obj):
    resp = answer(admission(), obj)
    assert resp["allowed"] is False and resp["status"]["code"] == 422


# ---- 6.1 the entry ----

def test_route1_entry_exactly():
    job = mutated(admission({"publish": {"image": IMAGE}, **CREDS}), trainjob())
    (entry,) = job["spec"]["runtimePatches"]
    assert entry == {
        "manager": MANAGER,
        "time": NOW_TEXT,
        "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [{"name": "node", "template": {"spec": {
            "template": {"spec": {
                "volumes": [
                    {"name": "dispatch-publish", "image": {"reference": IMAGE, "pullPolicy": "IfNotPresent"}},
                    {"name": "checkpoint-store", "secret": {"secretName": "s3-credentials"}},
                ],
                "containers": [{"name": "node", "volumeMounts": [
                    {"name": "dispatch-publish", "mountPath": "/opt/dispatch", "readOnly": True},
                    {"name": "checkpoint-store", "mountPath": "/var/run/dispatch/creds", "readOnly": True},
                ]}],
            }}}}}]}}},
    }


def test_route2_entry_exactly():
    rts = RuntimeIndex([runtime(jobs={"node": {"initContainers": [{"name": "dispatch-publish"}],
                                               "containers": [{"name": "node"}]}})])
    adm = admission(ROUTE2, runtimes=rts)
    resp = answer(adm, trainjob())
    assert resp["allowed"]
    assert any("end to end" in w for w in resp["warnings"])
    spec = node_spec(ops_of(resp)[0]["value"][0])
    assert spec == {
        "volumes": [{"name": "dispatch-publish", "emptyDir": {}}],
        "initContainers": [{"name": "dispatch-publish",
                            "env": [{"name": "DISPATCH_PUBLISH_DEST", "value": "/opt/dispatch"}],
                            "volumeMounts": [{"name": "dispatch-publish", "mountPath": "/opt/dispatch"}]}],
        "containers": [{"name": "node", "volumeMounts": [{"name": "dispatch-publish", "mountPath": "/opt/dispatch",
                                                          "readOnly": True}]}],
    }


def test_credentials_only_entry_has_no_publish_volume():
    spec = node_spec(mutated(admission(CREDS), trainjob())["spec"]["runtimePatches"][0])
    assert [v["name"] for v in spec["volumes"]] == ["checkpoint-store"]


def test_nothing_configured_no_entry():
    resp = answer(admission({}), trainjob())
    assert resp == {"uid": "uid-1", "allowed": True}


def test_mpi_launcher_both_jobs_patched():
    job = mutated(admission(), trainjob(runtime_name="mpi-launcher"))
    jobs = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert [j["name"] for j in jobs] == ["node", "launcher"]


# ---- 6.2 create ----

def test_appended_after_existing_entries():
    job = mutated(admission(), trainjob(patches=[{"manager": "a.io/x"}, {"manager": "b.io/y"}]))
    assert [e["manager"] for e in job["spec"]["runtimePatches"]] == ["a.io/x", "b.io/y", MANAGER]


def test_list_created_when_absent():
    ops = ops_of(answer(admission(), trainjob()))
    assert ops[0]["op"] == "add" and ops[0]["path"] == "/spec/runtimePatches"


def test_time_kept_when_content_unchanged():
    adm = admission()
    job = mutated(adm, trainjob())
    job["spec"]["runtimePatches"][0]["time"] = "2020-01-01T00:00:00Z"
    assert "patch" not in answer(adm, job)
    assert answer(adm, job, endpoint="validate")["allowed"]


def test_json_pointer_escaping():
    assert patch._pointer("metadata", "annotations", "a/b~c") == "/metadata/annotations/a~1b~0c"


# ---- 6.3 update ----

def created(adm, **kw):
    return mutated(adm, trainjob(**kw))


def test_label_change_on_running_job_untouched():
    adm = admission()
    old = created(adm, suspend=False)
    new = copy.deepcopy(old)
    new["metadata"]["labels"] = {"a": "b"}
    for ep in ("mutate", "validate"):
        resp = answer(adm, new, ep, operation="UPDATE", old=old)
        assert resp == {"uid": "uid-1", "allowed": True}


def test_metadata_update_allowed_even_when_runtime_is_gone():
    old = created(admission())
    new = copy.deepcopy(old)
    new["metadata"]["finalizers"] = []
    gone = admission(runtimes=RuntimeIndex([]))
    assert answer(gone, new, "validate", operation="UPDATE", old=old)["allowed"]


@pytest.mark.rules("update")
def test_editing_the_entry_is_refused():
    adm = admission()
    old = created(adm, suspend=True)
    new = copy.deepcopy(old)
    node_spec(new["spec"]["runtimePatches"][0])["containers"][0]["volumeMounts"][0]["readOnly"] = False
    for ep in ("mutate", "validate"):
        resp = answer(adm, new, ep, operation="UPDATE", old=old)
        assert resp["allowed"] is False and "immutable" in resp["status"]["message"]


def test_time_only_change_is_not_an_edit():
    adm = admission()
    old = created(adm)
    new = copy.deepcopy(old)
    new["spec"]["runtimePatches"][0]["time"] = "2027-01-01T00:00:00Z"
    assert answer(adm, new, "validate", operation="UPDATE", old=old)["allowed"]


@pytest.mark.rules("update")
def test_removed_entry_put_back_at_its_old_position():
    adm = admission()
    old = created(adm, patches=[{"manager": "a.io/x"}, {"manager": "b.io/y"}])
    old["spec"]["runtimePatches"].insert(1, old["spec"]["runtimePatches"].pop())  # ours in the middle
    new = copy.deepcopy(old)
    del new["spec"]["runtimePatches"][1]
    resp = answer(adm, new, operation="UPDATE", old=old)
    assert resp["allowed"] and any("put back" in w for w in resp["warnings"])
    restored = patch.apply(new, ops_of(resp))
    assert restored["spec"]["runtimePatches"] == old["spec"]["runtimePatches"]
    st = answer(adm, new, "validate", operation="UPDATE", old=old)
    assert st["allowed"] is False and "removed" in st["status"]["message"]


def test_removed_whole_list_put_back():
    adm = admission()
    old = created(adm)
    new = copy.deepcopy(old)
    del new["spec"]["runtimePatches"]
    restored = patch.apply(new, ops_of(answer(adm, new, operation="UPDATE", old=old)))
    assert restored == old


def assert_update_allowed_unpatched_with_warning(adm, new, old, warning):
    for ep in ("mutate", "validate"):
        resp = answer(adm, new, ep, operation="UPDATE", old=old)
        assert resp["allowed"] and "patch" not in resp
        assert any(warning in w for w in resp["warnings"])


def test_settings_rollout_keeps_the_old_entry_and_says_nothing():
    """SPEC 6.3: a stale entry is kept as it is, unsaid on updates (`audit` reports it)."""
    old = created(admission())
    new = copy.deepcopy(old)
    new["spec"]["suspend"] = True
    later = admission({"publish": {"image": "publish@sha256:" + "c" * 64}})
    for ep in ("mutate", "validate"):
        assert answer(later, new, ep, operation="UPDATE", old=old) == {"uid": "uid-1", "allowed": True}


def test_no_update_adds_the_entry():
    """SPEC 6.3: the entry is written on CREATE only; a job without it is told it runs without the mount."""
    adm = admission()
    for old, new in ((trainjob(suspend=True), trainjob(suspend=False)),   # resume
                     (trainjob(suspend=False), trainjob(suspend=True)),   # suspend
                     (trainjob(), trainjob(numNodes=3))):                 # another spec change
        resp = answer(adm, new, operation="UPDATE", old=old)
        assert resp["allowed"] and "patch" not in resp
        assert any("runs without /opt/dispatch/publish" in w for w in resp["warnings"])
        assert answer(adm, new, "validate", operation="UPDATE", old=old)["allowed"]


def test_update_that_adds_a_mount_is_checked():
    adm = admission()
    old = created(adm, suspend=True)
    new = copy.deepcopy(old)
    new["spec"]["runtimePatches"].insert(0, pod_patch("a.io/x", {"containers": [
        {"name": "node", "volumeMounts": [{"name": "v", "mountPath": "/opt/dispatch/p"}]}]}))
    for ep in ("mutate", "validate"):
        assert answer(adm, new, ep, operation="UPDATE", old=old)["allowed"] is False


def test_forged_entry_on_update_of_running_job_refused():
    adm = admission()
    old = trainjob()
    new = trainjob(patches=[forged()])
    resp = answer(adm, new, "validate", operation="UPDATE", old=old)
    assert resp["allowed"] is False and resp["status"]["code"] == 422


def test_warnings_are_short_plain_sentences():
    adm = admission(ROUTE2,
                    runtimes=RuntimeIndex([runtime(jobs={"node": {"initContainers": [{"name": "dispatch-publish"}],
                                                                  "containers": [{"name": "node"}]}})]))
    warnings = answer(adm, trainjob())["warnings"]
    assert warnings and all(len(w) <= 120 and not w.lower().startswith("warning") for w in warnings)


def test_a_long_warning_is_cut_to_120_characters():
    from webhook.core.review import warning

    long = "the runtime " + "x" * 300 + " cannot carry the mount"
    assert len(warning(long)) == 120 and warning(long).endswith("...")
    assert warning("two  spaces\nand a newline") == "two spaces and a newline"


def test_encoded_patch_is_the_json_of_the_operations():
    import base64
    import json as _json

    adm = admission({"publish": {"image": IMAGE}, **CREDS})
    for job in (trainjob(), trainjob(patches=[{"manager": "a.io/x"}]), trainjob(runtime_name="mpi-launcher")):
        for _ in range(2):  # the second time from the cached serialisation
            resp, outcome = adm.review(review(job), "mutate")
            assert _json.loads(base64.b64decode(resp["response"]["patch"])) == [op.as_dict() for op in outcome.ops]


def test_nothing_handed_out_changes_later_answers():
    """An answer's operations and entry are copies: changing them leaves the per-runtime cache intact."""
    adm = admission()
    first = ops_of(answer(adm, trainjob()))
    _, outcome = adm.review(review(trainjob()), "mutate")
    handed = outcome.ops[0].as_dict()
    handed["value"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"].clear()
    first[0]["value"][0]["manager"] = "evil.io/x"
    assert ops_of(answer(adm, trainjob())) == ops_of(answer(admission(), trainjob()))


@pytest.mark.parametrize("value", [1, 1.0, "true"])
def test_entries_compare_as_json_values(value):
    """readOnly: 1 equals True in Python, not in JSON: a forged entry must not pass for the computed one."""
    adm = admission()
    job = mutated(adm, trainjob())
    node_spec(job["spec"]["runtimePatches"][0])["containers"][0]["volumeMounts"][0]["readOnly"] = value
    resp = answer(adm, job, "validate")
    assert resp["allowed"] is False and "differs" in resp["status"]["message"]
