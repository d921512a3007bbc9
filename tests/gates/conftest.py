"""The gates go last in the collection: under `make test` (pytest-xdist, groups handed out in collection order)
they start when the other workers have run the rest, while the node suites' worker waits on the chart's rollouts,
instead of beside the node's start, which they slowed (the sweep alone keeps both cores busy for half a minute)."""

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(trylast=True)  # after tests/e2e/conftest.py has put the node suites first
def pytest_collection_modifyitems(items):
    gates = [i for i in items if Path(str(i.fspath)).resolve().parent == HERE]
    if gates:
        chosen = set(gates)
        items[:] = [i for i in items if i not in chosen] + gates
