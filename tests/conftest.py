"""Hypothesis profiles: CI runs a fixed, reproducible set of examples (derandomized, so CI judges the
change, not the luck of the draw); local runs and the long release run draw new ones each time.

The rules' tests are marked for the sweep (tests/sweep.py): a test named `test_<rule>_...` or
`test_spec_5_<rule>_...` (any id of `registry.RULES`) is marked for that rule, others with
`@pytest.mark.rules("<id>", ...)`; `--rule-off ID` runs the session with that rule switched off, and
`--sweep-report FILE` writes how each test ended, for the sweep to read (under pytest-xdist, the controller
writes it from the workers' reports).

pytest-xdist (`make test` runs `-n JOBS --dist loadgroup`): each file of tests/server is one group (its module
fixtures start a server once, on one worker); tests/unit's tests go to any worker; tests/e2e/conftest.py groups
the end-to-end files.
"""

import json
import os
import re
from pathlib import Path

import pytest
from hypothesis import settings

from webhook.core import registry

# No per-example deadline: under a loaded machine (the whole suite, CI) a slow example is not a failure.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True, deadline=None)
settings.register_profile("dev", print_blob=True, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# The ids come from the registry: a rule added there (R9, S7) marks its tests without an edit here.
_IDS = {r.id.lower(): r.id for r in registry.RULES}
_NAMED = re.compile(r"^test_(?:spec_5_)?(" + "|".join(map(re.escape, _IDS)) + ")_")


def pytest_addoption(parser):
    parser.addoption("--rule-off", action="append", default=[], metavar="ID",
                     help="switch this rule off for the session (the sweep)")
    parser.addoption("--sweep-report", metavar="FILE", help="write each test's end as JSON (the sweep)")


def pytest_configure(config):
    config.addinivalue_line("markers", "rules(*ids): the test checks these rules (the sweep runs it for each)")
    # pytest-xdist registers it too; here as well, so --strict-markers passes where xdist is not installed.
    config.addinivalue_line("markers", "xdist_group(name): tests that one pytest-xdist worker runs together")
    for r in registry.RULES:
        config.addinivalue_line("markers", f"rule_{r.id}: marked for rule {r.id} (set from the name or rules())")
    off = config.getoption("rule_off")
    if off:
        config._rules_off = registry.switched_off(*off)
        config._rules_off.__enter__()
    if config.getoption("sweep_report") and not hasattr(config, "workerinput"):  # xdist workers report to it
        config.pluginmanager.register(SweepReport(config.getoption("sweep_report")), "sweep-report")


class SweepReport:
    """How each test ended, written at the end for the sweep. Its hook runs in the session's own process, or
    in xdist's controller, which is given every worker's reports."""

    def __init__(self, path: str):
        self.path = path
        self.outcomes: list[dict] = []

    def pytest_runtest_logreport(self, report):
        assertion = getattr(report, "sweep_assertion", None)  # set by pytest_runtest_makereport below
        if assertion is not None:
            self.outcomes.append({"test": report.nodeid, "when": report.when, "outcome": report.outcome,
                                  "assertion": assertion})

    def pytest_unconfigure(self):
        with open(self.path, "w") as f:
            json.dump(self.outcomes, f)


def pytest_unconfigure(config):
    if getattr(config, "_rules_off", None) is not None:
        config._rules_off.__exit__(None, None, None)


def rules_of(item) -> set[str]:
    found = {m for mark in item.iter_markers("rules") for m in mark.args}
    named = _NAMED.match(getattr(item, "originalname", item.name))
    if named:
        found.add(_IDS[named.group(1)])
    return found


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the groups (its hook is registered later, so runs first)
def pytest_collection_modifyitems(config, items):
    for item in items:
        for rule_id in rules_of(item):
            if rule_id not in registry.BY_ID:
                raise pytest.UsageError(f"{item.nodeid}: no rule {rule_id!r} in webhook/core/registry.py")
            item.add_marker(f"rule_{rule_id}")
        path = Path(str(item.fspath))
        if path.parent.name == "server" and path.parent.parent.name == "tests":
            item.add_marker(pytest.mark.xdist_group(f"server/{path.name}"))


def pytest_collection_finish(session):
    """pytest-xdist's loadgroup keeps a group on one worker through the "@group" it appends to each node id; where
    the id does not take it (pytest-dev/pytest-xdist#1386, pytest 9.2), the groups go silently and the one-node
    suites would run on several workers at once: refuse to run instead."""
    if getattr(session.config.option, "loadgroup", False):
        lost = [i.nodeid for i in session.items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
        if lost:
            raise pytest.UsageError(f"pytest-xdist did not take the xdist_group of {lost[0]} (and {len(lost) - 1}"
                                    " more): see pytest-dev/pytest-xdist#1386; run with JOBS=1 or pytest<9.2")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if item.config.getoption("sweep_report", None) and (report.when == "call" or report.outcome != "passed"):
        # On the report, not the config: under xdist the report travels to the controller (its extra attributes
        # with it), the config does not.
        report.sweep_assertion = bool(call.excinfo is not None and call.excinfo.errisinstance(AssertionError))

