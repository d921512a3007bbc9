"""The repository's gates, run as tests of the parallel pass (they were steps before pytest, in series with it):
lint and types, the docs check, and the rule sweep. Each runs the same command `make lint`, `make docs-check` and
`make sweep` run, as a child process, and fails with that command's output.

Under `make test` they land on workers other than the node suites' (tests/e2e/conftest.py puts those first), in
the part of the run where those workers wait on the one node's rollouts, not on the CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def child_env() -> dict[str, str]:
    """This environment without pytest's and pytest-xdist's variables (PYTEST_XDIST_WORKER and the like): a child
    pytest (the sweep's) must not think itself a worker of this session."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}


def run(*cmd: str | Path, timeout: float = 900, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=env or child_env())


def test_ruff_finds_nothing_in_the_repository():
    got = run(BIN / "ruff", "check", "--no-cache", ".")
    assert got.returncode == 0, got.stdout[-6000:] + got.stderr[-2000:]


def test_mypy_finds_nothing_in_the_package():
    """pyproject's [tool.mypy]: strict on webhook.core."""
    got = run(BIN / "mypy", "webhook")
    assert got.returncode == 0, got.stdout[-6000:] + got.stderr[-2000:]
    assert "Success: no issues found" in got.stdout, got.stdout


def test_generated_pages_are_up_to_date_with_the_chart_values_too():
    """tools/gen_docs.py --check, helm-docs' pages included (tests/unit/test_docs.py checks the others)."""
    got = run(sys.executable, "tools/gen_docs.py", "--check")
    assert got.returncode == 0, got.stdout[-6000:] + got.stderr[-2000:]


def test_the_docs_site_builds_strict(tmp_path):
    """A broken link, a missing anchor or a page left out of mkdocs.yml's nav fails the build. (No --quiet: it
    hides the warnings --strict counts.)"""
    got = run(BIN / "mkdocs", "build", "--strict", "--site-dir", tmp_path / "site",
              env={**child_env(), "NO_MKDOCS_2_WARNING": "1"})
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-6000:]


def test_every_rule_is_killed_by_the_sweep():
    """tests/sweep.py: each rule of the registry switched off in turn fails one of its marked tests."""
    got = run(sys.executable, "-m", "tests.sweep")
    print(got.stdout)
    assert got.returncode == 0, got.stdout[-8000:] + got.stderr[-2000:]
    ids = [line.split()[0] for line in got.stdout.splitlines() if " killed: " in line]
    from webhook.core import registry

    assert ids == [r.id for r in registry.RULES], got.stdout


def test_the_sweep_kills_a_test_only_rule_of_a_test_modules_registry():
    """Issue 49: the toy hostPath rule R98 (tests/unit/test_toy_rule.py's REGISTRY) is killed by the sweep: its
    marked test fails when the sweep switches it off there, as a registry rule's does."""
    got = run(sys.executable, "-m", "tests.sweep", "--registry", "tests.unit.test_toy_rule", "R98", timeout=300)
    lines = got.stdout.splitlines()
    assert got.returncode == 0, got.stdout[-8000:] + got.stderr[-2000:]
    assert lines[0] == "baseline: 1 marked tests pass with every rule on", got.stdout
    assert lines[1].split() == ["R98", "killed:", "killed", "by", "tests/unit/test_toy_rule.py::"
                                "test_a_runtime_rule_with_one_hook_is_enforced_counted_audited_documented_and_switched_off"]
    assert lines[2].startswith("1 of 1 rules killed ("), got.stdout


def test_the_sweep_refuses_a_rule_its_registry_does_not_hold():
    got = run(sys.executable, "-m", "tests.sweep", "--registry", "tests.unit.test_toy_rule", "R97", timeout=60)
    assert got.returncode == 2 and got.stderr.splitlines()[-1].endswith(
        "error: no rule R97 in tests.unit.test_toy_rule"), got.stderr
    got = run(sys.executable, "-m", "tests.sweep", "--registry", "tests.helpers", timeout=60)
    assert got.returncode == 2 and "--registry: tests.helpers has no REGISTRY" in got.stderr, got.stderr
