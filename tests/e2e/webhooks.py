"""Our webhook as two local processes on a cluster's watch, registered by URL: route 1 (the default) and route 2,
chosen per TrainJob by the label `dispatch-e2e/route: "2"` through the configurations' objectSelector."""

from __future__ import annotations

import base64
import contextlib
from pathlib import Path

from tests.e2e.cluster import LOGS, ControlPlane
from tests.helpers import EXAMPLES
from tests.process import Webhook, webhook_server

ROUTE_LABEL = "dispatch-e2e/route"
SKIP_MUTATION_LABEL = "dispatch-e2e/skip-mutation"
CONFIGURATION = "dispatch-admission-e2e"  # the name of our mutating and validating configurations


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
        url, ca, log, proc = stack.enter_context(webhook_server(
            tmp / name, "--settings", str(path), "--kubeconfig", cluster.kubeconfig,
            "--runtime-metric-labels",  # per-runtime readiness series: test_rollout reads them (off by default)
            env={"PROMETHEUS_MULTIPROC_DIR": ""}))
        LOGS[f"webhook {name}{suffix}"] = log
        hooks.append(Webhook(url, ca, log, proc))
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


def remove_our_webhooks(cluster: ControlPlane) -> None:
    """Take our configurations away (fail-closed: once their processes stop, nothing may be left pointing at them)."""
    cluster.kubectl("delete", "mutatingwebhookconfiguration,validatingwebhookconfiguration", CONFIGURATION,
                    "--ignore-not-found")
