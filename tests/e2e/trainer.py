"""Kubeflow Trainer's controller manager run out of cluster beside a control plane, its webhook server on
loopback, and its own webhook configurations pointed there (tests/e2e/test_trainer.py, test_corpus.py,
test_node.py)."""

from __future__ import annotations

import base64
import subprocess
from pathlib import Path

import jsonpatch
import yaml

from tests.e2e import toolchain
from tests.e2e.cluster import LOGS, ControlPlane
from tests.process import free_port, stop, wait_https
from webhook import certs

# Trainer's kustomize base patches its generated webhook configurations (names, object selectors)
TRAINER_PATCHES = {"MutatingWebhookConfiguration": "patch_mutating.yaml",
                   "ValidatingWebhookConfiguration": "patch_validating.yaml"}


def trainer_webhooks(port: int, ca_pem: bytes) -> list[dict]:
    """Trainer's own webhook configurations from its module as its kustomize base deploys them (its JSON6902
    patches applied), pointed at its loopback webhook server. The names matter: the API server calls mutating
    configurations in the order of their names, and Trainer's, `defaulter.trainer.kubeflow.org` (the name its
    Helm chart and its certificate rotator use too), sorts before ours, so its defaulter runs first, as in a
    cluster."""
    base = toolchain.trainer_module() / "manifests" / "base" / "webhook"
    docs = [jsonpatch.apply_patch(d, yaml.safe_load((base / TRAINER_PATCHES[d["kind"]]).read_text()))
            for d in yaml.safe_load_all((base / "manifests.yaml").read_text()) if d]
    for d in docs:
        for w in d["webhooks"]:
            path = w["clientConfig"]["service"]["path"]
            w["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}",
                                 "caBundle": base64.b64encode(ca_pem).decode()}
    return docs


def start_trainer(cluster: ControlPlane, tmp: Path) -> tuple[subprocess.Popen, int]:
    binary = toolchain.trainer_bin() / "trainer-controller-manager"
    webhook_port, health_port, status_port = free_port(), free_port(), free_port()
    # controller-runtime reads its webhook certificate from $TMPDIR/k8s-webhook-server/serving-certs.
    certs.write_dev_pair(tmp / "k8s-webhook-server" / "serving-certs", ["localhost", "127.0.0.1"])
    config = tmp / "trainer-config.yaml"
    config.write_text(yaml.safe_dump({
        "apiVersion": "config.trainer.kubeflow.org/v1alpha1", "kind": "Configuration",
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}", "readinessEndpointName": "readyz",
                   "livenessEndpointName": "healthz"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": webhook_port, "host": "127.0.0.1"},
        "leaderElection": {"leaderElect": False},
        "certManagement": {"enable": False},
        "statusServer": {"port": status_port},
    }))
    log = tmp / "trainer-controller-manager.log"
    LOGS["trainer-controller-manager"] = log
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(binary), f"--config={config}", "--zap-log-level=info"], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={"KUBECONFIG": cluster.kubeconfig, "TMPDIR": str(tmp), "HOME": str(tmp),
                                     "PATH": "/usr/bin:/bin"})
    try:
        wait_https(f"http://127.0.0.1:{health_port}/readyz", None, proc, log, timeout=90)
    except BaseException:
        stop(proc)
        raise
    return proc, webhook_port
