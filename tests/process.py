"""Start and stop real processes for tests: the webhook server, and anything else with a port."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free loopback port, never one this test session was given before: the kernel may hand the port it
    just released to the next bind, so two calls in a row could name one port for two listeners (a --bind
    and a --metrics-bind on the same port failed test_serve once in a fresh clone)."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no loopback port left that this session has not used")


def stop(proc: subprocess.Popen, timeout: float = 15) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def wait_https(url: str, cafile: str, proc: subprocess.Popen, log: Path, timeout: float = 30,
               want=(200,), client_cert: tuple[str, str] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            ctx = ssl.create_default_context(cafile=cafile)  # the CA may be written by the server itself
            if client_cert:
                ctx.load_cert_chain(*client_cert)
            with urllib.request.urlopen(url, context=ctx, timeout=2) as r:
                if r.status in want:
                    return
        except Exception:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout}s:\n{log.read_text()[-4000:]}")


@contextlib.contextmanager
def webhook_server(tmp: Path, *args: str, cert_dir: Path | None = None, env: dict | None = None,
                   ready_path: str = "/readyz", port: int | None = None, make_certs: bool = True,
                   client_cert: tuple[str, str] | None = None):
    """`dispatch-admission serve` on a free loopback port; yields (base URL, CA file, log path, process)."""
    from webhook import certs

    tmp.mkdir(parents=True, exist_ok=True)
    cert_dir = cert_dir or tmp / "certs"
    if make_certs and not (cert_dir / "tls.crt").exists():
        certs.write_dev_pair(cert_dir, ["localhost", "127.0.0.1"])
    port = port or free_port()
    log = tmp / f"webhook-{port}.log"
    cmd = [sys.executable, "-m", "webhook", "serve", "--bind", f"127.0.0.1:{port}", "--cert-dir", str(cert_dir), *args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True)
    try:
        base = f"https://127.0.0.1:{port}"
        wait_https(base + ready_path, str(cert_dir / "ca.crt"), proc, log, client_cert=client_cert)
        yield base, str(cert_dir / "ca.crt"), log, proc
    finally:
        stop(proc)


def eventually(check, what: str, timeout: float = 20, every: float = 0.1, detail=None):
    """`check()`'s first truthy value, polled every `every` seconds until `timeout`: the one waiter of the suites
    (for what a server writes a moment after it answers, or what a cluster converges to). On timeout the
    AssertionError names `what` and adds `detail()`, when given (what the cluster looks like)."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            more = f":\n{detail()}" if detail is not None else ""
            raise AssertionError(f"{what} (waited {timeout:.0f}s){more}")
        time.sleep(every)
