"""Our rules against the same rules as Kyverno v1.15.2 policies (bench/kyverno), on one API server (issue 27).

Every case of tests/e2e/fidelity.py goes through both engines. Ours must answer every one as SPEC says;
Kyverno's answers must differ from ours exactly where docs/alternatives.md says they do (a policy that stops
working, or one that starts to, changes the list and fails this test).
"""

from __future__ import annotations

import contextlib

import pytest

from tests.e2e import fidelity, kyverno, toolchain
from tests.e2e.cluster import LOGS
from tests.e2e.conftest import start_cluster

# Where Kyverno's policies and our webhook answer differently, and why (docs/alternatives.md, section 2).
KNOWN_DISAGREEMENTS = fidelity.look_alike_cases()


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kyverno")
    with contextlib.ExitStack() as stack:
        cluster = start_cluster(stack, tmp, toolchain.trainer_crds(), suffix=" (kyverno)")
        kyverno.install(cluster)
        fidelity.setup(cluster)
        fidelity.serve_ours(stack, cluster, tmp, "kyverno")
        kyv = stack.enter_context(kyverno.running(cluster, tmp,
                                                  policies=kyverno.load_policies(skip_mutation_label=True)))
        LOGS["kyverno"] = kyv.log
        yield cluster


def test_the_same_trainjobs_through_ours_and_kyverno(both, capsys, tmp_path):
    results = fidelity.run(both)
    every = tmp_path / "fidelity.md"
    every.write_text("\n".join(fidelity.report(results, "kyverno", every=True)) + "\n")
    with capsys.disabled():
        print("\n" + "\n".join(fidelity.report(results, "kyverno")) + f"\n(every case: {every})")
    assert len(results) >= 80
    wrong = [(r.case.id, r.case.expect, r.ours.summary()) for r in results if not r.ours_as_spec_says]
    assert not wrong, f"ours answered against SPEC: {wrong}"
    disagreements = {r.case.id: (r.ours.summary(), r.other.summary()) for r in results if not r.agree}
    assert set(disagreements) == set(KNOWN_DISAGREEMENTS), (
        f"new: {[(k, v) for k, v in disagreements.items() if k not in KNOWN_DISAGREEMENTS]}; "
        f"gone: {sorted(set(KNOWN_DISAGREEMENTS) - set(disagreements))}")
