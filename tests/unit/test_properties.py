"""Properties over generated TrainJobs: the patch applies, the result validates, mutation is idempotent."""

import copy

from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from tests.helpers import CREDS, ROUTE1, ROUTE2, admission, answer, ops_of
from tests.strategies import trainjobs
from webhook.core import patch, paths

SETTINGS = [ROUTE1, {**ROUTE1, **CREDS}, ROUTE2, CREDS, {}]
ADMISSIONS = [admission(s) for s in SETTINGS]


def publish_dir_mounts(job):
    """(manager, container list, container, mount) for every mount at or under /opt/dispatch, in every entry."""
    for entry in job["spec"].get("runtimePatches", []):
        for rj in entry["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
            pod = rj["template"]["spec"]["template"]["spec"]
            for lst in ("containers", "initContainers"):
                for c in pod.get(lst, []):
                    for m in c.get("volumeMounts", []):
                        if paths.under_publish_dir(paths.skeleton(m["mountPath"])):
                            yield entry["manager"], lst, c["name"], m


@hsettings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(job=trainjobs(), which=st.integers(0, len(SETTINGS) - 1))
def test_admitted_patch_applies_validates_and_is_idempotent(job, which):
    adm = ADMISSIONS[which]
    sent = copy.deepcopy(job)
    resp = answer(adm, job)
    assert job == sent, "the review must not modify the object it was given"
    if not resp["allowed"]:
        assert resp["status"]["code"] in (422, 403, 404)
        assert "patch" not in resp
        return
    result = patch.apply(job, ops_of(resp))
    # On the result: nothing but the webhook's entry mounts at /opt/dispatch, and only the publish volume,
    # read-only on the node container (route 2: also writable on the init container that fills it).
    for manager, lst, container, mount in publish_dir_mounts(result):
        assert manager == adm.settings.manager, (manager, mount)
        assert mount["name"] == "dispatch-publish" and paths.normalise(mount["mountPath"]) == paths.PUBLISH_DIR
        assert (lst, container) == ("containers", "node") and mount["readOnly"] is True or (
            lst == "initContainers" and adm.settings.publish.via == "initContainer")
    again = answer(adm, result)
    assert again["allowed"] and "patch" not in again, "a second mutation must be a no-op"
    valid = answer(adm, result, "validate")
    assert valid["allowed"], valid.get("status")
    own = [e for e in result["spec"].get("runtimePatches", []) if e["manager"] == adm.settings.manager]
    assert len(own) == (1 if adm.settings.configured else 0)
    assert len(result["spec"].get("runtimePatches", [])) <= 16


@hsettings(max_examples=200, deadline=None)
@given(job=trainjobs())
def test_validate_agrees_with_mutate_on_the_result(job):
    adm = ADMISSIONS[0]
    m = answer(adm, job)
    v = answer(adm, job, "validate")
    if not m["allowed"]:
        assert not v["allowed"]
        # The same rule violations, bar S5 which only the validator reports.
        mutate_fields = {c["field"] for c in m["status"]["details"]["causes"]}
        assert mutate_fields <= {c["field"] for c in v["status"]["details"]["causes"]}
