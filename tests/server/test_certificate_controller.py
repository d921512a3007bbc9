"""The long-running commands of the chart's pods that are not servers, as their containers run them: PID 1 of a PID
namespace of their own, where the kernel drops a signal the process has no handler for (pid_namespaces(7)). The
certificate controller had none: it held every uninstall, and every rollout of its Recreate Deployment, for the
pod's whole grace period (30 s, seen on the node on 2026-12-05). Both now stop through
webhook.process.stopping."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, eventually
from tests.process import unanswered_kubeconfig


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(p) for p in (task / "children").read_text().split()]
    return found


COMMANDS = {
    # its first sync fails (nobody answers at that API server); it then waits 300 s for the next
    "certificates": (["--namespace", "dispatch-system", "--tls-secret", "tls", "--ca-secret", "ca",
                      "--tls-service", "dispatch-admission", "--webhook-configuration", "dispatch-admission",
                      "--every", "300"], b"certificate sync failed"),
    # it keeps trying to list; the store is made and its state written first
    "keep": (["--runtime-store", "{tmp}/store"], b"runtime keeper started"),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_as_pid_1_of_its_namespace_it_ends_on_sigterm_at_once(command, tmp_path):
    args, started = COMMANDS[command]
    log = tmp_path / f"{command}.log"
    with open(log, "wb") as out:
        # unshare (util-linux) makes the PID namespace (root: the e2e suites need it too); the command is its
        # PID 1, as in a container without an init process.
        proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-m", "webhook", command,
             "--kubeconfig", unanswered_kubeconfig(tmp_path / "kubeconfig"),
             *(a.format(tmp=tmp_path) for a in args)],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        [pid] = eventually(lambda: children(proc.pid), f"{command} started in its PID namespace")
        [ns_pids] = [line.split()[1:] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                     if line.startswith("NSpid:")]
        assert ns_pids[-1] == "1", f"not PID 1 of its namespace: {ns_pids}"
        eventually(lambda: started in log.read_bytes(), f"{command} running", timeout=60,
                   detail=lambda: log.read_text()[-2000:])
        sent = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        assert proc.wait(10) == 0, log.read_text()[-2000:]
        assert time.monotonic() - sent < 5, log.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
