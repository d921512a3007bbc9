"""Our rules as in-tree admission policies (bench/cel: ValidatingAdmissionPolicy and MutatingAdmissionPolicy,
admissionregistration.k8s.io/v1) installed in the suite's kube-apiserver, as a cluster administrator would
(kubectl apply), their bindings selecting the namespaces labelled `dispatch-e2e/engine=cel` (issue 37)."""

from __future__ import annotations

from pathlib import Path

from tests.e2e import fidelity
from tests.helpers import MANAGER, eventually, trainjob

POLICIES = Path(__file__).resolve().parent.parent.parent / "bench" / "cel"
POLICY_FILES = ("validate.yaml", "validate-runtime.yaml", "mutate.yaml")


def install(cluster, namespace: str, timeout: float = 60) -> None:
    """kubectl apply the policies and their bindings, then wait until the API server enforces both halves in
    `namespace`: a DISPATCH_ env refused (the validating policy), a plain TrainJob given our entry (the
    mutating one, its runtime params read). Policies and bindings are picked up asynchronously."""
    cluster.kubectl("apply", *(a for f in POLICY_FILES for a in ("-f", str(POLICIES / f))))
    custom = fidelity._api(cluster)
    bad = trainjob(name="cel-probe", namespace=namespace, env=[{"name": "DISPATCH_PROBE", "value": "1"}])
    good = trainjob(name="cel-probe", namespace=namespace)
    last = ["the DISPATCH_ env admitted"]

    def enforced() -> bool:
        try:
            custom.create_namespaced_custom_object(fidelity.GROUP, fidelity.VERSION, namespace, "trainjobs", bad,
                                                   dry_run="All")
        except Exception:
            try:
                got = custom.create_namespaced_custom_object(fidelity.GROUP, fidelity.VERSION, namespace, "trainjobs",
                                                             good, dry_run="All")
                if any(e["manager"] == MANAGER for e in got["spec"].get("runtimePatches") or []):
                    return True
                last[0] = "a TrainJob admitted without the entry"
            except Exception as exc:
                last[0] = f"a plain TrainJob refused: {str(exc)[-600:]}"
        return False

    eventually(enforced, f"the in-tree policies enforced in {namespace}", timeout, every=0.3, detail=lambda: last[0])
