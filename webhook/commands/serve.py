"""`dispatch-admission serve` (SPEC 7): the webhook app under gunicorn over TLS.

The CLI builds a `ServeConfig` once from the flags; `run` serves it. Settings are parsed once, in the gunicorn
master, before any worker starts: invalid settings stop the server with the ErrInvalid message. Each worker
builds its own app (and reads the pod's runtime cache) after fork, and follows the settings from then on
(SPEC 2.1, webhook.kube.live_settings): a good edit is taken without a restart, a bad one is logged and the
last good settings stay in use.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import certs
from ..core.admission import PREVIOUS_SETTINGS_GRACE, Enforcement
from ..core.errors import Denied, ErrInvalid, Reason
from ..core.runtimes import KINDS, NAMESPACE_SHARE, RuntimeSource
from ..core.settings import EXAMPLE, Settings, parse
from ..process import heap, metrics
from ..process.temporary import remove_at_exit
from ..serving.application import Listening, gunicorn_application
from ..serving.listener import DEFAULT_MAX_BODY, DEFAULT_READ_TIMEOUT
from .files import RuntimeFileError, load_runtimes, load_settings

log = logging.getLogger("dispatch_admission")

DEV_BIND = "127.0.0.1:8443"
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"  # package data: an installed wheel has them too
# The Secret is read this often: a renewal by another replica, or the Secret deleted (a new pair is then
# issued), reaches every replica within it. One GET of one Secret per replica: no list or watch rights.
REFRESH_SECONDS = 10


@dataclass(frozen=True)
class SecretTLS:
    """Self-managed certificates (`--tls-secret`): the pair kept in a Secret, its CA in the configurations."""

    secret: str
    service: str
    namespace: str
    webhook_configuration: str | None = None
    read_only: bool = False  # the certificate controller issues; this replica only reads


@dataclass(frozen=True)
class ServeConfig:
    """What `serve` resolved from its flags: built once by the CLI, handed to each worker."""

    settings: Settings
    listening: Listening
    cert_dir: Path
    dev: bool = False
    settings_file: str | None = None
    settings_configmap: tuple[str, str] | None = None  # NAMESPACE, NAME
    publish_repositories: frozenset[str] | None = None  # fixed for the server's life
    grace: float = PREVIOUS_SETTINGS_GRACE
    enforcement: Enforcement = Enforcement.ENFORCE
    runtime_files: tuple[str, ...] = ()
    kubeconfig: str | None = None
    runtime_store: str | None = None
    external_keeper: bool = False
    live_reads_per_second: float = 10.0
    live_reads_burst: int = 20
    namespace_share: int = NAMESPACE_SHARE
    runtime_metric_labels: bool = False
    secret_tls: SecretTLS | None = None
    client_ca: str | None = None
    tls_options: dict[str, Any] = field(default_factory=dict)  # certs.ReloadingContext's hardening
    metrics_auth: bool = False
    log_level: str = "info"

    def live_settings(self):
        """Where the settings are followed from (SPEC 2.1); None for --dev's embedded example."""
        from ..kube.live_settings import ConfigMapSettings, FileSettings

        if self.settings_configmap:
            from ..kube.client import api_client

            return ConfigMapSettings(api_client(self.kubeconfig), *self.settings_configmap,
                                     repositories=self.publish_repositories)
        return FileSettings(self.settings_file, repositories=self.publish_repositories) if self.settings_file else None


def _reason(text: str) -> Reason:
    return Reason(ErrInvalid, "settings", text)


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise Denied([Reason(ErrInvalid, "--metrics-bind", f"{text!r} is not HOST:PORT")])
    return host.strip("[]"), int(port)


def _dev_runtimes(args: argparse.Namespace) -> tuple[str, ...]:
    """--dev without --runtime or --kubeconfig: the example runtimes. Never fall back to the cluster client
    silently: --dev without them is a broken installation."""
    files = tuple(args.runtime or ())
    if args.dev and not files and not args.kubeconfig:
        files = tuple(sorted(str(p) for p in (EXAMPLES / "runtimes").glob("*.yaml")))
        if not files:
            raise Denied([_reason(f"--dev: no example runtimes in {EXAMPLES / 'runtimes'}; "
                                  "give --runtime FILE or --kubeconfig")])
    return files


def _start_settings(args: argparse.Namespace, configmap: tuple[str, str] | None) -> Settings:
    """The settings serve starts with: from the ConfigMap, the file, or --dev's embedded example."""
    if args.settings and configmap:
        raise Denied([_reason("give --settings FILE or --settings-configmap NS/NAME, not both")])
    if configmap:
        from ..kube.client import api_client
        from ..kube.live_settings import ConfigMapSettings

        try:
            return ConfigMapSettings(api_client(args.kubeconfig), *configmap).read()
        except Denied:
            raise
        except Exception as e:  # the API refused or cannot be reached: do not serve without settings
            raise Denied([_reason(f"cannot read ConfigMap {args.settings_configmap}: {type(e).__name__}:"
                                  f" {str(e)[:300]}")]) from None
    if args.settings:
        return load_settings(args.settings)
    if args.dev:
        return parse(json.dumps(EXAMPLE))
    raise Denied([_reason("--settings or --settings-configmap is required (or --dev for the example settings)")])


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """serve's flags resolved and checked; raises Denied (ErrInvalid) on what cannot be served."""
    from ..kube.live_settings import configmap_ref, fixed_repositories

    if args.metrics_auth and not args.metrics_bind:
        raise Denied([Reason(ErrInvalid, "--metrics-auth", "needs --metrics-bind: the port it guards")])
    cert_dir = Path(args.cert_dir or ("certs" if args.dev else "/etc/dispatch-admission/tls"))
    max_body = args.max_body or DEFAULT_MAX_BODY
    listening = Listening(str(cert_dir / "tls.crt"), str(cert_dir / "tls.key"),
                          bind=args.bind or (DEV_BIND if args.dev else None), workers=args.workers,
                          config_file=args.gunicorn_config, metrics_bind=args.metrics_bind,
                          metrics_address=_address(args.metrics_bind) if args.metrics_bind else None,
                          read_timeout=args.read_timeout or DEFAULT_READ_TIMEOUT, max_body=max_body,
                          max_body_in_flight=args.max_body_in_flight or 0)
    namespace = args.namespace or os.environ.get("POD_NAMESPACE") or "default"
    configmap = configmap_ref(args.settings_configmap) if args.settings_configmap else None
    settings = _start_settings(args, configmap)
    found = {"min_version": args.tls_min_version, "ciphers": args.tls_ciphers,
             "client_subjects": tuple(args.client_subject or ())}
    return ServeConfig(
        settings=settings, listening=listening, cert_dir=cert_dir, dev=bool(args.dev), settings_file=args.settings,
        settings_configmap=configmap, publish_repositories=fixed_repositories(args.publish_repositories, settings),
        grace=args.previous_settings_grace, enforcement=Enforcement(args.enforcement),
        runtime_files=_dev_runtimes(args), kubeconfig=args.kubeconfig, runtime_store=args.runtime_store,
        external_keeper=args.runtime_keeper == "external", live_reads_per_second=args.live_reads_per_second,
        live_reads_burst=args.live_reads_burst, namespace_share=args.namespace_share,
        runtime_metric_labels=bool(args.runtime_metric_labels),
        secret_tls=SecretTLS(args.tls_secret, args.tls_service, namespace, args.webhook_configuration,
                             bool(args.tls_read_only)) if args.tls_secret else None,
        client_ca=args.client_ca, tls_options={k: v for k, v in found.items() if v},
        metrics_auth=bool(args.metrics_auth), log_level=args.log_level)


def _runtime_source(config: ServeConfig, current: Callable[[], Settings], store_directory: str | None) -> RuntimeSource:
    """Runtimes from files, or from the pod's cache (the keeper's store); either way, each runtime's readiness
    is exported, judged at scrape time with the settings in use (`current`)."""
    from ..core.registry import runtime_facts

    def can_carry(runtime) -> bool:
        try:
            return runtime_facts(runtime, current()).can_carry
        except Exception:  # a runtime the rules cannot read cannot carry the mount either
            log.exception("judging runtime %s", runtime)
            return False

    if config.runtime_files:
        index = load_runtimes(list(config.runtime_files))
        metrics.judge_runtimes(lambda: ((r.key, can_carry(r)) for r in index))
        files = {"kinds": {kind: {"synced": True, "size": index.count(kind)} for kind in KINDS}}
        metrics.watch_runtime_cache(lambda: files)  # files are read whole before serving
        return index
    from ..kube.cluster import ClusterRuntimes
    from ..kube.live_reads import LiveReads
    from ..kube.store_reader import StoreReader

    assert store_directory is not None  # serve prepares the store where no runtime files are given
    store = StoreReader(store_directory)
    source = ClusterRuntimes(store, LiveReads(store_directory))
    metrics.watch_runtime_cache(store.state, source.synced)
    metrics.judge_runtimes(lambda: source.readiness(can_carry, current))
    return source


def _self_managed_certificates(config: ServeConfig, tls: SecretTLS) -> None:
    """Settle the pair in the Secret, serve it from cert_dir, put the CA in the webhook configurations,
    and keep doing so (certs.SelfManaged: a change of CA passes through a caBundle trusting both)."""
    from ..kube.client import api_client

    names = certs.service_names(tls.service, tls.namespace)
    keeper = certs.SelfManaged(api_client(config.kubeconfig), tls.namespace, tls.secret, names, config.cert_dir,
                               tls.webhook_configuration, read_only=tls.read_only)

    def sync() -> None:
        if keeper.sync():
            log.info(json.dumps({"msg": "serving certificate loaded", "secret": f"{tls.namespace}/{tls.secret}"}))

    sync()

    def loop() -> None:
        while True:
            time.sleep(REFRESH_SECONDS)
            try:
                sync()
            except Exception as e:
                log.warning(json.dumps({"msg": "certificate refresh failed", "error": str(e)[:300]}))

    threading.Thread(target=loop, name="certificate-refresh", daemon=True).start()


def _start_keeper(config: ServeConfig, directory: str, master: int) -> None:
    """Locally, the runtime keeper is a child process of serve's (`dispatch-admission keep`), stopped with it and
    not restarted: in the cluster it is a container of its own, which Kubernetes restarts with backoff."""
    import subprocess

    command = [sys.executable, "-m", "webhook", "keep", "--runtime-store", directory, "--parent", str(master),
               "--live-reads-per-second", str(config.live_reads_per_second),
               "--live-reads-burst", str(config.live_reads_burst), "--namespace-share", str(config.namespace_share),
               "--log-level", config.log_level]
    if config.kubeconfig:
        command += ["--kubeconfig", config.kubeconfig]
    keeper = subprocess.Popen(command)

    def stop() -> None:
        if os.getpid() == master and keeper.poll() is None:
            keeper.terminate()
            try:
                keeper.wait(5)
            except subprocess.TimeoutExpired:
                keeper.kill()

    atexit.register(stop)


def _runtime_store(config: ServeConfig, master: int) -> str | None:
    """The pod's one runtime cache, where no runtime files are given: the keeper writes it, the workers read it."""
    if config.runtime_files:
        return None
    import kubernetes.client  # noqa: F401  imported once, here: the workers share its pages (live settings)
    import kubernetes.config  # noqa: F401
    import kubernetes.watch  # noqa: F401

    from ..kube import store

    directory = store.prepare(config.runtime_store, fresh=not config.external_keeper)
    if not config.runtime_store:
        remove_at_exit(directory)  # in the master: the workers and the keeper leave it
    if not config.external_keeper:
        _start_keeper(config, directory, master)
    return directory


def _metrics_listener(config: ServeConfig) -> tuple[Callable[[Any], Any], Callable[[], object] | None]:
    """The metrics port's app maker and TLS: plain HTTP, or (--metrics-auth) HTTPS with tokens reviewed."""
    from ..serving.app import metrics_app

    if not config.metrics_auth:
        return metrics_app, None
    from ..kube.client import api_client
    from ..kube.metrics_auth import MetricsAuth

    options = {k: v for k, v in config.tls_options.items() if k != "client_subjects"}  # no client certificate asked
    tls = certs.ReloadingContext(config.listening.certfile, config.listening.keyfile, None,
                                 cafile=str(config.cert_dir / "ca.crt"), **options)
    return (lambda main: metrics_app(main, MetricsAuth(lambda: api_client(config.kubeconfig)))), tls.get


def _prepare(config: ServeConfig) -> certs.ReloadingContext:
    """What the master settles before gunicorn starts: the certificate and the runtime files. Raises Denied."""
    if config.dev:
        made = certs.write_dev_pair(config.cert_dir, certs.service_names("dispatch-admission", "dispatch-system"))
        if made:
            print(f"dispatch-admission serve: wrote a local CA and certificate to {config.cert_dir}/", file=sys.stderr)
    if config.secret_tls:
        try:
            _self_managed_certificates(config, config.secret_tls)
        except Exception as e:  # the API refused or cannot be reached: do not serve without a certificate
            where = f"{config.secret_tls.namespace}/{config.secret_tls.secret}"
            raise Denied([Reason(ErrInvalid, "--tls-secret", f"self-managed certificate in Secret {where}:"
                                 f" {type(e).__name__}: {str(e)[:500]}")]) from None
    try:
        tls = certs.ReloadingContext(config.listening.certfile, config.listening.keyfile, config.client_ca,
                                     cafile=str(config.cert_dir / "ca.crt"), **config.tls_options)
    except (OSError, ValueError) as e:
        raise Denied([Reason(ErrInvalid, "--cert-dir", f"cannot load the serving certificate from {config.cert_dir}:"
                             f" {e}")]) from None
    if config.runtime_files:  # fail now, in the master, on an unusable runtime file
        try:
            load_runtimes(list(config.runtime_files))
        except RuntimeFileError as e:
            raise Denied([Reason(ErrInvalid, "--runtime", str(e))]) from None
    return tls


def _worker_app(config: ServeConfig, tls: certs.ReloadingContext, store_directory: str | None) -> Callable:
    """The app each worker builds after fork."""
    from ..serving.app import create_app

    metrics.watch_certificates(tls.expiry)
    metrics.name_runtimes(config.runtime_metric_labels)
    # The runtimes' readiness is judged at each scrape under the settings the reviews use (SPEC 8.3): the
    # Admission's, held there alone (the app is made below, before any scrape).
    runtimes = _runtime_source(config, lambda: app.reviews.admission.settings, store_directory)
    app = create_app(config.settings, runtimes, tls.valid, config.listening.max_body,
                     enforcement=config.enforcement, serve_metrics=config.listening.metrics_bind is None,
                     live=config.live_settings(), grace=config.grace)
    return app


def run(config: ServeConfig) -> int:
    """Serve until stopped; raises Denied (exit 1) on what cannot be served."""
    tls = _prepare(config)
    ops, metrics_tls = _metrics_listener(config)
    store_directory = _runtime_store(config, os.getpid())  # the CLI refuses an external keeper without a store
    server = gunicorn_application(lambda: _worker_app(config, tls, store_directory), config.listening, tls=tls,
                                  ops=ops, metrics_tls=metrics_tls)
    cfg = server.cfg
    log.info(json.dumps({"msg": "starting", "bind": cfg.bind, "workers": cfg.workers, "threads": cfg.threads,
                         "read_timeout": config.listening.read_timeout, "keepalive": cfg.keepalive,
                         "enforcement": config.enforcement.value,
                         "manager": config.settings.manager, "publish": bool(config.settings.publish),
                         "settings": (f"ConfigMap {'/'.join(config.settings_configmap)}" if config.settings_configmap
                                      else config.settings_file or "embedded example"),
                         "runtimes": "files" if config.runtime_files else "cluster",
                         "metrics_auth": config.metrics_auth}))
    import gc

    heap.tune()
    gc.freeze()  # what the master holds is never collected: the workers and the keeper keep sharing its pages
    server.run()
    return 0
