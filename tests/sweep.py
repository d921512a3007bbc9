"""The sweep: every rule has a test that fails without it.

`python -m tests.sweep [ID ...]` (`make sweep`; `make test` runs it first) switches each rule of the
registry (webhook/core/registry.py) off in turn, in-process, and runs the unit tests marked for it
(tests/conftest.py), SWEEP_JOBS rules at once (one per core by default). A rule is killed only when one of its
tests fails on an assertion. A test that errors, is skipped, or a rule with no test, or marked tests that fail
with every rule on, fail the sweep itself: so do a missing tool or a broken environment, which are never
counted as a kill. It prints one line per rule and "N of N rules killed", and exits 0 only when every rule
was killed.

`python -m tests.sweep --registry MODULE [ID ...]` sweeps the test-only rules a test module holds in its own
`REGISTRY` instead (tests/conftest.py marks and switches them off as it does the registry's):
`--registry tests.unit.test_toy_rule R98`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from webhook.core import registry
from webhook.core.rule import Registry

ROOT = Path(__file__).resolve().parent.parent
UNIT = "tests/unit"
JOBS = int(os.environ.get("SWEEP_JOBS") or os.cpu_count() or 1)  # pytest processes at once


def run(marker: str, off: list[str], report: Path, where: str = UNIT) -> tuple[int, list[dict], str]:
    cmd = [sys.executable, "-m", "pytest", where, "-q", "-p", "no:cacheprovider", "-x", "-m", marker,
           "--sweep-report", str(report), *(a for r in off for a in ("--rule-off", r))]
    got = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    outcomes = json.loads(report.read_text()) if report.exists() else []
    return got.returncode, outcomes, (got.stdout + got.stderr)[-3000:]


def judge(rule_id: str, tmp: Path, where: str = UNIT) -> tuple[bool, str]:
    """(killed, what happened) for one rule; raises SystemExit on a sweep failure."""
    code, outcomes, text = run(f"rule_{rule_id}", [rule_id], tmp / f"{rule_id}.json", where)
    if code == 5 or not outcomes:
        return False, "no test is marked for it"
    bad = [o for o in outcomes if o["outcome"] == "skipped" or (o["outcome"] == "failed" and not o["assertion"])]
    if bad:
        raise SystemExit(f"sweep failed on {rule_id}: {bad[0]['test']} {bad[0]['outcome']} in {bad[0]['when']}"
                         f" without an assertion failing (an error, a skip or a missing tool):\n{text}")
    failed = [o["test"] for o in outcomes if o["outcome"] == "failed"]
    if not failed:
        return False, f"{len(outcomes)} marked tests all passed without it"
    return True, f"killed by {failed[0]}"


def rules_to_sweep(argv: list[str]) -> tuple[list[str], str]:
    """The ids the command line names (all of the registry's when none), checked against the registry, and
    where their tests are: the unit tests, or the module that holds the test-only registry (only its tests can be
    marked for its rules)."""
    parser = argparse.ArgumentParser(prog="python -m tests.sweep", description="Switch each rule off in turn.")
    parser.add_argument("--registry", metavar="MODULE",
                        help="a test module whose REGISTRY holds the rules to sweep (default: the registry's)")
    parser.add_argument("ids", nargs="*", metavar="ID", help="the rules to sweep (default: every rule of the registry)")
    args = parser.parse_args(argv)
    reg, where = registry.DEFAULT, UNIT
    if args.registry:
        module = importlib.import_module(args.registry)
        reg, where = getattr(module, "REGISTRY", None), str(Path(module.__file__ or "").relative_to(ROOT))
        if not isinstance(reg, Registry):
            parser.error(f"--registry: {args.registry} has no REGISTRY (a webhook.core.rule.Registry)")
    unknown = [i for i in args.ids if i not in reg.by_id]
    if unknown:
        parser.error(f"no rule {', '.join(unknown)} in {args.registry or 'webhook/core/registry.py'}")
    return args.ids or [r.id for r in reg.rules], where


def main(argv: list[str]) -> int:
    ids, where = rules_to_sweep(argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sweep-") as d:
        tmp = Path(d)
        # First with every rule on: the marked tests must pass, or a kill would prove nothing.
        marker = " or ".join(f"rule_{i}" for i in ids)
        code, outcomes, text = run(marker, [], tmp / "baseline.json", where)
        if code != 0:
            print(f"sweep failed: the marked tests do not pass with every rule on:\n{text}")
            return 1
        print(f"baseline: {len(outcomes)} marked tests pass with every rule on")
        killed = 0
        # The rules side by side (each its own pytest process and report file), printed in the registry's order.
        with concurrent.futures.ThreadPoolExecutor(max_workers=JOBS) as pool:
            for rule_id, (ok, what) in zip(ids, pool.map(lambda r: judge(r, tmp, where), ids), strict=True):
                killed += ok
                print(f"{rule_id:7} {'killed' if ok else 'SURVIVED'}: {what}", flush=True)
    print(f"{killed} of {len(ids)} rules killed ({time.monotonic() - started:.0f} s)")
    return 0 if killed == len(ids) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
