"""Adding a rule is one registry entry (a `Rule` with its hook) plus its tests: the proof.

A toy rule, R99, refusing a `spec.trainer.env` name `TOY_FORBIDDEN`, is registered through the public API
(`registry.DEFAULT.registered`, which adds it for the length of a `with` and removes it after) and, with no other
edit anywhere, is
- enforced: `/validate` denies with its sentinel, its field and its id;
- counted: in `warn`, the review's `would_deny` carries it, and the metrics' counting path
  (`metrics.count_would_deny`, what the server calls) counts it in `dispatch_admission_would_deny_total`;
- audited: the core audit's finding is a `violation` naming it, and the `audit` command's report lists it;
- documented: the rules reference page that `tools/gen_docs.py` renders has a row and a section for it;
- switched off by the sweep's off-switch (`registry.DEFAULT.switched_off`, what `--rule-off` uses): then allowed.

A second, R98 ("refuse hostPath volumes in node containers' runtime"), is one hook at `Point.RUNTIME_MOUNT`:
the runtime's stored facts keep each container's mounts by volume name and each volume's source.

Both live in this module's own `REGISTRY`, which tests/conftest.py honours like the registry's: the tests are
marked for them, and the sweep kills them (`python -m tests.sweep --registry tests.unit.test_toy_rule R98`,
tests/unit/test_sweep.py): a rule it switches off there is not registered by the tests.
"""

from __future__ import annotations

import io
import sys

import pytest
from prometheus_client import CollectorRegistry

from tests.helpers import ROOT, admission, answer, mutated, review, runtime, settings, stock_runtimes, trainjob
from webhook.commands.audit import Report
from webhook.core import registry
from webhook.core.admission import Admission, Enforcement
from webhook.core.errors import ErrInvalid, ErrUnsupported
from webhook.core.rule import Point, Registry, Rule, RuntimeMount, TrainerEnv
from webhook.inspection import audit
from webhook.process import metrics

sys.path.insert(0, str(ROOT / "tools"))

import gen_docs  # noqa: E402

FORBIDDEN = "TOY_FORBIDDEN"
FIELD = "spec.trainer.env[1].name"


def _forbid(rule: Rule, c: TrainerEnv) -> None:
    if c.name == FORBIDDEN:
        c.reasons.append(rule.refuse(c.field, f"{c.name!r} is forbidden by a toy rule"))


TOY = Rule("R99", "none (a test's toy)", ErrInvalid, f"a `spec.trainer.env` name `{FORBIDDEN}`",
           ("spec.trainer.env[].name",), hooks={Point.TRAINER_ENV: _forbid})


def _job() -> dict:
    """A TrainJob as the mutating endpoint leaves it (its entry in place), with the env the toy forbids."""
    job = mutated(admission(), trainjob(env=[{"name": "OTHER", "value": "1"}]))
    job["spec"]["trainer"]["env"].append({"name": FORBIDDEN, "value": "1"})
    return job


@pytest.mark.rules("R99")
def test_a_toy_rule_registered_is_enforced_counted_audited_documented_and_switched_off():
    job = _job()
    assert answer(admission(), job, "validate")["allowed"], "allowed before the toy rule is registered"
    with registry.DEFAULT.registered(*in_force(TOY)):
        assert registry.DEFAULT.by_id.get("R99") is TOY and registry.DEFAULT.rules[-1] is TOY

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
        with registry.DEFAULT.switched_off("R99"):
            assert answer(admission(), job, "validate")["allowed"]
        assert not answer(admission(), job, "validate")["allowed"], "back on after the off-switch"
    assert "R99" not in registry.DEFAULT.by_id and TOY not in registry.DEFAULT.rules
    assert answer(admission(), job, "validate")["allowed"], "gone once unregistered"
    assert "R99" not in gen_docs.errors_page()


def test_a_rule_id_cannot_be_registered_twice():
    with registry.DEFAULT.registered(TOY):
        try:
            with registry.DEFAULT.registered(Rule("R99", "x", ErrInvalid, "x", ("x",))):
                raise AssertionError("a second R99 was registered")
        except ValueError as e:
            assert "R99" in str(e)
    assert "R99" not in registry.DEFAULT.by_id


# ---- R98: a runtime rule, one hook, no other edit ----


def _no_host_path(rule: Rule, c: RuntimeMount) -> None:
    if c.target and c.container.name == "node" and not c.container.init and c.source == "hostPath":
        c.reasons.append(rule.refuse("spec.runtimeRef", f"{c.runtime}: job {c.job.name!r} container 'node' mounts"
                                                        f" hostPath volume {c.volume!r}", subject=str(c.runtime)))


HOST_PATH = Rule("R98", "none (a test's toy)", ErrUnsupported,
                 "a hostPath volume mounted by a target job's `node` container in the runtime",
                 ("runtime: the volumes each container mounts, and their sources",),
                 hooks={Point.RUNTIME_MOUNT: _no_host_path})


def _host_path_runtimes():
    """Stock runtimes, one whose `node` container mounts a hostPath volume, one whose sidecar does."""
    rts = stock_runtimes()
    for name, container in (("host-node", "node"), ("host-sidecar", "sidecar")):
        rts.put(runtime(name, jobs={"node": {
            "volumes": [{"name": "scratch", "emptyDir": {}}, {"name": "host", "hostPath": {"path": "/var/lib/x"}}],
            "containers": [{"name": "node", "volumeMounts": [{"name": "scratch", "mountPath": "/s"}]}] * (
                container != "node") + [{"name": container, "volumeMounts": [
                    {"name": "scratch", "mountPath": "/s"}, {"name": "host", "mountPath": "/h"}]}]}}))
    return rts


# The toy rules' own registry (tests/conftest.py reads a module's REGISTRY): the sweep switches them off here.
REGISTRY = Registry([TOY, HOST_PATH], registry.DEFAULT.malformed)


def in_force(rule: Rule) -> tuple[Rule, ...]:
    """`rule`, unless the sweep has switched it off in REGISTRY: what a test registers."""
    return tuple(r for r in REGISTRY.in_force().rules if r is rule)


@pytest.mark.rules("R98")
def test_a_runtime_rule_with_one_hook_is_enforced_counted_audited_documented_and_switched_off():
    rts = _host_path_runtimes()
    job, fine = trainjob(runtime_name="host-node"), trainjob(runtime_name="host-sidecar")
    assert answer(admission(runtimes=rts), job, "validate")["allowed"] is False, "S5 first: the job lacks the entry"
    assert answer(admission(runtimes=rts), job)["allowed"], "allowed before the rule is registered"
    with registry.DEFAULT.registered(*in_force(HOST_PATH)):
        resp = answer(admission(runtimes=rts), job)
        assert not resp["allowed"] and resp["status"]["code"] == 403
        [cause] = resp["status"]["details"]["causes"]
        assert cause["field"] == "spec.runtimeRef" and "mounts hostPath volume 'host'" in cause["message"]
        assert answer(admission(runtimes=rts), fine)["allowed"], "a sidecar's hostPath is not the rule's"

        warn = Admission(settings(), rts, enforcement=Enforcement.WARN)
        _, outcome = warn.review(review(job), "validate")
        assert outcome.allowed and ("ErrUnsupported", "R98") in outcome.would_deny

        adm = admission(runtimes=rts)
        found = audit.judge_runtime(adm, rts.get("ClusterTrainingRuntime", "", "host-node"))
        assert found.verdict is audit.Verdict.CANNOT_CARRY and [r.rule for r in found.causes] == ["R98"]
        assert audit.judge_trainjob(adm, job).verdict is audit.Verdict.VIOLATION

        page = gen_docs.errors_page()
        assert "| [R98](#r98) | ErrUnsupported | none (a test's toy) |" in page
        assert f"checked in {Point.RUNTIME_MOUNT.where}." in page

        with registry.DEFAULT.switched_off("R98"):
            assert answer(admission(runtimes=rts), job)["allowed"]
    assert answer(admission(runtimes=rts), job)["allowed"] and "R98" not in gen_docs.errors_page()
