"""/metrics cannot reach admission (issue 33, item 5): the real server with `--metrics-auth` against a fake
API server (tests/fake_api.py) that holds every token review.

Scrapes with unseen tokens fill the metrics port's own threads (webhook.serving.worker: METRICS_THREADS, at most
METRICS_WAITING scrapes queued or running); one more is answered 503 at once. Meanwhile reviews, small
(answered on the loop) and large (on the app threads), are answered as usual, and so are the kubelet's
probes on the metrics port. Once the API server answers, every scrape held is answered. With /metrics
answered on the loop and the token reviews on the app threads (the server before issue 33), the large
reviews wait behind the held token reviews.
"""

from __future__ import annotations

import json
import secrets
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.fake_api import FakeAPI
from tests.helpers import review, trainjob
from tests.process import RUNTIME_ARGS
from webhook.serving.worker import METRICS_WAITING


def large_review() -> bytes:
    """A review of about 200 KB: over the 64 KiB answered on the loop, so it goes to the app threads."""
    doc = review(trainjob())
    doc["request"]["object"]["metadata"]["annotations"] = {"example.com/pad": "x" * 200_000}
    return json.dumps(doc).encode()


@pytest.fixture(scope="module")
def api():
    fake = FakeAPI()
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def server(serve_module, tmp_path_factory, api):
    # the stock runtimes as files, and the fake API server for the token reviews
    kubeconfig = api.kubeconfig(tmp_path_factory.mktemp("metrics-port") / "kubeconfig")
    return serve_module(*RUNTIME_ARGS, "--workers", "1", "--metrics-auth", "--log-level", "warning",
                        kubeconfig=kubeconfig, metrics=True)


@pytest.mark.timing
def test_scrapes_held_by_the_api_server_never_hold_reviews(server, api):
    base, ca, metrics_url = server.url, server.ca, server.metrics_url

    def scrape(token: str) -> tuple[int, float]:
        t = time.monotonic()
        r = requests.get(metrics_url + "/metrics", headers={"Authorization": f"Bearer {token}"}, verify=ca, timeout=30)
        return r.status_code, time.monotonic() - t

    def post(body: bytes) -> tuple[int, float]:
        t = time.monotonic()
        r = requests.post(base + "/validate", data=body, headers={"Content-Type": "application/json"}, verify=ca,
                          timeout=10)
        assert r.json()["response"]["uid"] == "uid-1", r.text[:300]
        return r.status_code, time.monotonic() - t

    api.gate.clear()  # every token review waits
    with ThreadPoolExecutor(METRICS_WAITING) as pool:
        held = [pool.submit(scrape, secrets.token_hex(16)) for _ in range(METRICS_WAITING)]
        time.sleep(1.5)
        assert not any(f.done() for f in held)
        # Reviews are answered as usual, small and large, and the probes on the metrics port too.
        small, large = json.dumps(review(trainjob())).encode(), large_review()
        answers = [post(body) for body in (small, large) * 5]
        assert all(code == 200 and took < 2.0 for code, took in answers), answers
        for path in ("/healthz", "/readyz"):
            assert requests.get(metrics_url + path, verify=ca, timeout=5).status_code == 200
        # The metrics port's threads are taken: one more scrape is answered 503 at once.
        status, took = scrape(secrets.token_hex(16))
        assert status == 503 and took < 1.0, (status, took)
        api.gate.set()
        assert [f.result(30)[0] for f in held] == [401] * METRICS_WAITING  # random tokens: not valid
    assert api.reviews() <= METRICS_WAITING
