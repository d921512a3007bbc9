"""Kueue's manager beside the one-node cluster (issue 22): built from its Go module by toolchain.py, run out of
cluster against the node's API server like Trainer's and JobSet's controllers, with its webhook server on
loopback and its webhook configurations (from the module's config/components) registered by URL.

Facts this is built on (Kueue v0.19.2 as run here): with internal certificate management off, the
manager reads /etc/kueue/metrics/certs/tls.crt at start even with metrics off, and exits without it; it runs
in a private mount namespace where a read-only overlay on /etc adds that file, so the host's /etc is never
written. The visibility server hard-codes /visibility/tls.crt: VisibilityOnDemand=false keeps it off.
Kueue's webhooks use failurePolicy Fail, so they are removed before the manager stops.

Kueue acts as its own user, bound to the ClusterRole its module ships (config/components/rbac/role.yaml), so
a permission Kueue's RBAC lacks shows here as it would in a cluster.
"""

from __future__ import annotations

import base64
import contextlib
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.e2e import toolchain
from tests.e2e.cluster import ControlPlane
from tests.e2e.node import NODE_NAME, _http_ok, identity, kubeconfig_for
from tests.process import free_port, started_ready, stop

KUEUE_NAMESPACE = "kueue-system"  # what the manager takes for its own namespace out of cluster
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
KUEUE_MANAGER = "kueue.x-k8s.io/manager"  # the runtimePatches entry Kueue writes
LOCAL_QUEUE = "lq"
CLUSTER_QUEUE = "cq"
PRIORITIES = {"low": 100, "high": 1000}
# Room for one job: each TrainJob of the suite asks for JOB_REQUESTS on its one node.
QUOTA = {"cpu": "1", "memory": "1Gi"}
JOB_REQUESTS = {"cpu": "600m", "memory": "512Mi"}
MUTATING = "kueue-mutating-webhook-configuration"
VALIDATING = "kueue-validating-webhook-configuration"
# The webhooks kept from Kueue's manifests: its own kinds, and the two integrations this suite enables.
INTEGRATIONS = ("trainer.kubeflow.org/trainjob", "jobset.x-k8s.io/jobset")
KEPT_RESOURCES = {"trainjobs", "jobsets"}


@dataclass
class Kueue:
    cluster: ControlPlane
    proc: subprocess.Popen
    log: Path
    port: int
    ca_pem: bytes
    registered: list[tuple[str, str]] = field(default_factory=list)  # (kind, name) applied

    def webhook_configurations(self, mutating_name: str = MUTATING, reinvocation: str | None = None) -> list[dict]:
        """Kueue's webhook configurations from its module, pointed at its loopback server. `mutating_name`
        places its mutating configuration in the API server's order (configurations run in name order);
        `reinvocation` sets reinvocationPolicy on its trainjob webhook."""
        manifest = toolchain.kueue_module() / "config" / "components" / "webhook" / "manifests.yaml"
        ca = base64.b64encode(self.ca_pem).decode()
        # As Kueue's kustomization does: every webhook of an integration skips kube-system and kueue-system.
        skip = {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "NotIn",
                                      "values": ["kube-system", "kueue-system"]}]}
        docs = []
        for doc in (d for d in yaml.safe_load_all(manifest.read_text()) if d):
            kept = []
            for w in doc["webhooks"]:
                rule = w["rules"][0]
                own = rule["apiGroups"] == ["kueue.x-k8s.io"]
                if not own and not KEPT_RESOURCES & set(rule["resources"]):
                    continue
                w["clientConfig"] = {"url": f"https://127.0.0.1:{self.port}{w['clientConfig']['service']['path']}",
                                     "caBundle": ca}
                if not own:
                    w["namespaceSelector"] = skip
                if reinvocation and "trainjobs" in rule["resources"] and doc["kind"] == "MutatingWebhookConfiguration":
                    w["reinvocationPolicy"] = reinvocation
                kept.append(w)
            doc["webhooks"] = kept
            mutating = doc["kind"] == "MutatingWebhookConfiguration"
            doc["metadata"] = {"name": mutating_name if mutating else VALIDATING}
            docs.append(doc)
        return docs

    def register_webhooks(self, mutating_name: str = MUTATING, reinvocation: str | None = None) -> None:
        """Register Kueue's webhooks (replacing any registered before, under whatever name)."""
        self.remove_webhooks()
        for doc in self.webhook_configurations(mutating_name, reinvocation):
            self.cluster.apply(doc)
            self.registered.append((doc["kind"].lower(), doc["metadata"]["name"]))

    def remove_webhooks(self) -> None:
        for kind, name in self.registered:
            self.cluster.kubectl("delete", kind, name, "--ignore-not-found")
        self.registered.clear()


def queues(namespace: str) -> list[dict]:
    """A ResourceFlavor for the node (its nodeLabels become the pods' nodeSelector), a ClusterQueue with room
    for one job that preempts lower priorities, a LocalQueue in `namespace`, and two WorkloadPriorityClasses."""
    api = "kueue.x-k8s.io/v1beta2"
    return [
        {"apiVersion": api, "kind": "ResourceFlavor", "metadata": {"name": "default"},
         "spec": {"nodeLabels": {"kubernetes.io/hostname": NODE_NAME}}},
        {"apiVersion": api, "kind": "ClusterQueue", "metadata": {"name": CLUSTER_QUEUE},
         "spec": {"namespaceSelector": {}, "preemption": {"withinClusterQueue": "LowerPriority"},
                  "resourceGroups": [{"coveredResources": list(QUOTA), "flavors": [
                      {"name": "default", "resources": [{"name": r, "nominalQuota": q} for r, q in QUOTA.items()]}]}]}},
        {"apiVersion": api, "kind": "LocalQueue", "metadata": {"name": LOCAL_QUEUE, "namespace": namespace},
         "spec": {"clusterQueue": CLUSTER_QUEUE}},
        *({"apiVersion": api, "kind": "WorkloadPriorityClass", "metadata": {"name": name}, "value": value}
          for name, value in PRIORITIES.items()),
    ]


def _config(tmp: Path, port: int, health: int, cert_dir: Path) -> Path:
    config = tmp / "kueue-config.yaml"
    config.write_text(yaml.safe_dump({
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"host": "127.0.0.1", "port": port, "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "manageJobsWithoutQueueName": False,
        "integrations": {"frameworks": list(INTEGRATIONS)},
    }))
    return config


def start_kueue(stack: contextlib.ExitStack, cluster: ControlPlane, tmp: Path, namespace: str,
                logs: dict[str, Path] | None = None) -> Kueue:
    """Kueue's CRDs and RBAC, its manager (stopped with `stack`, after its webhooks are removed), its webhook
    configurations, and the queues of `queues(namespace)`."""
    from webhook import certs

    base = tmp / "kueue"
    base.mkdir(parents=True, exist_ok=True)
    cluster.install_crds(toolchain.kueue_crds())
    # Its ClusterRole, and the Role on Secrets in its own namespace (kueue-system out of cluster), whose watch
    # its cache waits for before any controller starts.
    rbac = toolchain.kueue_module() / "config" / "components" / "rbac"
    user = "kueue-controller-manager"
    cluster.kubectl("create", "namespace", KUEUE_NAMESPACE)
    for path, binding in (("role.yaml", "ClusterRoleBinding"), ("manager_secrets_role.yaml", "RoleBinding")):
        role = yaml.safe_load((rbac / path).read_text())
        meta = {"name": role["metadata"]["name"]}
        if binding == "RoleBinding":
            meta["namespace"] = role["metadata"]["namespace"] = KUEUE_NAMESPACE
        cluster.apply(role)
        cluster.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": binding, "metadata": meta,
                       "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role["kind"],
                                   "name": role["metadata"]["name"]},
                       "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]})
    kubeconfig = kubeconfig_for(cluster, "kueue", *identity(cluster, "kueue", user))

    cert_dir = base / "certs"
    certs.write_dev_pair(cert_dir, ["localhost", "127.0.0.1"])
    # The overlay's upper layer: /etc/kueue/metrics/certs as the manager expects it.
    layer = base / "etc-layer"
    metrics_certs = layer / "kueue" / "metrics" / "certs"
    metrics_certs.mkdir(parents=True, exist_ok=True)
    for name in ("tls.crt", "tls.key"):
        shutil.copy(cert_dir / name, metrics_certs / name)

    port, health = free_port(), free_port()
    binary = toolchain.kueue_bin() / "kueue"
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
           'mount -t overlay overlay -o "lowerdir=$1:/etc" /etc && shift && exec "$@"', "sh", str(layer),
           str(binary), f"--config={_config(base, port, health, cert_dir)}", f"--kubeconfig={kubeconfig}",
           "--zap-log-level=2", "--feature-gates=VisibilityOnDemand=false"]
    log = base / "kueue.log"
    if logs is not None:
        logs["kueue"] = log
    with open(log, "wb") as out:
        # unshare and sh exec: the process is Kueue's manager itself, and SIGTERM reaches it.
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={"HOME": str(base), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    stack.callback(stop, proc)
    started_ready("kueue", lambda: _http_ok(f"http://127.0.0.1:{health}/readyz"), 120, proc, log)
    kueue = Kueue(cluster, proc, log, port, (cert_dir / "ca.crt").read_bytes())
    stack.callback(kueue.remove_webhooks)  # runs before the manager stops: failurePolicy Fail
    kueue.register_webhooks()
    for doc in queues(namespace):
        cluster.apply(doc)
    return kueue
