"""The Helm chart: lint and template in every mode, the values schema, every value rendered; then install,
self-managed certificates, the helm test and pre-delete hooks' scripts and uninstall against the end-to-end
API server. helm is built from its Go module like the API server."""

from __future__ import annotations

import base64
import concurrent.futures
import copy
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from tests.e2e.helm import (
    BASE,
    CHART,
    FULL,
    HELM_LABEL,
    NS,
    SKIP_MUTATION_LABEL,
    WEBHOOK_IMAGE,
    args_of,
    certificate_controller,
    kubeconfig_as,
    merged,
    rendered,
    run_helm,
    serve_args,
    template,
    webhook_pod,
)
from tests.helpers import EXAMPLES, IMAGE, eventually, trainjob
from tests.process import free_port, running, webhook_server
from webhook.core import images
from webhook.core import settings as settings_mod

PEM = ("-----BEGIN CERTIFICATE-----\nMIIBszCCAVmgAwIBAgIUQ2E=\n-----END CERTIFICATE-----\n")

VALUE_SETS = {
    "default": {},
    "route1": {"publish": {"image": IMAGE}},
    "route2": {"publish": {"image": IMAGE, "via": "initContainer", "initContainer": "dispatch-publish"}},
    "cert-manager": {"publish": {"image": IMAGE}, "certificates": {"certManager": {"enabled": True}}},
    "credentials": {"publish": {"image": IMAGE}, "credentials": [
        {"name": "checkpoint-store", "secret": "s3-credentials", "mountPath": "/var/run/dispatch/creds"}],
        "metrics": {"serviceMonitor": {"enabled": True}},
        "networkPolicy": {"enabled": True, "apiServerCIDRs": ["10.0.0.0/8"],
                          "metricsFrom": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]}},
    "warn": {"publish": {"image": IMAGE}, "enforcement": "warn"},
    "single-replica": {"publish": {"image": IMAGE}, "replicaCount": 1},
    "monitoring": {"publish": {"image": IMAGE}, "prometheusRule": {"enabled": True, "labels": {"release": "kps"}},
                   "grafanaDashboard": {"enabled": True}, "metrics": {"serviceMonitor": {"enabled": True}},
                   "networkPolicy": {"metricsNamespaces": ["monitoring"]}},
    "client-ca": {"publish": {"image": IMAGE}, "clientCA": {"pem": PEM}},
    "openshift": {"publish": {"image": IMAGE},
                  "podSecurityContext": {"runAsUser": None, "runAsGroup": None, "fsGroup": None}},
    "no-rbac": {"publish": {"image": IMAGE}, "rbac": {"create": False},
                "serviceAccount": {"create": False, "name": "mine"}},
}


@pytest.mark.parametrize("name", VALUE_SETS)
def test_lint_and_template(helm, tmp_path, name):
    values = merged(BASE, VALUE_SETS[name])
    run_helm(helm, "lint", "--strict", str(CHART), values=values, tmp=tmp_path)
    docs = rendered(helm, tmp_path, values)
    kinds = {k for k, _ in docs}
    assert {"Deployment", "Service", "ConfigMap", "MutatingWebhookConfiguration",
            "ValidatingWebhookConfiguration"} <= kinds
    assert ("PodDisruptionBudget" in kinds) == (name != "single-replica")
    assert ({"ClusterRole", "ClusterRoleBinding"} <= kinds) == (name != "no-rbac")
    assert ("ServiceAccount", FULL) in docs if name != "no-rbac" else ("ServiceAccount", FULL) not in docs
    # The settings the chart renders are settings the webhook accepts.
    cm = docs[("ConfigMap", f"{FULL}-settings")]
    parsed = settings_mod.parse(cm["data"]["settings.json"])
    assert (parsed.publish is not None) == ("publish" in values)
    if name == "route2":
        assert parsed.publish.via == "initContainer"
    mutating = docs[("MutatingWebhookConfiguration", FULL)]["webhooks"][0]
    validating = docs[("ValidatingWebhookConfiguration", FULL)]["webhooks"][0]
    assert mutating["failurePolicy"] == "Ignore" and validating["failurePolicy"] == "Fail"
    assert mutating["reinvocationPolicy"] == "IfNeeded" and mutating["sideEffects"] == "None"
    assert mutating["admissionReviewVersions"] == ["v1"]
    excluded = mutating["namespaceSelector"]["matchExpressions"][0]["values"]
    assert "kube-system" in excluded and NS in excluded
    assert mutating["rules"][0]["resources"] == ["trainjobs"]
    assert mutating["rules"][0]["operations"] == ["CREATE", "UPDATE"]
    runtimes = docs[("ValidatingWebhookConfiguration", f"{FULL}-runtimes")]["webhooks"]
    assert [w["clientConfig"]["service"]["path"] for w in runtimes] == ["/runtimes"]
    args = args_of(docs)
    assert f"--enforcement={values.get('enforcement', 'enforce')}" in args
    if name == "cert-manager":
        assert ("Certificate", FULL) in docs
        for kind, cfg in (("MutatingWebhookConfiguration", FULL), ("ValidatingWebhookConfiguration", FULL),
                          ("ValidatingWebhookConfiguration", f"{FULL}-runtimes")):
            assert docs[(kind, cfg)]["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == f"{NS}/{FULL}"
        assert ("Role", f"{FULL}-tls") not in docs
        assert not any(a.startswith(("--tls-secret", "--webhook-configuration")) for a in args)
    else:
        assert ("Secret", f"{FULL}-tls") in docs and "data" not in docs[("Secret", f"{FULL}-tls")]
        # Issued by the certificate controller; the webhook pods only read the Secret.
        controller = docs[("Deployment", f"{FULL}-certs")]["spec"]["template"]["spec"]
        assert f"--webhook-configuration={FULL}" in controller["containers"][0]["args"]
        assert "--tls-read-only" in args and not any(a.startswith("--webhook-configuration") for a in args)
    # Failing well: an update of a TrainJob being deleted is never sent (a create always is), nor an opted-out
    # namespace; a short timeout.
    for hook in (mutating, validating):
        assert hook["matchConditions"] == [{
            "name": "not-being-deleted",
            "expression": "request.operation != 'UPDATE' || !has(oldObject.metadata.deletionTimestamp)"}]
        assert {"key": "dispatch-admission.io/ignore", "operator": "DoesNotExist"} in \
            hook["namespaceSelector"]["matchExpressions"]
        assert hook["timeoutSeconds"] <= 5
    # Closed by default: a NetworkPolicy (the metrics port opened only where the values say).
    assert ("NetworkPolicy", FULL) in docs
    if name in ("credentials", "monitoring"):
        assert ("ServiceMonitor", FULL) in docs
    if name == "credentials":
        assert ("NetworkPolicy", FULL) in docs
    if name == "monitoring":
        assert ("PrometheusRule", FULL) in docs and ("ConfigMap", f"{FULL}-dashboard") in docs


def test_image_repository_is_required(helm, tmp_path):
    got = template(helm, tmp_path, {"publish": {"image": IMAGE}}, check=False)
    assert got.returncode != 0
    assert "image.repository is required" in got.stderr, got.stderr
    dep = rendered(helm, tmp_path, {"image": {"digest": "sha256:" + "b" * 64}})[("Deployment", FULL)]
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == f"{WEBHOOK_IMAGE}@sha256:{'b' * 64}"


def test_lint_with_default_values_reports_the_missing_repository(helm, tmp_path):
    # helm lint renders `required` failures as [INFO] only; install and template refuse them (above).
    got = run_helm(helm, "lint", "--strict", str(CHART), check=False)
    assert "image.repository is required" in got.stdout + got.stderr


@pytest.mark.parametrize("typo", [
    {"webhok": {"timeoutSeconds": 5}},
    {"webhook": {"timeoutSecond": 5}},
    {"webhook": {"runtimes": {"enable": False}}},
    {"image": {"repo": "x"}},
    {"podSecurityContext": {"runAsUsr": 1000}},
    {"containerSecurityContext": {"readOnlyRootFileSystem": True}},
    {"probes": {"readiness": {"periodSecond": 3}}},
    {"prometheusRule": {"alerts": {"slowReview": {"enabled": False}}}},
    {"prometheusRule": {"alerts": {"slowReviews": {"threshold": 3}}}},
    {"tests": {"runtimeRef": {"nmae": "x"}}},
    {"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "k", "whenUnsatisfiable": "DoNotSchedule",
                                    "labelSelectr": {}}]},
    {"affinity": {"podAntiAfinity": {}}},
    {"metrics": {"serviceMonitor": {"enable": True}}},
    {"networkPolicy": {"metricsFrom": [{"namespaceSelctor": {}}]}},
    {"preUninstall": {"deleteWebhookConfiguration": False}},
])
def test_values_schema_refuses_typos(helm, tmp_path, typo):
    got = template(helm, tmp_path, merged(BASE, typo), check=False)
    assert got.returncode != 0 and "additional properties" in got.stderr, got.stderr


def _objects(node, path="$"):
    if isinstance(node, dict):
        if node.get("type") == "object" or (isinstance(node.get("type"), list) and "object" in node["type"]):
            yield path, node
        for k, v in node.items():
            yield from _objects(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _objects(v, f"{path}[{i}]")


# Kubernetes' own deep structures the schema hands to the API server's validation (at install) rather than copy.
OPEN_OBJECTS = {"$.properties.global", "$.properties.affinity.properties.nodeAffinity.properties."
                "requiredDuringSchedulingIgnoredDuringExecution.properties.nodeSelectorTerms.items"}


def test_values_schema_closes_every_object():
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["additionalProperties"] is False
    for path, node in _objects(schema):
        extra = node.get("additionalProperties")
        if path in OPEN_OBJECTS or path.endswith("DuringExecution.items"):
            continue
        # Closed (false), or a map whose values have a schema of their own (labels, resource quantities).
        assert extra is False or isinstance(extra, dict), f"{path} accepts unknown keys"
        if extra is False:
            assert "properties" in node, path


def _leaves(node, prefix=""):
    for k, v in node.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            yield from _leaves(v, path + ".")
        else:
            yield path, v


def _set(values: dict, path: str, value) -> dict:
    out = copy.deepcopy(values)
    node = out
    *parents, last = path.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return out


# Values that only act together with others: the context a change of the leaf is rendered in.
CM = {"certificates": {"certManager": {"enabled": True}}}
CONTEXTS = {
    "publish.via": {"publish": {"image": IMAGE}},
    "publish.initContainer": {"publish": {"image": IMAGE, "via": "initContainer"}},
    "clientCA.key": {"clientCA": {"existingConfigMap": "api-ca"}},
    "clientCA.allowedSubjects": {"clientCA": {"pem": PEM}},
    "certificates.certManager.": CM,
    "metrics.serviceMonitor.": {"metrics": {"serviceMonitor": {"enabled": True}},
                                "networkPolicy": {"metricsNamespaces": ["monitoring"]}},
    "certificates.controller.serviceAccount.": {"certificates": {"controller": {"serviceAccount": {"name": "certs"}}}},
    "networkPolicy.konnectivityAgents.": {"networkPolicy": {"apiServerSource": "konnectivity"}},
    "networkPolicy.cilium.": {"networkPolicy": {"apiServerSource": "cilium"}},
    "networkPolicy.": {"networkPolicy": {"enabled": True, "apiServerCIDRs": ["10.0.0.0/8"]}},
    "publish.repositories": {"publish": {"image": IMAGE}},
    "prometheusRule.": {"prometheusRule": {"enabled": True}},
    "grafanaDashboard.": {"grafanaDashboard": {"enabled": True}},
    "podDisruptionBudget.minAvailable": {"replicaCount": 3},
    "podAntiAffinity": {},
    "tests.verify.": {"tests": {"verify": {"runtime": "ClusterTrainingRuntime/torch-distributed"}}},
    "audit.": {"audit": {"enabled": True}},
}
PEER = [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]
CHANGES = {
    "runtimeStore.sizeLimit": "2Gi",
    "nameOverride": "other",
    "fullnameOverride": "custom",
    "manager": "example.com/publish",
    "publish.image": IMAGE,
    "publish.via": "initContainer",
    "publish.initContainer": "my-init",
    "publish.repositories": [IMAGE.split("@")[0], "registry.example/other"],
    "guard.groups": ["platform-team"],
    "guard.users": ["alice"],
    "guard.serviceAccounts": ["argocd/argocd-application-controller"],
    "certificates.controller.serviceAccount.name": "other-certs",
    "certificates.controller.serviceAccount.annotations": {"example.com/role": "x"},
    "networkPolicy.apiServerSource": "konnectivity",
    "networkPolicy.konnectivityAgents.namespace": "konnectivity",
    "networkPolicy.konnectivityAgents.podLabels.k8s-app": "agent",
    "networkPolicy.cilium.fromEntities": ["kube-apiserver", "remote-node"],
    "credentials": [{"name": "c", "secret": "s", "mountPath": "/creds"}],
    "enforcement": "warn",
    "image.repository": "registry.example/other",
    "image.tag": "v9",
    "image.digest": "sha256:" + "b" * 64,
    "image.pullPolicy": "Always",
    "imagePullSecrets": [{"name": "pull"}],
    "logLevel": "debug",
    "webhook.mutating.failurePolicy": "Fail",
    "webhook.validating.failurePolicy": "Ignore",
    "webhook.excludeNamespaces": ["skipped"],
    "webhook.objectSelector": {"matchLabels": {"a": "b"}},
    "webhook.ignoreNamespaceLabel": "example.com/no-dispatch",
    "webhook.url": "https://127.0.0.1:9443",
    "webhook.caBundle": "QUJD",
    "clientCA.pem": PEM,
    "clientCA.existingConfigMap": "api-ca",
    "clientCA.key": "front-proxy.crt",
    "clientCA.allowedSubjects": ["kube-apiserver", "kube-apiserver-2"],
    "tls.minVersion": "1.3",
    "tls.ciphers": "ECDHE+AESGCM",
    "certificates.controller.resources.requests.cpu": "20m",
    "certificates.controller.resources.requests.memory": "64Mi",
    "certificates.controller.resources.limits.memory": "128Mi",
    "certificates.secretName": "my-tls",
    "certificates.certManager.issuerRef": {"name": "ca", "kind": "ClusterIssuer"},
    "certificates.certManager.duration": "2160h",
    "certificates.certManager.renewBefore": "360h",
    "metrics.serviceMonitor.interval": "15s",
    "metrics.serviceMonitor.labels": {"release": "kps"},
    "resources.requests.cpu": "200m",
    "resources.requests.memory": "64Mi",
    "resources.limits.memory": "1Gi",
    "audit.schedule": "5 * * * *",
    "audit.resources.requests.cpu": "20m",
    "audit.resources.requests.memory": "80Mi",
    "audit.resources.limits.memory": "512Mi",
    "runtimeKeeper.resources.requests.cpu": "20m",
    "runtimeKeeper.resources.requests.memory": "80Mi",
    "runtimeKeeper.resources.requests.ephemeral-storage": "32Mi",
    "runtimeKeeper.resources.limits.memory": "512Mi",
    "runtimeKeeper.resources.limits.ephemeral-storage": "1Gi",
    "podDisruptionBudget.minAvailable": 2,
    "podAntiAffinity": "hard",
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]}]}]}}},
    "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                   "whenUnsatisfiable": "ScheduleAnyway"}],
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
    "priorityClassName": "",
    "podAnnotations": {"example.com/a": "b"},
    "podLabels": {"team": "ml"},
    "podSecurityContext.seccompProfile.type": "Unconfined",
    "containerSecurityContext.capabilities.drop": ["NET_RAW"],
    "containerSecurityContext.seccompProfile.type": "Unconfined",
    "serviceAccount.name": "mine",
    "serviceAccount.annotations": {"example.com/role": "x"},
    "networkPolicy.apiServerCIDRs": ["192.168.0.0/16"],
    "networkPolicy.extraFrom": PEER,
    "networkPolicy.metricsFrom": PEER,
    "networkPolicy.metricsNamespaces": ["monitoring"],
    "prometheusRule.labels": {"release": "kps"},
    "prometheusRule.selector": 'service="x"',
    "prometheusRule.kubeStateMetricsSelector": 'job="kube-state-metrics"',
    "grafanaDashboard.namespace": "monitoring",
    "grafanaDashboard.labels.grafana_dashboard": "yes",
    "grafanaDashboard.annotations": {"grafana_folder": "ML"},
    "tests.namespace": "team-a",
    "tests.runtimeRef.name": "other-runtime",
    "tests.runtimeRef.kind": "TrainingRuntime",
    "tests.labels": {"team": "ml"},
    "tests.verify.runtime": "TrainingRuntime/other-runtime",
    "tests.verify.resources.requests.cpu": "75m",
    "tests.verify.resources.requests.memory": "100Mi",
    "tests.verify.resources.limits.memory": "256Mi",
    "hooks.resources.requests.cpu": "20m",
    "hooks.resources.requests.memory": "48Mi",
    "hooks.resources.limits.memory": "128Mi",
}


def _change(path: str, default):
    if path in CHANGES:
        return CHANGES[path]
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 1
    if path.endswith(".for"):
        return "7m"
    if path.endswith(".severity"):
        return "page"
    raise AssertionError(f"no change defined for value {path}: add one to CHANGES")


def _context(path: str) -> dict:
    for prefix, ctx in CONTEXTS.items():
        if path == prefix or (prefix.endswith(".") and path.startswith(prefix)):
            return ctx
    return {}


def test_every_value_is_rendered(helm, tmp_path):
    """Each value in values.yaml changes what the chart renders (in the context it acts in): no value is ignored."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    leaves = list(_leaves(defaults))
    assert len(leaves) > 100

    def check(leaf):
        path, default = leaf
        context = merged(BASE, _context(path))
        node = context
        for part in path.split("."):
            node = node.get(part, {}) if isinstance(node, dict) else {}
        current = default if node == {} else node  # the context's own value, where it sets this one
        changed = _set(context, path, _change(path, current))
        before = template(helm, tmp_path, context).stdout
        after = template(helm, tmp_path, changed, check=False)
        if after.returncode != 0:
            return f"{path}: {after.stderr.strip()}"
        if after.stdout != before:
            return None
        return f"{path}: changing it to {_change(path, current)!r} renders nothing different"

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        problems = [p for p in pool.map(check, leaves) if p]
    assert not problems, "\n".join(problems)


def test_changes_table_names_only_real_values():
    paths = {p for p, _ in _leaves(yaml.safe_load((CHART / "values.yaml").read_text()))}
    assert set(CHANGES) <= paths


def test_log_level_client_ca_and_enforcement_reach_serve(helm, tmp_path):
    docs = rendered(helm, tmp_path, {"logLevel": "debug", "enforcement": "warn", "clientCA": {"pem": PEM}})
    args = args_of(docs)
    assert {"--log-level=debug", "--enforcement=warn", "--client-ca=/etc/dispatch-admission/client-ca/ca.crt",
            "--metrics-bind=0.0.0.0:8080", "--bind=0.0.0.0:8443"} <= set(args)
    assert docs[("ConfigMap", f"{FULL}-client-ca")]["data"]["ca.crt"].strip() == PEM.strip()
    pod = webhook_pod(docs)
    assert "checksum/client-ca" in pod["metadata"]["annotations"]
    mounts = {m["name"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["client-ca"] == {"name": "client-ca", "mountPath": "/etc/dispatch-admission/client-ca",
                                   "readOnly": True}
    # The TLS port then wants a client certificate the kubelet has not got: the probes use the metrics port.
    c = pod["spec"]["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["port"] == "metrics" and c[probe]["httpGet"]["scheme"] == "HTTP"
    existing = rendered(helm, tmp_path, {"clientCA": {"existingConfigMap": "api-ca", "key": "front.crt"}})
    assert ("ConfigMap", f"{FULL}-client-ca") not in existing
    assert "--client-ca=/etc/dispatch-admission/client-ca/front.crt" in args_of(existing)
    plain = args_of(rendered(helm, tmp_path, {}))
    assert not any(a.startswith("--client-ca") for a in plain)


def test_deployment_is_hardened(helm, tmp_path):
    dep = rendered(helm, tmp_path, VALUE_SETS["route1"])[("Deployment", FULL)]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    psc = pod["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["seccompProfile"]["type"] == "RuntimeDefault"
    assert psc["runAsUser"] == 65532
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"] and sc["runAsNonRoot"] is True
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "https", "scheme": "HTTPS"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "https", "scheme": "HTTPS"}
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["periodSeconds"] == 5
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert "podAntiAffinity" in pod["affinity"] and c["resources"]["requests"]
    # the settings are read through the API (SPEC 2.1), not mounted; a change of them rolls no pod
    assert f"--settings-configmap={NS}/{FULL}-settings" in c["args"]
    assert "settings" not in {m["name"] for m in c["volumeMounts"]}
    annotations = dep["spec"]["template"]["metadata"].get("annotations") or {}
    assert not any(k.startswith("checksum/settings") for k in annotations)


def test_openshift_can_drop_the_fixed_ids(helm, tmp_path):
    docs = rendered(helm, tmp_path, VALUE_SETS["openshift"])
    for pod in (webhook_pod(docs)["spec"], docs[("Pod", f"{FULL}-test")]["spec"],
                docs[("Job", f"{FULL}-pre-delete")]["spec"]["template"]["spec"]):
        assert pod["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}


def test_scheduling_values(helm, tmp_path):
    tsc = [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"},
           {"maxSkew": 2, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": {"tier": "webhook"}}}]
    affinity = CHANGES["affinity"]
    pod = webhook_pod(rendered(helm, tmp_path, {"topologySpreadConstraints": tsc, "affinity": affinity}))["spec"]
    assert pod["affinity"] == affinity  # the raw affinity replaces the anti-affinity preset
    got = pod["topologySpreadConstraints"]
    assert got[0]["labelSelector"] == {"matchLabels": {"app.kubernetes.io/name": "dispatch-admission",
                                                       "app.kubernetes.io/instance": "rel"}}
    assert got[1]["labelSelector"] == {"matchLabels": {"tier": "webhook"}}
    hard = webhook_pod(rendered(helm, tmp_path, {"podAntiAffinity": "hard"}))["spec"]["affinity"]["podAntiAffinity"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" in hard
    assert "affinity" not in webhook_pod(rendered(helm, tmp_path, {"podAntiAffinity": "none"}))["spec"]
    assert "priorityClassName" not in webhook_pod(rendered(helm, tmp_path, {"priorityClassName": ""}))["spec"]


def test_pdb_only_over_several_replicas(helm, tmp_path):
    assert ("PodDisruptionBudget", FULL) not in rendered(helm, tmp_path, {"replicaCount": 1})
    pdb = rendered(helm, tmp_path, {"replicaCount": 3})[("PodDisruptionBudget", FULL)]
    assert pdb["spec"]["minAvailable"] == 1
    assert rendered(helm, tmp_path, {"podDisruptionBudget": {"minAvailable": "50%"}})[
        ("PodDisruptionBudget", FULL)]["spec"]["minAvailable"] == "50%"
    got = template(helm, tmp_path, merged(BASE, {"podDisruptionBudget": {"minAvailable": 2}}), check=False)
    assert got.returncode != 0 and "no node could ever be drained" in got.stderr


def test_labels_and_names(helm, tmp_path):
    docs = rendered(helm, tmp_path, {"podLabels": {"team": "ml"}})
    for (kind, name), doc in docs.items():
        labels = doc["metadata"]["labels"]
        assert labels["helm.sh/chart"] == "dispatch-admission-0.1.0", (kind, name)
        assert labels["app.kubernetes.io/component"] in ("webhook", "test", "pre-delete", "certificates"), (kind, name)
        assert labels["app.kubernetes.io/managed-by"] == "Helm" and labels["app.kubernetes.io/instance"] == "rel"
    pod_labels = webhook_pod(docs)["metadata"]["labels"]
    assert pod_labels["team"] == "ml" and pod_labels["app.kubernetes.io/component"] == "webhook"
    assert pod_labels["app.kubernetes.io/version"] == "0.1.0"
    assert docs[("Deployment", FULL)]["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "dispatch-admission", "app.kubernetes.io/instance": "rel"}
    # Overrides.
    assert ("Deployment", "rel-other") in rendered(helm, tmp_path, {"nameOverride": "other"})
    custom = rendered(helm, tmp_path, {"fullnameOverride": "custom"})
    assert {("Deployment", "custom"), ("ValidatingWebhookConfiguration", "custom-runtimes"),
            ("Job", "custom-pre-delete"),
            ("Pod", "custom-test")} <= set(custom)
    out = run_helm(helm, "template", "r" * 53, str(CHART), "-n", NS, values=BASE, tmp=tmp_path).stdout
    names = [d["metadata"]["name"] for d in yaml.safe_load_all(out) if d]
    assert len(names) > 15 and all(len(name) <= 63 for name in names), names


def test_chart_label_replaces_plus(helm, tmp_path):
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    meta["version"] = "0.1.0+build.7"
    (chart / "Chart.yaml").write_text(yaml.safe_dump(meta))
    docs = rendered(helm, tmp_path, {}, chart=chart)
    assert {d["metadata"]["labels"]["helm.sh/chart"] for d in docs.values()} == {"dispatch-admission-0.1.0_build.7"}


def test_hook_pods_are_never_the_webhook(helm, tmp_path):
    """The Service, the PDB and the ReplicaSet select by these labels: a hook pod must not match them
    (the Service would send admission reviews to it; the ReplicaSet would adopt it)."""
    docs = rendered(helm, tmp_path, {})
    selector = docs[("Deployment", FULL)]["spec"]["selector"]["matchLabels"]
    hook_pods = [docs[("Pod", f"{FULL}-test")]["metadata"],
                 docs[("Job", f"{FULL}-pre-delete")]["spec"]["template"]["metadata"]]
    for meta in hook_pods:
        assert not all(meta["labels"].get(k) == v for k, v in selector.items())
    assert docs[("Service", FULL)]["spec"]["selector"] == selector


def test_metrics_have_a_port_of_their_own(helm, tmp_path):
    docs = rendered(helm, tmp_path, VALUE_SETS["credentials"])
    ports = {p["name"]: p for p in docs[("Service", FULL)]["spec"]["ports"]}
    assert ports["metrics"]["port"] == 8080 and ports["metrics"]["targetPort"] == "metrics"
    assert ports["https"]["port"] == 443 and ports["https"]["targetPort"] == "https"
    container = webhook_pod(docs)["spec"]["containers"][0]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"https": 8443, "metrics": 8080}
    (endpoint,) = docs[("ServiceMonitor", FULL)]["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["scheme"] == "http" and endpoint["path"] == "/metrics"
    assert "tlsConfig" not in endpoint
    webhook_rule, metrics_rule = docs[("NetworkPolicy", FULL)]["spec"]["ingress"]
    assert webhook_rule["ports"] == [{"port": 8443, "protocol": "TCP"}]
    assert webhook_rule["from"] == [{"ipBlock": {"cidr": "10.0.0.0/8"}}]
    assert metrics_rule["ports"] == [{"port": 8080, "protocol": "TCP"}]
    assert metrics_rule["from"] == VALUE_SETS["credentials"]["networkPolicy"]["metricsFrom"]
    # A ServiceMonitor behind a NetworkPolicy that admits no Prometheus would scrape nothing.
    got = template(helm, tmp_path, merged(BASE, {"metrics": {"serviceMonitor": {"enabled": True}},
                                                  "networkPolicy": {"enabled": True,
                                                                    "apiServerCIDRs": ["10.0.0.0/8"]}}),
                   check=False)
    assert got.returncode != 0 and "networkPolicy.metricsFrom" in got.stderr


def test_metrics_auth_serves_https_to_reviewed_tokens(helm, tmp_path):
    """metrics.auth: serve --metrics-auth, the rights to review a token and its access, a ClusterRole to bind
    Prometheus to, probes and the ServiceMonitor in HTTPS (tests/e2e/test_metrics_auth.py runs the server)."""
    docs = rendered(helm, tmp_path, merged(VALUE_SETS["credentials"], {"metrics": {"auth": True}}))
    assert "--metrics-auth" in args_of(docs)
    assert {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]} in docs[
        ("ClusterRole", FULL)]["rules"]
    assert {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"], "verbs": ["create"]} in docs[
        ("ClusterRole", FULL)]["rules"]
    assert docs[("ClusterRole", f"{FULL}-metrics-reader")]["rules"] == [{"nonResourceURLs": ["/metrics"],
                                                                         "verbs": ["get"]}]
    (endpoint,) = docs[("ServiceMonitor", FULL)]["spec"]["endpoints"]
    assert endpoint["scheme"] == "https" and endpoint["bearerTokenFile"].endswith("serviceaccount/token")
    container = webhook_pod(docs)["spec"]["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["scheme"] == "HTTPS", probe
    plain = rendered(helm, tmp_path, VALUE_SETS["credentials"])
    assert "--metrics-auth" not in args_of(plain) and ("ClusterRole", f"{FULL}-metrics-reader") not in plain


def test_network_policy_is_on_by_default_and_opens_only_what_the_values_name(helm, tmp_path):
    docs = rendered(helm, tmp_path, {})
    spec = docs[("NetworkPolicy", FULL)]["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    (webhook_rule,) = spec["ingress"]  # the metrics port: no rule, so closed to every pod
    assert webhook_rule["ports"] == [{"port": 8443, "protocol": "TCP"}] and "from" not in webhook_rule
    assert docs[("NetworkPolicy", f"{FULL}-certs")]["spec"] == {
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "dispatch-admission-certs",
                                        "app.kubernetes.io/instance": "rel"}}, "policyTypes": ["Ingress"]}
    named = rendered(helm, tmp_path, {"networkPolicy": {"apiServerCIDRs": ["172.18.0.0/16"],
                                                        "metricsNamespaces": ["monitoring", "ops"]}})
    webhook_rule, metrics_rule = named[("NetworkPolicy", FULL)]["spec"]["ingress"]
    assert webhook_rule["from"] == [{"ipBlock": {"cidr": "172.18.0.0/16"}}]
    assert metrics_rule == {"ports": [{"port": 8080, "protocol": "TCP"}], "from": [{"namespaceSelector": {
        "matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In",
                              "values": ["monitoring", "ops"]}]}}]}
    off = rendered(helm, tmp_path, {"networkPolicy": {"enabled": False}})
    assert "NetworkPolicy" not in {k for k, _ in off}


def test_tls_and_client_subjects_reach_serve(helm, tmp_path):
    plain = args_of(rendered(helm, tmp_path, {}))
    assert "--tls-min-version=1.2" in plain
    assert not any(a.startswith(("--tls-ciphers", "--client-subject")) for a in plain)
    assert "--runtime-metric-labels" not in plain, "runtimes are counted, not named, by default"
    args = args_of(rendered(helm, tmp_path, {"clientCA": {"pem": PEM}, "tls": {"minVersion": "1.3",
                                                                              "ciphers": "ECDHE+AESGCM"},
                                             "metrics": {"runtimeLabels": True}}))
    assert {"--client-subject=kube-apiserver", "--tls-min-version=1.3", "--tls-ciphers=ECDHE+AESGCM",
            "--runtime-metric-labels"} <= set(args)
    two = args_of(rendered(helm, tmp_path, {"clientCA": {"pem": PEM, "allowedSubjects": ["a", "b"]}}))
    assert [a for a in two if a.startswith("--client-subject")] == ["--client-subject=a", "--client-subject=b"]


def test_runtime_warnings_configuration(helm, tmp_path):
    docs = rendered(helm, tmp_path, {"webhook": {"timeoutSeconds": 7, "excludeNamespaces": ["skipped"],
                                                 "objectSelector": {"matchLabels": {"a": "b"}}}})
    (hook,) = docs[("ValidatingWebhookConfiguration", f"{FULL}-runtimes")]["webhooks"]
    assert hook["name"] == "runtimes.dispatch.go.phpboyscout.uk"
    assert hook["failurePolicy"] == "Ignore" and hook["sideEffects"] == "None" and hook["timeoutSeconds"] == 7
    assert hook["rules"] == [{"apiGroups": ["trainer.kubeflow.org"], "apiVersions": ["v1alpha1"],
                              "resources": ["clustertrainingruntimes", "trainingruntimes"],
                              "operations": ["CREATE", "UPDATE"], "scope": "*"}]
    assert hook["clientConfig"]["service"] == {"name": FULL, "namespace": NS, "path": "/runtimes", "port": 443}
    assert "skipped" in hook["namespaceSelector"]["matchExpressions"][0]["values"]
    assert "objectSelector" not in hook  # the TrainJob selector is not the runtimes'
    by_url = rendered(helm, tmp_path, {"webhook": {"url": "https://127.0.0.1:9443/", "caBundle": "QUJD"}})
    (hook,) = by_url[("ValidatingWebhookConfiguration", f"{FULL}-runtimes")]["webhooks"]
    assert hook["clientConfig"] == {"url": "https://127.0.0.1:9443/runtimes", "caBundle": "QUJD"}
    off = rendered(helm, tmp_path, {"webhook": {"runtimes": {"enabled": False}}})
    assert ("ValidatingWebhookConfiguration", f"{FULL}-runtimes") not in off
    assert off[("ClusterRole", f"{FULL}-certs")]["rules"][1]["resourceNames"] == [FULL]


def test_rbac_is_least_privilege(helm, tmp_path):
    docs = rendered(helm, tmp_path, VALUE_SETS["route1"])
    # The serving pods: read runtimes, and get the one TLS Secret. No webhook configuration, no Secret written.
    rules = docs[("ClusterRole", FULL)]["rules"]
    assert rules == [{"apiGroups": ["trainer.kubeflow.org"],
                      "resources": ["trainingruntimes", "clustertrainingruntimes"],
                      "verbs": ["get", "list", "watch"]}]
    assert docs[("Role", f"{FULL}-settings")]["rules"] == [
        {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [f"{FULL}-settings"],
         "verbs": ["get", "list", "watch"]}]
    assert docs[("RoleBinding", f"{FULL}-settings")]["subjects"][0]["name"] == FULL
    role = docs[("Role", f"{FULL}-tls")]["rules"]
    assert role == [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": [f"{FULL}-tls"], "verbs": ["get"]}]
    assert docs[("RoleBinding", f"{FULL}-tls")]["subjects"][0]["name"] == FULL
    # The certificate controller, under a ServiceAccount of its own: patch this release's configurations, fill the
    # Secret.
    controller = f"{FULL}-certs"
    assert docs[("Deployment", controller)]["spec"]["template"]["spec"]["serviceAccountName"] == controller
    assert ("ServiceAccount", controller) in docs
    rules = docs[("ClusterRole", controller)]["rules"]
    assert rules == [{"apiGroups": ["admissionregistration.k8s.io"], "resources": ["mutatingwebhookconfigurations"],
                      "resourceNames": [FULL], "verbs": ["get", "patch"]},
                     {"apiGroups": ["admissionregistration.k8s.io"], "resources": ["validatingwebhookconfigurations"],
                      "resourceNames": [FULL, f"{FULL}-runtimes"], "verbs": ["get", "patch"]}]
    assert docs[("Role", controller)]["rules"] == [
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": [f"{FULL}-tls", f"{FULL}-ca"],
         "verbs": ["get", "update"]},
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}]  # re-created when deleted
    for kind in ("ClusterRoleBinding", "RoleBinding"):
        assert docs[(kind, controller)]["subjects"] == [{"kind": "ServiceAccount", "name": controller, "namespace": NS}]
    cm = rendered(helm, tmp_path, VALUE_SETS["cert-manager"])
    assert len(cm[("ClusterRole", FULL)]["rules"]) == 1
    assert not [k for k in cm if k[1] == controller], "cert-manager issues: no controller"
    # The key cert-manager's Secret holds is mounted readable by the pod's user only.
    (tls,) = [v for v in webhook_pod(cm)["spec"]["volumes"] if v["name"] == "tls"]
    assert tls["secret"]["defaultMode"] == 0o400
    # The hooks: the test may only create (dry-run) TrainJobs in its namespace; pre-delete may only delete ours.
    assert docs[("Role", f"{FULL}-test")]["metadata"]["namespace"] == "default"
    assert docs[("Role", f"{FULL}-test")]["rules"] == [
        {"apiGroups": ["trainer.kubeflow.org"], "resources": ["trainjobs"], "verbs": ["create"]}]
    pre = docs[("ClusterRole", f"{FULL}-pre-delete")]["rules"]
    assert [(r["resources"], r["resourceNames"], r["verbs"]) for r in pre] == [
        (["mutatingwebhookconfigurations"], [FULL], ["get", "delete"]),
        (["validatingwebhookconfigurations"], [FULL, f"{FULL}-runtimes"], ["get", "delete"])]
    none = rendered(helm, tmp_path, VALUE_SETS["no-rbac"])
    assert not {k for k, _ in none} & {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
    assert webhook_pod(none)["spec"]["serviceAccountName"] == "mine"


def test_hooks_run_the_chart_scripts(helm, tmp_path):
    docs = rendered(helm, tmp_path,
                    merged(VALUE_SETS["route1"], {"webhook": {"objectSelector": {"matchLabels": {"a": "b"}}},
                                                                  "tests": {"labels": {"team": "ml"}}}))
    pod = docs[("Pod", f"{FULL}-test")]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    # Kept after a success for helm test --logs; deleted after a failure, its log printed by Helm first.
    assert pod["metadata"]["annotations"]["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-failed"
    assert pod["metadata"]["annotations"]["helm.sh/hook-output-log-policy"] == "hook-failed"
    for kind in ("ServiceAccount", "Role", "RoleBinding"):
        assert "hook-failed" in docs[(kind, f"{FULL}-test")]["metadata"]["annotations"]["helm.sh/hook-delete-policy"]
    (c,) = pod["spec"]["containers"]
    assert c["image"] == f"{WEBHOOK_IMAGE}:0.1.0" and c["command"] == ["python3", "-c"]
    assert c["args"] == [(CHART / "files" / "helm-test.py").read_text()]
    config = json.loads(c["env"][0]["value"])
    assert config == {"namespace": "default",
                      "runtimeRef": {"name": "torch-distributed", "kind": "ClusterTrainingRuntime"},
                      "labels": {"a": "b", "team": "ml"}, "manager": "dispatch.go.phpboyscout.uk/publish",
                      "expectEntry": True, "enforcement": "enforce", "timeoutSeconds": 120, "namespaceExcluded": False,
                      "webhooks": ["mutate.dispatch.go.phpboyscout.uk", "validate.dispatch.go.phpboyscout.uk"]}
    job = docs[("Job", f"{FULL}-pre-delete")]
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["args"] == [(CHART / "files" / "pre-delete.py").read_text()]
    assert json.loads(c["env"][0]["value"])["configurations"] == [
        ["validatingwebhookconfigurations", FULL], ["validatingwebhookconfigurations", f"{FULL}-runtimes"],
        ["mutatingwebhookconfigurations", FULL]]
    for hook_kind, hook_name in ((("ServiceAccount", f"{FULL}-test")), ("ClusterRole", f"{FULL}-pre-delete")):
        assert int(docs[(hook_kind, hook_name)]["metadata"]["annotations"]["helm.sh/hook-weight"]) < 0
    # A test namespace the webhook never sees cannot prove anything: the test says so (the install still works).
    for excluded in (NS, "kube-system"):
        pod = rendered(helm, tmp_path, {"tests": {"namespace": excluded}})[("Pod", f"{FULL}-test")]
        assert json.loads(pod["spec"]["containers"][0]["env"][0]["value"])["namespaceExcluded"] is True
    off = rendered(helm, tmp_path,
                   {"tests": {"enabled": False}, "preUninstall": {"deleteWebhookConfigurations": False}})
    assert not any(name.endswith(("-test", "-pre-delete")) for _, name in off)


def test_kube_version_needs_image_volumes_on_by_default(helm, tmp_path):
    """The default route mounts an image volume: on by default from Kubernetes 1.35."""
    values = merged(BASE, {})
    for version, ok in (("1.34.4", False), ("1.35.0", True), ("1.37.2", True)):
        got = run_helm(helm, "template", "rel", str(CHART), "--kube-version", version, values=values, tmp=tmp_path,
                       check=False)
        assert (got.returncode == 0) == ok, (version, got.stderr)


@pytest.mark.parametrize("image", [f"registry.example/publish:v1@{IMAGE.split('@')[1]}", "registry.example/publish:v1",
                                   "publish@sha256:" + "A" * 64])
def test_values_schema_refuses_a_bad_publish_image(helm, tmp_path, image):
    got = template(helm, tmp_path, merged(BASE, {"publish": {"image": image}}), check=False)
    assert got.returncode != 0 and "publish/image" in got.stderr


def test_values_schema_refuses_init_container_on_route1(helm, tmp_path):
    got = template(helm, tmp_path, merged(BASE, {"publish": {"image": IMAGE, "initContainer": "x"}}), check=False)
    assert got.returncode != 0


def test_what_the_values_schema_cannot_say_stops_the_webhook(helm, tmp_path):
    # Overlapping mount paths pass the chart's schema; the webhook refuses to start on them.
    values = {"publish": {"image": IMAGE}, "credentials": [{"name": "a", "secret": "s", "mountPath": "/opt"}]}
    cm = rendered(helm, tmp_path, values)[("ConfigMap", f"{FULL}-settings")]
    with pytest.raises(settings_mod.Denied):
        settings_mod.parse(cm["data"]["settings.json"])


def test_values_schema_shares_the_webhook_patterns():
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["properties"]["publish"]["properties"]["image"]["anyOf"][1]["pattern"] == images.PINNED_PATTERN
    assert schema["properties"]["manager"]["pattern"] == settings_mod.DOMAIN_PREFIXED_PATH


def _local_args(args: list[str], tmp, port: int, metrics_port: int) -> list[str]:
    """The chart's serve arguments with the in-pod paths and listen addresses made local."""
    local = {"--cert-dir": str(tmp / "certs"),
             "--bind": f"127.0.0.1:{port}", "--metrics-bind": f"127.0.0.1:{metrics_port}",
             "--client-ca": str(tmp / "client-ca.crt")}
    out = []
    for a in args[1:]:
        flag, _, value = a.partition("=")
        if flag == "--settings-configmap":  # no API server here: the same settings from a file
            out.append(f"--settings={EXAMPLES / 'settings' / 'route1.json'}")
        else:
            out.append(f"{flag}={local[flag]}" if flag in local else a)
    return out


def test_serve_accepts_the_arguments_the_chart_renders(helm, tmp_path):
    """The Deployment's arguments (cert-manager mode: certificates from files) start a serving webhook whose
    metrics port answers plain HTTP with /metrics and nothing else."""
    docs = rendered(helm, tmp_path, merged(VALUE_SETS["cert-manager"], {"enforcement": "warn", "logLevel": "debug"}))
    port, metrics_port = free_port(), free_port()
    args = _local_args(args_of(docs), tmp_path, port, metrics_port)
    args += ["--runtime", str(EXAMPLES / "runtimes" / "torch-distributed.yaml")]
    with webhook_server(tmp_path, *args, port=port, cert_dir=tmp_path / "certs",
                        env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "metrics")}):
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
            assert r.status == 200 and b"dispatch_admission_" in r.read()
        for path in ("/validate", "/mutate", "/runtimes"):
            req = urllib.request.Request(f"http://127.0.0.1:{metrics_port}{path}", data=b"{}", method="POST")
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=5)
            assert e.value.code == 413  # the metrics port takes no request body


@pytest.mark.parametrize("client_ca", [False, True], ids=["tls-probes", "client-ca-probes"])
def test_probes_answer_where_the_chart_points_them(helm, tmp_path, client_ca):
    """The kubelet probes the port and scheme the chart names, with no client certificate: /healthz and /readyz
    must answer 200 there. With clientCA the TLS port demands a client certificate, so the chart probes the
    metrics port, which must then serve the two health paths as well."""
    from webhook import certs

    values = merged(VALUE_SETS["cert-manager"])
    if client_ca:
        _, ca = certs.make_ca("e2e API server client CA")
        pem = certs.pem_cert(ca)
        (tmp_path / "client-ca.crt").write_bytes(pem)
        values = merged(values, {"clientCA": {"pem": pem.decode()}})
    docs = rendered(helm, tmp_path, values)
    port, metrics_port = free_port(), free_port()
    args = _local_args(args_of(docs), tmp_path, port, metrics_port)
    args += ["--runtime", str(EXAMPLES / "runtimes" / "torch-distributed.yaml")]
    container = webhook_pod(docs)["spec"]["containers"][0]
    ports = {"https": port, "metrics": metrics_port}
    certs.write_dev_pair(tmp_path / "certs", ["localhost", "127.0.0.1"])
    ctx = ssl.create_default_context(cafile=str(tmp_path / "certs" / "ca.crt"))
    def answers(probe: str, url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=5, context=ctx if url.startswith("https") else None) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError) as e:
            assert getattr(e, "code", None) != 404, f"{probe} {url}: not served there (404)"
            return False

    # waited for on the metrics port's /metrics: with client certificates required, the TLS port cannot be
    # polled without one
    with running([sys.executable, "-m", "webhook", "serve", *args], tmp_path / "serve.log",
                 f"http://127.0.0.1:{metrics_port}/metrics",
                 env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "metrics")}):
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = container[probe]["httpGet"]
            url = f"{get['scheme'].lower()}://127.0.0.1:{ports[get['port']]}{get['path']}"
            eventually(lambda probe=probe, url=url: answers(probe, url), f"{probe} {url} answers 200", 30, 0.5)


# ---- against the API server ----

def _served(port, ca_pem: bytes) -> bytes:
    ctx = ssl.create_default_context(cadata=ca_pem.decode())
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            return tls.getpeercert(binary_form=True)


def _secret(cluster, name):
    s = cluster.get("secret", name, NS)
    return s["metadata"]["resourceVersion"], {k: base64.b64decode(v) for k, v in (s.get("data") or {}).items()}


def _install(env, helm, tmp_path, port, release="rel", extra=None):
    # The settings of the session's own webhooks (route1.json), which also see these TrainJobs: the release's
    # replicas read them from its ConfigMap, and both must write the same entry.
    route1 = json.loads((EXAMPLES / "settings" / "route1.json").read_text())
    values = merged(BASE, {"publish": route1["publish"], "credentials": route1["credentials"],
                           "webhook": {"url": f"https://127.0.0.1:{port}",
                                       "objectSelector": {"matchLabels": {HELM_LABEL: release}}},
                           "tests": {"labels": {SKIP_MUTATION_LABEL: "true"}}}, extra or {})
    run_helm(helm, "install", release, str(CHART), "--namespace", NS, "--create-namespace",
             values=values, tmp=tmp_path, kubeconfig=env.cluster.kubeconfig)


def test_install_self_managed_certificates_and_uninstall(env, helm, tmp_path):
    c = env.cluster
    port = free_port()
    _install(env, helm, tmp_path, port)
    try:
        _installed(c, helm, tmp_path, port)
    finally:
        run_helm(helm, "uninstall", "rel", "-n", NS, "--wait", "--no-hooks", kubeconfig=c.kubeconfig, check=False)
        c.kubectl("delete", "clusterrole,clusterrolebinding", f"{FULL}-pre-delete", "--ignore-not-found", check=False)
        c.kubectl("delete", "serviceaccount", f"{FULL}-pre-delete", f"{FULL}-test", "-n", NS, "--ignore-not-found",
                  check=False)
        c.kubectl("delete", "role,rolebinding", f"{FULL}-test", "-n", "default", "--ignore-not-found", check=False)


def _hooks(c, helm, release="rel") -> list[dict]:
    out = run_helm(helm, "get", "hooks", release, "-n", NS, kubeconfig=c.kubeconfig).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def _run_hook_script(c, tmp_path, hooks, pod_spec: dict, sa: str, config_override: dict | None = None):
    """Run a hook pod's script here, as the hook's ServiceAccount with the hook's RBAC (applied from the
    release's hooks), against the e2e API server: what the pod does in a cluster, without a kubelet."""
    for doc in hooks:
        if doc["kind"] in ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding") and \
                doc["metadata"]["name"] == sa:
            c.apply(doc)
    _, token = kubeconfig_as(c, sa, tmp_path)
    sa_dir = tmp_path / f"sa-{sa}"
    sa_dir.mkdir(exist_ok=True)
    (sa_dir / "token").write_text(token)
    shutil.copy(c.ca_file, sa_dir / "ca.crt")
    api = urllib.parse.urlsplit(c.server)
    (container,) = pod_spec["containers"]
    assert container["command"] == ["python3", "-c"]
    env = {e["name"]: e["value"] for e in container["env"]}
    if config_override:
        (key,) = env
        env[key] = json.dumps({**json.loads(env[key]), **config_override})
    return subprocess.run([sys.executable, "-c", container["args"][0]], capture_output=True, text=True, timeout=180,
                          env={**os.environ, **env, "SERVICEACCOUNT_DIR": str(sa_dir),
                               "KUBERNETES_SERVICE_HOST": api.hostname, "KUBERNETES_SERVICE_PORT": str(api.port)})


def _installed(c, helm, tmp_path, port):
    manifest = run_helm(helm, "get", "manifest", "rel", "-n", NS, kubeconfig=c.kubeconfig).stdout
    objects = [(d["kind"], d["metadata"]["name"],
                d["metadata"].get("namespace")) for d in yaml.safe_load_all(manifest) if d]
    assert len(objects) >= 13
    for kind, name, ns in objects:
        assert c.get(kind, name, ns) is not None, f"{kind} {name} was not created"
    hooks = _hooks(c, helm)
    assert {(d["kind"], d["metadata"]["name"]) for d in hooks} >= {("Pod", f"{FULL}-test"),
                                                                   ("Job", f"{FULL}-pre-delete")}

    # The certificate controller and two replica processes, each under the chart's ServiceAccount for it (its
    # RBAC, nothing more): the replicas only read what the controller issued.
    sa_kubeconfig, _ = kubeconfig_as(c, FULL, tmp_path)
    args = serve_args("rel", sa_kubeconfig)
    with certificate_controller(c, "rel", tmp_path), \
            webhook_server(tmp_path / "a", *args, port=port, make_certs=False):
        version_a, files = _secret(c, f"{FULL}-tls")
        assert set(files) == {"ca.crt", "tls.crt", "tls.key"}, "the CA's key is never in the serving Secret"
        assert set(_secret(c, f"{FULL}-ca")[1]) == {"ca.crt", "ca.key"}
        served_a = _served(port, files["ca.crt"])
        port_b = free_port()
        with webhook_server(tmp_path / "b", *args, port=port_b, make_certs=False):
            version_b, files_b = _secret(c, f"{FULL}-tls")
            assert version_b == version_a, "the second replica rewrote the Secret"
            assert _served(port_b, files["ca.crt"]) == served_a, "the replicas serve different certificates"
        served_pem = x509.load_der_x509_certificate(served_a).public_bytes(serialization.Encoding.PEM)
        assert served_pem == files["tls.crt"]
        bundle = base64.b64encode(files["ca.crt"]).decode()
        for kind in ("mutatingwebhookconfiguration", "validatingwebhookconfiguration"):
            cfg = c.get(kind, FULL)
            assert [w["clientConfig"]["caBundle"] for w in cfg["webhooks"]] == [bundle]
        # The installed configurations are live: a TrainJob they select goes through them.
        job = trainjob(name="via-helm", namespace="team-a")
        job["metadata"]["labels"] = {HELM_LABEL: "rel"}
        c.apply(job)
        log_a = tmp_path / "a" / f"webhook-{port}.log"
        eventually(lambda: "via-helm" in log_a.read_text(), "the release's webhook did not log the review")

        # helm test's script, as its ServiceAccount: a dry-run TrainJob comes back with our entry (the session's
        # webhooks skip it), and one breaking S3 is refused by this release's webhook.
        test_pod = next(d for d in hooks if d["kind"] == "Pod")
        got = _run_hook_script(c, tmp_path, hooks, test_pod["spec"], f"{FULL}-test")
        assert got.returncode == 0, got.stdout + got.stderr
        assert "ok: a TrainJob was admitted with the dispatch.go.phpboyscout.uk/publish entry" in got.stdout
        eventually(lambda: "dispatch-admission-test-" in log_a.read_text(), "the helm test's review was not logged")

    # With no webhook answering, the same script fails (it proves something).
    got = _run_hook_script(c, tmp_path, hooks, test_pod["spec"], f"{FULL}-test", {"timeoutSeconds": 3})
    assert got.returncode == 1 and "FAILED" in got.stdout, got.stdout + got.stderr
    got = _run_hook_script(c, tmp_path, hooks, test_pod["spec"], f"{FULL}-test", {"namespaceExcluded": True})
    assert got.returncode == 1 and "set tests.namespace to one it serves" in got.stdout, got.stdout + got.stderr

    # helm uninstall: Helm 3 deletes webhook configurations last (they are not in its uninstall order), after
    # the Service and the Deployment. The pre-delete hook's script deletes them first.
    job = next(d for d in hooks if d["kind"] == "Job")
    got = _run_hook_script(c, tmp_path, hooks, job["spec"]["template"]["spec"], f"{FULL}-pre-delete")
    assert got.returncode == 0, got.stdout + got.stderr
    for kind, name in (("validatingwebhookconfiguration", FULL), ("validatingwebhookconfiguration", f"{FULL}-runtimes"),
                       ("mutatingwebhookconfiguration", FULL)):
        assert c.get(kind, name) is None, f"{kind} {name} survived the pre-delete hook"
    assert c.get("deployment", FULL, NS) is not None and c.get("service", FULL, NS) is not None
    # Run twice (a retried uninstall): the configurations are already gone, still a success.
    again = _run_hook_script(c, tmp_path, hooks, job["spec"]["template"]["spec"], f"{FULL}-pre-delete",
                             {"settleSeconds": 0})
    assert again.returncode == 0 and "already gone" in again.stdout

    # The hooks cannot run here (no kubelet): uninstall without them, and see Helm's own order.
    got = run_helm(helm, "uninstall", "rel", "-n", NS, "--wait", "--no-hooks", "--debug", kubeconfig=c.kubeconfig)
    order = re.findall(r'Starting delete for "[^"]+" (\w+)', got.stdout + got.stderr)
    assert order, got.stdout + got.stderr
    assert order.index("Service") < order.index("ValidatingWebhookConfiguration"), order
    assert order.index("Deployment") < order.index("MutatingWebhookConfiguration"), order
    assert run_helm(helm, "status", "rel", "-n", NS, kubeconfig=c.kubeconfig, check=False).returncode != 0
    for kind, name, ns in objects:
        eventually(lambda kind=kind, name=name, ns=ns: c.get(kind, name, ns) is None,
                   f"{kind} {name} survived helm uninstall", 30, 0.5)


def test_self_managed_ca_reaches_the_runtime_warnings_configuration(env, helm, tmp_path):
    """The webhook writes its CA into <--webhook-configuration>-runtimes too (the chart's runtime-warnings
    ValidatingWebhookConfiguration), so runtime warnings work with self-managed certificates."""
    c = env.cluster
    port = free_port()
    _install(env, helm, tmp_path, port, release="rt", extra={"tests": {"enabled": False}})
    try:
        sa_kubeconfig, _ = kubeconfig_as(c, "rt-dispatch-admission", tmp_path)
        with certificate_controller(c, "rt", tmp_path), \
                webhook_server(tmp_path / "a", *serve_args("rt", sa_kubeconfig), port=port, make_certs=False):
            _, files = _secret(c, "rt-dispatch-admission-tls")
            bundle = base64.b64encode(files["ca.crt"]).decode()
            for kind, name in (("mutatingwebhookconfiguration", "rt-dispatch-admission"),
                               ("validatingwebhookconfiguration", "rt-dispatch-admission"),
                               ("validatingwebhookconfiguration", "rt-dispatch-admission-runtimes")):
                hooks = c.get(kind, name)["webhooks"]
                assert [w["clientConfig"].get("caBundle") for w in hooks] == [bundle], f"no CA in {kind} {name}"
    finally:
        run_helm(helm, "uninstall", "rt", "-n", NS, "--wait", "--no-hooks", kubeconfig=c.kubeconfig, check=False)


def test_helm_test_verify_runs_verify_with_only_its_rbac(helm, tmp_path):
    """tests.verify.runtime (docs/verify.md): a pod running `dispatch-admission verify` under its own
    ServiceAccount, with the RBAC verify needs and nothing more, all of it deleted when the test ends."""
    assert not any("-verify" in name for _, name in rendered(helm, tmp_path, VALUE_SETS["route1"])), \
        "off when tests.verify.runtime is empty"
    tests = {"namespace": "team-a", "labels": {"kueue.x-k8s.io/queue-name": "q"},
             "verify": {"runtime": "ClusterTrainingRuntime/torch-distributed"}}
    values = merged(VALUE_SETS["route1"], {"webhook": {"objectSelector": {"matchLabels": {"a": "b"}}}, "tests": tests})
    docs = rendered(helm, tmp_path, values)
    name = f"{FULL}-verify-{NS}"  # every object named as the pod: helm test --logs reads a pod log per hook name
    pod = docs[("Pod", name)]
    assert pod["metadata"]["annotations"] == {"helm.sh/hook": "test",
                                              "helm.sh/hook-delete-policy": "before-hook-creation,hook-failed",
                                              "helm.sh/hook-output-log-policy": "hook-failed"}
    assert pod["spec"]["serviceAccountName"] == name
    (c,) = pod["spec"]["containers"]
    assert c["args"] == ["verify", "--runtime=ClusterTrainingRuntime/torch-distributed", "--namespace=team-a",
                         "--settings=/etc/dispatch-admission/settings/settings.json", "--timeout=240",
                         "--label=a=b", "--label=kueue.x-k8s.io/queue-name=q"]
    assert pod["spec"]["volumes"] == [{"name": "settings", "configMap": {"name": f"{FULL}-settings"}}]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert docs[("Role", name)]["metadata"]["namespace"] == "team-a"
    assert docs[("Role", name)]["rules"] == [
        {"apiGroups": ["trainer.kubeflow.org"], "resources": ["trainjobs"],
         "verbs": ["create", "get", "list", "delete", "watch"]},
        {"apiGroups": [""], "resources": ["pods", "events"], "verbs": ["get", "list"]},
        {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]}]
    # with credentials: whether each one's Secret exists, those Secrets only (issue 35)
    with_creds = rendered(helm, tmp_path, merged(values, {"credentials": [
        {"name": "a", "secret": "s3-credentials", "mountPath": "/creds/a"},
        {"name": "b", "secret": "registry-token", "mountPath": "/creds/b"}]}))
    assert with_creds[("Role", name)]["rules"][3] == {"apiGroups": [""], "resources": ["secrets"],
                                                      "resourceNames": ["s3-credentials", "registry-token"],
                                                      "verbs": ["get"]}
    assert docs[("ClusterRole", name)]["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list"]},
        {"apiGroups": ["trainer.kubeflow.org"], "resources": ["clustertrainingruntimes"],
         "resourceNames": ["torch-distributed"], "verbs": ["get"]}]
    for kind, obj_name in (("ServiceAccount", name), ("Role", name), ("RoleBinding", name),
                           ("ClusterRole", name), ("ClusterRoleBinding", name)):
        annotations = docs[(kind, obj_name)]["metadata"]["annotations"]
        assert annotations["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded,hook-failed", kind
        assert int(annotations["helm.sh/hook-weight"]) < 0, kind
    # A TrainingRuntime is read in the namespace instead; no cluster-wide runtime read at all.
    docs = rendered(helm, tmp_path, merged(values, {"tests": {"verify": {"runtime": "TrainingRuntime/mine"}}}))
    assert {"apiGroups": ["trainer.kubeflow.org"], "resources": ["trainingruntimes"], "verbs": ["get"]} \
        in docs[("Role", name)]["rules"]
    assert docs[("ClusterRole", name)]["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list"]}]


def test_the_runtime_keeper_is_a_native_sidecar_sharing_the_store(helm, tmp_path):
    """Issue 33: the keeper in a container of its own (restartPolicy: Always init container), its memory and
    ephemeral storage bounded apart from the webhook's, the two sharing the store's volume."""
    docs = rendered(helm, tmp_path, {"runtimeKeeper": {"liveReads": {"perSecond": 5, "burst": 7}}})
    pod = webhook_pod(docs)["spec"]
    (keeper,) = pod["initContainers"]
    (webhook,) = pod["containers"]
    assert keeper["name"] == "runtime-keeper" and keeper["restartPolicy"] == "Always"
    assert keeper["args"][:2] == ["keep", "--runtime-store=/var/cache/dispatch-admission/runtimes"]
    assert {"--live-reads-per-second=5", "--live-reads-burst=7"} <= set(keeper["args"])
    assert {"--runtime-store=/var/cache/dispatch-admission/runtimes",
            "--runtime-keeper=external"} <= set(webhook["args"])
    assert keeper["image"] == webhook["image"]
    assert keeper["securityContext"] == webhook["securityContext"]
    store = {"name": "runtime-store", "mountPath": "/var/cache/dispatch-admission"}
    assert store in keeper["volumeMounts"] and store in webhook["volumeMounts"]
    limits = keeper["resources"]["limits"]
    assert limits["memory"] and limits["ephemeral-storage"]
    size_limit = next(v for v in pod["volumes"] if v["name"] == "runtime-store")["emptyDir"]["sizeLimit"]

    def mib(q: str) -> int:
        return int(q[:-2]) * {"Mi": 1, "Gi": 1024}[q[-2:]]

    from webhook.kube.store import MAP_SIZE

    assert mib(size_limit) > MAP_SIZE >> 20 and mib(limits["ephemeral-storage"]) > mib(size_limit), \
        "the store's bound is below the volume's limit and the container's: the store cannot get the pod evicted"


def test_the_audit_cronjob_writes_openreports_with_rights_to_nothing_else(helm, tmp_path):
    """Issue 37: `audit.enabled` renders a CronJob running `audit --report --exit-zero` on the settings ConfigMap,
    as a ServiceAccount that may list runtimes and TrainJobs and write reports only (Secrets with checkSecrets)."""
    assert not [k for k in rendered(helm, tmp_path, {}) if k[0] == "CronJob"], "off by default"
    docs = rendered(helm, tmp_path, {"audit": {"enabled": True}})
    job = docs[("CronJob", f"{FULL}-audit")]
    pod = job["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["args"] == ["audit", "--settings=/etc/dispatch-admission/settings/settings.json", "--report",
                         "--exit-zero"]
    assert pod["serviceAccountName"] == f"{FULL}-audit" and job["spec"]["concurrencyPolicy"] == "Forbid"
    assert pod["volumes"] == [{"name": "settings", "configMap": {"name": f"{FULL}-settings"}}]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    rules = docs[("ClusterRole", f"{FULL}-audit")]["rules"]
    assert rules == [
        {"apiGroups": ["trainer.kubeflow.org"],
         "resources": ["clustertrainingruntimes", "trainingruntimes", "trainjobs"],
         "verbs": ["list"]},
        {"apiGroups": ["openreports.io"], "resources": ["reports", "clusterreports"],
         "verbs": ["get", "list", "create", "update", "delete"]}]
    secrets = rendered(helm, tmp_path, {"audit": {"enabled": True, "checkSecrets": True}})
    assert {"apiGroups": [""], "resources": ["secrets"],
            "verbs": ["list"]} in secrets[("ClusterRole", f"{FULL}-audit")][
        "rules"]


def notes(helm, tmp_path, values: dict) -> str:
    """The chart's NOTES.txt as `helm install` prints it (`helm template` leaves NOTES out): a copy of the chart whose
    NOTES text is also a named template, rendered into a ConfigMap."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    text = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "_notes_under_test.tpl").write_text(f'{{{{- define "notes-under-test" -}}}}\n{text}'
                                                               "\n{{- end -}}\n")
    (chart / "templates" / "notes-under-test.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes-under-test}\ndata:\n  notes: |\n"
        '{{ include "notes-under-test" . | indent 4 }}\n')
    return rendered(helm, tmp_path, values, chart=chart)[("ConfigMap", "notes-under-test")]["data"]["notes"]


@pytest.mark.parametrize(("values", "warned"), [
    ({}, True),
    ({"networkPolicy": {"enabled": False}}, True),
    ({"networkPolicy": {"apiServerCIDRs": ["10.0.0.0/8"]}}, False),
    ({"clientCA": {"pem": PEM}}, False),
    ({"clientCA": {"existingConfigMap": "api-server-client-ca"}}, False),
], ids=["defaults", "no-network-policy", "cidrs", "client-ca-pem", "client-ca-configmap"])
def test_notes_warn_while_the_webhook_port_takes_any_source(helm, tmp_path, values, warned):
    """Issue 47: with neither apiServerCIDRs nor clientCA any pod can send the webhook reviews; the install says so."""
    text = notes(helm, tmp_path, merged(BASE, {"publish": {"image": IMAGE}}, values))
    assert ("WARNING: the webhook port is open to every pod in the cluster" in text) is warned, text
    assert "is installed as" in text
