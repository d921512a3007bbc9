"""Start and stop real processes for tests: the webhook server (`webhook_server`, yielding a `Webhook`), and
anything else with a port (`running`)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import requests

from tests.helpers import EXAMPLES, ROOT, eventually, metric_total

SETTINGS = EXAMPLES / "settings" / "route1.json"
# The stock runtimes as files: a server that needs no API server.
RUNTIME_ARGS = [a for p in sorted((EXAMPLES / "runtimes").glob("*.yaml")) for a in ("--runtime", str(p))]


_HANDED_OUT: set[int] = set()

# Under pytest-xdist each worker takes its ports from a range of its own, below the kernel's ephemeral range
# (32768-60999: where bind-to-port-0 and outgoing connections take theirs) and below Kubernetes' NodePort range
# (30000-32767): two workers asking the kernel for a free port at once could both be told the same one, and
# both then bind it. A serial session asks the kernel, as before.
_WORKER_PORTS = range(20000, 30000)


def _worker_ports() -> range | None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1"... (set in each worker process)
    if not worker.startswith("gw"):
        return None
    index, count = int(worker[2:]), max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), 1)
    span = len(_WORKER_PORTS) // count
    start = _WORKER_PORTS.start + (index % count) * span
    return range(start, start + span)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def started_ready(what: str, check, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None,
                  every: float = 0.5):
    """eventually() for a process we started: `check()`'s first truthy value (an exception it raises counts as not
    yet), failing at once if `proc` exits, and reporting `log`'s tail and the last error on timeout."""
    last: list[Exception] = []

    def tail() -> str:
        return log.read_text(errors="replace")[-4000:] if log else ""

    def ready():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited {proc.returncode}:\n{tail()}")
        try:
            return check()
        except Exception as e:  # noqa: BLE001 - reported on timeout
            last[:] = [e]
            return None

    return eventually(ready, f"{what} ready", timeout, every=every, detail=lambda: f"({last}):\n{tail()}")


def free_port() -> int:
    """A free loopback port, never one this test session (this worker, under xdist) was given before: the kernel
    may hand the port it just released to the next bind, so two calls in a row could name one port for two
    listeners (a --bind and a --metrics-bind on the same port failed test_serve once in a fresh clone)."""
    ports = _worker_ports()
    if ports is not None:
        # From a random point of the worker's range: another session's worker of the same index (another
        # checkout's CI) is then unlikely to walk the same ports at the same time.
        offset = random.randrange(len(ports))
        for i in range(len(ports)):
            port = ports[(offset + i) % len(ports)]
            if port not in _HANDED_OUT and _bindable(port):
                _HANDED_OUT.add(port)
                return port
        raise RuntimeError(f"no port left in {ports} that this worker has not used")
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no loopback port left that this session has not used")


def unanswered_kubeconfig(path: Path) -> str:
    """A kubeconfig naming an API server nobody answers at (a free loopback port): the watch never lists."""
    import yaml

    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "nowhere",
        "clusters": [{"name": "nowhere", "cluster": {"server": f"https://127.0.0.1:{free_port()}",
                                                     "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "x"}}],
        "contexts": [{"name": "nowhere", "context": {"cluster": "nowhere", "user": "u"}}]}))
    return str(path)


def stop(proc: subprocess.Popen, timeout: float = 15) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def _answers(url: str, cafile: str | None, proc: subprocess.Popen, log: Path | None, want: Sequence[int],
             client_cert: tuple[str, str] | None) -> bool:
    if proc.poll() is not None:
        tail = log.read_text()[-4000:] if log and log.exists() else ""
        raise RuntimeError(f"process exited with {proc.returncode}:\n{tail}")
    try:
        ctx = None
        if url.startswith("https:"):
            ctx = ssl.create_default_context(cafile=cafile)  # the CA may be written by the server itself
            if client_cert:
                ctx.load_cert_chain(*client_cert)
        with urllib.request.urlopen(url, context=ctx, timeout=2) as r:
            return r.status in want
    except Exception:
        return False


def wait_https(url: str, cafile: str | None, proc: subprocess.Popen, log: Path | None, timeout: float = 30,
               want: Sequence[int] = (200,), client_cert: tuple[str, str] | None = None) -> None:
    """Until `url` answers one of `want` (plain HTTP for an http: URL); a process that exits fails at once."""
    try:
        eventually(lambda: _answers(url, cafile, proc, log, want, client_cert), f"{url} ready", timeout, 0.2)
    except AssertionError:
        tail = log.read_text()[-4000:] if log and log.exists() else ""
        raise RuntimeError(f"{url} not ready after {timeout}s:\n{tail}") from None


@contextlib.contextmanager
def running(cmd: Sequence[str], log: Path | None, ready_url: str, cafile: str | None = None, env: dict | None = None,
            stderr=None, client_cert: tuple[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """`cmd` in a session of its own, its output in `log` (or `stderr` when given: a pipe nobody reads), until
    `ready_url` answers 200; stopped on the way out."""
    out = open(log, "wb") if log else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(list(cmd), stdout=out, stderr=stderr if stderr is not None else subprocess.STDOUT,
                                cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                start_new_session=True)
    finally:
        if log:
            out.close()
    try:
        wait_https(ready_url, cafile, proc, log, client_cert=client_cert)
        yield proc
    finally:
        stop(proc)
        if proc.stderr:
            proc.stderr.close()


@dataclass
class Webhook:
    """A running `dispatch-admission serve`: its base URL, CA file, log and process, and its metrics port's URL
    when it has one."""

    url: str
    ca: str
    log: Path
    process: subprocess.Popen
    metrics_url: str | None = None

    def __iter__(self):  # (url, ca, log, process), for the suites that unpack it
        return iter((self.url, self.ca, self.log, self.process))

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def post(self, path: str, body, content_type: str = "application/json", **kw) -> requests.Response:
        """POST `body` (JSON-encoded unless bytes or text) to `path`, the server's certificate verified."""
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        kw.setdefault("timeout", 10)
        headers = {"Content-Type": content_type, **kw.pop("headers", {})}
        return requests.post(self.url + path, data=data, headers=headers, verify=self.ca, **kw)

    def review(self, doc: dict, endpoint: str = "mutate", **kw) -> dict:
        """The AdmissionReview response to `doc` at /`endpoint` (answered 200, or the test fails)."""
        got = self.post("/" + endpoint, doc, **kw)
        assert got.status_code == 200, got.text[:500]
        return got.json()["response"]

    def metrics(self) -> str:
        """/metrics, from the metrics port when it has one (plain HTTP unless --metrics-auth)."""
        if self.metrics_url:
            return requests.get(self.metrics_url + "/metrics", verify=self.ca, timeout=10).text
        return requests.get(self.url + "/metrics", verify=self.ca, timeout=10).text

    def metric(self, name: str, /, **labels: str) -> float:
        """The sum of the samples named `name` whose labels include `labels` (0 when there is none)."""
        return metric_total(self.metrics(), name, **labels)

    def logged(self, text: str) -> bool:
        return text in self.log.read_text()


@contextlib.contextmanager
def webhook_server(tmp: Path, *args: str, cert_dir: Path | None = None, env: dict | None = None,
                   ready_path: str = "/readyz", port: int | None = None, make_certs: bool = True,
                   client_cert: tuple[str, str] | None = None, metrics: bool = False,
                   ready_on_metrics: bool = False) -> Iterator[Webhook]:
    """`dispatch-admission serve *args` on a free loopback port, waited for at `ready_path`; `metrics`: with a
    metrics port of its own (`--metrics-bind`), probed there instead when `ready_on_metrics` (a TLS port whose
    certificate does not verify)."""
    from webhook import certs

    tmp.mkdir(parents=True, exist_ok=True)
    cert_dir = cert_dir or tmp / "certs"
    if make_certs and not (cert_dir / "tls.crt").exists():
        certs.write_dev_pair(cert_dir, ["localhost", "127.0.0.1"])
    port = port or free_port()
    log = tmp / f"webhook-{port}.log"
    cmd = [sys.executable, "-m", "webhook", "serve", "--bind", f"127.0.0.1:{port}", "--cert-dir", str(cert_dir), *args]
    metrics_url = None
    if metrics:
        metrics_port = free_port()
        cmd += ["--metrics-bind", f"127.0.0.1:{metrics_port}"]
        metrics_url = f"{'https' if '--metrics-auth' in args else 'http'}://127.0.0.1:{metrics_port}"
    base, ca = f"https://127.0.0.1:{port}", str(cert_dir / "ca.crt")
    ready = (metrics_url if ready_on_metrics and metrics_url else base) + ready_path
    with running(cmd, log, ready, ca, env, client_cert=client_cert) as proc:
        yield Webhook(base, ca, log, proc, metrics_url)


class Serve:
    """`serve(*args, settings=, kubeconfig=, **kw)`: a `webhook_server` with the route 1 example settings and,
    without a kubeconfig, the stock runtimes as files; each in a directory of its own, all stopped when the
    fixture's scope ends (tests/conftest.py: `serve`, `serve_module`)."""

    def __init__(self, stack: contextlib.ExitStack, tmp_path_factory):
        self._stack, self._tmp = stack, tmp_path_factory

    def __call__(self, *args: str, settings: Path | str = SETTINGS, kubeconfig: str | None = None,
                 **kw) -> Webhook:
        source = ["--kubeconfig", str(kubeconfig)] if kubeconfig else RUNTIME_ARGS
        return self._stack.enter_context(webhook_server(self._tmp.mktemp("serve"), "--settings", str(settings),
                                                        *source, *args, **kw))
