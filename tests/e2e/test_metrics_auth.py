"""`serve --metrics-auth` (issue 25, item 2): the metrics port in HTTPS, /metrics only for a bearer token the
real API server authenticates (TokenReview) and authorizes for get on /metrics (SubjectAccessReview), as
kubebuilder's metrics filter does; the probes' paths stay open. A flood of random tokens cannot reach
admission nor the API server past the rate limit (issue 33, item 5)."""

from __future__ import annotations

import json
import secrets
import threading
import time

import pytest
import requests

from tests.helpers import metric_total, review, trainjob
from webhook.kube.metrics_auth import UNSEEN_BURST, UNSEEN_PER_SECOND

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


def test_metrics_only_for_a_token_allowed_to_get_them(env, serve):
    c = env.cluster
    c.apply(READER)
    c.apply(BINDING)
    allowed, other = token(c, "e2e-prometheus"), token(c, "e2e-nosy")
    hook = serve("--metrics-auth", kubeconfig=c.kubeconfig, metrics=True, env={"PROMETHEUS_MULTIPROC_DIR": ""})
    url, ca, port = hook.metrics_url, hook.ca, int(hook.metrics_url.rsplit(":", 1)[1])

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


WORKERS = 2  # serve's default
FLOOD_SECONDS = 10.0
FLOODERS = 4


def token_reviews(cluster) -> float:
    """TokenReviews the API server has answered (its own apiserver_request_total)."""
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    return metric_total(text, "apiserver_request_total", resource="tokenreviews")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@pytest.mark.timing
def test_a_flood_of_random_tokens_cannot_reach_admission(env, serve):
    """Issue 33, item 5: four clients send random bearer tokens to /metrics as fast as they can for ten
    seconds. TrainJob reviews sent meanwhile are answered as fast as before the flood, a Prometheus
    connection whose token was allowed before keeps its scrapes, and the API server sees no more
    TokenReviews than the rate limit lets through (per worker: a burst, then a few a second)."""
    c = env.cluster
    c.apply(READER)
    c.apply(BINDING)
    allowed = token(c, "e2e-prometheus")
    body = json.dumps(review(trainjob())).encode()
    hook = serve("--metrics-auth", kubeconfig=c.kubeconfig, metrics=True, env={"PROMETHEUS_MULTIPROC_DIR": ""})
    base, ca, url = hook.url, hook.ca, hook.metrics_url + "/metrics"
    api_server = requests.Session()  # reviews on a kept connection, as the API server sends them

    def reviews(seconds: float) -> tuple[list[float], list[str]]:  # each timed (the figures): not a wait
        took, failed, end = [], [], time.monotonic() + seconds
        while time.monotonic() < end:
            t = time.monotonic()
            try:
                r = api_server.post(base + "/validate", data=body, headers={"Content-Type": "application/json"},
                                    verify=ca, timeout=10)
                if r.status_code != 200 or r.json()["response"]["uid"] != "uid-1":
                    failed.append(f"{r.status_code} {r.text[:200]}")
            except requests.RequestException as e:
                failed.append(repr(e))
            took.append(time.monotonic() - t)
            time.sleep(0.02)
        return took, failed

    prometheus = requests.Session()
    assert prometheus.get(url, headers={"Authorization": f"Bearer {allowed}"}, verify=ca,
                          timeout=10).status_code == 200
    quiet, failures = reviews(5)

    codes: dict[int, int] = {}
    stop = threading.Event()

    def flooder() -> None:
        s = requests.Session()
        while not stop.is_set():
            try:
                r = s.get(url, headers={"Authorization": f"Bearer {secrets.token_urlsafe(32)}"}, verify=ca,
                          timeout=10)
                codes[r.status_code] = codes.get(r.status_code, 0) + 1
            except requests.RequestException:
                codes[0] = codes.get(0, 0) + 1
                s = requests.Session()

    scrapes: list[int] = []

    def scraper() -> None:  # Prometheus, on its kept connection, every half second
        while not stop.is_set():
            scrapes.append(prometheus.get(url, headers={"Authorization": f"Bearer {allowed}"}, verify=ca,
                                          timeout=10).status_code)
            time.sleep(0.5)

    before, started = token_reviews(c), time.monotonic()
    threads = [threading.Thread(target=flooder) for _ in range(FLOODERS)] + [threading.Thread(target=scraper)]
    for t in threads:
        t.start()
    flooded, failed = reviews(FLOOD_SECONDS)
    stop.set()
    for t in threads:
        t.join(15)
    elapsed = time.monotonic() - started
    seen = token_reviews(c) - before
    failures += failed
    limit = WORKERS * (UNSEEN_BURST + UNSEEN_PER_SECOND * elapsed)
    figures = {"flood answers": codes, "TokenReviews seen": seen, "limit": round(limit, 1),
               "review p50/p99 ms quiet": [round(pct(quiet, q) * 1000, 1) for q in (0.5, 0.99)],
               "review p50/p99 ms flooded": [round(pct(flooded, q) * 1000, 1) for q in (0.5, 0.99)],
               "reviews flooded": len(flooded), "Prometheus scrapes": scrapes}
    print("\nflood of random tokens:", json.dumps(figures))
    assert failures == [], failures[:5]
    assert sum(codes.values()) > 10 * limit and codes.get(429, 0) > sum(codes.values()) / 2, figures
    assert seen <= limit, figures
    assert scrapes and set(scrapes) == {200}, figures
    # As fast as before the flood: the flood is answered off the loop and off the reviews' threads, and
    # its tokens never wait on the API server.
    assert pct(flooded, 0.5) <= 3 * pct(quiet, 0.5) + 0.005, figures
    assert pct(flooded, 0.99) <= max(5 * pct(quiet, 0.99), 0.05), figures
