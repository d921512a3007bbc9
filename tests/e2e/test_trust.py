"""Issue 35 on the API server: who can change what the webhook enforces.

The chart is installed into the end-to-end API server (as test_helm's install does) with its guard, its
certificate controller and one replica as local processes, each under the chart's ServiceAccount for it, the
replica started with the arguments the chart renders (--settings-configmap, --publish-repositories,
--previous-settings-grace). The session's own webhooks are taken away meanwhile, so every TrainJob here goes
through the release's configurations alone, their matchConditions included.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import pytest
import yaml

from tests.e2e.helm import (
    BASE,
    CHART,
    HELM_LABEL,
    NS,
    certificate_controller,
    kubeconfig_as,
    merged,
    rendered,
    run_helm,
)
from tests.e2e.webhooks import webhooks_swapped
from tests.helpers import EXAMPLES, MANAGER, eventually, trainjob
from tests.process import free_port, webhook_server

RELEASE = "trust"
FULL = f"{RELEASE}-dispatch-admission"
SETTINGS = f"{FULL}-settings"
LABEL = "dispatch-admission.io/ignore"
ROUTE1 = json.loads((EXAMPLES / "settings" / "route1.json").read_text())
REPO, D0 = ROUTE1["publish"]["image"].split("@")
D1 = "sha256:" + "1" * 64
ELSEWHERE = "registry.example/evil/publish@sha256:" + "e" * 64
LISTED_GROUP, LISTED_USER, LISTED_SA, UNLISTED_SA = "platform-team", "bob", "deployer", "other"
VALUES = merged(BASE, {"publish": ROUTE1["publish"], "credentials": ROUTE1["credentials"],
                       "tests": {"enabled": False},
                       "guard": {"groups": [LISTED_GROUP], "users": [LISTED_USER],
                                 "serviceAccounts": [f"{NS}/{LISTED_SA}"]}})


class Release:
    """The installed release and its one replica, which a test may restart with the chart's new arguments."""

    def __init__(self, c, helm, tmp: Path, port: int):
        self.c, self.helm, self.tmp, self.port = c, helm, tmp, port
        self.values = merged(VALUES, {"webhook": {"url": f"https://127.0.0.1:{port}",
                                                  "objectSelector": {"matchLabels": {HELM_LABEL: RELEASE}}}})
        self.replica: contextlib.ExitStack | None = None
        self.log: Path | None = None
        self.metrics_port = 0
        self.starts = 0

    def helm_run(self, verb: str, values: dict | None = None):
        return run_helm(self.helm, verb, RELEASE, str(CHART), "--namespace", NS, "--create-namespace",
                        values=values or self.values, tmp=self.tmp, kubeconfig=self.c.kubeconfig)

    def chart_args(self) -> list[str]:
        """The replica's arguments as the chart renders them now, with its listen addresses and paths made local."""
        manifest = run_helm(self.helm, "get", "manifest", RELEASE, "-n", NS, kubeconfig=self.c.kubeconfig).stdout
        (deployment,) = [d for d in yaml.safe_load_all(manifest) if d and d["kind"] == "Deployment"
                         and d["metadata"]["name"] == FULL]
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[0] == "serve"
        # The pod's runtime-keeper sidecar is not here: serve starts its own keeper beside it (process).
        local = {"--metrics-bind": f"127.0.0.1:{self.metrics_port}", "--workers": "1",
                 "--runtime-store": str(self.tmp / f"store-{self.starts}"), "--runtime-keeper": "process"}
        out = []
        for a in args[1:]:
            flag, _, _ = a.partition("=")
            if flag in ("--bind", "--cert-dir"):
                continue  # webhook_server gives its own
            out.append(f"{flag}={local[flag]}" if flag in local else a)
        return out

    def start(self) -> None:
        """The replica, under the webhook's ServiceAccount (its RBAC, nothing more)."""
        self.stop()
        self.starts += 1
        self.metrics_port = free_port()
        sa_kubeconfig, _ = kubeconfig_as(self.c, FULL, self.tmp)
        stack = contextlib.ExitStack()
        _, _, self.log, _ = stack.enter_context(webhook_server(
            self.tmp / f"replica-{self.starts}", *self.chart_args(), "--kubeconfig", str(sa_kubeconfig),
            "--namespace", NS, port=self.port, make_certs=False,
            env={"PROMETHEUS_MULTIPROC_DIR": str(self.tmp / f"metrics-{self.starts}")}))
        self.replica = stack

    def stop(self) -> None:
        if self.replica is not None:
            self.replica.close()
            self.replica = None

    def settings_valid(self) -> float:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return float(re.search(r"^dispatch_admission_settings_valid(?:\{[^}]*\})? (\S+)$", text, re.M).group(1))

    def set_publish(self, image: str) -> int:
        """An edit of the settings ConfigMap by the cluster's administrator (kubectl patch); the replica's log
        offset before it."""
        offset = len(self.log.read_text())
        doc = json.loads(json.dumps(ROUTE1))
        doc["publish"]["image"] = image
        self.c.kubectl("patch", "configmap", SETTINGS, "-n", NS, "--type=merge",
                       "-p", json.dumps({"data": {"settings.json": json.dumps(doc)}}))
        return offset

    def publish(self, image: str) -> str:
        """The settings switched to `image`; the switch's log line."""
        since = self.set_publish(image)
        return eventually(lambda: next((line for line in self.log.read_text()[since:].splitlines()
                                        if '"settings switched"' in line and f'"publish": "{image}"' in line), None),
                          f"the replica did not switch to {image}")


@pytest.fixture(scope="module")
def release(env, helm, tmp_path_factory):  # noqa: F811  (helm: the fixture imported above)
    c = env.cluster
    rel = Release(c, helm, tmp_path_factory.mktemp("trust"), free_port())
    with webhooks_swapped(c, [env.route1, env.route2], None):
        rel.helm_run("install")
        try:
            with certificate_controller(c, RELEASE, rel.tmp):
                rel.start()
                try:
                    yield rel
                finally:
                    rel.stop()
        finally:
            run_helm(helm, "uninstall", RELEASE, "-n", NS, "--wait", "--no-hooks", kubeconfig=c.kubeconfig,
                     check=False)
            c.kubectl("delete", "trainjobs", "-n", "team-a", "-l", f"{HELM_LABEL}={RELEASE}", "--wait=false",
                      check=False)


# ---- helpers: TrainJobs through the release's webhooks ----

def job(name: str, patches: list | None = None, deleting: bool = False) -> dict:
    doc = trainjob(name=name, namespace="team-a", patches=patches, suspend=True)
    doc["metadata"]["labels"] = {HELM_LABEL: RELEASE}
    if deleting:
        doc["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    return doc


def create(c, doc: dict, dry_run: bool = False):
    args = ["create", "-f", "-", "-o", "json"] + (["--dry-run=server"] if dry_run else [])
    return c.kubectl(*args, stdin=json.dumps(doc), check=False)


def our_entry(obj: dict) -> dict | None:
    return next((p for p in obj["spec"].get("runtimePatches") or [] if p.get("manager") == MANAGER), None)


def digest(obj: dict) -> str | None:
    entry = our_entry(obj)
    found = re.search(r"@(sha256:[0-9a-f]{64})", json.dumps(entry)) if entry else None
    return found.group(1) if found else None


def created_digest(c, doc: dict) -> str | None:
    got = create(c, doc, dry_run=True)
    assert got.returncode == 0, got.stderr
    return digest(json.loads(got.stdout))


def entry_for(c, name: str) -> dict:
    """The entry the replica writes now (a server-side dry run: nothing is stored)."""
    got = create(c, job(name), dry_run=True)
    assert got.returncode == 0, got.stderr
    return our_entry(json.loads(got.stdout))


@contextlib.contextmanager
def published(rel: Release, image: str):
    """The settings switched to `image` for the block, then back to the release's own."""
    line = rel.publish(image)
    try:
        yield line
    finally:
        rel.publish(f"{REPO}@{D0}")


@contextlib.contextmanager
def mutation_skipped(c):
    """The mutating webhook selects no TrainJob for the block: a create comes to validation as sent, as when the
    mutating webhook (failurePolicy Ignore) could not be reached."""
    path = "/webhooks/0/objectSelector"
    c.kubectl("patch", "mutatingwebhookconfiguration", FULL, "--type=json", "-p", json.dumps(
        [{"op": "replace", "path": path, "value": {"matchLabels": {HELM_LABEL: "nobody"}}}]))
    try:
        yield
    finally:
        c.kubectl("patch", "mutatingwebhookconfiguration", FULL, "--type=json", "-p", json.dumps(
            [{"op": "replace", "path": path, "value": {"matchLabels": {HELM_LABEL: RELEASE}}}]))


# ---- the CA key apart ----

def test_the_serving_pods_token_cannot_read_the_ca_key(release):
    c = release.c
    webhook, _ = kubeconfig_as(c, FULL, release.tmp)
    controller, _ = kubeconfig_as(c, f"{FULL}-certs", release.tmp)

    def secret_as(kubeconfig, name):
        return c.kubectl("--kubeconfig", str(kubeconfig), "get", "secret", name, "-n", NS, "-o", "json", check=False)

    refused = secret_as(webhook, f"{FULL}-ca")
    assert refused.returncode != 0 and "Forbidden" in refused.stderr, refused.stdout + refused.stderr
    listed = c.kubectl("--kubeconfig", str(webhook), "get", "secrets", "-n", NS, check=False)
    assert listed.returncode != 0 and "Forbidden" in listed.stderr
    served = secret_as(webhook, f"{FULL}-tls")
    assert served.returncode == 0, served.stderr
    assert set(json.loads(served.stdout)["data"]) == {"ca.crt", "tls.crt", "tls.key"}
    ca = secret_as(controller, f"{FULL}-ca")
    assert ca.returncode == 0 and set(json.loads(ca.stdout)["data"]) == {"ca.crt", "ca.key"}


# ---- the publish image's repository, fixed at deploy time ----

def test_a_live_edit_naming_another_repository_is_refused_and_a_moved_digest_taken(release):
    c = release.c
    assert created_digest(c, job("repo-before")) == D0
    release.set_publish(ELSEWHERE)
    eventually(lambda: release.settings_valid() == 0, "an edit naming another repository was taken")
    assert "repository 'registry.example/evil/publish' is not one fixed at deploy time" in release.log.read_text()
    assert created_digest(c, job("repo-refused")) == D0, "the last good settings keep serving"
    with published(release, f"{REPO}@{D1}") as switch:
        assert release.settings_valid() == 1
        assert created_digest(c, job("repo-moved")) == D1, "a digest moved within the repository is taken"
        assert f'"previous_publish": "{REPO}@{D0}"' in switch, "the switch logs the old digest"


# ---- the grace, and no create skipping mutation ----

def test_a_create_carrying_a_deletion_timestamp_is_mutated_never_let_through(release):
    """A tenant sets deletionTimestamp on a create to skip the mutating webhook, carrying a digest switched away
    from, which validation accepts in its grace. The chart's matchConditions judge only UPDATEs (on the stored
    object), so the create is mutated (or refused), never admitted with the old entry.

    Kubernetes 1.37.2 (this suite's) already drops the field before mutating admission, so the chart's former
    condition (`!has(object.metadata.deletionTimestamp)`, on any operation) let nothing through here either;
    the hole is an API server that clears it only in BeforeCreate, after mutation. This shows the end result."""
    c = release.c
    old_entry = entry_for(c, "deleting-entry")
    with published(release, f"{REPO}@{D1}"):
        got = create(c, job("deleting-create", [old_entry], deleting=True))
        assert got.returncode == 0, got.stderr
        stored = json.loads(got.stdout)
        assert "deletionTimestamp" not in stored["metadata"]
        assert digest(stored) == D1, "the create skipped mutation: it carries the revoked digest"
        assert "replaced the runtimePatches entry" in got.stderr, "not mutated"


def test_with_grace_zero_the_old_digest_is_refused_at_once_and_an_upgrade_keeps_serving(release):
    c = release.c
    old_entry = entry_for(c, "grace-entry")
    with mutation_skipped(c), published(release, f"{REPO}@{D1}"):
        got = create(c, job("grace-default", [old_entry]), dry_run=True)
        assert got.returncode == 0 and digest(json.loads(got.stdout)) == D0, \
            f"with the default grace the previous digest is accepted for ten minutes: {got.stderr}"
    # helm upgrade by the identity that installed the chart: the guard lets it through.
    release.helm_run("upgrade", merged(release.values, {"previousSettingsGraceSeconds": 0}))
    release.start()  # the Deployment's new arguments: its pods roll
    assert "--previous-settings-grace=0" in release.chart_args()
    current = entry_for(c, "grace-current")
    assert digest({"spec": {"runtimePatches": [current]}}) == D0, "the upgraded webhook mutates"
    with mutation_skipped(c), published(release, f"{REPO}@{D1}"):
        got = create(c, job("grace-zero", [old_entry]), dry_run=True)
        assert got.returncode != 0 and "differs from what the webhook's settings produce" in got.stderr, \
            got.stdout + got.stderr
    eventually(lambda: digest({"spec": {"runtimePatches": [entry_for(c, "grace-after")]}}) == D0,
               "the webhook stopped mutating")


# ---- the guard ----

def as_(c, who: list[str], *args: str):
    return c.kubectl(*who, *args, check=False)


GUARD_REFUSAL = "only the identities in the chart's guard values may"


def test_the_guard_refuses_an_unlisted_identity_and_admits_a_listed_one(release):
    c = release.c
    rbac = [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "trust-e2e-editor"},
         "rules": [{"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "create", "patch", "update"]},
                   {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "patch", "update", "delete"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "trust-e2e-editor"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "trust-e2e-editor"},
         "subjects": [{"kind": "User", "name": "alice", "apiGroup": "rbac.authorization.k8s.io"},
                      {"kind": "User", "name": LISTED_USER, "apiGroup": "rbac.authorization.k8s.io"},
                      {"kind": "Group", "name": LISTED_GROUP, "apiGroup": "rbac.authorization.k8s.io"},
                      {"kind": "ServiceAccount", "name": LISTED_SA, "namespace": NS},
                      {"kind": "ServiceAccount", "name": UNLISTED_SA, "namespace": NS}]}]
    for doc in rbac:
        c.apply(doc)
    for sa in (LISTED_SA, UNLISTED_SA):
        c.kubectl("create", "serviceaccount", sa, "-n", NS)
    alice, bob, team = ["--as", "alice"], ["--as", LISTED_USER], ["--as", "carol", "--as-group", LISTED_GROUP]
    listed_sa = ["--kubeconfig", str(kubeconfig_as(c, LISTED_SA, release.tmp)[0])]
    other_sa = ["--kubeconfig", str(kubeconfig_as(c, UNLISTED_SA, release.tmp)[0])]
    try:
        def alice_refused():
            got = as_(c, alice, "label", "ns", "team-a", f"{LABEL}=")
            if got.returncode == 0:  # the binding takes effect a moment after the install: undo, try again
                c.kubectl("label", "ns", "team-a", f"{LABEL}-")
                return None
            return got

        got = eventually(alice_refused, "alice's opt-out label was never refused", timeout=30, every=0.5)
        assert GUARD_REFUSAL in got.stderr and f"{FULL}-guard" in got.stderr, got.stderr
        created = c.kubectl("--as", "alice", "create", "-f", "-", check=False, stdin=json.dumps(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "trust-opted-out", "labels": {LABEL: ""}}}))
        assert created.returncode != 0 and GUARD_REFUSAL in created.stderr, created.stderr
        for who in (alice, other_sa):
            edit = as_(c, who, "annotate", "configmap", SETTINGS, "-n", NS, "edited-by=someone")
            assert edit.returncode != 0 and GUARD_REFUSAL in edit.stderr, edit.stderr
        gone = as_(c, alice, "delete", "configmap", SETTINGS, "-n", NS)
        assert gone.returncode != 0 and GUARD_REFUSAL in gone.stderr, gone.stderr
        refused = as_(c, other_sa, "label", "ns", "team-a", f"{LABEL}=")
        assert refused.returncode != 0 and GUARD_REFUSAL in refused.stderr, refused.stderr
        # Other labels are anyone's (with the RBAC for it).
        assert as_(c, alice, "label", "ns", "team-a", "team=a").returncode == 0
        assert as_(c, alice, "label", "ns", "team-a", "team-").returncode == 0
        # Listed: a user, a group's member, a ServiceAccount; each sets and removes the label, and edits the settings.
        for who in (bob, team, listed_sa):
            for change in (f"{LABEL}=", f"{LABEL}-"):
                got = as_(c, who, "label", "ns", "team-a", change)
                assert got.returncode == 0, (who, got.stderr)
            got = as_(c, who, "annotate", "--overwrite", "configmap", SETTINGS, "-n", NS, "edited-by=platform")
            assert got.returncode == 0, (who, got.stderr)
        # The administrator is in no list: the one who may patch the guard passes (so helm upgrade does).
        assert as_(c, [], "label", "ns", "team-a", f"{LABEL}=").returncode == 0
        assert as_(c, [], "label", "ns", "team-a", f"{LABEL}-").returncode == 0
        assert created_digest(c, job("guard-after")) == D0, "the webhook keeps working"
    finally:
        c.kubectl("label", "ns", "team-a", f"{LABEL}-", check=False)
        c.kubectl("delete", "ns", "trust-opted-out", "--wait=false", "--ignore-not-found", check=False)
        c.kubectl("delete", "serviceaccount", LISTED_SA, UNLISTED_SA, "-n", NS, "--ignore-not-found", check=False)
        for doc in rbac:
            c.kubectl("delete", doc["kind"].lower(), doc["metadata"]["name"], "--ignore-not-found", check=False)


# ---- the NetworkPolicy variants ----

@pytest.mark.parametrize("source", ["cidrs", "cilium", "calico", "konnectivity"])
def test_each_network_policy_variant_is_one_the_api_server_takes(env, helm, tmp_path, source):  # noqa: F811
    """Server-side dry runs of the NetworkPolicies each variant renders (no CNI runs here to enforce them, and
    no Cilium CRD is installed: the CiliumNetworkPolicy's shape is test_chart_trust's)."""
    values = {"networkPolicy": {"apiServerSource": source, "apiServerCIDRs": ["10.0.0.10/32"] if source == "calico"
                                else [], "metricsNamespaces": ["monitoring"]}}
    docs = rendered(helm, tmp_path, values)
    policies = [d for (kind, _), d in docs.items() if kind == "NetworkPolicy"]
    assert len(policies) == 2
    for doc in policies:
        doc["metadata"]["namespace"] = "team-a"
        got = env.cluster.kubectl("create", "--dry-run=server", "-f", "-", stdin=json.dumps(doc), check=False)
        assert got.returncode == 0, got.stderr
