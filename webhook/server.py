"""The webhook server: a Flask application factory, and `serve`, which runs it under gunicorn over TLS.

Settings are parsed once, in the gunicorn master, before any worker starts: invalid settings stop
the server with the ErrInvalid message. Each worker builds its own app (and runtime cache) after fork,
and follows the settings from then on (SPEC 2.1, webhook.live_settings): a good edit is taken without a
restart, a bad one is logged and the last good settings stay in use.
The worker class (webhook.worker) reads requests on an event loop with deadlines and hands whole
requests to the app's threads; gunicorn's settings combine as webhook.gunicorn_config says.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import orjson
from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException
from werkzeug.wsgi import get_content_length

from . import heap, metrics
from .core.admission import MUTATE, PREVIOUS_SETTINGS_GRACE, RUNTIMES, VALIDATE, Admission, BadReview, Enforcement, Verb
from .core.errors import Denied, ErrInvalid, Reason
from .core.runtimes import KINDS, RuntimeSource, WouldBlock
from .core.settings import EXAMPLE, Settings, parse
from .files import RuntimeFileError, load_runtimes, load_settings
from .live_settings import LiveSettings, fixed_repositories, switch_line
from .worker import DEFAULT_MAX_BODY, DEFAULT_READ_TIMEOUT
from .wsgi import error_body

log = logging.getLogger("dispatch_admission")
review_logger = logging.getLogger("dispatch_admission.review")  # its level switches the review lines

DEV_BIND = "127.0.0.1:8443"


def _dumps(body: Mapping[str, Any]) -> bytes:
    """Compact JSON. orjson where it can (a review's encode and decode are a fifth of its CPU with the
    standard library); the standard library for what orjson refuses (lone surrogates, integers past
    64 bits), so what is accepted and what is written stay the standard library's JSON values."""
    try:
        return orjson.dumps(body)
    except TypeError:  # orjson.JSONEncodeError
        return json.dumps(body, separators=(",", ":")).encode()


# orjson reads an integer past 64 bits as a float: a body with 19 digits in a row skips it. Found by
# mapping every digit to "0" and everything else to " " (bytes.translate and a substring search run at
# memory speed: a regex took 10 times longer, 22 µs on a 2 KB review and 0.1-0.2 s on a 7 MiB body).
_DIGITS_AS_ZERO = bytes(48 if 48 <= b <= 57 else 32 for b in range(256))
_LONG_NUMBER = b"0" * 19


def _loads(body: bytes):
    """A request body as the standard library's json.loads reads it (and refuses it, with its message):
    orjson first; what orjson refuses (NaN, lone surrogates, nesting past 1,024, or no JSON at all) or would
    read differently (19 digits or more in a row) goes to the standard library, which decides. One
    difference remains: nesting between the standard library's limit (a little under 1,000 levels, less
    the caller's stack) and orjson's 1,024 is read, and the rules judge it (a structure they must walk
    that deep is refused as nested too deeply; tests/server/test_hostile.py)."""
    if _LONG_NUMBER not in body.translate(_DIGITS_AS_ZERO):
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            pass
    return json.loads(body)


def _json(body: dict, code: int) -> Response:
    return Response(_dumps(body), status=code, mimetype="application/json")


def _error_body(code: int, message: str) -> bytes:
    """A request refused before review: counted, and answered with the worker's error body."""
    metrics.get().bad_requests.labels(str(code)).inc()
    return error_body(code, message)


def _error(code: int, message: str) -> Response:
    return Response(_error_body(code, message), status=code, mimetype="application/json")


REVIEW_PATHS = {"/mutate": MUTATE, "/validate": VALIDATE, "/runtimes": RUNTIMES}
STATUS = {200: "200 OK", 400: "400 Bad Request", 401: "401 Unauthorized", 403: "403 Forbidden",
          413: "413 Content Too Large", 415: "415 Unsupported Media Type", 429: "429 Too Many Requests",
          500: "500 Internal Server Error",
          503: "503 Service Unavailable"}
INTERNAL = b'{"error":"internal error in dispatch-admission","code":500}'


class Answered(list):
    """A review's WSGI result: its body, and its accounting run by close(), which the server calls once the
    request is complete (PEP 3333), i.e. after the answer is written."""

    __slots__ = ("close",)

    def __init__(self, body: bytes, account: Callable[[], None]):
        super().__init__((body,))
        self.close = account


class ReviewLog:
    """One JSON line per review on stderr, written by a thread of its own.

    Not through `logging`: its handler lock and LogRecord cost as much as the review itself under load
    (measured with py-spy). `write` runs on the worker's event loop (in the review's close()): it only
    appends the line to a bounded queue, so a stderr that stops taking lines (a pipe nobody reads) never
    blocks the loop; while the queue is full, lines are dropped and counted
    (dispatch_admission_log_dropped_total). The writer wakes when lines arrive, lets more gather for
    LINGER seconds (a wake-up per line costs more than the line), and writes them in batches of whole
    lines under PIPE_BUF bytes: such a write is atomic, so lines from workers never interleave.
    """

    MAX_LINE = 4000
    QUEUED = 1000   # lines waiting for stderr, at most (4 MB at the longest)
    LINGER = 0.02
    BATCH = 4096    # PIPE_BUF on Linux

    def __init__(self, enabled: bool, fd: int = 2, queued: int = QUEUED):
        self.enabled, self.fd, self.queued = enabled, fd, queued
        self.lines: deque[bytes] = deque()
        self.waiting = threading.Event()
        self.dropped = metrics.get().log_dropped
        self.writer: threading.Thread | None = None
        self.idle = True  # the writer has nothing in hand
        self.starting = threading.Lock()

    def write(self, fields: dict) -> None:
        line = json.dumps(fields, separators=(", ", ": "))
        if len(line) > self.MAX_LINE:
            fields = {**fields, "message": fields.get("message", "")[: self.MAX_LINE // 2] + "..."}
            line = json.dumps(fields, separators=(", ", ": "))[: self.MAX_LINE]
        if self.writer is None:  # started on first use: in the worker, after fork
            with self.starting:
                if self.writer is None:
                    self.writer = threading.Thread(target=self._write, name="review-log", daemon=True)
                    self.writer.start()
                    atexit.register(self.drain)
        if len(self.lines) >= self.queued:
            self.dropped.inc()
            return
        self.lines.append(line.encode() + b"\n")
        if not self.waiting.is_set():
            self.waiting.set()

    def _write(self) -> None:
        lines = self.lines
        while True:
            self.idle = True
            self.waiting.wait()
            self.idle = False
            time.sleep(self.LINGER)
            self.waiting.clear()
            batch = b""
            while lines:
                line = lines.popleft()
                if len(batch) + len(line) > self.BATCH:
                    self._out(batch)
                    batch = b""
                batch += line
            self._out(batch)

    def drain(self, timeout: float = 1.0) -> None:
        """At the worker's exit: the lines still queued written, waiting at most `timeout` (stderr may be stalled)."""
        deadline = time.monotonic() + timeout
        self.waiting.set()
        while (self.lines or not self.idle) and time.monotonic() < deadline:
            time.sleep(0.005)

    def _out(self, data: bytes) -> None:
        try:
            if data:
                os.write(self.fd, data)
        except OSError:
            pass  # stderr gone: never fail a review over a log line


def create_app(settings: Settings, runtimes: RuntimeSource, tls_loaded: Callable[[], bool] = lambda: True,
               max_body: int = DEFAULT_MAX_BODY, review_log: ReviewLog | None = None,
               enforcement: Enforcement = Enforcement.ENFORCE, serve_metrics: bool = True,
               live: LiveSettings | None = None, on_switch: Callable[[Settings], None] | None = None,
               grace: float = PREVIOUS_SETTINGS_GRACE) -> Flask:
    """The application factory: routes over one Admission. `serve_metrics` False leaves /metrics to a
    port of its own (serve --metrics-bind). `live`, where given, is followed: the settings it hands over
    are switched to (and `on_switch` told), and it is read again before an S4 refusal (SPEC 2.1); the settings
    switched away from stay acceptable on CREATE for `grace` seconds.

    POSTs to the three review paths are answered before Flask's request machinery (a request context,
    URL matching and a Response object cost more than a review does); Flask holds POST routes for the same
    paths only so that other methods get its 405.
    """
    app = Flask("dispatch_admission")
    admission = Admission(settings, runtimes, enforcement=enforcement, refresh=live.refresh if live else None,
                          grace=grace)
    if live is not None:
        def switched(new: Settings) -> None:
            old = admission.settings
            if admission.switch(new):
                metrics.get().settings_switches.inc()
                log.info(json.dumps(switch_line(live.where, old, new)))
                if on_switch is not None:
                    on_switch(new)

        live.start(switched)
    review_log = review_log or ReviewLog(review_logger.isEnabledFor(logging.INFO))
    families = metrics.get()
    latency = {v: families.latency.labels(v.value) for v in Verb}

    def answer(verb: Verb, environ: dict) -> tuple[int, bytes, Callable[[], None] | None]:
        """(HTTP status, JSON body, the review's accounting) for one review request. The accounting (metrics,
        the log line) is left to the caller to run once the answer is sent: it is off the API server's clock."""
        started = time.perf_counter()
        endpoint = verb.value
        mimetype = environ.get("CONTENT_TYPE", "").split(";", 1)[0].strip().lower()
        if mimetype != "application/json":
            return 415, _error_body(415, f"Content-Type must be application/json, not {mimetype or 'none'!r}"), None
        content_length = get_content_length(environ) or 0  # the worker hands whole bodies, with their length
        if content_length > max_body:
            return 413, _error_body(413, f"the body is over the limit of {max_body} bytes"), None
        body = environ["wsgi.input"].read(content_length)
        try:
            doc = _loads(body)
        except (ValueError, RecursionError) as e:
            return 400, _error_body(400, f"the body is not JSON: {str(e)[:200]}"), None
        try:
            response, outcome = admission.review(doc, verb)
        except BadReview as e:
            return 400, _error_body(400, f"not an AdmissionReview v1: {e}"), None
        except RecursionError:  # the envelope itself nested too deeply (the core judges a deep object)
            return 400, _error_body(400, "not an AdmissionReview v1: nested too deeply"), None
        out = _dumps(response)
        elapsed = time.perf_counter() - started

        def account() -> None:
            latency[verb].observe(elapsed)
            families.reviews.labels(endpoint, "allowed" if outcome.allowed else "denied", outcome.sentinel).inc()
            would_deny = outcome.would_deny
            metrics.count_would_deny(families, would_deny)
            if outcome.intercepted and review_log.enabled:
                review_log.write({
                    "msg": "review", "endpoint": endpoint, "uid": outcome.uid, "operation": outcome.operation,
                    "namespace": outcome.namespace, "name": outcome.name, "allowed": outcome.allowed,
                    "sentinel": outcome.sentinel or None, "patched": bool(outcome.ops and outcome.allowed),
                    "warnings": len(outcome.warnings), "ms": round(elapsed * 1000, 3),
                    **({"would_deny": [{"sentinel": s, "rule": r} for s, r in would_deny]} if would_deny else {}),
                    **({"message": response["response"]["status"]["message"][:1000]} if not outcome.allowed else {}),
                })

        return 200, out, account

    flask_wsgi = app.wsgi_app

    def wsgi_app(environ, start_response):
        verb = REVIEW_PATHS.get(environ.get("PATH_INFO", ""))
        if verb is None or environ.get("REQUEST_METHOD") != "POST":
            return flask_wsgi(environ, start_response)
        try:
            code, body, account = answer(verb, environ)
        except WouldBlock:
            raise  # the worker runs it again on a thread that may block (see worker.Connection._dispatch)
        except Exception:  # a fault of ours; the worker lives on
            log.exception("unexpected error serving %s", environ.get("PATH_INFO"))
            code, body, account = 500, INTERNAL, None
        start_response(STATUS[code], [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return Answered(body, account) if account is not None else [body]

    app.wsgi_app = wsgi_app  # type: ignore[method-assign]  # reviews answered before Flask

    def answered_before_flask():  # never reached: wsgi_app answers every POST to these paths
        raise RuntimeError("a review POST reached Flask")

    for path in REVIEW_PATHS:
        app.add_url_rule(path, endpoint=path.strip("/"), view_func=answered_before_flask, methods=["POST"])

    @app.get("/healthz")
    def healthz():
        return _json({"status": "ok"}, 200)

    @app.get("/readyz")
    def readyz():
        checks = {"settings": True, "certificate": tls_loaded(), "runtimes": runtimes.ready()}
        return _json({"ready": all(checks.values()), "checks": checks}, 200 if all(checks.values()) else 503)

    if serve_metrics:
        @app.get("/metrics")
        def metrics_endpoint():
            body, content_type = metrics.exposition()
            return Response(body, status=200, content_type=content_type)

    @app.errorhandler(HTTPException)
    def http_error(e: HTTPException):
        return _error(e.code or 400, e.description or e.name)

    @app.errorhandler(Exception)
    def unexpected(e: Exception):  # a fault of ours; the worker lives on
        log.exception("unexpected error serving %s", request.path)
        return _json({"error": "internal error in dispatch-admission", "code": 500}, 500)

    return app


# ---- serve: gunicorn ----


HEALTH_PATHS = ("/healthz", "/readyz")


def ops_app(main: Callable, auth=None) -> Callable:
    """The listener of `serve --metrics-bind`: GET /metrics, and /healthz and /readyz from the main app (for
    kubelet probes when the TLS port requires client certificates); nothing else, so a NetworkPolicy can open
    this port to Prometheus without opening the review paths. `auth` (a MetricsAuth, `--metrics-auth`):
    /metrics only for a token the API server authenticates and authorizes."""

    def app(environ, start_response):
        path = environ.get("PATH_INFO")
        if path in HEALTH_PATHS:
            return main(environ, start_response)
        if path != "/metrics":
            body = b'{"error":"only /metrics, /healthz and /readyz are served on this port","code":404}'
            start_response("404 Not Found", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD"), ("Content-Length", "0")])
            return [b""]
        refused = auth.check(environ.get("HTTP_AUTHORIZATION")) if auth is not None else None
        if refused is not None:
            code, why = refused
            body = _error_body(code, why)
            extra = ([("WWW-Authenticate", 'Bearer realm="metrics"')] if code == 401 else
                     [("Retry-After", "1")] if code == 429 else [])
            start_response(STATUS.get(code, f"{code} Error"), [("Content-Type", "application/json"),
                                                               ("Content-Length", str(len(body))), *extra])
            return [body]
        body, content_type = metrics.exposition()
        start_response("200 OK", [("Content-Type", content_type), ("Content-Length", str(len(body)))])
        return [body]

    return app


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise Denied([Reason(ErrInvalid, "--metrics-bind", f"{text!r} is not HOST:PORT")])
    return host.strip("[]"), int(port)


class _Options:
    """What `serve` resolved from its flags, handed to each worker."""

    def __init__(self, args):
        self.dev = bool(args.dev)
        self.bind = args.bind or (DEV_BIND if self.dev else None)  # None: gunicorn configuration, else 0.0.0.0:8443
        self.cert_dir = Path(args.cert_dir or ("certs" if self.dev else "/etc/dispatch-admission/tls"))
        self.runtime_files = list(args.runtime or [])
        if self.dev and not self.runtime_files and not args.kubeconfig:
            # The example runtimes are package data: an installed wheel has them too. Never fall back to the
            # cluster client silently: --dev without them is a broken installation.
            examples = Path(__file__).resolve().parent / "examples" / "runtimes"
            self.runtime_files = sorted(str(p) for p in examples.glob("*.yaml"))
            if not self.runtime_files:
                raise Denied([_reason(f"--dev: no example runtimes in {examples}; "
                                      "give --runtime FILE or --kubeconfig")])
        self.kubeconfig = args.kubeconfig
        self.tls_secret = args.tls_secret
        self.tls_service = args.tls_service
        self.webhook_configuration = args.webhook_configuration
        self.tls_read_only = bool(getattr(args, "tls_read_only", False))  # the certificate controller issues
        self.namespace = args.namespace or os.environ.get("POD_NAMESPACE") or "default"
        self.client_ca = args.client_ca
        self.workers = args.workers
        self.max_body = args.max_body or DEFAULT_MAX_BODY
        self.max_body_in_flight = getattr(args, "max_body_in_flight", None) or 0
        self.read_timeout = args.read_timeout or DEFAULT_READ_TIMEOUT
        self.gunicorn_config = args.gunicorn_config
        self.metrics_bind = args.metrics_bind
        self.metrics_address = _address(args.metrics_bind) if args.metrics_bind else None
        self.metrics_auth = bool(getattr(args, "metrics_auth", False))
        if self.metrics_auth and not self.metrics_bind:
            raise Denied([Reason(ErrInvalid, "--metrics-auth", "needs --metrics-bind: the port it guards")])
        self.enforcement = Enforcement(args.enforcement)
        self.settings_file = args.settings
        self.settings_configmap = None
        self.publish_repositories: frozenset[str] | None = None  # fixed once the start-up settings are read
        self.grace = getattr(args, "previous_settings_grace", PREVIOUS_SETTINGS_GRACE)
        if args.settings and args.settings_configmap:
            raise Denied([_reason("give --settings FILE or --settings-configmap NS/NAME, not both")])
        if args.settings_configmap:
            from .live_settings import configmap_ref

            self.settings_configmap = configmap_ref(args.settings_configmap)
            try:
                self.settings = self.live_settings().read()
            except Denied:
                raise
            except Exception as e:  # the API refused or cannot be reached: do not serve without settings
                raise Denied([_reason(f"cannot read ConfigMap {args.settings_configmap}: {type(e).__name__}:"
                                      f" {str(e)[:300]}")]) from None
        elif args.settings:
            self.settings = load_settings(args.settings)
        elif self.dev:
            self.settings = parse(json.dumps(EXAMPLE))
        else:
            raise Denied([_reason("--settings or --settings-configmap is required "
                                  "(or --dev for the example settings)")])
        self.publish_repositories = fixed_repositories(getattr(args, "publish_repositories", None), self.settings)

    def live_settings(self) -> LiveSettings | None:
        """Where the settings are followed from (SPEC 2.1); None for --dev's embedded example."""
        from .live_settings import ConfigMapSettings, FileSettings

        if self.settings_configmap:
            from .cluster import api_client

            return ConfigMapSettings(api_client(self.kubeconfig), *self.settings_configmap,
                                     repositories=self.publish_repositories)
        return FileSettings(self.settings_file, repositories=self.publish_repositories) if self.settings_file else None


def _reason(text: str) -> Reason:
    return Reason(ErrInvalid, "settings", text)


def _runtime_source(opts: _Options, current: Callable[[], Settings], store_directory: str | None) -> RuntimeSource:
    """Runtimes from files, or from the pod's cache (the keeper's store); either way, each runtime's readiness
    is exported, judged at scrape time with the settings in use (`current`)."""
    from .core.rules import runtime_facts

    def can_carry(runtime) -> bool:
        try:
            return runtime_facts(runtime, current()).can_carry
        except Exception:  # a runtime the rules cannot read cannot carry the mount either
            log.exception("judging runtime %s", runtime)
            return False

    if opts.runtime_files:
        index = load_runtimes(opts.runtime_files)
        metrics.judge_runtimes(lambda: ((r.key, can_carry(r)) for r in index))
        files = {"kinds": {kind: {"synced": True, "size": index.count(kind)} for kind in KINDS}}
        metrics.watch_runtime_cache(lambda: files)  # files are read whole before serving
        return index
    from .cluster import ClusterRuntimes
    from .live_reads import LiveReads
    from .store import StoreReader

    assert store_directory is not None  # serve prepares the store where no runtime files are given
    store = StoreReader(store_directory)
    source = ClusterRuntimes(store, LiveReads(store_directory))
    metrics.watch_runtime_cache(store.state, source.synced)
    metrics.judge_runtimes(lambda: source.readiness(can_carry, current))
    return source


# The Secret is read this often: a renewal by another replica, or the Secret deleted (a new pair is then
# issued), reaches every replica within it. One GET of one Secret per replica: no list or watch rights.
REFRESH_SECONDS = 10


def _self_managed_certificates(opts: _Options) -> None:
    """Settle the pair in the Secret, serve it from cert_dir, put the CA in the webhook configurations,
    and keep doing so (certs.SelfManaged: a change of CA passes through a caBundle trusting both)."""
    import threading

    from . import certs
    from .cluster import api_client

    api = api_client(opts.kubeconfig)
    names = certs.service_names(opts.tls_service, opts.namespace)
    keeper = certs.SelfManaged(api, opts.namespace, opts.tls_secret, names, opts.cert_dir, opts.webhook_configuration,
                               read_only=opts.tls_read_only)

    def sync() -> None:
        if keeper.sync():
            log.info(json.dumps({"msg": "serving certificate loaded", "secret": f"{opts.namespace}/{opts.tls_secret}"}))

    sync()

    def loop() -> None:
        while True:
            time.sleep(REFRESH_SECONDS)
            try:
                sync()
            except Exception as e:
                log.warning(json.dumps({"msg": "certificate refresh failed", "error": str(e)[:300]}))

    threading.Thread(target=loop, name="certificate-refresh", daemon=True).start()


def _start_keeper(directory: str, kubeconfig: str | None, args, master: int) -> None:
    """Locally, the runtime keeper is a child process of serve's (`dispatch-admission keep`), stopped with it and
    not restarted: in the cluster it is a container of its own, which Kubernetes restarts with backoff."""
    import subprocess

    command = [sys.executable, "-m", "webhook", "keep", "--runtime-store", directory, "--parent", str(master),
               "--live-reads-per-second", str(getattr(args, "live_reads_per_second", 10.0)),
               "--live-reads-burst", str(getattr(args, "live_reads_burst", 20)),
               "--log-level", getattr(args, "log_level", "info")]
    if kubeconfig:
        command += ["--kubeconfig", kubeconfig]
    keeper = subprocess.Popen(command)

    def stop() -> None:
        if os.getpid() == master and keeper.poll() is None:
            keeper.terminate()
            try:
                keeper.wait(5)
            except subprocess.TimeoutExpired:
                keeper.kill()

    atexit.register(stop)


def gunicorn_application(load: Callable[[], Callable], *, bind: str | None, workers: int | None, certfile: str,
                         keyfile: str, tls, config_file: str | None = None, metrics_bind: str | None = None,
                         metrics_address: tuple[str, int] | None = None, read_timeout: float = DEFAULT_READ_TIMEOUT,
                         max_body: int = DEFAULT_MAX_BODY, max_body_in_flight: int = 0,
                         ops: Callable[[Callable], Callable] | None = None,
                         metrics_tls: Callable[[], object] | None = None):
    """A gunicorn Application serving `load()` with the webhook's worker, settings and TLS (bench/baseline.py
    serves its app with this too, so the two are compared on equal terms)."""
    from gunicorn.app.base import Application

    from . import gunicorn_config
    from .worker import WorkerOptions

    class Server(Application):
        worker_options = WorkerOptions(handshake_timeout=read_timeout, request_timeout=read_timeout,
                                       max_body=max_body, max_body_in_flight=max_body_in_flight,
                                       metrics_address=metrics_address, metrics_tls=metrics_tls)

        def init(self, parser, opts, args):  # not called: load_config is ours
            return None

        def load_config(self):
            gunicorn_config.configure(self, config_file=config_file, certfile=certfile, keyfile=keyfile, tls=tls,
                                      explicit={"bind": [bind] if bind else None, "workers": workers},
                                      warn=lambda text: log.warning(json.dumps({"msg": text})))
            if metrics_bind:
                self.cfg.set("bind", list(self.cfg.bind) + [metrics_bind])

        def load(self):
            return load()

        def metrics_app(self):
            """The WSGI app of the metrics listener, made in the worker after the main one."""
            return ops(self.wsgi()) if ops else None

    return Server()


def _tls_options(args) -> dict:
    """serve's TLS hardening flags (docs/hardening.md), as ReloadingContext takes them."""
    found = {"min_version": getattr(args, "tls_min_version", None), "ciphers": getattr(args, "tls_ciphers", None),
             "client_subjects": tuple(getattr(args, "client_subject", None) or ())}
    return {k: v for k, v in found.items() if v}


def run(args) -> int:
    from . import certs

    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr,
                        format="%(message)s")
    try:
        opts = _Options(args)
    except Denied as e:
        print(f"dispatch-admission serve: {e}", file=sys.stderr)
        return 1
    if opts.dev:
        made = certs.write_dev_pair(opts.cert_dir, certs.service_names("dispatch-admission", "dispatch-system"))
        if made:
            print(f"dispatch-admission serve: wrote a local CA and certificate to {opts.cert_dir}/", file=sys.stderr)
    if opts.tls_secret:
        try:
            _self_managed_certificates(opts)
        except Exception as e:  # the API refused or cannot be reached: do not serve without a certificate
            print(f"dispatch-admission serve: self-managed certificate in Secret {opts.namespace}/{opts.tls_secret}:"
                  f" {type(e).__name__}: {str(e)[:500]}", file=sys.stderr)
            return 1
    certfile, keyfile = str(opts.cert_dir / "tls.crt"), str(opts.cert_dir / "tls.key")
    try:
        tls = certs.ReloadingContext(certfile, keyfile, opts.client_ca, cafile=str(opts.cert_dir / "ca.crt"),
                                     **_tls_options(args))
    except (OSError, ValueError) as e:
        print(f"dispatch-admission serve: cannot load the serving certificate from {opts.cert_dir}: {e}",
              file=sys.stderr)
        return 1
    if opts.runtime_files:  # fail now, in the master, on an unusable runtime file
        try:
            load_runtimes(opts.runtime_files)
        except RuntimeFileError as e:
            print(f"dispatch-admission serve: runtime {e}", file=sys.stderr)
            return 1

    ops: Callable[..., Any]
    ops, metrics_tls = ops_app, None
    if opts.metrics_auth:  # HTTPS on the metrics port (no client certificate asked), tokens reviewed
        from .cluster import api_client
        from .metrics_auth import MetricsAuth

        tls_options = {k: v for k, v in _tls_options(args).items() if k != "client_subjects"}
        metrics_tls = certs.ReloadingContext(certfile, keyfile, None, cafile=str(opts.cert_dir / "ca.crt"),
                                             **tls_options).get
        ops = lambda main: ops_app(main, MetricsAuth(lambda: api_client(opts.kubeconfig)))  # noqa: E731
    store_directory = None
    master = os.getpid()
    if not opts.runtime_files:  # the pod's one runtime cache: the keeper writes it, the workers read it
        import kubernetes.client  # noqa: F401  imported once, here: the workers share its pages (live settings)
        import kubernetes.config  # noqa: F401
        import kubernetes.watch  # noqa: F401

        from . import store

        given = getattr(args, "runtime_store", None)
        external = getattr(args, "runtime_keeper", "process") == "external"
        if external and not given:
            print("dispatch-admission serve: --runtime-keeper external needs --runtime-store, the directory the other"
                  " container keeps", file=sys.stderr)
            return 2
        store_directory = store.prepare(given, fresh=not external)
        if not given:
            atexit.register(lambda: os.getpid() == master
                            and shutil.rmtree(store_directory, ignore_errors=True))  # type: ignore[func-returns-value]
        if not external:
            _start_keeper(store_directory, opts.kubeconfig, args, master)

    def load():  # in each worker, after fork
        metrics.watch_certificates(tls.expiry)
        metrics.name_runtimes(bool(getattr(args, "runtime_metric_labels", False)))
        current = [opts.settings]
        runtimes = _runtime_source(opts, lambda: current[0], store_directory)

        def rejudge(settings: Settings) -> None:
            """The runtimes' readiness is judged under the settings just taken from the next scrape (SPEC 8.3)."""
            current[0] = settings

        return create_app(opts.settings, runtimes, tls.valid, opts.max_body, enforcement=opts.enforcement,
                          serve_metrics=opts.metrics_bind is None, live=opts.live_settings(), on_switch=rejudge,
                          grace=opts.grace)

    server = gunicorn_application(load, bind=opts.bind, workers=opts.workers, certfile=certfile, keyfile=keyfile,
                                  tls=tls, config_file=opts.gunicorn_config, metrics_bind=opts.metrics_bind,
                                  metrics_address=opts.metrics_address, read_timeout=opts.read_timeout,
                                  max_body=opts.max_body, max_body_in_flight=opts.max_body_in_flight, ops=ops,
                                  metrics_tls=metrics_tls)
    cfg = server.cfg
    log.info(json.dumps({"msg": "starting", "bind": cfg.bind, "workers": cfg.workers, "threads": cfg.threads,
                         "read_timeout": opts.read_timeout, "keepalive": cfg.keepalive,
                         "enforcement": opts.enforcement.value,
                         "manager": opts.settings.manager, "publish": bool(opts.settings.publish),
                         "settings": (f"ConfigMap {'/'.join(opts.settings_configmap)}" if opts.settings_configmap
                                      else opts.settings_file or "embedded example"),
                         "runtimes": "files" if opts.runtime_files else "cluster",
                         "metrics_auth": opts.metrics_auth}))
    import gc

    heap.tune()
    gc.freeze()  # what the master holds is never collected: the workers and the keeper keep sharing its pages
    server.run()
    return 0
