"""`serve --metrics-auth` (issue 25, item 2): the metrics port in HTTPS, /metrics only for a bearer token the
real API server authenticates (TokenReview) and authorizes for get on /metrics (SubjectAccessReview), as
kubebuilder's metrics filter does; the probes' paths stay open."""

from __future__ import annotations

import requests

from tests.helpers import EXAMPLES
from tests.process import free_port, webhook_server

READER = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
          "metadata": {"name": "e2e-metrics-reader"},
          "rules": [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]}
BINDING = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
           "metadata": {"name": "e2e-metrics-reader"},
           "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "e2e-metrics-reader"},
           "subjects": [{"kind": "ServiceAccount", "name": "e2e-prometheus", "namespace": "default"}]}


def token(cluster, account: str) -> str:
    cluster.kubectl("create", "serviceaccount", account, "-n", "default", check=False)
    return cluster.kubectl("create", "token", account, "-n", "default").stdout.strip()


def test_metrics_only_for_a_token_allowed_to_get_them(env, tmp_path):
    c = env.cluster
    c.apply(READER)
    c.apply(BINDING)
    allowed, other = token(c, "e2e-prometheus"), token(c, "e2e-nosy")
    port = free_port()
    with webhook_server(tmp_path, "--settings", str(EXAMPLES / "settings" / "route1.json"), "--kubeconfig",
                        c.kubeconfig, "--metrics-bind", f"127.0.0.1:{port}", "--metrics-auth",
                        env={"PROMETHEUS_MULTIPROC_DIR": ""}) as (_, ca, log, proc):
        url = f"https://127.0.0.1:{port}"

        def get(path: str, bearer: str | None = None) -> requests.Response:
            headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
            return requests.get(url + path, headers=headers, verify=ca, timeout=10)

        none = get("/metrics")
        assert none.status_code == 401 and none.headers["WWW-Authenticate"].startswith("Bearer"), none.text
        assert get("/metrics", "not-a-token").status_code == 401
        refused = get("/metrics", other)
        assert refused.status_code == 403, refused.text
        assert "system:serviceaccount:default:e2e-nosy may not get /metrics" in refused.json()["error"]
        for _ in range(3):  # the second and third from the verdict kept for the token
            got = get("/metrics", allowed)
            assert got.status_code == 200 and "dispatch_admission_settings_valid 1.0" in got.text, got.text[:300]
        assert get("/metrics", other).status_code == 403
        for path in ("/healthz", "/readyz"):  # the kubelet's probes carry no token
            assert get(path).status_code == 200
        try:
            plain = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
            assert plain.status_code != 200, "no metrics in plain HTTP"
        except requests.ConnectionError:
            pass  # the TLS listener closes a plain-HTTP client
