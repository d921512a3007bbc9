"""The real server process (gunicorn, TLS) on a loopback port, through a verifying HTTPS client."""

import base64
import json
import socket
import ssl
import subprocess
import sys
import threading
import time

import pytest
import requests

from tests.helpers import ROOT, eventually, review, trainjob
from tests.process import RUNTIME_ARGS, SETTINGS, unanswered_kubeconfig
from tests.tls import handshake, rotate_serving
from webhook import certs


@pytest.fixture(scope="module")
def server(serve_module):
    return serve_module("--max-body", str(1024 * 1024))


def cli_review(doc, validate=False):
    args = [sys.executable, "-m", "webhook", "review", "--settings", str(SETTINGS), *RUNTIME_ARGS]
    if validate:
        args.append("--validate")
    out = subprocess.run(args, input=json.dumps(doc), capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout)


def without_time(review_doc):
    """The answer with the entry's admission time blanked, so two clocks compare equal."""
    resp = review_doc["response"]
    if "patch" in resp:
        ops = json.loads(base64.b64decode(resp["patch"]))
        for op in ops:
            for entry in op.get("value", []) if isinstance(op.get("value"), list) else [op.get("value")]:
                if isinstance(entry, dict):
                    entry.pop("time", None)
        resp = {**resp, "patch": ops}
    return {**review_doc, "response": resp}


CASES = [
    trainjob(),
    trainjob(runtime_name="mpi-launcher"),
    trainjob(runtime_name="missing"),
    trainjob(env=[{"name": "DISPATCH_X", "value": "1"}]),
]


@pytest.mark.parametrize("job", CASES)
@pytest.mark.parametrize("endpoint", ["mutate", "validate"])
def test_answers_match_the_cli(server, job, endpoint):
    doc = review(job)
    got = server.post(f"/{endpoint}", doc)
    assert got.status_code == 200 and got.headers["Content-Type"] == "application/json"
    assert without_time(got.json()) == without_time(cli_review(doc, validate=endpoint == "validate"))


def test_denial_status_shape(server):
    got = server.review(review(trainjob(runtime_name="missing"), uid="u-404"))
    assert got["uid"] == "u-404" and got["allowed"] is False
    assert got["status"]["code"] == 404 and got["status"]["reason"] == "NotFound"


@pytest.mark.parametrize("body,content_type,code", [
    (b"{}", "text/plain", 415),
    (b"{}", "", 415),
    (b"not json", "application/json", 400),
    (b"[" * 50000 + b"]" * 50000, "application/json", 400),
    (b"[]", "application/json", 400),
    (b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {}}', "application/json", 400),
    (b'{"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": {"uid": "x"}}',
     "application/json", 400),
    (b"\xff\xfe", "application/json", 400),
    (b"x" * (1024 * 1024 + 1), "application/json", 413),
])
def test_request_hygiene(server, body, content_type, code):
    got = server.post("/mutate", body, content_type=content_type)
    assert got.status_code == code
    assert got.headers["Content-Type"] == "application/json" and got.json()["code"] == code


def test_wrong_method_and_path(server):
    base, ca = server.url, server.ca
    assert requests.get(base + "/mutate", verify=ca, timeout=5).status_code == 405
    assert requests.get(base + "/nope", verify=ca, timeout=5).status_code == 404


def test_health_ready_metrics(server):
    base, ca = server.url, server.ca
    assert requests.get(base + "/healthz", verify=ca, timeout=5).json() == {"status": "ok"}
    ready = requests.get(base + "/readyz", verify=ca, timeout=5).json()
    assert ready["ready"] is True and all(ready["checks"].values())
    # Its own 415 (under xdist this module's tests are spread over workers: test_request_hygiene's may be elsewhere).
    assert server.post("/mutate", b"{}", content_type="text/plain").status_code == 415
    server.post("/validate", review(trainjob()))
    # Counted just after the answer is written: polled.
    counted = 'dispatch_admission_reviews_total{endpoint="validate",outcome="denied",sentinel="ErrInvalid"}'
    text = eventually(lambda: (lambda t: counted in t and t)(server.metrics()), f"{counted} in /metrics")
    assert "dispatch_admission_review_seconds_bucket" in text
    assert 'dispatch_admission_bad_requests_total{code="415"}' in text


def test_one_log_line_per_review(server):
    server.post("/mutate", review(trainjob(), uid="log-me-1"))
    eventually(lambda: server.logged('"log-me-1"'), "the review was not logged")
    time.sleep(0.3)  # and no second line comes
    lines = [json.loads(ln) for ln in server.log.read_text().splitlines() if '"log-me-1"' in ln]
    assert len(lines) == 1
    assert {"uid", "namespace", "name", "operation", "allowed", "sentinel", "ms"} <= set(lines[0])


def test_plain_http_is_refused(server):
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.post(server.url.replace("https", "http") + "/mutate", data="{}", timeout=5)


def _handshake(server, maximum):
    return handshake(server.url, server.ca, maximum, "DEFAULT:@SECLEVEL=0", minimum=ssl.TLSVersion.MINIMUM_SUPPORTED)


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion.TLSv1_1 is deprecated:DeprecationWarning")
def test_tls_1_1_refused_1_2_accepted(server):
    with pytest.raises((ssl.SSLError, ConnectionResetError)):
        _handshake(server, ssl.TLSVersion.TLSv1_1)
    assert _handshake(server, ssl.TLSVersion.TLSv1_2) == "TLSv1.2"


def test_invalid_settings_stop_the_server(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"publish": {"image": "publish:v1"}}')
    certs.write_dev_pair(tmp_path, ["localhost"])
    got = subprocess.run([sys.executable, "-m", "webhook", "serve", "--settings", str(bad), "--cert-dir", str(tmp_path),
                          "--bind", "127.0.0.1:0", *RUNTIME_ARGS], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert got.returncode != 0 and "ErrInvalid: publish.image" in got.stderr


def test_missing_certificate_stops_the_server(tmp_path):
    got = subprocess.run([sys.executable, "-m", "webhook", "serve", "--settings", str(SETTINGS), "--cert-dir",
                          str(tmp_path), "--bind", "127.0.0.1:0", *RUNTIME_ARGS], capture_output=True, text=True,
                         timeout=30, cwd=ROOT)
    assert got.returncode != 0 and "certificate" in got.stderr


def _served_serial(base, ca):
    port = int(base.rsplit(":", 1)[1])
    ctx = ssl.create_default_context(cafile=ca)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            from cryptography import x509
            return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number


def test_certificate_rotation_without_failed_requests(serve, tmp_path):
    cert_dir = tmp_path / "certs"
    certs.write_dev_pair(cert_dir, ["localhost", "127.0.0.1"])
    hook = serve(cert_dir=cert_dir)
    base, ca = hook.url, hook.ca
    before = _served_serial(base, ca)
    failures, sent = [], [0]
    stop = threading.Event()
    body = json.dumps(review(trainjob()))

    def load():
        s = requests.Session()  # keep-alive, and new connections as the server recycles them
        while not stop.is_set():
            try:
                r = s.post(base + "/mutate", data=body, headers={"Content-Type": "application/json"},
                           verify=ca, timeout=10)
                if r.status_code != 200:
                    failures.append(r.status_code)
            except Exception as e:  # any failed request fails the test
                failures.append(repr(e))
            sent[0] += 1
            s.close() if sent[0] % 5 == 0 else None

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(1)
    for _ in range(3):
        rotate_serving(cert_dir, ["localhost", "127.0.0.1"])
        time.sleep(1.5)  # rotations spaced under the load: not a wait
    try:
        eventually(lambda: _served_serial(base, ca) != before, "the renewed certificate served", 10, 0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(15)
    assert failures == [] and sent[0] > 20


def test_not_ready_and_unavailable_until_the_runtime_cache_syncs(serve, tmp_path):
    """With the API server unreachable the watch never completes its first list: /readyz is 503 and a
    review answers ErrUnavailable (503), never ErrNotFound and never an allowed admission."""
    s = serve(kubeconfig=unanswered_kubeconfig(tmp_path / "kubeconfig"), ready_path="/healthz")
    ready = requests.get(s.url + "/readyz", verify=s.ca, timeout=5)
    assert ready.status_code == 503 and ready.json()["checks"]["runtimes"] is False
    got = s.review(review(trainjob()))
    assert got["allowed"] is False and got["status"]["code"] == 503
    assert got["status"]["message"].startswith("ErrUnavailable: spec.runtimeRef: ")
    # The keeper, a process of its own forked beside the workers, writes these: polled, not read once.
    synced = ('dispatch_admission_runtime_cache_synced{kind="ClusterTrainingRuntime"} 0.0',
              'dispatch_admission_runtime_cache_synced{kind="TrainingRuntime"} 0.0')
    eventually(lambda: all(line in s.metrics() for line in synced), f"{synced} in /metrics", 15)


def test_metrics_directory_made_and_cleaned_at_start(serve, tmp_path):
    """The chart points PROMETHEUS_MULTIPROC_DIR at a path in an emptyDir: made if absent, stale files dropped."""
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    stale = metrics_dir / "counter_99999.db"
    stale.write_bytes(b"stale")
    s = serve(env={"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)})
    assert not stale.exists()
    s.post("/mutate", review(trainjob()))
    # Counted in the review's close(), just after its answer is written: polled, not read once
    eventually(lambda: "dispatch_admission_reviews_total" in s.metrics(), "the review was never counted", 15)
    fresh = tmp_path / "not" / "yet" / "there"
    s = serve(env={"PROMETHEUS_MULTIPROC_DIR": str(fresh)})
    s.post("/mutate", review(trainjob()))
    assert fresh.is_dir() and any(fresh.glob("*.db"))
