"""Gunicorn settings for the webhook, and how they combine with gunicorn's own configuration.

The API server waits at most `timeoutSeconds` (10 s by default) for an answer and keeps its connections
open, so: the webhook's worker (webhook.serving.worker.Worker: TLS and request reads on an event loop with
deadlines, whole requests to a few threads), keep-alive longer than Go's idle-connection reuse.

Precedence, highest first (gunicorn's own order):

1. `serve` flags given on the command line: `--bind`, `--workers` (and `--metrics-bind`, which adds a
   listener);
2. `GUNICORN_CMD_ARGS` (gunicorn's command-line syntax, e.g. `--threads 8 --keep-alive 120`; it may
   name a config file with `--config`, read at step 3 when `serve -c` is not given);
3. the config file given with `serve -c FILE` (gunicorn's Python format: `threads = 8`);
4. the defaults below.

Set by `serve` whatever the above say (the webhook depends on them; a change is refused with a warning):
`worker_class`, `certfile`, `keyfile`, `ssl_context`. A `child_exit` hook of the user's is kept and
called after the webhook's own.
"""

from __future__ import annotations

import os
from collections.abc import Callable

WORKER_CLASS = "webhook.serving.worker.Worker"

DEFAULTS: dict = {
    "bind": ["0.0.0.0:8443"],
    "workers": 2,                  # one per core on the 2-core reference machine
    "threads": 4,                  # per worker, for the app only: whole requests, never a waiting client
    "worker_connections": 1000,    # per worker; at the limit the longest-idle keep-alive connection gives way
    "keepalive": 75,               # longer than Go's idle-connection reuse (90 s max idle; 30 s keep-alive probes)
    "timeout": 30,                 # a worker silent this long (or with a request stuck in the app) is replaced
    "graceful_timeout": 10,        # SIGTERM: finish what is in flight, close idle connections, exit
    "backlog": 2048,
    "accesslog": None,             # one structured line per review is logged by the app instead
    "errorlog": "-",
    "loglevel": "info",
    "limit_request_line": 8190,
    "limit_request_fields": 100,
    "limit_request_field_size": 8190,
    "proc_name": "dispatch-admission",
    "control_socket_disable": True,  # not needed, and the root filesystem is read-only in the pod
}

FIXED = ("worker_class", "certfile", "keyfile", "ssl_context")


def fixed(certfile: str, keyfile: str, tls) -> dict:
    """The settings serve always sets: our worker, and TLS from the reloading context."""

    def ssl_context(conf, default_factory):
        return tls.get()  # cached; rebuilt when the certificate files change

    return {"worker_class": WORKER_CLASS, "certfile": certfile, "keyfile": keyfile, "ssl_context": ssl_context}


def _mark_dead(user_hook: Callable | None):
    def child_exit(server, worker):
        from prometheus_client import multiprocess

        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # unset where no metrics are kept (bench/baseline.py)
            multiprocess.mark_process_dead(worker.pid)  # its live gauges leave the sums
        if user_hook is not None:
            user_hook(server, worker)

    return child_exit


def configure(app, *, config_file: str | None, explicit: dict, certfile: str, keyfile: str, tls,
              warn: Callable[[str], None]) -> None:
    """Fill `app.cfg` (a gunicorn Application's) in the order above."""
    cfg = app.cfg
    ours = fixed(certfile, keyfile, tls)
    for key, value in {**DEFAULTS, **ours}.items():
        cfg.set(key, value)
    parser = cfg.parser()
    env_args = parser.parse_args(cfg.get_cmd_args_from_env())
    default_child_exit = cfg.child_exit
    location = config_file or env_args.config
    if location:
        app.load_config_from_file(location)
    for key, value in vars(env_args).items():
        if value is None or key in ("args", "config"):
            continue
        cfg.set(key.lower(), value)
    for key, value in explicit.items():
        if value is not None:
            cfg.set(key, value)
    for key, value in ours.items():
        current = cfg.settings[key].value
        if current is not value and current != value:
            warn(f"gunicorn setting {key}={current!r} ignored: serve sets it"
                 + (" (the webhook's worker)" if key == "worker_class" else " (TLS from --cert-dir)"))
        cfg.set(key, value)
    user_exit = cfg.child_exit if cfg.child_exit is not default_child_exit else None
    cfg.set("child_exit", _mark_dead(user_exit))
