"""`dispatch-admission certificates`, the chart's certificate controller, as its container runs it: PID 1 of a PID
namespace of its own, where the kernel drops a signal the process has no handler for (pid_namespaces(7)). A
controller that ignored SIGTERM there held every uninstall, and every rollout of its Recreate Deployment, for the
pod's whole grace period (30 s, seen on the node on 2026-12-05)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import ROOT, eventually
from tests.process import unanswered_kubeconfig


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(p) for p in (task / "children").read_text().split()]
    return found


def test_as_pid_1_of_its_namespace_it_ends_on_sigterm_without_waiting_for_its_next_sync(tmp_path):
    log = tmp_path / "certificates.log"
    with open(log, "wb") as out:
        # unshare (util-linux) makes the PID namespace (root: the e2e suites need it too); the controller is its
        # PID 1, as in a container without an init process.
        proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-m", "webhook", "certificates",
             "--kubeconfig", unanswered_kubeconfig(tmp_path / "kubeconfig"), "--namespace", "dispatch-system",
             "--tls-secret", "tls", "--ca-secret", "ca", "--tls-service", "dispatch-admission",
             "--webhook-configuration", "dispatch-admission", "--every", "300"],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        [controller] = eventually(lambda: children(proc.pid), "the controller started in its PID namespace")
        [ns_pids] = [line.split()[1:] for line in Path(f"/proc/{controller}/status").read_text().splitlines()
                     if line.startswith("NSpid:")]
        assert ns_pids[-1] == "1", f"not PID 1 of its namespace: {ns_pids}"
        # Its first sync failed (nobody answers at that API server): it now waits 300 s for the next.
        eventually(lambda: b"certificate sync failed" in log.read_bytes(), "the first sync tried", timeout=60,
                   detail=lambda: log.read_text()[-2000:])
        sent = time.monotonic()
        os.kill(controller, signal.SIGTERM)
        assert proc.wait(10) == 0, log.read_text()[-2000:]
        assert time.monotonic() - sent < 5
        assert "certificate controller stopped" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
