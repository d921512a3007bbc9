"""Adding a rule is one registry entry (a `Rule` with its hook) plus its tests: the proof.

A toy rule, R99, refusing a `spec.trainer.env` name `TOY_FORBIDDEN`, is registered through the public API
(`registry.registered`, which adds it for the length of a `with` and removes it after) and, with no other
edit anywhere, is
- enforced: `/validate` denies with its sentinel, its field and its id;
- counted: in `warn`, the review's `would_deny` carries it, and the metrics' counting path
  (`metrics.count_would_deny`, what the server calls) counts it in `dispatch_admission_would_deny_total`;
- audited: the core audit's finding is a `violation` naming it, and the `audit` command's report lists it;
- documented: the rules reference page that `tools/gen_docs.py` renders has a row and a section for it;
- switched off by the sweep's off-switch (`registry.switched_off`, what `--rule-off` uses): then allowed.
"""

from __future__ import annotations

import io
import sys

from prometheus_client import CollectorRegistry

from tests.helpers import ROOT, admission, answer, mutated, review, settings, stock_runtimes, trainjob
from webhook.commands.audit import Report
from webhook.core import audit, registry
from webhook.core.admission import Admission, Enforcement
from webhook.core.errors import ErrInvalid, Reasons
from webhook.core.rule import Point, Rule
from webhook.core.settings import Settings
from webhook.process import metrics

sys.path.insert(0, str(ROOT / "tools"))

import gen_docs  # noqa: E402

FORBIDDEN = "TOY_FORBIDDEN"
FIELD = "spec.trainer.env[1].name"


def _forbid(rule: Rule, reasons: Reasons, settings: Settings, field: str, name: str) -> None:
    if name == FORBIDDEN:
        reasons.append(rule.refuse(field, f"{name!r} is forbidden by a toy rule"))


TOY = Rule("R99", "none (a test's toy)", ErrInvalid, f"a `spec.trainer.env` name `{FORBIDDEN}`",
           ("spec.trainer.env[].name",), hooks={Point.TRAINER_ENV: _forbid})


def _job() -> dict:
    """A TrainJob as the mutating endpoint leaves it (its entry in place), with the env the toy forbids."""
    job = mutated(admission(), trainjob(env=[{"name": "OTHER", "value": "1"}]))
    job["spec"]["trainer"]["env"].append({"name": FORBIDDEN, "value": "1"})
    return job


def test_a_toy_rule_registered_is_enforced_counted_audited_documented_and_switched_off():
    job = _job()
    assert answer(admission(), job, "validate")["allowed"], "allowed before the toy rule is registered"
    with registry.registered(TOY):
        assert registry.rule("R99") is TOY and registry.RULES[-1] is TOY

        # enforced by /validate, with its sentinel, field and id
        resp = answer(admission(), job, "validate")
        assert not resp["allowed"] and resp["status"]["code"] == 422
        assert resp["status"]["details"]["causes"] == [
            {"reason": "FieldValueInvalid", "message": f"ErrInvalid: {FORBIDDEN!r} is forbidden by a toy rule",
             "field": FIELD}]
        _, outcome = admission().review(review(job), "validate")
        assert [(r.sentinel, r.field, r.rule) for r in outcome.reasons] == [(ErrInvalid, FIELD, "R99")]

        # counted in would_deny: the outcome in warn mode, then the metrics' counting path
        warn = Admission(settings(), stock_runtimes(), enforcement=Enforcement.WARN)
        _, outcome = warn.review(review(job), "validate")
        assert outcome.allowed and outcome.would_deny == (("ErrInvalid", "R99"),)
        families_registry = CollectorRegistry()
        families = metrics.Metrics(families_registry)
        metrics.count_would_deny(families, outcome.would_deny)
        assert families_registry.get_sample_value(
            "dispatch_admission_would_deny_total", {"sentinel": "ErrInvalid", "rule": "R99"}) == 1.0

        # listed by the audit: the core's finding, and the audit command's report of it
        finding = audit.judge_trainjob(admission(), job)
        assert finding.verdict is audit.Verdict.VIOLATION
        assert [(r.field, r.rule) for r in finding.causes] == [(FIELD, "R99")]
        assert finding.as_json()["causes"] == [
            {"sentinel": "ErrInvalid", "field": FIELD, "message": f"{FORBIDDEN!r} is forbidden by a toy rule"}]
        out = io.StringIO()
        report = Report("table", out)
        report.add(finding)
        report.close()
        assert f"violation        TrainJob team-a/job  ErrInvalid: {FIELD}: {FORBIDDEN!r}" in out.getvalue()

        # in the rules reference the docs generator renders
        page = gen_docs.errors_page()
        assert "| [R99](#r99) | ErrInvalid | none (a test's toy) |" in page
        assert f"### R99\n\nRefuses a `spec.trainer.env` name `{FORBIDDEN}`." in page
        assert "checked in `rules.scan`: each `spec.trainer.env` name." in page

        # switched off by the sweep's off-switch: allowed
        with registry.switched_off("R99"):
            assert answer(admission(), job, "validate")["allowed"]
        assert not answer(admission(), job, "validate")["allowed"], "back on after the off-switch"
    assert "R99" not in registry.BY_ID and TOY not in registry.RULES
    assert answer(admission(), job, "validate")["allowed"], "gone once unregistered"
    assert "R99" not in gen_docs.errors_page()


def test_a_rule_id_cannot_be_registered_twice():
    with registry.registered(TOY):
        try:
            with registry.registered(Rule("R99", "x", ErrInvalid, "x", ("x",))):
                raise AssertionError("a second R99 was registered")
        except ValueError as e:
            assert "R99" in str(e)
    assert "R99" not in registry.BY_ID
