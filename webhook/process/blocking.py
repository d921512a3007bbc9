"""The "may I block" rule: a thread answering on the worker's event loop must not wait on the network.

The HTTP layer (webhook.serving.cycle) marks the inline answer with `NoBlocking`; the readers of the API server ask
`blocking_allowed()`: the runtime cache (webhook.kube.cluster) answers a miss as pending (the core then waits for
the live read on a thread: webhook.core.admission.Reviewing), the settings (webhook.kube.live_settings) raise
`WouldBlock` instead of reading. A module of its own so the HTTP layer needs no Kubernetes adapter to say so.
"""

from __future__ import annotations

import threading
from types import TracebackType

_local = threading.local()


class WouldBlock(Exception):
    """A read would have to block (wait on the API server) where its caller forbade it (`NoBlocking`)."""


def blocking_allowed() -> bool:
    """False on a thread that must not wait on the network (the worker's event loop answering inline)."""
    return not getattr(_local, "no_blocking", False)


class NoBlocking:
    """`with NoBlocking():` a read that would wait on the API server is not made (pending, or WouldBlock)."""

    def __enter__(self) -> None:
        _local.no_blocking = True

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        _local.no_blocking = False
