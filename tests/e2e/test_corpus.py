"""The upstream corpus on the API server (issue 34 item 2): every object the webhook admits (tests/corpus_cases.py,
at the Python level) is (b) valid for Trainer's CRDs, with strict field validation, and keeps the webhook's entry
as written, and (c) passes Trainer's own checks of runtimePatches (its validating webhook, run beside the API
server as tests/e2e/test_trainer.py runs it). Objects are sent as server-side dry runs: checked, never stored.
Trainer v2.3.0 does not refuse an entry naming a job or container the runtime lacks (see the test that shows it);
tests/unit/test_corpus.py checks that part of (c) on the pods the harness builds.

One control plane for the module. The corpus's runtimes are created in it, each under a name of its own where two
share one (the corpus holds three ClusterTrainingRuntimes named torch-distributed), and again with route 2's init
container under `r2-NAME`; a TrainJob names its runtime's server name. Strict field validation refuses some
runtimes of the docs; they are created without the unknown fields, as `kubectl apply --validate=false` would.
Each admitted TrainJob is sent twice: as upstream wrote it (the baseline: where the API server refuses it, the
refusal is upstream's, listed in REFUSED_UPSTREAM) and as the webhook mutated it.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections import Counter
from dataclasses import dataclass

import pytest

from tests.corpus import GROUP, STOCK, Doc, upstream
from tests.corpus_cases import CASES, Verdict, run, with_init_container
from tests.e2e import toolchain
from tests.e2e.cluster import ControlPlane
from tests.e2e.conftest import start_cluster
from tests.e2e.trainer import start_trainer, trainer_webhooks
from tests.process import eventually, stop

VERSION = "v1alpha1"
PLURAL = {"TrainJob": "trainjobs", "ClusterTrainingRuntime": "clustertrainingruntimes",
          "TrainingRuntime": "trainingruntimes"}
TRAINER_VALIDATOR = 'admission webhook "validator.trainjob.trainer.kubeflow.org" denied the request'
NOT_SEEN_YET = "must be created before the TrainJob is created"  # Trainer's cache has not seen the runtime yet

# Upstream runtimes the API server refuses as written (strict field validation, as `kubectl apply` asks for it),
# and why. Each is then created with the unknown fields dropped (`--validate=false`), so that the TrainJobs naming
# it are still checked. Reviewed, like the table of tests/corpus_cases.py.
NO_TORCH_PROCS = "mlPolicy.torch.numProcPerNode is no field of v2.3.0's CRD (only flux and mpi have one)"
REFUSED_BY_THE_API_SERVER = {
    "docs/operator-guides/job-scheduling/kai.md (line 33) ClusterTrainingRuntime pytorch-kai-runtime":
        "mlPolicy.torch.numNodes, template.spec.containers and template.spec.schedulerName are no fields of the CRD",
    "docs/operator-guides/runtime.md (line 18) ClusterTrainingRuntime torch-distributed": NO_TORCH_PROCS,
    "docs/operator-guides/runtime.md (line 72) TrainingRuntime team-a/pytorch-team-runtime": NO_TORCH_PROCS,
    "docs/user-guides/local-execution/overview.md (line 212) ClusterTrainingRuntime torch-custom": NO_TORCH_PROCS,
    "docs/user-guides/pytorch-rocm.md (line 303) ClusterTrainingRuntime torch-rocm-distributed": NO_TORCH_PROCS,
}
# TrainJobs (or probes) the webhook admits that the API server refuses as upstream wrote them, and why.
REFUSED_UPSTREAM = {
    "examples/yaml/05-multi-step.yaml (doc 2) TrainJob default/multi-step-example":
        "Trainer's webhook: spec.initializer.dataset needs the dataset-initializer container to mount the volume"
        " `initializer` (plugins/jobset/jobset.go, Validate); the example's runtime mounts none",
}


@dataclass
class Api:
    cluster: ControlPlane
    objects: object  # kubernetes.client.CustomObjectsApi

    def create(self, obj: dict, dry_run: bool = True, validation: str = "Strict") -> tuple[dict | None, str]:
        """(the object as the API server would store it, "") or (None, the refusal)."""
        from kubernetes.client.exceptions import ApiException

        kind, meta = obj["kind"], obj["metadata"]
        extra = {"dry_run": "All"} if dry_run else {}
        last = [""]

        def answered() -> tuple[dict | None, str] | None:
            try:
                if kind == "ClusterTrainingRuntime":
                    got = self.objects.create_cluster_custom_object(GROUP, VERSION, PLURAL[kind], obj,
                                                                    field_validation=validation, **extra)
                else:
                    got = self.objects.create_namespaced_custom_object(GROUP, VERSION, meta["namespace"], PLURAL[kind],
                                                                       obj, field_validation=validation, **extra)
                return got, ""
            except ApiException as e:
                try:
                    message = json.loads(e.body).get("message", e.body)
                except (TypeError, ValueError):
                    message = str(e.body)
                last[0] = f"{e.status}: {message}"
                return None if NOT_SEEN_YET in message else (None, last[0])  # not seen yet: sent again

        try:
            return eventually(answered, f"{kind} {meta.get('name')} answered", 20, every=0.2)
        except AssertionError:
            return None, last[0]


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    from kubernetes import client, config

    tmp = tmp_path_factory.mktemp("corpus")
    with contextlib.ExitStack() as stack:
        cluster = start_cluster(stack, tmp, toolchain.trainer_crds() + toolchain.jobset_crds(), " (corpus)")
        proc, port = start_trainer(cluster, tmp)
        stack.callback(stop, proc)
        ca = (tmp / "k8s-webhook-server" / "serving-certs" / "ca.crt").read_bytes()
        for doc in trainer_webhooks(port, ca):
            cluster.apply(doc)
        yield Api(cluster, client.CustomObjectsApi(config.new_client_from_config(config_file=cluster.kubeconfig)))


def server_names(runtimes: list[Doc]) -> dict[str, str]:
    """A name per runtime doc id, unique per kind and namespace: the doc's own, `-2`, `-3` after the first (the
    stock runtimes first: they keep their names)."""
    seen: Counter = Counter()
    names = {}
    for d in sorted(runtimes, key=lambda d: not d.source.startswith(STOCK)):
        seen[d.key] += 1
        names[d.id] = d.name if seen[d.key] == 1 else f"{d.name}-{seen[d.key]}"
    return names


def as_served(obj: dict, name: str) -> dict:
    out = copy.deepcopy(obj)
    out["metadata"]["name"] = name
    out["metadata"].pop("resourceVersion", None)
    return out


@pytest.fixture(scope="module")
def served(api):
    """The corpus's runtimes created in the cluster; (names by doc id, refusals by doc id)."""
    corpus = upstream()
    names = server_names(corpus.runtimes)
    for ns in sorted({d.namespace for d in corpus.docs if d.namespace} - {"default", "team-a"}):
        api.cluster.kubectl("create", "namespace", ns)
    refused = {}
    for d in corpus.runtimes:
        for obj in (as_served(d.obj, names[d.id]), as_served(with_init_container(d.obj), "r2-" + names[d.id])):
            got, why = api.create(obj, dry_run=False)
            if got is None:
                refused[d.id] = why
                api.create(obj, dry_run=False, validation="Ignore")
    return names, refused


def test_the_corpus_runtimes_are_valid_for_the_crd_and_trainers_webhook(served):
    _, refused = served
    assert set(refused) == set(REFUSED_BY_THE_API_SERVER), "\n".join(f"{k}: {v}" for k, v in refused.items())


def _job(*pod_specs: dict) -> dict:
    """A TrainJob on the stock torch-distributed with one entry patching job `node` with `pod_specs` merged."""
    pod: dict = {}
    for spec in pod_specs:
        pod.update(spec)
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainJob", "metadata": {"name": "c", "namespace": "default"},
            "spec": {"runtimeRef": {"name": "torch-distributed"}, "runtimePatches": [
                {"manager": "example.com/x", "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
                    {"name": "node", "template": {"spec": {"template": {"spec": pod}}}}]}}}}]}}


def test_trainers_webhook_and_strict_validation_are_consulted(api, served):
    """The checks are live: env on the node container (Trainer's webhook) and a field no CRD has (strict) fail."""
    _, why = api.create(_job({"containers": [{"name": "node", "env": [{"name": "A", "value": "b"}]}]}))
    assert TRAINER_VALIDATOR in why and "must not have envs for" in why, why
    _, why = api.create(_job({"containers": [{"name": "node", "volumeMounts": [
        {"name": "v", "mountPath": "/v", "readOnlyy": True}]}]}))
    assert 'unknown field "spec.runtimePatches[0]' in why, why


def test_trainers_webhook_admits_a_patch_naming_what_the_runtime_lacks(api, served):
    """SPEC 1 says Trainer's webhook refuses a patch naming a replicated job or container the runtime lacks; v2.3.0
    checks the patches against the template they were merged into, so it never finds one missing. The corpus
    checks that the webhook's entry names none (tests/trainer_pods.py, added_by) instead of relying on it."""
    got, why = api.create(_job({"containers": [{"name": "nope"}], "initContainers": [{"name": "nope-either"}]}))
    assert got is not None, why
def _entry(obj: dict, manager: str) -> dict | None:
    found = next((e for e in (obj.get("spec") or {}).get("runtimePatches") or [] if e.get("manager") == manager), None)
    return None if found is None else {k: v for k, v in found.items() if k != "time"}


def _sent(v: Verdict, obj: dict, names: dict, route2: bool) -> dict:
    out = copy.deepcopy(obj)
    out["spec"]["runtimeRef"]["name"] = ("r2-" if route2 else "") + names[v.subject.runtime().id]
    return out


@pytest.mark.parametrize("case", [c for c in CASES if c.settings_refused is None and c.default is None],
                         ids=lambda c: c.id)
def test_what_the_webhook_admits_is_stored_and_passes_trainers_checks(api, served, case):
    """(b) and (c) for every subject the webhook admits under `case`. Where the API server refuses the object as
    upstream wrote it (REFUSED_UPSTREAM), the mutated one must be refused the same way: the entry adds nothing."""
    names, _ = served
    manager = case.settings["manager"]
    failed, checked, refused_upstream = [], set(), set()
    for v in run(case, upstream()):
        if not v.admitted:
            continue
        checked.add(v.subject.id)
        baseline, why_upstream = api.create(_sent(v, v.subject.trainjob, names, case.route2_runtimes))
        stored, why = api.create(_sent(v, v.stored, names, case.route2_runtimes))
        if baseline is None:
            refused_upstream.add(v.subject.id)
            if why != why_upstream:
                failed.append(f"{v.subject.id}: refused as upstream wrote it ({why_upstream}), and mutated: {why}")
        elif stored is None:
            kind = "(c) Trainer's webhook" if TRAINER_VALIDATOR in why else "(b) the API server"
            failed.append(f"{v.subject.id}: {kind} refuses the mutated object: {why}")
        elif _entry(stored, manager) != _entry(v.stored, manager):
            failed.append(f"{v.subject.id}: (b) the stored entry differs from the one written:"
                          f" {_entry(stored, manager)} != {_entry(v.stored, manager)}")
    assert checked, "nothing admitted to check"
    assert refused_upstream == set(REFUSED_UPSTREAM) & checked, f"refused as upstream wrote them: {refused_upstream}"
    assert not failed, f"{case.id}: {len(failed)} of {len(checked)}:\n" + "\n".join(failed)
