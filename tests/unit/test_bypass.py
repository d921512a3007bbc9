"""The bypass catalogue against the pure core."""

import pytest

from tests.bypass import cases, publish_mounts
from tests.helpers import CREDS, ROUTE1, admission, answer, mutated, ops_of, review
from webhook.core import patch

ADM = admission({**ROUTE1, **CREDS})
CASES = cases(lambda job: mutated(ADM, job))


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
