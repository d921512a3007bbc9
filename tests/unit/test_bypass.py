"""The bypass catalogue against the pure core."""

import pytest

from tests.bypass import cases
from tests.helpers import CREDS, MANAGER, ROUTE1, admission, answer, mutated, ops_of, review
from webhook.core import patch, paths

ADM = admission({**ROUTE1, **CREDS})
CASES = cases(lambda job: mutated(ADM, job))


def publish_mounts(job):
    """Every mount at or under /opt/dispatch (or looking like it) outside the webhook's own entry."""
    for entry in job["spec"].get("runtimePatches") or []:
        if entry.get("manager") == MANAGER:
            continue
        for rj in entry.get("trainingRuntimeSpec", {}).get("template", {}).get("spec", {}).get("replicatedJobs", []):
            pod = rj["template"]["spec"]["template"]["spec"]
            for lst in ("containers", "initContainers"):
                for c in pod.get(lst, []):
                    for m in c.get("volumeMounts", []):
                        if paths.under_publish_dir(paths.skeleton(m["mountPath"])):
                            yield m


@pytest.mark.parametrize("name,operation,obj,old,rule", CASES, ids=[c[0] for c in CASES])
def test_bypass_is_refused(name, operation, obj, old, rule):
    kw = {"operation": operation, "old": old}
    v = answer(ADM, obj, "validate", **kw)
    assert v["allowed"] is False, f"validate admitted {name}"
    assert v["status"]["code"] in (400, 403, 422), v["status"]
    # Refused by the rule the trick aims at, not only by another (S5 cannot stand in: the entry is there).
    _, outcome = ADM.review(review(obj, **kw), "validate")
    assert rule in {r.rule for r in outcome.reasons}, outcome.reasons
    assert "S5" not in {r.rule for r in outcome.reasons}
    m = answer(ADM, obj, "mutate", **kw)
    if m["allowed"]:
        result = patch.apply(obj, ops_of(m))
        assert answer(ADM, result, "validate", **kw)["allowed"], f"mutate's result for {name} is not valid"
        assert not list(publish_mounts(result))
