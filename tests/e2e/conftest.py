"""Session fixtures: the control plane, Trainer's CRDs, the example runtimes, and our webhook registered by URL.

Two webhook processes run against the cluster's watch: route 1 (the default) and route 2, chosen per
TrainJob by the label `dispatch-e2e/route: "2"` through the webhook configurations' objectSelector.
"""

from __future__ import annotations

import base64
import contextlib
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e import toolchain
from tests.e2e.cluster import ControlPlane, logs_since
from tests.helpers import EXAMPLES
from tests.process import Webhook, webhook_server

ROUTE_LABEL = "dispatch-e2e/route"
SKIP_MUTATION_LABEL = "dispatch-e2e/skip-mutation"
_LOGS: dict[str, Path] = {}


def pytest_report_header(config):
    # The versions the end-to-end suite builds and runs (the compatibility matrix changes the first two).
    return (f"e2e versions: Kubernetes {toolchain.KUBERNETES}, Trainer {toolchain.TRAINER}, JobSet {toolchain.JOBSET}, "
            f"Kueue {toolchain.KUEUE}, containerd {toolchain.CONTAINERD}, runc {toolchain.RUNC}")


# pytest-xdist (`make test` runs `-n JOBS --dist loadgroup`): the suites that start the one-node cluster (one node
# can exist on a host at a time) are one group, run by one worker one after another; every other file is a group
# of its own, so its module fixtures start once and its tests keep their order; the `env` control plane (a
# session fixture) starts once in each worker that needs it.
NODE_SUITES = ("test_node.py", "test_verify.py", "test_kueue.py", "test_install.py")
# Files whose tests share no module fixture and depend on no order: spread over the workers test by test.
INDEPENDENT = ("test_helm.py", "test_chart_trust.py", "test_chart_docs.py")


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the groups (its hook is registered later, so runs first)
def pytest_collection_modifyitems(items):
    for item in items:
        path = Path(str(item.fspath))
        if path.parent.name != "e2e" or path.parent.parent.name != "tests":
            continue
        item.add_marker(pytest.mark.e2e)
        if path.name in NODE_SUITES:
            item.add_marker(pytest.mark.xdist_group("node"))
        elif path.name not in INDEPENDENT:
            item.add_marker(pytest.mark.xdist_group(f"e2e/{path.name}"))


@pytest.fixture(autouse=True)
def _log_offsets(request):
    request.node.stash[_offsets_key] = {name: (p.stat().st_size if p.exists() else 0) for name, p in _LOGS.items()}
    yield


_offsets_key = pytest.StashKey[dict]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and item.stash.get(_offsets_key, None) is not None:
        for name, offset in item.stash[_offsets_key].items():
            text = logs_since(_LOGS[name], offset)
            if text:
                report.sections.append((f"{name} log during this test", text[-20000:]))
    return report


@dataclass
class Env:
    cluster: ControlPlane
    route1: Webhook
    route2: Webhook


def webhook_configurations(route1: Webhook, route2: Webhook) -> list[dict]:
    """Mutating and validating configurations for both routes, reached by URL."""

    def bundle(hook):
        return base64.b64encode(Path(hook.ca).read_bytes()).decode()

    rules = [{"apiGroups": ["trainer.kubeflow.org"], "apiVersions": ["v1alpha1"], "resources": ["trainjobs"],
              "operations": ["CREATE", "UPDATE"], "scope": "*"}]
    ns = {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system"]}]}

    def hook(name, wh, path, route_op, extra_exprs=(), failure="Fail", reinvoke=False):
        h = {
            "name": name, "admissionReviewVersions": ["v1"], "sideEffects": "None", "timeoutSeconds": 10,
            "failurePolicy": failure, "matchPolicy": "Equivalent", "rules": rules, "namespaceSelector": ns,
            "objectSelector": {"matchExpressions": [{"key": ROUTE_LABEL, "operator": route_op, "values": ["2"]},
                                                    *extra_exprs]},
            "clientConfig": {"url": wh.url + path, "caBundle": bundle(wh)},
        }
        if reinvoke:
            h["reinvocationPolicy"] = "IfNeeded"
        return h

    skip = {"key": SKIP_MUTATION_LABEL, "operator": "DoesNotExist"}
    return [
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
         "metadata": {"name": "dispatch-admission-e2e"},
         "webhooks": [hook("mutate.route1.dispatch.go.phpboyscout.uk", route1, "/mutate", "NotIn", [skip], "Fail",
                           True),
                      hook("mutate.route2.dispatch.go.phpboyscout.uk", route2, "/mutate", "In", [skip], "Fail", True)]},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
         "metadata": {"name": "dispatch-admission-e2e"},
         "webhooks": [hook("validate.route1.dispatch.go.phpboyscout.uk", route1, "/validate", "NotIn"),
                      hook("validate.route2.dispatch.go.phpboyscout.uk", route2, "/validate", "In")]},
    ]


def start_our_webhooks(stack: contextlib.ExitStack, cluster: ControlPlane, tmp: Path, suffix: str = "",
                       settings: tuple[Path, Path] | None = None) -> list[Webhook]:
    """Route 1 and route 2 webhook processes on the cluster's watch, registered by URL; `settings`: their
    settings files (the examples' route1.json and route2.json unless given)."""
    hooks = []
    files = settings or (EXAMPLES / "settings" / "route1.json", EXAMPLES / "settings" / "route2.json")
    for name, path in zip(("route1", "route2"), files, strict=True):
        hook = stack.enter_context(webhook_server(
            tmp / name, "--settings", str(path), "--kubeconfig", cluster.kubeconfig,
            "--runtime-metric-labels",  # per-runtime readiness series: test_rollout reads them (off by default)
            env={"PROMETHEUS_MULTIPROC_DIR": ""}))
        _LOGS[f"webhook {name}{suffix}"] = hook.log
        hooks.append(hook)
    for doc in webhook_configurations(*hooks):
        cluster.apply(doc)
    return hooks


@contextlib.contextmanager
def webhooks_swapped(cluster: ControlPlane, installed: list[Webhook], replacement: list[Webhook] | None):
    """Point our configurations at other webhook processes, or (None) take them away; restore after."""
    if replacement is None:
        cluster.kubectl("delete", "mutatingwebhookconfiguration,validatingwebhookconfiguration",
                        "dispatch-admission-e2e")
    else:
        for doc in webhook_configurations(*replacement):
            cluster.apply(doc)
    try:
        yield
    finally:
        for doc in webhook_configurations(*installed):
            cluster.apply(doc)


def start_cluster(stack: contextlib.ExitStack, tmp: Path, crds: list[Path], suffix: str = "") -> ControlPlane:
    """etcd and kube-apiserver (stopped with the stack), the CRDs installed, namespace team-a made."""
    cluster = ControlPlane(tmp / "control-plane")
    stack.callback(cluster.stop)
    _LOGS[f"etcd{suffix}"] = cluster.etcd_log
    _LOGS[f"kube-apiserver{suffix}"] = cluster.apiserver_log
    cluster.start()
    cluster.install_crds(crds)
    cluster.kubectl("create", "namespace", "team-a")
    return cluster


@pytest.fixture(scope="module")
def helm():
    """The helm binary (test_helm, test_chart_trust and test_trust)."""
    return str(toolchain.helm_bin() / "helm")


@pytest.fixture(scope="session")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    with contextlib.ExitStack() as stack:
        cluster = start_cluster(stack, tmp, toolchain.trainer_crds())
        for f in sorted((EXAMPLES / "runtimes").glob("*.yaml")):
            cluster.kubectl("apply", "-f", str(f))
        yield Env(cluster, *start_our_webhooks(stack, cluster, tmp))
