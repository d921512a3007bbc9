"""The chart through helm (template, install) and the release's processes run here as its pods run them:
values layered, manifests rendered, a ServiceAccount's kubeconfig, serve's arguments for a replica, and the
certificate controller (tests/e2e/test_helm.py, test_trust.py, test_chart_trust.py, test_alerts.py)."""

from __future__ import annotations

import contextlib
import copy
import subprocess
import sys
import tempfile

import yaml

from tests.helpers import ROOT
from tests.process import stop

CHART = ROOT / "charts" / "dispatch-admission"
HELM_LABEL = "dispatch-e2e/helm"
SKIP_MUTATION_LABEL = "dispatch-e2e/skip-mutation"  # the session's own webhooks then leave a TrainJob alone
NS = "dispatch-system"
FULL = "rel-dispatch-admission"
WEBHOOK_IMAGE = "registry.example/dispatch-admission"
BASE = {"image": {"repository": WEBHOOK_IMAGE}}


def merged(*layers: dict) -> dict:
    out: dict = {}
    for layer in layers:
        out = _merge(out, layer)
    return out


def _merge(a: dict, b: dict) -> dict:
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) and v else copy.deepcopy(v)
    return out


def run_helm(helm, *args, values: dict | None = None, tmp=None, check=True, kubeconfig=None):
    cmd = [helm, *args]
    if values is not None:
        with tempfile.NamedTemporaryFile("w", dir=tmp, prefix="values-", suffix=".yaml", delete=False) as f:
            yaml.safe_dump(values, f)
        cmd += ["-f", f.name]
    if kubeconfig:
        cmd += ["--kubeconfig", kubeconfig]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if check and got.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}:\n{got.stdout}\n{got.stderr}")
    return got


def template(helm, tmp, values, check=True, chart=CHART):
    return run_helm(helm, "template", "rel", str(chart), "--namespace", NS, values=values, tmp=tmp, check=check)


def rendered(helm, tmp, values, chart=CHART) -> dict[tuple[str, str], dict]:
    out = template(helm, tmp, merged(BASE, values), chart=chart).stdout
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out) if d}


def webhook_pod(docs) -> dict:
    return docs[("Deployment", FULL)]["spec"]["template"]


def args_of(docs) -> list[str]:
    return webhook_pod(docs)["spec"]["containers"][0]["args"]


def kubeconfig_as(c, sa, tmp_path):
    token = c.kubectl("create", "token", sa, "-n", NS).stdout.strip()
    sa_config = yaml.safe_load(open(c.kubeconfig))
    sa_config["users"] = [{"name": "sa", "user": {"token": token}}]
    sa_config["contexts"][0]["context"]["user"] = "sa"
    path = tmp_path / f"{sa}-kubeconfig"
    path.write_text(yaml.safe_dump(sa_config))
    return path, token


def serve_args(release: str, sa_kubeconfig) -> list[str]:
    full = f"{release}-dispatch-admission"
    # the settings through the API, as the release's ServiceAccount: its Role must let it read and watch them
    return ["--settings-configmap", f"{NS}/{full}-settings", "--kubeconfig", str(sa_kubeconfig),
            "--tls-secret", f"{full}-tls", "--tls-service", full, "--tls-read-only", "--namespace", NS]


@contextlib.contextmanager
def certificate_controller(c, release: str, tmp_path):
    """`dispatch-admission certificates` as the chart's controller Deployment runs it, under its ServiceAccount."""
    full = f"{release}-dispatch-admission"
    sa_kubeconfig, _ = kubeconfig_as(c, f"{full}-certs", tmp_path)
    log = tmp_path / f"{full}-certs.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "webhook", "certificates", "--kubeconfig", str(sa_kubeconfig),
                                 "--tls-secret", f"{full}-tls", "--ca-secret", f"{full}-ca", "--tls-service", full,
                                 "--webhook-configuration", full,
                                 "--namespace", NS, "--every", "2"], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)
    try:
        yield log
    finally:
        stop(proc)


def node_values(publish_image: str, image: str, tests_namespace: str) -> dict:
    """The chart's values on the harness's node: the webhook image built here (`HOST/REPO@sha256:...`), the publish
    image the node's registry holds, and helm test's TrainJobs where the node's runtimes are (test_install, demo)."""
    repository, digest = image.split("@")
    return {"image": {"repository": repository, "digest": digest},
            "publish": {"image": publish_image},
            "tests": {"namespace": tests_namespace, "timeoutSeconds": 120}}

