"""The gunicorn Application that runs the webhook: its worker class, settings and TLS
(webhook.serving.gunicorn_config)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

from .listener import DEFAULT_MAX_BODY, DEFAULT_READ_TIMEOUT

log = logging.getLogger("dispatch_admission")


@dataclass(frozen=True)
class Listening:
    """Where and how the webhook listens: what gunicorn and its worker are given (`serve`'s flags)."""

    certfile: str
    keyfile: str
    bind: str | None = None  # None: gunicorn's configuration, else 0.0.0.0:8443
    workers: int | None = None
    config_file: str | None = None  # a gunicorn configuration file, as `gunicorn -c` reads
    metrics_bind: str | None = None  # a port of its own for /metrics (and the probes)
    metrics_address: tuple[str, int] | None = None  # metrics_bind as (host, port)
    read_timeout: float = DEFAULT_READ_TIMEOUT
    max_body: int = DEFAULT_MAX_BODY
    max_body_in_flight: int = 0  # 0: webhook.serving.room.BUDGET (64 MiB)


def gunicorn_application(load: Callable[[], Callable], listening: Listening, *, tls,
                         ops: Callable[[Callable], Callable] | None = None,
                         metrics_tls: Callable[[], object] | None = None):
    """A gunicorn Application serving `load()` with the webhook's worker, settings and TLS (`tls`: a
    certs.ReloadingContext). `ops` makes the metrics listener's app from the main one; `metrics_tls`: that
    listener's TLS context, where it speaks HTTPS. bench/baseline.py serves its app with this too, so the two
    are compared on equal terms."""
    from gunicorn.app.base import Application

    from . import gunicorn_config
    from .listener import WorkerOptions

    on = listening

    class Server(Application):
        worker_options = WorkerOptions(handshake_timeout=on.read_timeout, request_timeout=on.read_timeout,
                                       max_body=on.max_body, max_body_in_flight=on.max_body_in_flight,
                                       metrics_address=on.metrics_address, metrics_tls=metrics_tls)

        def init(self, parser, opts, args):  # not called: load_config is ours
            return None

        def load_config(self):
            gunicorn_config.configure(self, config_file=on.config_file, certfile=on.certfile, keyfile=on.keyfile,
                                      tls=tls, explicit={"bind": [on.bind] if on.bind else None,
                                                         "workers": on.workers},
                                      warn=lambda text: log.warning(json.dumps({"msg": text})))
            if on.metrics_bind:
                self.cfg.set("bind", list(self.cfg.bind) + [on.metrics_bind])

        def load(self):
            return load()

        def metrics_app(self):
            """The WSGI app of the metrics listener, made in the worker after the main one."""
            return ops(self.wsgi()) if ops else None

    return Server()
