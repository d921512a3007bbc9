"""`serve` as a user configures it, against the real server process: the worker's HTTP handling (request
limits, Expect and Transfer-Encoding not served, pipelining, bad framing), the metrics port, certificate
readiness and metrics, warn mode and /runtimes, and gunicorn's own configuration (-c FILE, GUNICORN_CMD_ARGS)."""

from __future__ import annotations

import datetime as dt
import json
import socket
import subprocess
import time
import urllib.error
import urllib.request

import pytest
import requests
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from tests.helpers import eventually, metric_series, review, runtime, trainjob
from tests.tls import read_response, rotate_serving, tls_socket
from webhook import certs

BODY = json.dumps(review(trainjob())).encode()


def get(url: str, timeout: float = 5) -> tuple[int, str]:
    """(status, body); (0, error) when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, ConnectionError) as e:
        return 0, repr(e)


@pytest.fixture(scope="module")
def ops(serve_module):
    """A server with its metrics on a port of their own."""
    return serve_module("--runtime-metric-labels", metrics=True)


def request_bytes(path=b"/mutate", body=BODY, extra=b"") -> bytes:
    return (b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + extra
            + b"Content-Length: %d\r\n\r\n" % len(body) + body)


# ---- the worker's HTTP handling ----

def test_pipelined_requests_are_answered_in_order(ops):
    base, ca = ops.url, ops.ca
    with tls_socket(base, ca) as s:
        s.sendall(request_bytes() + request_bytes(b"/validate") + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        buffered = bytearray()
        first, second, third = (read_response(s, buffered) for _ in range(3))
    assert first[0] == second[0] == third[0] == 200
    assert json.loads(first[2])["response"]["allowed"] is True and "patch" in json.loads(first[2])["response"]
    assert json.loads(second[2])["response"]["allowed"] is False  # /validate: the entry is missing
    assert json.loads(third[2]) == {"status": "ok"}


def test_expect_100_continue_is_not_honoured(ops):
    """No 100 Continue (the API server never asks for one): a client that sends its body anyway, as
    clients do after a short wait, gets its answer, and nothing before it."""
    base, ca = ops.url, ops.ca
    with tls_socket(base, ca) as s:
        s.sendall(b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nExpect: 100-continue\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(BODY))
        s.settimeout(0.5)
        with pytest.raises((TimeoutError, socket.timeout)):  # nothing to read until the body is sent
            s.recv(1)
        s.settimeout(10)
        s.sendall(BODY)
        code, _, body = read_response(s, bytearray())
    assert code == 200 and json.loads(body)["response"]["allowed"] is True


def test_expect_100_continue_over_the_limit_is_413_without_the_body(ops):
    """The client waiting to be told to continue is told 413 instead, and the connection closed (it will
    not send the body)."""
    base, ca = ops.url, ops.ca
    with tls_socket(base, ca) as s:
        s.sendall(b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nExpect: 100-continue\r\n"
                  b"Content-Length: %d\r\n\r\n" % (8 * 1024 * 1024))
        started = time.monotonic()
        code, headers, body = read_response(s, bytearray())
        assert code == 413 and headers.get("connection") == "close"
        assert s.recv(1) == b"" and time.monotonic() - started < 3


@pytest.mark.parametrize("raw,code", [
    (b"POST /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", 431),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(101)) + b"\r\n", 431),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 70000, 431),  # head over 64 KiB, unfinished
    (b"NOT A REQUEST\r\n\r\n", 400),
    (b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello", 400),
    # Content-Length beside Transfer-Encoding (request smuggling), a name with a space, a NUL in a value,
    # no Host in HTTP/1.1 (RFC 9112 3.2), a negative length
    (b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Name: 1\r\n\r\n", 400),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: a\x00b\r\n\r\n", 400),
    (b"POST /mutate HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}", 400),
    (b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400),
    # two Host fields, bare LF line ends, a target urlsplit cannot read, CONNECT, an HTTP version other than 1.x
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", 400),
    (b"GET /healthz HTTP/1.1\nHost: x\n\n", 400),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\n\n", 400),
    (b"GET http://[::1/ HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"CONNECT x:443 HTTP/1.1\r\nHost: x:443\r\n\r\n", 400),
    (b"GET /healthz HTTP/2.0\r\nHost: x\r\n\r\n", 505),
    # Transfer-Encoding of any kind, whatever follows: 411 (the API server sends a Content-Length)
    (b"POST /mutate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 411),
    (b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
     + b"%x\r\n" % len(BODY) + BODY + b"\r\n0\r\n\r\n", 411),
    (b"POST /mutate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 411),
    (b"POST /mutate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", 411),
    (b"POST /mutate HTTP/1.1\r\nHost: x\r\nConnection: upgrade\r\nUpgrade: x\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n", 411),
])
def test_request_limits_and_bad_framing(ops, raw, code):
    """gunicorn's limit_request_line/fields/field_size hold (414, 431), a head over 64 KiB is 431, bad
    framing is 400 and a body sent with Transfer-Encoding 411; each answered in JSON, then the connection
    is closed."""
    base, ca = ops.url, ops.ca
    with tls_socket(base, ca) as s:
        s.sendall(raw)
        buffered = bytearray()
        got, headers, body = read_response(s, buffered)
        assert got == code and json.loads(body)["code"] == code
        assert headers.get("connection") == "close"
        assert s.recv(1) == b""


def test_requests_split_anywhere_and_pipelined_are_read_exactly(ops):
    """Where one request ends and the next begins is exact whatever the reads: two reviews and a GET,
    with blank lines before one (RFC 9112 2.2), sent a few bytes per TLS record, each answered in order."""
    base, ca = ops.url, ops.ca
    stream = request_bytes() + b"\r\n" + request_bytes(b"/validate") + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    with tls_socket(base, ca) as s:
        for i in range(0, len(stream), 7):
            s.sendall(stream[i:i + 7])
        buffered = bytearray()
        answers = [read_response(s, buffered) for _ in range(3)]
    assert [a[0] for a in answers] == [200, 200, 200]
    assert json.loads(answers[0][2])["response"]["allowed"] is True
    assert json.loads(answers[1][2])["response"]["allowed"] is False
    assert json.loads(answers[2][2]) == {"status": "ok"}


def test_an_upgrade_is_not_honoured(ops):
    """A request asking for another protocol is answered in HTTP/1.1, then the connection closed: what
    follows it is not read."""
    base, ca = ops.url, ops.ca
    with tls_socket(base, ca) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: upgrade\r\nUpgrade: h2c\r\n\r\n"
                  + request_bytes())
        code, headers, body = read_response(s, bytearray())
        assert code == 200 and json.loads(body) == {"status": "ok"}, body
        assert headers.get("connection") == "close" and s.recv(1) == b""


def test_junk_is_refused_at_once_not_at_the_deadline(ops):
    """A TLS ClientHello sent to the plain metrics listener is not an HTTP request: 400 at its first
    byte, not a wait for the request deadline or 64 KiB."""
    port = int(ops.metrics_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        started = time.monotonic()
        s.sendall(b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03")
        code, headers, body = read_response(s, bytearray())
        assert code == 400 and s.recv(1) == b"" and time.monotonic() - started < 3


def test_a_body_over_the_limit_is_413_and_the_connection_stays_usable(ops):
    """The app answers 413 as soon as the limit is passed; the rest is read and dropped, so the client
    reads the answer and the connection serves the next request."""
    base, ca = ops.url, ops.ca
    big = b"x" * (8 * 1024 * 1024)
    with tls_socket(base, ca) as s:
        s.sendall(request_bytes(body=big) + request_bytes())
        buffered = bytearray()
        first = read_response(s, buffered)
        second = read_response(s, buffered)
    assert first[0] == 413 and json.loads(first[2])["code"] == 413
    assert second[0] == 200 and json.loads(second[2])["response"]["allowed"] is True


# ---- the metrics port ----

def test_metrics_on_a_port_of_their_own(ops):
    base, ca, metrics_url = ops.url, ops.ca, ops.metrics_url
    ops.post("/mutate", BODY)
    # Counted just after the answer is written: polled.
    counted = 'dispatch_admission_reviews_total{endpoint="mutate",outcome="allowed",sentinel=""}'
    got = eventually(lambda: (lambda answer: counted in answer[1] and answer)(get(metrics_url + "/metrics")),
                     f"{counted} in /metrics", 15)
    assert got[0] == 200
    # The probes' paths are there too (the kubelet has no client certificate for the TLS port)...
    assert get(metrics_url + "/healthz") == (200, '{"status":"ok"}')
    assert get(metrics_url + "/readyz")[0] == 200
    # ... and nothing else: no review path in plain HTTP (a review's body is refused at its head, and the
    # path is not there), and no metrics on the TLS port.
    for path in ("/mutate", "/validate", "/runtimes"):
        req = urllib.request.Request(metrics_url + path, data=BODY, headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == 413
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(metrics_url + path, method="POST"), timeout=5)
        assert e.value.code == 404
    assert requests.get(base + "/metrics", verify=ca, timeout=5).status_code == 404


def test_certificate_and_runtime_metrics(ops):
    ca = ops.ca
    text = get(ops.metrics_url + "/metrics")[1]
    cert_dir = ca.rsplit("/", 1)[0]
    serving = x509.load_pem_x509_certificate(open(f"{cert_dir}/tls.crt", "rb").read())
    authority = x509.load_pem_x509_certificate(open(ca, "rb").read())

    expiry = metric_series(text, "dispatch_admission_certificate_not_after_seconds")
    assert sorted((labels["certificate"], value) for labels, value in expiry) == [
        ("ca", authority.not_valid_after_utc.timestamp()), ("serving", serving.not_valid_after_utc.timestamp())]
    # One series per runtime (not one per worker): the stock runtimes, each judged by the rules.
    ready = [(tuple(sorted(labels.items())), value)
             for labels, value in metric_series(text, "dispatch_admission_runtime_ready")]
    assert len(ready) == len({k for k, _ in ready})
    assert ((("kind", "ClusterTrainingRuntime"), ("name", "torch-distributed"), ("namespace", "")), 1.0) in ready
    unfit = {labels["kind"]: value for labels, value in metric_series(text, "dispatch_admission_runtimes_cannot_carry")}
    assert unfit["ClusterTrainingRuntime"] == sum(1 for labels, v in ready if v == 0.0
                                                  and dict(labels)["kind"] == "ClusterTrainingRuntime")
    synced = {labels["kind"]: value for labels, value in metric_series(text, "dispatch_admission_runtime_cache_synced")}
    assert synced == {"ClusterTrainingRuntime": 1.0, "TrainingRuntime": 1.0}


# ---- readiness: a certificate that cannot be served is not ready ----

def _expired_pair(cert_dir):
    certs.write_dev_pair(cert_dir, ["localhost", "127.0.0.1"])
    ca_key = serialization.load_pem_private_key((cert_dir / "ca.key").read_bytes(), None)
    ca_cert = x509.load_pem_x509_certificate((cert_dir / "ca.crt").read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(ca_cert.subject).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=2)).not_valid_after(now - dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    certs.write_file(cert_dir / "tls.key", certs.pem_key(key), True)
    certs.write_file(cert_dir / "tls.crt", certs.pem_cert(cert), False)


def test_readyz_fails_while_the_certificate_is_expired(serve, tmp_path):
    cert_dir = tmp_path / "certs"
    _expired_pair(cert_dir)
    # waited for on its plain-HTTP port: the TLS port's certificate does not verify
    hook = serve(cert_dir=cert_dir, metrics=True, ready_on_metrics=True, ready_path="/healthz")
    url = hook.metrics_url + "/readyz"
    code, body = get(url)
    assert code == 503 and json.loads(body)["checks"] == {"settings": True, "certificate": False, "runtimes": True}
    rotate_serving(cert_dir, ["localhost", "127.0.0.1"])
    eventually(lambda: get(url)[0] == 200, "a renewed certificate makes it ready again", 15, 0.2)


# ---- warn mode and /runtimes ----

def test_warn_mode_counts_and_logs_what_enforce_would_deny(serve):
    hook = serve("--enforcement", "warn", metrics=True)
    doc = review(trainjob(env=[{"name": "DISPATCH_X", "value": "1"}]), uid="warned-1")
    got = hook.review(doc, "validate")
    assert got["allowed"] is True and any(w.startswith("would deny: ") for w in got["warnings"])
    # Counted once the answer is written (the accounting follows the response): polled, not read once.
    counted = eventually(lambda: metric_series(hook.metrics(), "dispatch_admission_would_deny_total"),
                         "dispatch_admission_would_deny_total counted", 15)
    assert all(value == 1 for _, value in counted)
    line = eventually(lambda: next((json.loads(ln) for ln in hook.log.read_text().splitlines()
                                    if '"warned-1"' in ln), None), "the review logged", 15)
    assert line["allowed"] is True
    assert sorted((w["sentinel"], w["rule"]) for w in line["would_deny"]) == sorted(
        (labels["sentinel"], labels["rule"]) for labels, _ in counted)


def test_runtimes_path_warns_and_allows(ops):
    base, ca = ops.url, ops.ca
    broken = runtime("no-node", jobs={"trainer": {"containers": [{"name": "main"}]}})
    doc = review(broken, resource="clustertrainingruntimes")
    doc["request"]["kind"] = {"group": "trainer.kubeflow.org", "version": "v1alpha1", "kind": "ClusterTrainingRuntime"}
    got = requests.post(base + "/runtimes", json=doc, verify=ca, timeout=10).json()["response"]
    assert got["allowed"] is True and got["warnings"] and got["warnings"][0].startswith("R3: ")
    good = requests.post(base + "/runtimes", json=review(runtime("fine"), resource="clustertrainingruntimes"),
                         verify=ca, timeout=10).json()["response"]
    assert good["allowed"] is True and "warnings" not in good


# ---- gunicorn's own configuration ----

def _started_line(log) -> dict:
    return next(json.loads(ln) for ln in log.read_text().splitlines() if '"msg": "starting"' in ln)


def _workers(pid: int) -> int:
    return len(subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split())


def test_gunicorn_configuration_file_and_environment(serve, tmp_path):
    """Precedence: serve's flags, then GUNICORN_CMD_ARGS, then -c FILE, then the webhook's defaults; the
    worker class and TLS settings stay serve's."""
    config = tmp_path / "gunicorn.conf.py"
    config.write_text("threads = 3\nkeepalive = 120\nworkers = 3\nworker_class = 'sync'\n")
    hook = serve("-c", str(config), "--workers", "1", env={"GUNICORN_CMD_ARGS": "--keep-alive 90 --workers 4"})
    started = _started_line(hook.log)
    assert (started["threads"], started["keepalive"], started["workers"]) == (3, 90, 1)
    eventually(lambda: _workers(hook.process.pid) == 1, "one worker", 15, 0.2)
    assert hook.logged("Using worker: webhook.serving.worker.Worker")
    assert hook.logged("worker_class='sync' ignored")
    assert hook.review(json.loads(BODY))["allowed"] is True
    hook = serve(env={"GUNICORN_CMD_ARGS": f"--config {config} --threads 2"})
    started = _started_line(hook.log)
    assert (started["threads"], started["keepalive"], started["workers"]) == (2, 120, 3)


def test_read_timeout_is_configurable(serve):
    hook = serve("--read-timeout", "1")
    with tls_socket(hook.url, hook.ca) as s:
        s.sendall(b"POST /mutate HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        s.settimeout(10)
        assert s.recv(1) == b""
        assert 0.9 <= time.monotonic() - started < 5


def test_the_directories_serve_made_are_gone_when_it_stops(serve, tmp_path):
    """Without PROMETHEUS_MULTIPROC_DIR and --runtime-store, serve makes temporary directories for its metrics
    files and its runtime store (webhook.process.temporary); both are removed when serve stops (each test
    server had left its metrics directory behind in /tmp)."""
    from tests.process import stop, unanswered_kubeconfig

    temp = tmp_path / "tmp"
    temp.mkdir()
    kubeconfig = unanswered_kubeconfig(tmp_path / "kubeconfig")  # the store is made all the same
    hook = serve(kubeconfig=kubeconfig, ready_path="/healthz",
                 env={"TMPDIR": str(temp), "PROMETHEUS_MULTIPROC_DIR": ""})
    made = sorted(temp.glob("dispatch-admission-*"))
    assert [p.name.rsplit("-", 1)[0] for p in made] == ["dispatch-admission-metrics", "dispatch-admission-runtimes"]
    assert list(made[0].glob("*.db")), made
    stop(hook.process)
    assert hook.process.returncode == 0, hook.log.read_text()[-2000:]
    assert [p for p in made if p.exists()] == [], "serve left a directory it made"
