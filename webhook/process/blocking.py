"""The "may I block" rule: a thread answering on the worker's event loop must not wait on the network.

The HTTP layer (webhook.serving.connection) marks the inline answer with `NoBlocking`; the readers of the API server
(webhook.kube.cluster, webhook.kube.live_settings) ask `blocking_allowed()` and raise WouldBlock instead of reading. A
module of its own so the HTTP layer needs no Kubernetes adapter to say so.
"""

from __future__ import annotations

import threading
from types import TracebackType

_local = threading.local()


def blocking_allowed() -> bool:
    """False on a thread that must not wait on the network (the worker's event loop answering inline)."""
    return not getattr(_local, "no_blocking", False)


class NoBlocking:
    """`with NoBlocking():` a cache miss raises WouldBlock instead of reading the API server."""

    def __enter__(self) -> None:
        _local.no_blocking = True

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        _local.no_blocking = False
