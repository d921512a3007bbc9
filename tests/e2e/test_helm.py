"""The Helm chart: lint and template in every mode, then install, self-managed certificates and
uninstall against the end-to-end API server. helm is built from its Go module like the API server."""

from __future__ import annotations

import base64
import json
import socket
import ssl
import subprocess
import time

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from webhook.core import images, settings as settings_mod
from tests.e2e import toolchain
from tests.helpers import EXAMPLES, IMAGE, ROOT, trainjob
from tests.process import free_port, webhook_server

CHART = ROOT / "charts" / "dispatch-admission"
HELM_LABEL = "dispatch-e2e/helm"

VALUE_SETS = {
    "default": {},
    "route1": {"publish": {"image": IMAGE}},
    "route2": {"publish": {"image": IMAGE, "via": "initContainer", "initContainer": "dispatch-publish"}},
    "cert-manager": {"publish": {"image": IMAGE}, "certificates": {"certManager": {"enabled": True}}},
    "credentials": {"publish": {"image": IMAGE}, "credentials": [
        {"name": "checkpoint-store", "secret": "s3-credentials", "mountPath": "/var/run/dispatch/creds"}],
        "metrics": {"serviceMonitor": {"enabled": True}},
        "networkPolicy": {"enabled": True, "apiServerCIDRs": ["10.0.0.0/8"]}},
}


@pytest.fixture(scope="module")
def helm():
    return str(toolchain.helm_bin() / "helm")


def run_helm(helm, *args, values: dict | None = None, tmp=None, check=True, kubeconfig=None):
    cmd = [helm, *args]
    if values is not None:
        path = tmp / f"values-{abs(hash(json.dumps(values, sort_keys=True)))}.yaml"
        path.write_text(yaml.safe_dump(values))
        cmd += ["-f", str(path)]
    if kubeconfig:
        cmd += ["--kubeconfig", kubeconfig]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if check and got.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}:\n{got.stdout}\n{got.stderr}")
    return got


def rendered(helm, tmp, values) -> dict[tuple[str, str], dict]:
    out = run_helm(helm, "template", "rel", str(CHART), "--namespace", "dispatch-system", values=values, tmp=tmp).stdout
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out) if d}


@pytest.mark.parametrize("name", VALUE_SETS)
def test_lint_and_template(helm, tmp_path, name):
    values = VALUE_SETS[name]
    run_helm(helm, "lint", "--strict", str(CHART), values=values, tmp=tmp_path)
    docs = rendered(helm, tmp_path, values)
    kinds = {k for k, _ in docs}
    assert {"Deployment", "Service", "ConfigMap", "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration",
            "ClusterRole", "ClusterRoleBinding", "PodDisruptionBudget", "ServiceAccount"} <= kinds
    # The settings the chart renders are settings the webhook accepts.
    cm = docs[("ConfigMap", "rel-dispatch-admission-settings")]
    parsed = settings_mod.parse(cm["data"]["settings.json"])
    assert (parsed.publish is not None) == ("publish" in values)
    if name == "route2":
        assert parsed.publish.via == "initContainer"
    mutating = docs[("MutatingWebhookConfiguration", "rel-dispatch-admission")]["webhooks"][0]
    validating = docs[("ValidatingWebhookConfiguration", "rel-dispatch-admission")]["webhooks"][0]
    assert mutating["failurePolicy"] == "Ignore" and validating["failurePolicy"] == "Fail"
    assert mutating["reinvocationPolicy"] == "IfNeeded" and mutating["sideEffects"] == "None"
    assert mutating["admissionReviewVersions"] == ["v1"]
    excluded = mutating["namespaceSelector"]["matchExpressions"][0]["values"]
    assert "kube-system" in excluded and "dispatch-system" in excluded
    assert mutating["rules"][0]["resources"] == ["trainjobs"] and mutating["rules"][0]["operations"] == ["CREATE", "UPDATE"]
    if name == "cert-manager":
        assert ("Certificate", "rel-dispatch-admission") in docs
        assert docs[("MutatingWebhookConfiguration", "rel-dispatch-admission")]["metadata"]["annotations"][
            "cert-manager.io/inject-ca-from"] == "dispatch-system/rel-dispatch-admission"
        assert ("Role", "rel-dispatch-admission-tls") not in docs
    else:
        assert ("Secret", "rel-dispatch-admission-tls") in docs and "data" not in docs[("Secret", "rel-dispatch-admission-tls")]
    if name == "credentials":
        assert ("ServiceMonitor", "rel-dispatch-admission") in docs and ("NetworkPolicy", "rel-dispatch-admission") in docs


def test_deployment_is_hardened(helm, tmp_path):
    dep = rendered(helm, tmp_path, VALUE_SETS["route1"])[("Deployment", "rel-dispatch-admission")]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert dep["spec"]["replicas"] == 2
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "https", "scheme": "HTTPS"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "https", "scheme": "HTTPS"}
    assert "podAntiAffinity" in pod["affinity"] and c["resources"]["requests"]
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["settings"]["readOnly"] is True


def test_rbac_is_least_privilege(helm, tmp_path):
    docs = rendered(helm, tmp_path, VALUE_SETS["route1"])
    rules = docs[("ClusterRole", "rel-dispatch-admission")]["rules"]
    assert rules[0]["verbs"] == ["get", "list", "watch"]
    assert rules[1]["resourceNames"] == ["rel-dispatch-admission"] and rules[1]["verbs"] == ["get", "patch"]
    role = docs[("Role", "rel-dispatch-admission-tls")]["rules"]
    assert role == [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["rel-dispatch-admission-tls"],
                     "verbs": ["get", "update"]}]


@pytest.mark.parametrize("image", [f"registry.example/publish:v1@{IMAGE.split('@')[1]}", "registry.example/publish:v1",
                                   "publish@sha256:" + "A" * 64])
def test_values_schema_refuses_a_bad_publish_image(helm, tmp_path, image):
    got = run_helm(helm, "template", "rel", str(CHART), values={"publish": {"image": image}}, tmp=tmp_path, check=False)
    assert got.returncode != 0 and "publish/image" in got.stderr


def test_values_schema_refuses_init_container_on_route1(helm, tmp_path):
    got = run_helm(helm, "template", "rel", str(CHART), tmp=tmp_path, check=False,
                   values={"publish": {"image": IMAGE, "initContainer": "x"}})
    assert got.returncode != 0


def test_what_the_values_schema_cannot_say_stops_the_webhook(helm, tmp_path):
    # Overlapping mount paths pass the chart's schema; the webhook refuses to start on them.
    values = {"publish": {"image": IMAGE}, "credentials": [{"name": "a", "secret": "s", "mountPath": "/opt"}]}
    cm = rendered(helm, tmp_path, values)[("ConfigMap", "rel-dispatch-admission-settings")]
    with pytest.raises(settings_mod.Denied):
        settings_mod.parse(cm["data"]["settings.json"])


def test_values_schema_shares_the_webhook_patterns():
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["properties"]["publish"]["properties"]["image"]["anyOf"][1]["pattern"] == images.PINNED_PATTERN
    assert schema["properties"]["manager"]["pattern"] == settings_mod.DOMAIN_PREFIXED_PATH


# ---- against the API server ----

def _served(port, ca_pem: bytes) -> bytes:
    ctx = ssl.create_default_context(cadata=ca_pem.decode())
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            return tls.getpeercert(binary_form=True)


def _secret(cluster, name):
    s = cluster.get("secret", name, "dispatch-system")
    return s["metadata"]["resourceVersion"], {k: base64.b64decode(v) for k, v in (s.get("data") or {}).items()}


def test_install_self_managed_certificates_and_uninstall(env, helm, tmp_path):
    c = env.cluster
    port = free_port()
    values = {"publish": {"image": IMAGE}, "webhook": {"url": f"https://127.0.0.1:{port}",
                                                          "objectSelector": {"matchLabels": {HELM_LABEL: "true"}}}}
    run_helm(helm, "install", "rel", str(CHART), "--namespace", "dispatch-system", "--create-namespace",
             values=values, tmp=tmp_path, kubeconfig=c.kubeconfig)
    try:
        _installed(c, helm, tmp_path, port)
    finally:
        run_helm(helm, "uninstall", "rel", "-n", "dispatch-system", "--wait", kubeconfig=c.kubeconfig, check=False)


def _installed(c, helm, tmp_path, port):
    manifest = run_helm(helm, "get", "manifest", "rel", "-n", "dispatch-system", kubeconfig=c.kubeconfig).stdout
    objects = [(d["kind"], d["metadata"]["name"], d["metadata"].get("namespace")) for d in yaml.safe_load_all(manifest) if d]
    assert len(objects) >= 12
    for kind, name, ns in objects:
        assert c.get(kind, name, ns) is not None, f"{kind} {name} was not created"

    # Two replica processes under the chart's own ServiceAccount (its RBAC, nothing more).
    token = c.kubectl("create", "token", "rel-dispatch-admission", "-n", "dispatch-system").stdout.strip()
    sa_config = yaml.safe_load(open(c.kubeconfig))
    sa_config["users"] = [{"name": "sa", "user": {"token": token}}]
    sa_config["contexts"][0]["context"]["user"] = "sa"
    sa_kubeconfig = tmp_path / "sa-kubeconfig"
    sa_kubeconfig.write_text(yaml.safe_dump(sa_config))
    args = ["--settings", str(EXAMPLES / "settings" / "route1.json"), "--kubeconfig", str(sa_kubeconfig),
            "--tls-secret", "rel-dispatch-admission-tls", "--tls-service", "rel-dispatch-admission",
            "--webhook-configuration", "rel-dispatch-admission", "--namespace", "dispatch-system"]
    with webhook_server(tmp_path / "a", *args, port=port, make_certs=False):
        version_a, files = _secret(c, "rel-dispatch-admission-tls")
        assert set(files) == {"ca.crt", "ca.key", "tls.crt", "tls.key"}
        served_a = _served(port, files["ca.crt"])
        port_b = free_port()
        with webhook_server(tmp_path / "b", *args, port=port_b, make_certs=False):
            version_b, files_b = _secret(c, "rel-dispatch-admission-tls")
            assert version_b == version_a, "the second replica rewrote the Secret"
            assert _served(port_b, files["ca.crt"]) == served_a, "the replicas serve different certificates"
        served_pem = x509.load_der_x509_certificate(served_a).public_bytes(serialization.Encoding.PEM)
        assert served_pem == files["tls.crt"]
        bundle = base64.b64encode(files["ca.crt"]).decode()
        for kind in ("mutatingwebhookconfiguration", "validatingwebhookconfiguration"):
            cfg = c.get(kind, "rel-dispatch-admission")
            assert [w["clientConfig"]["caBundle"] for w in cfg["webhooks"]] == [bundle]
        # The installed configurations are live: a TrainJob they select goes through them.
        job = trainjob(name="via-helm", namespace="team-a")
        job["metadata"]["labels"] = {HELM_LABEL: "true"}
        c.apply(job)
        assert "via-helm" in (tmp_path / "a" / f"webhook-{port}.log").read_text()

    run_helm(helm, "uninstall", "rel", "-n", "dispatch-system", "--wait", kubeconfig=c.kubeconfig)
    assert run_helm(helm, "status", "rel", "-n", "dispatch-system", kubeconfig=c.kubeconfig, check=False).returncode != 0
    for kind, name, ns in objects:
        deadline = time.monotonic() + 30
        while c.get(kind, name, ns) is not None:
            assert time.monotonic() < deadline, f"{kind} {name} survived helm uninstall"
            time.sleep(0.5)
