"""Issue 35, rendered: who can change what the webhook enforces. The publish repositories and the grace reach
serve; the guard policy; the CA Secret and a ServiceAccount per role; the NetworkPolicy variants per platform.
What these do on the API server is tests/e2e/test_trust.py's."""

from __future__ import annotations

import pytest

from tests.e2e.helm import (
    BASE,
    FULL,
    NS,
    args_of,
    merged,
    rendered,
    template,
)
from tests.helpers import IMAGE

REPO = IMAGE.split("@")[0]
ROUTE1 = {"publish": {"image": IMAGE}}


def arg(docs, flag: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args_of(docs) if a.startswith(flag + "=")]
    return value


def refused(helm, tmp_path, values) -> str:
    got = template(helm, tmp_path, merged(BASE, values), check=False)
    assert got.returncode != 0, "rendered"
    return got.stderr


# ---- the publish image's repository, and the previous settings' grace ----

def test_the_publish_repository_is_fixed_at_deploy_time(helm, tmp_path):
    assert arg(rendered(helm, tmp_path, ROUTE1), "--publish-repositories") == REPO
    assert arg(rendered(helm, tmp_path, {}), "--publish-repositories") == "", "no image: no repository may be named"
    both = rendered(helm, tmp_path, merged(ROUTE1, {"publish": {"repositories": [REPO, "registry.example/next"]}}))
    assert arg(both, "--publish-repositories") == f"{REPO},registry.example/next"
    err = refused(helm, tmp_path, merged(ROUTE1, {"publish": {"repositories": ["registry.example/next"]}}))
    assert f"publish.image's repository {REPO} is not in publish.repositories" in err
    for bad in (IMAGE, REPO + ":v1", "registry.example/Upper"):
        assert "/publish/repositories/0" in refused(helm, tmp_path, {"publish": {"repositories": [bad]}}), bad


def test_the_grace_reaches_serve_and_may_be_zero(helm, tmp_path):
    assert arg(rendered(helm, tmp_path, {}), "--previous-settings-grace") == "600"
    assert arg(rendered(helm, tmp_path, {"previousSettingsGraceSeconds": 0}), "--previous-settings-grace") == "0"
    assert "/previousSettingsGraceSeconds" in refused(helm, tmp_path, {"previousSettingsGraceSeconds": -1})


# ---- the CA apart, and one ServiceAccount per role ----

def test_the_ca_key_has_a_secret_only_the_controller_reads(helm, tmp_path):
    docs = rendered(helm, tmp_path, ROUTE1)
    assert docs[("Secret", f"{FULL}-ca")]["type"] == "Opaque" and "data" not in docs[("Secret", f"{FULL}-ca")]
    controller = docs[("Deployment", f"{FULL}-certs")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--ca-secret={FULL}-ca" in controller and f"--tls-secret={FULL}-tls" in controller
    readable = [r for kind, name in docs if kind == "Role"
                for r in docs[(kind, name)]["rules"] if "secrets" in r["resources"]]
    webhook = docs[("Role", f"{FULL}-tls")]["rules"]
    assert webhook == [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": [f"{FULL}-tls"],
                        "verbs": ["get"]}], "the serving pods read their Secret only"
    assert [r["resourceNames"] for r in readable if f"{FULL}-ca" in r.get("resourceNames", [])] == [
        [f"{FULL}-tls", f"{FULL}-ca"]], "the controller's Role alone names the CA Secret"
    assert ("Secret", f"{FULL}-ca") not in rendered(helm, tmp_path, merged(
        ROUTE1, {"certificates": {"certManager": {"enabled": True}}})), "cert-manager keeps its CA its own way"


def controller_account(docs) -> str:
    return docs[("Deployment", f"{FULL}-certs")]["spec"]["template"]["spec"]["serviceAccountName"]


def bound(docs, kind: str, name: str) -> list[str]:
    return [s["name"] for s in docs[(kind, name)]["subjects"]]


def test_each_role_runs_as_a_service_account_of_its_own(helm, tmp_path):
    """serviceAccount.create=false no longer puts the certificate controller on the namespace's default account."""
    docs = rendered(helm, tmp_path, {"serviceAccount": {"create": False}})
    assert docs[("Deployment", FULL)]["spec"]["template"]["spec"]["serviceAccountName"] == "default"
    assert controller_account(docs) == f"{FULL}-certs" and ("ServiceAccount", f"{FULL}-certs") in docs
    assert bound(docs, "RoleBinding", f"{FULL}-certs") == [f"{FULL}-certs"]
    assert bound(docs, "ClusterRoleBinding", f"{FULL}-certs") == [f"{FULL}-certs"]
    # Both made elsewhere: each named, each bound.
    own = rendered(helm, tmp_path, {"serviceAccount": {"create": False, "name": "webhook-sa"},
                                    "certificates": {"controller": {"serviceAccount": {"create": False,
                                                                                       "name": "certs-sa"}}}})
    assert controller_account(own) == "certs-sa" and not [k for k in own if k[0] == "ServiceAccount"
                                                           and k[1] in ("certs-sa", "webhook-sa")]
    assert bound(own, "RoleBinding", f"{FULL}-certs") == ["certs-sa"]
    assert bound(own, "RoleBinding", f"{FULL}-tls") == ["webhook-sa"]
    # Refused: the same account for both roles, or the namespace's default for the controller.
    assert "the certificate controller and the webhook would both run as ServiceAccount default" in refused(
        helm, tmp_path, {"serviceAccount": {"create": False},
                         "certificates": {"controller": {"serviceAccount": {"create": False, "name": "default"}}}})
    assert "would both run as ServiceAccount shared" in refused(
        helm, tmp_path, {"serviceAccount": {"create": False, "name": "shared"},
                         "certificates": {"controller": {"serviceAccount": {"create": False, "name": "shared"}}}})
    assert "would both run as ServiceAccount same" in refused(
        helm, tmp_path, {"serviceAccount": {"name": "same"},
                         "certificates": {"controller": {"serviceAccount": {"name": "same"}}}})
    assert "must not be default" in refused(
        helm, tmp_path, {"certificates": {"controller": {"serviceAccount": {"create": False, "name": "default"}}}})
    assert "certificates.controller.serviceAccount.name is required" in refused(
        helm, tmp_path, {"serviceAccount": {"create": False},
                         "certificates": {"controller": {"serviceAccount": {"create": False}}}})
    # cert-manager: no controller, nothing to keep apart.
    assert ("Deployment", f"{FULL}-certs") not in rendered(helm, tmp_path, {
        "serviceAccount": {"create": False}, "certificates": {"certManager": {"enabled": True},
                                                              "controller": {"serviceAccount": {"create": False}}}})


# ---- the guard ----

def test_the_guard_is_on_by_default_and_names_who_may_pass(helm, tmp_path):
    docs = rendered(helm, tmp_path, {"guard": {"groups": ["platform-team"], "users": ["alice"],
                                               "serviceAccounts": ["argocd/argocd-application-controller"]}})
    policy = docs[("ValidatingAdmissionPolicy", f"{FULL}-guard")]["spec"]
    assert docs[("ValidatingAdmissionPolicyBinding", f"{FULL}-guard")]["spec"] == {
        "policyName": f"{FULL}-guard", "validationActions": ["Deny"]}
    assert policy["failurePolicy"] == "Fail"
    namespaces, settings = policy["matchConstraints"]["resourceRules"]
    assert namespaces == {"apiGroups": [""], "apiVersions": ["v1"], "resources": ["namespaces"],
                          "operations": ["CREATE", "UPDATE"]}
    assert settings["resources"] == ["configmaps"] and settings["resourceNames"] == [f"{FULL}-settings"]
    assert settings["operations"] == ["CREATE", "UPDATE", "DELETE"]
    variables = {v["name"]: v["expression"] for v in policy["variables"]}
    trusted = variables["trusted"]
    assert 'request.userInfo.username in ["alice","system:serviceaccount:argocd:argocd-application-controller"]' \
        in trusted
    assert 'g in ["platform-team"]' in trusted
    assert f'.name("{FULL}-guard").check(\'patch\').allowed()' in trusted, "the installer (who may patch it) passes"
    assert '"dispatch-admission.io/ignore" in object.metadata.labels' in variables["optOutUnchanged"]
    assert variables["settings"] == f"request.resource.resource == 'configmaps' && request.namespace == \"{NS}\""
    assert len(policy["validations"]) == 2
    no_label = rendered(helm, tmp_path, {"webhook": {"ignoreNamespaceLabel": ""}})
    (rule,) = no_label[("ValidatingAdmissionPolicy", f"{FULL}-guard")]["spec"]["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["configmaps"], "no opt-out label: only the settings are guarded"
    off = rendered(helm, tmp_path, {"guard": {"enabled": False}})
    assert not [k for k in off if k[0].startswith("ValidatingAdmissionPolicy")]
    assert "/guard/serviceAccounts/0" in refused(helm, tmp_path, {"guard": {"serviceAccounts": ["no-namespace"]}})


# ---- the NetworkPolicy per platform ----

def webhook_peers(docs):
    """The `from` of the NetworkPolicy's rule for the webhook port (None: any source; absent rule: [])."""
    rules = [r for r in docs[("NetworkPolicy", FULL)]["spec"]["ingress"] if r["ports"][0]["port"] == 8443]
    return [r.get("from") for r in rules]


def test_network_policy_variants_per_platform(helm, tmp_path):
    assert webhook_peers(rendered(helm, tmp_path, {})) == [None], "cidrs, none given: any source"
    cilium = rendered(helm, tmp_path, {"networkPolicy": {"apiServerSource": "cilium"}})
    assert webhook_peers(cilium) == [], "Cilium: the webhook port is opened by the CiliumNetworkPolicy alone"
    cnp = cilium[("CiliumNetworkPolicy", f"{FULL}-apiserver")]
    assert cnp["apiVersion"] == "cilium.io/v2" and cnp["metadata"]["namespace"] == NS
    assert cnp["spec"] == {
        "endpointSelector": {"matchLabels": {"app.kubernetes.io/name": "dispatch-admission",
                                             "app.kubernetes.io/instance": "rel"}},
        "ingress": [{"fromEntities": ["kube-apiserver"],
                     "toPorts": [{"ports": [{"port": "8443", "protocol": "TCP"}]}]}]}
    wider = rendered(helm, tmp_path, {"networkPolicy": {"apiServerSource": "cilium", "apiServerCIDRs": ["10.0.0.1/32"],
                                                        "cilium": {"fromEntities": ["kube-apiserver", "remote-node"]}}})
    assert webhook_peers(wider) == [[{"ipBlock": {"cidr": "10.0.0.1/32"}}]]
    assert wider[("CiliumNetworkPolicy", f"{FULL}-apiserver")]["spec"]["ingress"][0]["fromEntities"] == [
        "kube-apiserver", "remote-node"]
    assert "apiServerCIDRs" in refused(helm, tmp_path, {"networkPolicy": {"apiServerSource": "calico"}})
    calico = rendered(helm, tmp_path, {"networkPolicy": {"apiServerSource": "calico",
                                                         "apiServerCIDRs": ["10.0.0.10/32", "192.168.77.0/32"]}})
    assert webhook_peers(calico) == [[{"ipBlock": {"cidr": "10.0.0.10/32"}}, {"ipBlock": {"cidr": "192.168.77.0/32"}}]]
    konnectivity = rendered(helm, tmp_path, {"networkPolicy": {"apiServerSource": "konnectivity"}})
    assert webhook_peers(konnectivity) == [[{
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
        "podSelector": {"matchLabels": {"k8s-app": "konnectivity-agent"}}}]]
    for docs in (calico, konnectivity, rendered(helm, tmp_path, {})):
        assert not [k for k in docs if k[0] == "CiliumNetworkPolicy"]
    assert "/networkPolicy/apiServerSource" in refused(helm, tmp_path, {"networkPolicy": {"apiServerSource": "weave"}})


@pytest.mark.parametrize("source", ["cidrs", "cilium", "calico", "konnectivity"])
def test_the_metrics_port_and_the_controller_stay_closed_in_every_variant(helm, tmp_path, source):
    values = {"networkPolicy": {"apiServerSource": source, "apiServerCIDRs": ["10.0.0.10/32"]}}
    docs = rendered(helm, tmp_path, values)
    ports = [r["ports"][0]["port"] for r in docs[("NetworkPolicy", FULL)]["spec"]["ingress"]]
    assert 8080 not in ports
    assert "ingress" not in docs[("NetworkPolicy", f"{FULL}-certs")]["spec"]
    opened = rendered(helm, tmp_path, merged(values, {"networkPolicy": {"metricsNamespaces": ["monitoring"]}}))
    assert 8080 in [r["ports"][0]["port"] for r in opened[("NetworkPolicy", FULL)]["spec"]["ingress"]]
