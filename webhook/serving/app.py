"""The webhook's app (SPEC 7): the review paths (`Reviews`), which the worker's request cycle calls directly,
the probes and /metrics routed by Flask, and the Flask app of the metrics listener (`serve --metrics-bind`).

The review paths are answered without WSGI or Flask: an environ, a request context, URL matching and a
Response object cost more than a review does and none of them is read. Everything else is Flask's.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException, NotFound

from ..core.admission import (
    MUTATE,
    PREVIOUS_SETTINGS_GRACE,
    RUNTIMES,
    VALIDATE,
    Admission,
    BadReview,
    Enforcement,
    Verb,
)
from ..core.decision import Outcome
from ..core.review import AdmissionReview
from ..core.reviewing import Result, Reviewing
from ..core.runtimes import RuntimeSource
from ..core.settings import Settings
from ..core.sources import switch_line
from ..process import metrics
from .codec import dumps, loads
from .listener import DEFAULT_MAX_BODY
from .review_log import ReviewLog
from .wsgi import JSON, Answer, error_body

log = logging.getLogger("dispatch_admission")
review_logger = logging.getLogger("dispatch_admission.review")  # its level switches the review lines

STATUS = {200: "200 OK", 400: "400 Bad Request", 401: "401 Unauthorized", 403: "403 Forbidden",
          405: "405 Method Not Allowed", 413: "413 Content Too Large", 415: "415 Unsupported Media Type",
          429: "429 Too Many Requests", 500: "500 Internal Server Error", 503: "503 Service Unavailable"}
INTERNAL = b'{"error":"internal error in dispatch-admission","code":500}'
OPS_ONLY = "only /metrics, /healthz and /readyz are served on this port"
ALLOW_POST = [("Allow", "POST")]


class FollowedSettings(Protocol):
    """Settings followed while serving (webhook.kube.live_settings: a ConfigMap or a file)."""

    where: str

    def start(self, on_change: Callable[[Settings], None]) -> None: ...

    def refresh(self) -> Settings | None: ...


class MetricsGate(Protocol):
    """Who may read /metrics (webhook.kube.metrics_auth): None to serve, else (HTTP status, why)."""

    def check(self, authorization: str | None) -> tuple[int, str] | None: ...


def _answer(code: int, body: bytes, extra: list[tuple[str, str]] | None = None) -> Answer:
    return STATUS[code], JSON + extra if extra else JSON, body, None


Later = Callable[[], Answer]  # the rest of a review that waits for a read that may block: run on a thread


def refused(code: int, message: str) -> bytes:
    """A request refused before review: counted, and answered with the worker's error body."""
    metrics.get().bad_requests.labels(str(code)).inc()
    return error_body(code, message)


def json_response(body: dict, code: int) -> Response:
    return Response(dumps(body), status=code, mimetype="application/json")


class Reviews:
    """The review paths: POST /mutate, /validate and /runtimes over one Admission, any other method 405. The
    worker's request cycle (webhook.serving.cycle) hands a review here as its method, Content-Type, body and
    Content-Length, no WSGI environ, and gets its answer (the accounting to run once it is sent, off the API
    server's clock, as its close()), or, where the review waits for a read that may block, the rest of it to
    run on a thread."""

    paths: dict[bytes, Verb] = {b"/mutate": MUTATE, b"/validate": VALIDATE, b"/runtimes": RUNTIMES}

    def __init__(self, admission: Admission, *, max_body: int, review_log: ReviewLog):
        self.admission, self.max_body, self.review_log = admission, max_body, review_log
        self.families = metrics.get()
        self.latency = {v: self.families.latency.labels(v.value) for v in Verb}
        self.counters: dict[tuple[str, str, str], Any] = {}  # reviews_total's children, by their labels

    def begin(self, verb: Verb, method: bytes, content_type: bytes, body: bytes, length: int) -> Answer | Later:
        """The answer, or what is left of the review once a read it waits for may block (a thread runs it)."""
        started = time.perf_counter()
        try:
            got = self._begin(verb, method, content_type, body, length, started)
            if isinstance(got, tuple):
                return got
            return partial(self._finish, verb, got, started)
        except Exception:  # a fault of ours; the worker lives on
            log.exception("unexpected error serving %s", verb.value)
            return _answer(500, INTERNAL)

    def answer(self, verb: Verb, method: bytes, content_type: bytes, body: bytes, length: int) -> Answer:
        """The answer, made where blocking is allowed (an app thread)."""
        got = self.begin(verb, method, content_type, body, length)
        return got if isinstance(got, tuple) else got()

    def _begin(self, verb: Verb, method: bytes, content_type: bytes, body: bytes, length: int,
               started: float) -> Answer | Reviewing[Result]:
        if method != b"POST":
            return _answer(405, refused(405, "the review paths take POST only"), extra=ALLOW_POST)
        mimetype = content_type.split(b";", 1)[0].strip().lower()
        if mimetype != b"application/json":
            shown = mimetype.decode("latin-1")
            return _answer(415, refused(415, f"Content-Type must be application/json, not {shown or 'none'!r}"))
        if length > self.max_body:  # by its Content-Length: the worker drops an over-limit body as it comes
            return _answer(413, refused(413, f"the body is over the limit of {self.max_body} bytes"))
        try:
            doc = loads(body)
        except (ValueError, RecursionError) as e:
            return _answer(400, refused(400, f"the body is not JSON: {str(e)[:200]}"))
        try:
            reviewing = self.admission.begin(doc, verb)
        except BadReview as e:
            return _answer(400, refused(400, f"not an AdmissionReview v1: {e}"))
        except RecursionError:  # the envelope itself nested too deeply (the core judges a deep object)
            return _answer(400, refused(400, "not an AdmissionReview v1: nested too deeply"))
        if reviewing.result is None:
            return reviewing
        return self._answered(verb, reviewing.result, started)

    def _finish(self, verb: Verb, reviewing: Reviewing[Result], started: float) -> Answer:
        """On a thread: the review goes on from the read it waited for."""
        try:
            return self._answered(verb, reviewing.finish(), started)
        except BadReview as e:
            return _answer(400, refused(400, f"not an AdmissionReview v1: {e}"))
        except RecursionError:
            return _answer(400, refused(400, "not an AdmissionReview v1: nested too deeply"))
        except Exception:
            log.exception("unexpected error serving %s", verb.value)
            return _answer(500, INTERNAL)

    def _answered(self, verb: Verb, result: Result, started: float) -> Answer:
        response, outcome = result
        elapsed = time.perf_counter() - started
        return STATUS[200], JSON, dumps(response), lambda: self.account(verb, response, outcome, elapsed)

    def account(self, verb: Verb, response: AdmissionReview, outcome: Outcome, elapsed: float) -> None:
        """The review's metrics and, where the review log is on, its line."""
        self.latency[verb].observe(elapsed)
        labels = (verb.value, "allowed" if outcome.allowed else "denied", outcome.sentinel)
        counter = self.counters.get(labels)
        if counter is None:  # a few dozen label sets at most (verbs, allowed, the sentinels): labels() once each
            counter = self.counters[labels] = self.families.reviews.labels(*labels)
        counter.inc()
        would_deny = outcome.would_deny
        metrics.count_would_deny(self.families, would_deny)
        if not (outcome.intercepted and self.review_log.enabled):
            return
        self.review_log.write({
            "msg": "review", "endpoint": verb.value, "uid": outcome.uid, "operation": outcome.operation,
            "namespace": outcome.namespace, "name": outcome.name, "allowed": outcome.allowed,
            "sentinel": outcome.sentinel or None, "patched": bool(outcome.ops and outcome.allowed),
            "warnings": len(outcome.warnings), "ms": round(elapsed * 1000, 3),
            **({"would_deny": [{"sentinel": s, "rule": r} for s, r in would_deny]} if would_deny else {}),
            **({"message": response["response"]["status"]["message"][:1000]} if not outcome.allowed else {}),
        })


def _errors(app: Flask, not_found: str | None = None) -> None:
    """Flask's refusals as the worker's error bodies (counted); a fault of ours a 500, the worker living on."""

    @app.errorhandler(HTTPException)
    def http_error(e: HTTPException):
        message = not_found if not_found and isinstance(e, NotFound) else e.description or e.name
        allowed = getattr(e, "valid_methods", None)  # a 405 says which methods the path takes
        headers = {"Allow": ", ".join(allowed)} if allowed else {}
        return Response(refused(e.code or 400, message), status=e.code or 400, mimetype="application/json",
                        headers=headers)

    @app.errorhandler(Exception)
    def unexpected(e: Exception):
        log.exception("unexpected error serving %s", request.path)
        return json_response({"error": "internal error in dispatch-admission", "code": 500}, 500)


def _probes(app: Flask, readiness: Callable[[], dict[str, bool]]) -> None:
    @app.get("/healthz")
    def healthz():
        return json_response({"status": "ok"}, 200)

    @app.get("/readyz")
    def readyz():
        checks = readiness()
        return json_response({"ready": all(checks.values()), "checks": checks}, 200 if all(checks.values()) else 503)


def _metrics_route(app: Flask) -> None:
    @app.get("/metrics")
    def metrics_endpoint():
        body, content_type = metrics.exposition()
        return Response(body, status=200, content_type=content_type)


class MetricsFilter:
    """In front of the metrics listener's app, as kubebuilder's metrics filter: a request for /metrics whose
    token the gate refuses is answered here, before Flask (a flood of random tokens costs a tenth of what it
    would through Flask's request machinery, CPU the reviews of the same worker need)."""

    def __init__(self, app: Callable, gate: MetricsGate):
        self.app, self.gate = app, gate

    def __call__(self, environ: dict, start_response: Callable):
        why = self.gate.check(environ.get("HTTP_AUTHORIZATION")) if environ.get("PATH_INFO") == "/metrics" else None
        if why is None:
            return self.app(environ, start_response)
        code, text = why
        body = refused(code, text)
        extra = ([("WWW-Authenticate", 'Bearer realm="metrics"')] if code == 401 else
                 [("Retry-After", "1")] if code == 429 else [])
        start_response(STATUS.get(code, f"{code} Error"), [("Content-Type", "application/json"),
                                                           ("Content-Length", str(len(body))), *extra])
        return [body]


def _follow(admission: Admission, live: FollowedSettings) -> None:
    """Switch to the settings `live` hands over (SPEC 2.1), logged and counted."""

    def switched(new: Settings) -> None:
        old = admission.settings
        if admission.switch(new):
            metrics.get().settings_switches.inc()
            log.info(json.dumps(switch_line(live.where, old, new)))

    live.start(switched)


class WebhookApp(Flask):
    """Flask, for the probes and /metrics, with the review paths beside it: the worker's request cycle routes
    those to `reviews` (webhook.serving.listener.Site), never through Flask."""

    reviews: Reviews


def create_app(settings: Settings, runtimes: RuntimeSource, tls_loaded: Callable[[], bool] = lambda: True,
               max_body: int = DEFAULT_MAX_BODY, review_log: ReviewLog | None = None,
               enforcement: Enforcement = Enforcement.ENFORCE, serve_metrics: bool = True,
               live: FollowedSettings | None = None, grace: float = PREVIOUS_SETTINGS_GRACE) -> WebhookApp:
    """The application factory: the review paths over one Admission (`app.reviews`; its settings are the
    settings in use: `app.reviews.admission.settings`), and Flask's routes. `serve_metrics` False leaves
    /metrics to a port of its own (serve --metrics-bind). `live`, where given, is followed: the settings it
    hands over are switched to, and it is read again before an S4 refusal (SPEC 2.1); the settings switched
    away from stay acceptable on CREATE for `grace` seconds."""
    app = WebhookApp("dispatch_admission")
    admission = Admission(settings, runtimes, enforcement=enforcement, refresh=live.refresh if live else None,
                          grace=grace)
    if live is not None:
        _follow(admission, live)
    _probes(app, lambda: {"settings": True, "certificate": tls_loaded(), "runtimes": runtimes.ready()})
    if serve_metrics:
        _metrics_route(app)
    _errors(app)
    app.reviews = Reviews(admission, max_body=max_body,
                          review_log=review_log or ReviewLog(review_logger.isEnabledFor(logging.INFO)))
    return app


def metrics_app(main: Flask, gate: MetricsGate | None = None) -> Flask:
    """The listener of `serve --metrics-bind`: GET /metrics, and the main app's /healthz and /readyz (for kubelet
    probes when the TLS port requires client certificates); nothing else, so a NetworkPolicy can open this port
    to Prometheus without opening the review paths. `gate` (`--metrics-auth`): /metrics only for a token the
    API server authenticates and authorizes."""
    app = Flask("dispatch_admission_metrics")
    for path in ("/healthz", "/readyz"):
        app.add_url_rule(path, endpoint=path.strip("/"), view_func=main.view_functions[path.strip("/")])
    _metrics_route(app)
    _errors(app, not_found=OPS_ONLY)
    if gate is not None:
        app.wsgi_app = MetricsFilter(app.wsgi_app, gate)  # type: ignore[method-assign]
    return app
