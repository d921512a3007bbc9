"""Our rules against the same rules as in-tree admission policies (bench/cel: ValidatingAdmissionPolicy and
MutatingAdmissionPolicy, admissionregistration.k8s.io/v1), on one kube-apiserver 1.37.2 (issue 37, item 2).

The policies are installed with kubectl as a cluster administrator would, their bindings selecting the
`cel` namespace; our webhook is registered for its own namespace only. Every case of tests/e2e/fidelity.py
goes through both. Ours must answer every one as SPEC says; the policies' answers must differ from ours
exactly where docs/alternatives.md says they do (the look-alike characters): a policy that stops working,
or one that starts to, changes the list and fails this test.
"""

from __future__ import annotations

import contextlib

import pytest

from tests.e2e import cel, fidelity, toolchain
from tests.e2e.conftest import start_cluster


@pytest.fixture(scope="module")
def beside_policies(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cel")
    with contextlib.ExitStack() as stack:
        cluster = start_cluster(stack, tmp, toolchain.trainer_crds(), suffix=" (cel)")
        fidelity.setup(cluster, engines=("ours", "cel"))
        fidelity.serve_ours(stack, cluster, tmp, "the in-tree policies")
        cel.install(cluster, fidelity.NAMESPACES["cel"])
        yield cluster


def test_the_same_trainjobs_through_ours_and_the_in_tree_policies(beside_policies, capsys, tmp_path):
    results = fidelity.run(beside_policies, other="cel")
    every = tmp_path / "fidelity-cel.md"
    every.write_text("\n".join(fidelity.report(results, "cel", every=True)) + "\n")
    # The same refusal code as ours: a policy's validation carries a reason (Invalid 422, Forbidden 403),
    # never NotFound or ServiceUnavailable.
    both_refused = [r for r in results if not r.ours.allowed and not r.other.allowed]
    same_code = [r for r in both_refused if r.ours.code == r.other.code]
    with capsys.disabled():
        print("\n" + "\n".join(fidelity.report(results, "cel"))
              + f"\nBoth refused {len(both_refused)}; with the same HTTP code {len(same_code)}."
              + f"\n(every case: {every})")
    assert len(results) >= 80
    wrong = [(r.case.id, r.case.expect, r.ours.summary()) for r in results if not r.ours_as_spec_says]
    assert not wrong, f"ours answered against SPEC: {wrong}"
    known = fidelity.look_alike_cases()
    disagreements = {r.case.id: (r.ours.summary(), r.other.summary()) for r in results if not r.agree}
    assert set(disagreements) == set(known), (
        f"new: {[(k, v) for k, v in disagreements.items() if k not in known]}; "
        f"gone: {sorted(set(known) - set(disagreements))}")
    # Where both admit, the policies' entry is ours (`time` aside: CEL has no clock), at the same place.
    admitted = [r for r in results if r.ours.allowed and r.other.allowed]
    assert admitted and all(r.ours.entry == r.other.entry and r.ours.index == r.other.index for r in admitted)
    # A different code only where a policy cannot give ours: no NotFound reason (R2, 404), and a runtime
    # without a node job (R3, 403) leaves the object without the entry, which S5 refuses (422).
    assert all(r.ours.code == 404 or r.case.id.startswith("R3 ") for r in both_refused if r not in same_code), [
        (r.case.id, r.ours.code, r.other.code) for r in both_refused if r not in same_code]
    # Every refusal that is not the CRD's is one of the policies', named in the message.
    crd = fidelity.by_crd(results, "cel")
    assert all("ValidatingAdmissionPolicy" in r.other.message for r in both_refused if r not in crd)
