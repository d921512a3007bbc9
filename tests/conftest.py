"""Hypothesis profiles: CI runs a fixed, reproducible set of examples (derandomized, so CI judges the
change, not the luck of the draw); local runs and the long release run draw new ones each time.

The rules' tests are marked for the sweep (tests/sweep.py): a test named `test_<rule>_...` or
`test_spec_5_<rule>_...` (any id of `registry.DEFAULT`) is marked for that rule, others with
`@pytest.mark.rules("<id>", ...)`; `--rule-off ID` runs the session with that rule switched off, and
`--sweep-report FILE` writes how each test ended, for the sweep to read.
"""

import contextlib
import json
import os
import re

import pytest
from hypothesis import settings

from tests.process import Serve
from webhook.core import registry

# No per-example deadline: under a loaded machine (the whole suite, CI) a slow example is not a failure.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True, deadline=None)
settings.register_profile("dev", print_blob=True, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# The ids come from the registry: a rule added there (R9, S7) marks its tests without an edit here.
_IDS = {r.id.lower(): r.id for r in registry.DEFAULT.rules}
_NAMED = re.compile(r"^test_(?:spec_5_)?(" + "|".join(map(re.escape, _IDS)) + ")_")


def pytest_addoption(parser):
    parser.addoption("--rule-off", action="append", default=[], metavar="ID",
                     help="switch this rule off for the session (the sweep)")
    parser.addoption("--sweep-report", metavar="FILE", help="write each test's end as JSON (the sweep)")


def pytest_configure(config):
    config.addinivalue_line("markers", "rules(*ids): the test checks these rules (the sweep runs it for each)")
    for r in registry.DEFAULT.rules:
        config.addinivalue_line("markers", f"rule_{r.id}: marked for rule {r.id} (set from the name or rules())")
    off = config.getoption("rule_off")
    if off:
        config._rules_off = registry.DEFAULT.switched_off(*off)
        config._rules_off.__enter__()
    config._sweep_outcomes = []


def pytest_unconfigure(config):
    if getattr(config, "_rules_off", None) is not None:
        config._rules_off.__exit__(None, None, None)
    path = config.getoption("sweep_report", None)
    if path:
        with open(path, "w") as f:
            json.dump(config._sweep_outcomes, f)


def rules_of(item) -> set[str]:
    found = {m for mark in item.iter_markers("rules") for m in mark.args}
    named = _NAMED.match(getattr(item, "originalname", item.name))
    if named:
        found.add(_IDS[named.group(1)])
    return found


def pytest_collection_modifyitems(config, items):
    for item in items:
        for rule_id in rules_of(item):
            if rule_id not in registry.DEFAULT.by_id:
                raise pytest.UsageError(f"{item.nodeid}: no rule {rule_id!r} in webhook/core/registry.py")
            item.add_marker(f"rule_{rule_id}")


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
