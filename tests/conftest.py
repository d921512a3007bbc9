"""Hypothesis profiles: CI runs a fixed, reproducible set of examples (derandomized, so CI judges the
change, not the luck of the draw); local runs and the long release run draw new ones each time.

The rules' tests are marked for the sweep (tests/sweep.py): a test named `test_<rule>_...` or
`test_spec_5_<rule>_...` (any id of `registry.DEFAULT`) is marked for that rule, others with
`@pytest.mark.rules("<id>", ...)`; `--rule-off ID` runs the session with that rule switched off, and
`--sweep-report FILE` writes how each test ended, for the sweep to read. A test module may hold test-only rules
in a `REGISTRY` of its own (a `rule.Registry`; tests/unit/test_toy_rule.py): its tests are marked for them the same
way, and `--rule-off` switches them off there (`python -m tests.sweep --registry MODULE ID`).
"""

import contextlib
import json
import os
import re

import pytest
from hypothesis import settings

from tests.process import Serve
from webhook.core import registry
from webhook.core.rule import Registry

# No per-example deadline: under a loaded machine (the whole suite, CI) a slow example is not a failure.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True, deadline=None)
settings.register_profile("dev", print_blob=True, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def _named(reg: Registry) -> re.Pattern[str]:
    """The test names marked for `reg`'s rules: `test_<id>_...` or `test_spec_5_<id>_...`."""
    return re.compile(r"^test_(?:spec_5_)?(" + "|".join(re.escape(r.id.lower()) for r in reg.rules) + ")_")


# The ids come from the registry: a rule added there (R9, S7) marks its tests without an edit here.
_NAMED = _named(registry.DEFAULT)


def pytest_addoption(parser):
    parser.addoption("--rule-off", action="append", default=[], metavar="ID",
                     help="switch this rule off for the session (the sweep)")
    parser.addoption("--sweep-report", metavar="FILE", help="write each test's end as JSON (the sweep)")


def pytest_configure(config):
    config.addinivalue_line("markers", "rules(*ids): the test checks these rules (the sweep runs it for each)")
    for r in registry.DEFAULT.rules:
        config.addinivalue_line("markers", f"rule_{r.id}: marked for rule {r.id} (set from the name or rules())")
    config._rules_off = contextlib.ExitStack()
    off = config.getoption("rule_off")
    ours = [r for r in off if r in registry.DEFAULT.by_id]
    if ours:
        config._rules_off.enter_context(registry.DEFAULT.switched_off(*ours))
    # The others are a test module's own: switched off in its REGISTRY once collection has imported it.
    config._rules_off_elsewhere = [r for r in off if r not in registry.DEFAULT.by_id]
    config._sweep_outcomes = []


def pytest_unconfigure(config):
    config._rules_off.close()
    path = config.getoption("sweep_report", None)
    if path:
        with open(path, "w") as f:
            json.dump(config._sweep_outcomes, f)


def own_registry(item) -> Registry | None:
    """The test-only rules of the item's module (its `REGISTRY`), if it has any."""
    found = getattr(getattr(item, "module", None), "REGISTRY", None)
    return found if isinstance(found, Registry) else None


def rules_of(item, own: Registry | None = None) -> set[str]:
    found = {m for mark in item.iter_markers("rules") for m in mark.args}
    name = getattr(item, "originalname", item.name)
    for reg, named in ((registry.DEFAULT, _NAMED), *(((own, _named(own)),) if own else ())):
        match = named.match(name) if reg.rules else None
        if match:
            found.add(next(r.id for r in reg.rules if r.id.lower() == match.group(1)))
    return found


def _take_own(config, own: Registry, seen: list[Registry]) -> None:
    """A module's REGISTRY met for the first time: its markers declared, the rules `--rule-off` names switched off."""
    seen.append(own)
    for r in own.rules:
        config.addinivalue_line("markers", f"rule_{r.id}: marked for the test-only rule {r.id}")
    off = [r for r in config._rules_off_elsewhere if r in own.by_id]
    if off:
        config._rules_off.enter_context(own.switched_off(*off))


def pytest_collection_modifyitems(config, items):
    seen: list[Registry] = []
    for item in items:
        own = own_registry(item)
        if own is not None and all(own is not s for s in seen):
            _take_own(config, own, seen)
        for rule_id in rules_of(item, own):
            if rule_id not in registry.DEFAULT.by_id and (own is None or rule_id not in own.by_id):
                raise pytest.UsageError(f"{item.nodeid}: no rule {rule_id!r} in webhook/core/registry.py"
                                        " or the module's REGISTRY")
            item.add_marker(f"rule_{rule_id}")
    unknown = [r for r in config._rules_off_elsewhere if not any(r in s.by_id for s in seen)]
    if unknown:
        raise pytest.UsageError(f"--rule-off: no rule {', '.join(unknown)} in webhook/core/registry.py"
                                " or a collected test module's REGISTRY")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if item.config.getoption("sweep_report", None) and (report.when == "call" or report.outcome != "passed"):
        assertion = call.excinfo is not None and call.excinfo.errisinstance(AssertionError)
        item.config._sweep_outcomes.append({"test": item.nodeid, "when": report.when, "outcome": report.outcome,
                                            "assertion": bool(assertion)})


@pytest.fixture
def serve(tmp_path_factory):
    """The one server fixture: `serve(*args, settings=, kubeconfig=, metrics=, env=, ...)` starts
    `dispatch-admission serve` (tests/process.py: `Serve`) and returns its `Webhook`; every server it started
    is stopped when the test ends."""
    with contextlib.ExitStack() as stack:
        yield Serve(stack, tmp_path_factory)


@pytest.fixture(scope="module")
def serve_module(tmp_path_factory):
    """`serve` for the servers a module's tests share: stopped when the module's last test ends."""
    with contextlib.ExitStack() as stack:
        yield Serve(stack, tmp_path_factory)
