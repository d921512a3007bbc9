"""The rule registry (webhook/core/registry.py) is the one list of rule ids: every id a reason carries in
the code is there, and a rule switched off gives no reason anywhere (what the sweep relies on)."""

import ast

import pytest

from tests.helpers import ROOT, admission, answer, review, runtime, sentinels, stock_runtimes, trainjob
from webhook.core import errors, registry
from webhook.core.runtimes import RuntimeIndex

CORE = ROOT / "webhook" / "core"
LABELS = {r.id for r in registry.RULES} | {label for label, _ in registry.OTHER_LABELS}


def rule_tags_in_code() -> set[str]:
    """The rule of every reason the core makes: `reasons.add(SENTINEL, FIELD, TEXT, RULE)`,
    `Reason(SENTINEL, FIELD, TEXT, RULE)`, `Walk(..., rule=RULE)`, where RULE is a literal or a RULE_ name."""
    consts = {n: getattr(errors, n) for n in dir(errors) if n.startswith("RULE_")}
    found = set()
    for path in CORE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            values = []
            if name in ("add", "Reason") and len(node.args) == 4:
                values.append(node.args[3])
            values += [k.value for k in node.keywords if k.arg == "rule"]
            for v in values:
                if isinstance(v, ast.Constant) and isinstance(v.value, str):
                    found.add(v.value)
                elif isinstance(v, ast.Name) and v.id in consts:
                    found.add(consts[v.id])
    return found


def test_every_rule_id_in_the_code_is_in_the_registry_and_every_rule_is_used():
    used = rule_tags_in_code()
    assert used - LABELS == set()
    assert {r.id for r in registry.RULES} <= used
    assert len(registry.BY_ID) == len(registry.RULES)
    for r in registry.RULES:
        assert r.section and r.refuses and r.reads and r.where


def test_a_rule_switched_off_gives_no_reason_and_comes_back():
    job = trainjob(env=[{"name": "DISPATCH_X", "value": "1"}, {"name": "PET_NNODES", "value": "2"}])
    assert sentinels(answer(admission(), job)) == ["ErrInvalid", "ErrInvalid"]
    with registry.switched_off("S3"):
        resp = answer(admission(), job)
        assert [c["field"] for c in resp["status"]["details"]["causes"]] == ["spec.trainer.env[1].name"]  # R7 only
        with registry.switched_off("R7"):
            assert answer(admission(), job)["allowed"]
    assert len(sentinels(answer(admission(), job))) == 2


def test_switching_off_an_unknown_rule_is_an_error():
    with pytest.raises(KeyError):
        with registry.switched_off("S9"):
            pass


def test_each_rules_sentinel_is_the_one_its_refusals_carry():
    adm = admission(runtimes=RuntimeIndex(list(stock_runtimes()) + [runtime("plain", torch=False)]))
    cases = {"S3": trainjob(env=[{"name": "DISPATCH_X"}]), "R2": trainjob(runtime_name="missing"),
             "R6": trainjob(runtime_name="plain", numProcPerNode=2), "R3": trainjob(runtime_name="no-node")}
    adm.runtimes.put(runtime("no-node", jobs={"w": {"containers": [{"name": "trainer"}]}}))
    for rule_id, job in cases.items():
        _, outcome = adm.review(review(job), "validate")
        assert {r.sentinel for r in outcome.reasons if r.rule == rule_id} == {registry.rule(rule_id).sentinel}, rule_id
