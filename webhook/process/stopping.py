"""How the long-running commands that are not servers (the runtime keeper, the certificate controller) stop.

As a container's PID 1 a process receives no signal it has no handler for (pid_namespaces(7)): without one,
SIGTERM is dropped and the kubelet waits out the pod's grace period before it kills.
"""

from __future__ import annotations

import signal
import threading


def stopped_by_signals() -> threading.Event:
    """An Event set by SIGTERM or SIGINT, for a loop to wait on (`stopped.wait(seconds)`) and end. Main thread only."""
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    return stopped
