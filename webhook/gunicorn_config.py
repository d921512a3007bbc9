"""Gunicorn settings for a webhook: the API server waits at most `timeoutSeconds` (10 s by default)
and keeps connections open, so threads with keep-alive, never a long-blocking sync worker.
"""

from __future__ import annotations

import os


def settings(bind: str, workers: int, certfile: str, keyfile: str, tls) -> dict:
    def ssl_context(conf, default_factory):
        return tls.get()  # cached; rebuilt when the certificate files change

    def child_exit(server, worker):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)

    return {
        "bind": [bind],
        "workers": workers,            # one per core on the 2-core reference machine
        "worker_class": "gthread",     # keep-alive and concurrent requests per worker
        "threads": int(os.environ.get("DISPATCH_ADMISSION_THREADS", "4")),
        "worker_connections": 1000,
        "keepalive": 75,               # longer than Go's idle-connection reuse so the API server reuses them
        "timeout": 30,                 # a worker silent this long is killed and replaced
        "graceful_timeout": 10,
        "backlog": 2048,
        "certfile": certfile,
        "keyfile": keyfile,
        "ssl_context": ssl_context,
        "do_handshake_on_connect": False,
        "accesslog": None,             # one structured line per review is logged by the app instead
        "errorlog": "-",
        "loglevel": "info",
        "child_exit": child_exit,
        "limit_request_line": 8190,
        "limit_request_fields": 100,
        "limit_request_field_size": 8190,
        "proc_name": "dispatch-admission",
        "control_socket_disable": True,  # not needed, and the root filesystem is read-only in the pod
    }
