"""webhook.kube.metrics_auth against a fake API server (plain HTTP on loopback, the real kubernetes client):
verdicts kept in a bounded LRU, one review in flight per token, a rate limit on unseen tokens that never
holds back a token allowed before, and a timeout on each review (issue 33, item 5). The real API server:
tests/e2e/test_metrics_auth.py."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.fake_api import FakeAPI
from webhook.kube import metrics_auth
from webhook.kube.metrics_auth import ALLOWED_SECONDS, MetricsAuth


@pytest.fixture
def api():
    fake = FakeAPI()
    yield fake
    fake.stop()


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def bearer(token: str) -> str:
    return f"Bearer {token}"


def test_verdicts_are_kept_and_the_least_recently_used_is_forgotten_first(api):
    clock = Clock()
    auth = MetricsAuth(api.client, clock=clock, cached=3)
    assert auth.check(bearer("prometheus")) is None
    assert auth.check(bearer("nosy")) == (403, "nosy may not get /metrics (SubjectAccessReview)")
    assert auth.check(bearer("forged")) == (401, "the token is not valid (TokenReview)")
    assert auth.check(None)[0] == 401 and api.reviews() == 3
    for _ in range(5):  # from the verdicts kept: no call
        assert auth.check(bearer("prometheus")) is None and auth.check(bearer("forged"))[0] == 401
    assert api.reviews() == 3
    auth.check(bearer("another"))  # a fourth token: "nosy", the least recently used, is forgotten
    assert api.reviews() == 4
    auth.check(bearer("prometheus")), auth.check(bearer("forged"))
    assert api.reviews() == 4
    auth.check(bearer("nosy"))
    assert api.reviews() == 5


def test_concurrent_scrapes_with_one_token_share_one_review(api):
    auth = MetricsAuth(api.client)
    api.gate.clear()
    with ThreadPoolExecutor(8) as pool:
        checks = [pool.submit(auth.check, bearer("prometheus")) for _ in range(8)]
        time.sleep(0.5)
        api.gate.set()
        assert [c.result(60) for c in checks] == [None] * 8
    assert api.calls == ["TokenReview", "SubjectAccessReview"]


def test_unseen_tokens_past_the_rate_are_429_without_a_call(api):
    clock = Clock()
    auth = MetricsAuth(api.client, clock=clock, per_second=1, burst=3)
    got = [auth.check(bearer(f"random-{i}")) for i in range(10)]
    assert [g[0] for g in got] == [401] * 3 + [429] * 7 and api.reviews() == 3
    assert "too many tokens to review" in got[-1][1]
    clock.now += 1  # one more a second
    assert auth.check(bearer("random-10"))[0] == 401 and auth.check(bearer("random-11"))[0] == 429
    assert api.reviews() == 4


def test_a_token_allowed_before_is_reviewed_again_whatever_the_rate(api):
    """A flood of random tokens uses up the rate; Prometheus's token, allowed before, is still reviewed when
    its verdict expires (and a token never seen is not)."""
    clock = Clock()
    auth = MetricsAuth(api.client, clock=clock, per_second=0.001, burst=2)
    assert auth.check(bearer("prometheus")) is None
    assert auth.check(bearer("random-1"))[0] == 401 and auth.check(bearer("random-2"))[0] == 429
    clock.now += ALLOWED_SECONDS + 1
    assert auth.check(bearer("prometheus")) is None and api.reviews() == 3
    assert auth.check(bearer("nosy"))[0] == 429


def test_a_review_waits_at_most_the_timeout_and_its_failure_is_not_kept(api, monkeypatch):
    monkeypatch.setattr(metrics_auth, "REVIEW_TIMEOUT", 0.3)
    auth = MetricsAuth(api.client)
    api.delay = 2.0
    started = time.monotonic()
    got = auth.check(bearer("prometheus"))
    assert got is not None and got[0] == 503 and "cannot review the token now" in got[1], got
    assert time.monotonic() - started < 1.5
    api.delay = 0.0
    assert auth.check(bearer("prometheus")) is None  # reviewed again: the timeout was not kept as a verdict
