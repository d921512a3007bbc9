"""The rule registry (webhook/core/registry.py) is the one list of rule ids: every id a reason carries in
the code is there, and a rule switched off gives no reason anywhere (what the sweep relies on)."""

import ast
import dataclasses

import pytest

from tests.helpers import NOW, ROOT, admission, answer, review, runtime, sentinels, settings, stock_runtimes, trainjob
from webhook.core import errors, registry
from webhook.core.admission import Admission
from webhook.core.rule import Point, Registry, Unreadable
from webhook.core.runtimes import RuntimeIndex

CORE = ROOT / "webhook" / "core"
LABELS = {r.id for r in registry.RULES} | {label for label, _ in registry.OTHER_LABELS}


def rule_tags_in_code() -> set[str]:
    """Every rule label written in the core outside the registry: the 4th argument of `reasons.add(...)` or
    `Reason(...)`, a `rule=` keyword, or a string compared with something (`r.rule == "R2"`), where the label
    is a literal or a RULE_ name. A reason of a rule is made through its rule (`registry.R2.refuse`), so no
    rule id may be among them."""
    consts = {n: getattr(errors, n) for n in dir(errors) if n.startswith("RULE_")}
    found = set()
    for path in CORE.glob("*.py"):
        if path.name in ("registry.py", "errors.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            values: list[ast.expr] = []
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name in ("add", "Reason") and len(node.args) == 4:
                    values.append(node.args[3])
                values += [k.value for k in node.keywords if k.arg == "rule"]
            elif isinstance(node, ast.Compare):
                values += [node.left, *node.comparators]
            for v in values:
                if isinstance(v, ast.Constant) and isinstance(v.value, str) and v.value in LABELS:
                    found.add(v.value)
                elif isinstance(v, ast.Name) and v.id in consts:
                    found.add(consts[v.id])
    return found


def test_no_rule_id_is_written_beside_a_check_and_every_rule_has_a_check():
    assert rule_tags_in_code() - {label for label, _ in registry.OTHER_LABELS} == set()
    for r in registry.RULES + (registry.MALFORMED,):
        assert r.section and r.refuses and r.reads and r.where, r.id
        assert r.hooks, f"{r.id} has no hook"
        for point, hook in r.hooks.items():
            assert isinstance(point, Point) and point.where in r.where and callable(hook)
    assert len(registry.DEFAULT.by_id) == len(registry.DEFAULT.rules) == len(registry.RULES)


def test_every_rule_is_hooks_at_typed_points_and_the_walks_know_no_rule():
    """Issue 49: no `checks.on(...)` ladder beside the hooks, the walks import no registry, and the registry is
    an object handed to `Admission`, never module state reassigned."""
    for path in CORE.glob("*.py"):
        assert "checks.on(" not in path.read_text(), path.name
    tree = ast.parse((CORE / "rules.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names} | {
        n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "registry" not in imported
    assert not [n for n in ast.walk(ast.parse((CORE / "registry.py").read_text())) if isinstance(n, ast.Global)]
    for point in Point:  # one context object per point: a frozen dataclass
        params = point.context.__dataclass_params__
        assert params.frozen and "reasons" in {f.name for f in dataclasses.fields(point.context)}, point
    with pytest.raises(AssertionError):  # a point is given its own context type only
        registry.DEFAULT.in_force().call(Point.ROOM, Unreadable(errors.Reasons(), "f", "t"))
    other = Registry(registry.RULES[:1], registry.MALFORMED)  # S1 alone
    job = trainjob(env=[{"name": "DISPATCH_X", "value": "1"}])
    assert not answer(admission(), job)["allowed"]
    assert answer(Admission(settings(), stock_runtimes(), clock=lambda: NOW, registry=other), job)["allowed"]
    assert other.find("malformed") is registry.MALFORMED and other.find("S3") is None


def test_a_reason_is_made_through_its_rule_with_its_id_and_sentinel():
    r1 = registry.DEFAULT.rule("R1")
    assert r1.refuse("spec.runtimeRef.kind", "x") == errors.Reason(r1.sentinel, "spec.runtimeRef.kind", "x", "R1")
    assert r1.refuse("spec.runtimeRef", "required", sentinel=errors.ErrInvalid).sentinel is errors.ErrInvalid
    with pytest.raises(ValueError):
        registry.DEFAULT.rule("S3").refuse("spec.trainer.env[0].name", "x", sentinel=errors.ErrNotFound)


def test_a_malformed_object_has_an_id_of_its_own_that_cannot_be_switched_off():
    job = trainjob(patches=[{"manager": "other.example.com/x", "trainingRuntimeSpec": []}])
    _, outcome = admission().review(review(job), "validate")
    assert ("malformed", "spec.runtimePatches[0].trainingRuntimeSpec") in [(r.rule, r.field) for r in outcome.reasons]
    assert "S2" not in {r.rule for r in outcome.reasons}  # no longer counted as a mount under /opt/dispatch
    with pytest.raises(KeyError):
        with registry.DEFAULT.switched_off("malformed"):
            pass
    with registry.DEFAULT.switched_off(*registry.DEFAULT.by_id):  # every rule off: what cannot be read is still refused
        _, outcome = admission().review(review(job), "validate")
        assert [r.rule for r in outcome.reasons] == ["malformed"]


def test_a_rule_switched_off_gives_no_reason_and_comes_back():
    job = trainjob(env=[{"name": "DISPATCH_X", "value": "1"}, {"name": "PET_NNODES", "value": "2"}])
    assert sentinels(answer(admission(), job)) == ["ErrInvalid", "ErrInvalid"]
    with registry.DEFAULT.switched_off("S3"):
        resp = answer(admission(), job)
        assert [c["field"] for c in resp["status"]["details"]["causes"]] == ["spec.trainer.env[1].name"]  # R7 only
        with registry.DEFAULT.switched_off("R7"):
            assert answer(admission(), job)["allowed"]
    assert len(sentinels(answer(admission(), job))) == 2


def test_switching_off_an_unknown_rule_is_an_error():
    with pytest.raises(KeyError):
        with registry.DEFAULT.switched_off("S9"):
            pass


def test_each_rules_sentinel_is_the_one_its_refusals_carry():
    adm = admission(runtimes=RuntimeIndex(list(stock_runtimes()) + [runtime("plain", torch=False)]))
    cases = {"S3": trainjob(env=[{"name": "DISPATCH_X"}]), "R2": trainjob(runtime_name="missing"),
             "R6": trainjob(runtime_name="plain", numProcPerNode=2), "R3": trainjob(runtime_name="no-node")}
    adm.runtimes.put(runtime("no-node", jobs={"w": {"containers": [{"name": "trainer"}]}}))
    for rule_id, job in cases.items():
        _, outcome = adm.review(review(job), "validate")
        want = registry.DEFAULT.rule(rule_id).sentinel
        assert {r.sentinel for r in outcome.reasons if r.rule == rule_id} == {want}, rule_id
