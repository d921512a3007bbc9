"""Who may read /metrics with `serve --metrics-auth`: as kubebuilder's metrics filter does, a bearer token
the API server authenticates (TokenReview) and authorizes for `get` on the non-resource URL /metrics
(SubjectAccessReview). The metrics port then speaks HTTPS (the serving certificate), so the token is never
sent in the clear. /healthz and /readyz stay open on that port for the kubelet's probes.

The metrics port is open to whoever the NetworkPolicy lets in, and every token costs the API server two
requests; so that no flood of tokens can reach admission (issue 33, item 5):

- a verdict is kept per token (by its SHA-256) for a minute (10 s for a refusal) among the `CACHED` most
  recently used: a Prometheus scraping every 15 s costs the API server two requests a minute per worker;
- concurrent scrapes with one token share one review;
- tokens with no verdict are reviewed at `UNSEEN_PER_SECOND` per worker (bursts of `UNSEEN_BURST`); past
  that they are answered 429 at once, without a call to the API server. A token allowed before is
  reviewed again when its verdict expires whatever the rate: a flood cannot lock Prometheus out;
- each review waits at most `REVIEW_TIMEOUT` for the API server (controller-runtime's filter waits 10 s);
- the worker answers /metrics on a small executor of its own (webhook.serving.worker), never on its event loop
  nor on the threads that answer reviews.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ..process import metrics

ALLOWED_SECONDS = 60.0
DENIED_SECONDS = 10.0    # a token just bound to the role is let in soon
CACHED = 1000            # verdicts remembered at once; the least recently used is forgotten first
UNSEEN_PER_SECOND = 2.0  # reviews of tokens with no verdict, per worker
UNSEEN_BURST = 10
REVIEW_TIMEOUT = 10.0    # seconds, for each of the two reviews
PATH = "/metrics"


class MetricsAuth:
    """`check(authorization)`: None when allowed, else (HTTP status, reason): 401 without a valid token,
    403 when its user may not get /metrics, 429 when too many unseen tokens came, 503 when the API server
    cannot say. Thread-safe: called on the metrics port's executor."""

    def __init__(self, api_client: Callable[[], object], clock: Callable[[], float] = time.monotonic,
                 per_second: float = UNSEEN_PER_SECOND, burst: int = UNSEEN_BURST, cached: int = CACHED):
        self._client = api_client
        self._api: Any = None  # the API client, made on the first review
        self.clock, self.per_second, self.burst, self.cached = clock, per_second, burst, cached
        self._verdicts: OrderedDict[bytes, tuple[float, tuple[int, str] | None]] = OrderedDict()
        self._flights: dict[bytes, Future] = {}  # the review under way per token
        self._allowance, self._allowance_at = float(burst), clock()
        self._lock = threading.Lock()

    def check(self, authorization: str | None) -> tuple[int, str] | None:
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return 401, "a bearer token is required (Authorization: Bearer TOKEN)"
        key = hashlib.sha256(token.encode()).digest()
        with self._lock:
            now = self.clock()
            hit = self._verdicts.get(key)
            if hit is not None:
                self._verdicts.move_to_end(key)
                if now < hit[0]:
                    return hit[1]
            flight = self._flights.get(key)
            if flight is None:
                allowed_before = hit is not None and hit[1] is None
                if not allowed_before and not self._take_allowance(now):
                    return 429, (f"too many tokens to review (over {self.per_second:g} a second): try again;"
                                 " a token already allowed is not held back")
                flight = self._flights[key] = Future()
                leading = True
            else:
                leading = False
        if not leading:  # another scrape with this token is being reviewed: its verdict is ours
            try:
                return flight.result(timeout=2 * REVIEW_TIMEOUT + 1)
            except Exception:
                return 503, "the API server cannot review the token now: timed out"
        verdict, keep = None, True
        try:
            verdict = self._review(token)
        except Exception as e:  # the API server refused the review itself, cannot be reached, or took too long
            verdict, keep = (503, f"the API server cannot review the token now: {type(e).__name__}"), False
        finally:
            with self._lock:
                if keep:
                    self._remember(key, verdict)
                del self._flights[key]
            flight.set_result(verdict)
        return verdict

    def _take_allowance(self, now: float) -> bool:
        """A token bucket: `per_second` reviews of unseen tokens, `burst` at once."""
        self._allowance = min(float(self.burst), self._allowance + (now - self._allowance_at) * self.per_second)
        self._allowance_at = now
        if self._allowance < 1:
            return False
        self._allowance -= 1
        return True

    def _remember(self, key: bytes, verdict: tuple[int, str] | None) -> None:
        self._verdicts[key] = (self.clock() + (ALLOWED_SECONDS if verdict is None else DENIED_SECONDS), verdict)
        self._verdicts.move_to_end(key)
        while len(self._verdicts) > self.cached:
            self._verdicts.popitem(last=False)

    def _review(self, token: str) -> tuple[int, str] | None:
        from kubernetes import client

        if self._api is None:
            self._api = self._client()
        review = self._call("TokenReview", client.AuthenticationV1Api(self._api).create_token_review,
                            client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token)))
        status = review.status
        if not status or not status.authenticated or not status.user:
            return 401, "the token is not valid (TokenReview)"
        user = status.user
        access = self._call("SubjectAccessReview", client.AuthorizationV1Api(self._api).create_subject_access_review,
                            client.V1SubjectAccessReview(spec=client.V1SubjectAccessReviewSpec(
                                user=user.username, groups=user.groups, uid=user.uid, extra=user.extra,
                                non_resource_attributes=client.V1NonResourceAttributes(path=PATH, verb="get"))))
        if not access.status or not access.status.allowed:
            return 403, f"{user.username} may not get {PATH} (SubjectAccessReview)"
        return None

    @staticmethod
    def _call(kind: str, create: Callable, body: object):
        families = metrics.get()
        families.api_requests.labels("create", kind).inc()
        try:
            # (connect, read), not one float: clients before kubernetes 37 ignore a float timeout (only int or tuple).
            return create(body, _request_timeout=(REVIEW_TIMEOUT, REVIEW_TIMEOUT))
        except Exception:
            families.api_errors.labels("create", kind).inc()
            raise
