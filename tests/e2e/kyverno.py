"""Kyverno v1.15.2's admission controller run out of cluster against the suite's kube-apiserver (issue 27),
beside our webhook, each engine confined to namespaces labelled for it.

Facts this rests on (see the probe's notes): Kyverno needs its CRDs, a `kyverno` namespace (its leases
and certificate Secrets), a few environment variables that are only names, and `--serverIP` with the port,
since it registers its own webhook configurations by URL (`https://<serverIP>/mutate/fail` and so on), with
a CA it issues itself. Its configurations outlive it (failurePolicy Fail), so `stop` deletes them.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import time
import warnings
from pathlib import Path

import requests
import urllib3
import yaml

from tests.e2e import toolchain
from tests.process import free_port, started_ready, stop

POLICIES = Path(__file__).resolve().parent.parent.parent / "bench" / "kyverno"
POLICY_FILES = ("mutate.yaml", "validate.yaml", "validate-cel.yaml")
ENGINE_LABEL = "dispatch-e2e/engine"
SKIP_MUTATION_LABEL = "dispatch-e2e/skip-mutation"
# The webhooks the resource configurations hold, as the API server's metrics name them.
MUTATE_HOOK = "mutate.kyverno.svc-fail"
VALIDATE_HOOK = "validate.kyverno.svc-fail"
OUR_CONFIGURATION = "dispatch-admission-beside-kyverno"


def install(cluster) -> None:
    """Kyverno's CRDs and namespace, and its ConfigMap confining its resource webhooks to the namespaces
    labelled for it (so each engine's latency is its own, and neither sees the other's objects)."""
    cluster.install_crds(toolchain.kyverno_crds())
    cluster.kubectl("create", "namespace", "kyverno")
    selector = {"namespaceSelector": {"matchLabels": {ENGINE_LABEL: "kyverno"}}}
    cluster.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "kyverno", "namespace": "kyverno"},
                   "data": {"webhooks": json.dumps(selector)}})


class Kyverno:
    """One Kyverno admission controller process; `ready_s` is from start to serving with the policies Ready."""

    def __init__(self, cluster, workdir: Path, admission_reports: bool = True):
        self.cluster, self.dir = cluster, workdir
        self.admission_reports = admission_reports
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log = self.dir / f"kyverno-{'reports' if admission_reports else 'no-reports'}.log"
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.ready_s = float("nan")

    def start(self, policies: list[dict] | None = None, resource: str = "trainjobs") -> Kyverno:
        binary = toolchain.kyverno_bin() / "kyverno"
        self.port = free_port()
        names = {"KYVERNO_NAMESPACE": "kyverno", "KYVERNO_SERVICEACCOUNT_NAME": "kyverno-admission-controller",
                 "KYVERNO_DEPLOYMENT": "kyverno-admission-controller", "KYVERNO_POD_NAME": "kyverno-out-of-cluster",
                 "INIT_CONFIG": "kyverno", "METRICS_CONFIG": "kyverno-metrics"}
        cmd = [str(binary), "--kubeconfig", self.cluster.kubeconfig, "--serverIP", f"127.0.0.1:{self.port}",
               "--webhookServerPort", str(self.port),
               "--caSecretName", "kyverno-svc.kyverno.svc.kyverno-tls-ca",
               "--tlsSecretName", "kyverno-svc.kyverno.svc.kyverno-tls-pair",
               "--controllerRuntimeMetricsAddress", "0", "--disableMetrics", "--disableLogColor",
               f"--admissionReports={'true' if self.admission_reports else 'false'}"]
        started = time.monotonic()
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, **names})
        self._wait_ready()
        for doc in policies if policies is not None else load_policies():
            self.cluster.apply(doc)
        self._wait_policies(policies if policies is not None else load_policies(), resource)
        self.ready_s = time.monotonic() - started
        return self

    def _wait_ready(self, timeout: float = 180) -> None:
        # Its configurations appear ~2 s before it can serve them (its TLS Secret syncs last): a policy
        # applied in that gap fails with `tls: internal error`, so readiness is what counts.
        def ready() -> bool:
            with warnings.catch_warnings():  # its CA is its own, issued at start: nothing to verify against yet
                warnings.simplefilter("ignore", urllib3.exceptions.InsecureRequestWarning)
                return requests.get(f"https://127.0.0.1:{self.port}/health/readiness", verify=False, timeout=2).ok

        started_ready("kyverno", ready, timeout, self.proc, self.log, every=0.2)

    def _wait_policies(self, docs: list[dict], resource: str, timeout: float = 120) -> None:
        """Every policy Ready, and the resource webhooks registered for `resource` (the policies are live)."""
        names = [d["metadata"]["name"] for d in docs]

        def live() -> bool:
            ready = all(self.cluster.kubectl("get", "clusterpolicy", n, "-o",
                                             "jsonpath={.status.conditions[?(@.type=='Ready')].status}",
                                             check=False).stdout.strip() == "True" for n in names)
            hooks = self.cluster.kubectl("get", "mutatingwebhookconfiguration,validatingwebhookconfiguration",
                                         "-o", "json", check=False)
            return ready and hooks.returncode == 0 and bool(_lists(yaml.safe_load(hooks.stdout), resource))

        started_ready("kyverno's policies", live, timeout, self.proc, self.log, every=0.3)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                stop(self.proc)
        # Left behind with failurePolicy Fail, they would refuse every request they match.
        for kind in ("mutatingwebhookconfiguration", "validatingwebhookconfiguration"):
            got = self.cluster.kubectl("get", kind, "-o", "name", check=False).stdout.split()
            doomed = [n for n in got if n.split("/", 1)[1].startswith("kyverno-")]
            if doomed:
                self.cluster.kubectl("delete", *doomed, "--ignore-not-found", check=False)


def _lists(doc: dict, resource: str) -> bool:
    """Both of Kyverno's resource webhooks list `resource` in the configurations `doc` holds."""
    kinds = set()
    for cfg in doc.get("items", []):
        for hook in cfg.get("webhooks") or []:
            if hook["name"] in (MUTATE_HOOK, VALIDATE_HOOK) and any(
                    resource in r.get("resources", []) for r in hook.get("rules") or []):
                kinds.add(hook["name"])
    return kinds == {MUTATE_HOOK, VALIDATE_HOOK}


def load_policies(skip_mutation_label: bool = False) -> list[dict]:
    """The ClusterPolicies of bench/kyverno. With `skip_mutation_label`, the mutate rules exclude objects
    labelled SKIP_MUTATION_LABEL, as our mutating configuration's objectSelector does in the tests: the
    only way a test can bypass a mutation to reach S5 (nothing a policy author would ship)."""
    docs = [d for f in POLICY_FILES for d in yaml.safe_load_all((POLICIES / f).read_text()) if d]
    if skip_mutation_label:
        for doc in docs:
            for rule in doc["spec"]["rules"]:
                if "mutate" in rule:
                    rule["exclude"] = {"any": [{"resources": {"selector": {"matchExpressions": [
                        {"key": SKIP_MUTATION_LABEL, "operator": "Exists"}]}}}]}
    return docs


def our_configurations(hook) -> list[dict]:
    """Our route-1 webhook, registered by URL as the suite does, for the namespaces labelled for it only."""
    bundle = base64.b64encode(Path(hook.ca).read_bytes()).decode()
    rules = [{"apiGroups": ["trainer.kubeflow.org"], "apiVersions": ["v1alpha1"], "resources": ["trainjobs"],
              "operations": ["CREATE", "UPDATE"], "scope": "*"}]
    ns = {"matchLabels": {ENGINE_LABEL: "ours"}}

    def one(name, path, **extra):
        return {"name": name, "admissionReviewVersions": ["v1"], "sideEffects": "None", "timeoutSeconds": 10,
                "failurePolicy": "Fail", "matchPolicy": "Equivalent", "rules": rules, "namespaceSelector": ns,
                "clientConfig": {"url": hook.url + path, "caBundle": bundle}, **extra}

    skip = {"matchExpressions": [{"key": SKIP_MUTATION_LABEL, "operator": "DoesNotExist"}]}
    return [
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
         "metadata": {"name": OUR_CONFIGURATION},
         "webhooks": [one("mutate.route1.dispatch.go.phpboyscout.uk", "/mutate", objectSelector=skip,
                          reinvocationPolicy="IfNeeded")]},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
         "metadata": {"name": OUR_CONFIGURATION},
         "webhooks": [one("validate.route1.dispatch.go.phpboyscout.uk", "/validate")]},
    ]


@contextlib.contextmanager
def running(cluster, workdir: Path, admission_reports: bool = True, policies: list[dict] | None = None,
            resource: str = "trainjobs"):
    kyv = Kyverno(cluster, workdir, admission_reports)
    try:
        yield kyv.start(policies, resource)
    finally:
        kyv.stop()
