"""Who may read /metrics with `serve --metrics-auth`: as kubebuilder's metrics filter does, a bearer token
the API server authenticates (TokenReview) and authorizes for `get` on the non-resource URL /metrics
(SubjectAccessReview). The metrics port then speaks HTTPS (the serving certificate), so the token is never
sent in the clear. /healthz and /readyz stay open on that port for the kubelet's probes.

A verdict is kept for a minute per token (by its SHA-256), so a Prometheus scraping every 15 s costs the
API server two requests a minute per pod. The reviews block: on the worker's loop a token not yet judged
raises WouldBlock, and the request is answered from a thread.
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Callable

from .cluster import blocking_allowed
from .core.runtimes import WouldBlock

ALLOWED_SECONDS = 60.0
DENIED_SECONDS = 10.0  # a token just bound to the role is let in soon
CACHED = 1000          # tokens remembered at once (then all are forgotten)
PATH = "/metrics"


class MetricsAuth:
    """`check(authorization)`: None when allowed, else (HTTP status, reason): 401 without a valid token,
    403 when its user may not get /metrics, 503 when the API server cannot say."""

    def __init__(self, api_client: Callable[[], object], clock: Callable[[], float] = time.monotonic):
        self._client, self._api = api_client, None
        self.clock = clock
        self._verdicts: dict[bytes, tuple[float, tuple[int, str] | None]] = {}
        self._lock = threading.Lock()

    def check(self, authorization: str | None) -> tuple[int, str] | None:
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return 401, "a bearer token is required (Authorization: Bearer TOKEN)"
        key = hashlib.sha256(token.encode()).digest()
        with self._lock:
            hit = self._verdicts.get(key)
        if hit is not None and self.clock() < hit[0]:
            return hit[1]
        if not blocking_allowed():
            raise WouldBlock("the token is reviewed by the API server")
        try:
            verdict = self._review(token)
        except Exception as e:  # the API server refused the review itself, or cannot be reached
            return 503, f"the API server cannot review the token now: {type(e).__name__}"
        with self._lock:
            if len(self._verdicts) >= CACHED:
                self._verdicts.clear()
            self._verdicts[key] = (self.clock() + (ALLOWED_SECONDS if verdict is None else DENIED_SECONDS), verdict)
        return verdict

    def _review(self, token: str) -> tuple[int, str] | None:
        from kubernetes import client

        if self._api is None:
            self._api = self._client()
        review = client.AuthenticationV1Api(self._api).create_token_review(
            client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token)))
        status = review.status
        if not status or not status.authenticated or not status.user:
            return 401, "the token is not valid (TokenReview)"
        user = status.user
        access = client.AuthorizationV1Api(self._api).create_subject_access_review(client.V1SubjectAccessReview(
            spec=client.V1SubjectAccessReviewSpec(
                user=user.username, groups=user.groups, uid=user.uid, extra=user.extra,
                non_resource_attributes=client.V1NonResourceAttributes(path=PATH, verb="get"))))
        if not access.status or not access.status.allowed:
            return 403, f"{user.username} may not get {PATH} (SubjectAccessReview)"
        return None
