"""Prometheus metrics.

The families are made by `start()`, which `serve` calls at start-up in the gunicorn master (before it
forks the workers), and not at import. Gunicorn runs several worker processes, so `start()` puts counters,
histograms and the cache gauges in prometheus_client's multiprocess mode (files in
PROMETHEUS_MULTIPROC_DIR, a fresh directory when unset): a scrape answered by any worker reports the sum
(or min/max) over the live workers. `get()` answers the families, made single-process on first use where
`start()` was never called (tests, the offline commands).

The runtime cache's families are read at scrape time from the state the keeper writes into the store
(webhook.kube.keeper): the keeper is another process, in the cluster another container, with no port of its
own; its requests to the API server are added to dispatch_admission_api_requests_total and
dispatch_admission_api_errors_total beside the workers' own (the settings ConfigMap's).

Three families describe state every worker holds (the serving certificate it loaded, the runtimes of
the pod's cache judged with the settings it holds, whether its latest settings could be used) and are
reported at scrape time by the worker that answers, rather than through the multiprocess files: a
scrape shows one value per certificate and per runtime, a deleted runtime's series goes away with it
(multiprocess files cannot remove a series), and the gunicorn master, which never serves, contributes
nothing stale.

The names are a contract (alerts and the dashboard query them):

- dispatch_admission_reviews_total{endpoint,outcome,sentinel}       counter
- dispatch_admission_review_seconds{endpoint}                       histogram
- dispatch_admission_bad_requests_total{code}                       counter (4xx before review)
- dispatch_admission_would_deny_total{sentinel,rule}                counter (warn mode, SPEC 8.1)
- dispatch_admission_runtime_cache_size{kind}                       gauge (from the keeper, the pod's one watch)
- dispatch_admission_runtime_cache_last_sync_timestamp_seconds{kind} gauge, when the keeper last completed a list
- dispatch_admission_runtime_cache_synced{kind}                     gauge 0/1 (the store has completed a first list)
- dispatch_admission_runtime_cache_age_seconds{kind}                gauge, since the cache was last confirmed current
- dispatch_admission_runtime_keeper_starts_total                    counter, keepers started on the pod's store
- dispatch_admission_runtime_keeper_errors_total{operation,kind}    counter, the keeper's failed lists, watches, writes
- dispatch_admission_runtime_live_reads_total{outcome}              counter, live reads on a miss, for the whole pod
- dispatch_admission_runtime_store_bytes                            gauge, what the store's file uses
- dispatch_admission_runtimes_not_held{kind,reason}                 gauge, runtimes the store holds not whole (issue 47)
- dispatch_admission_runtimes_cannot_carry{kind}                     gauge, runtimes that cannot carry (SPEC 8.3)
- dispatch_admission_runtime_ready{kind,namespace,name}             gauge 0/1 (SPEC 8.3), only with
  `serve --runtime-metric-labels`: by default /metrics names no runtime (no tenant's names leak through it,
  and tenants cannot add series by creating runtimes)
- dispatch_admission_certificate_not_after_seconds{certificate}     gauge, "serving" and "ca"
- dispatch_admission_client_timeouts_total{stage}                    counter (SPEC 7 deadlines)
- dispatch_admission_log_dropped_total                              counter (review log lines dropped: stderr stalled)
- dispatch_admission_request_bytes_held                             gauge (max over workers: budget bytes held now)
- dispatch_admission_request_bytes_held_peak                        gauge (max over workers: the most ever held at once)
- dispatch_admission_api_requests_total{verb,kind}, dispatch_admission_api_errors_total{verb,kind}
- dispatch_admission_settings_valid                                 gauge 0/1 (SPEC 2.1)
- dispatch_admission_settings_switches_total                        counter (settings taken while serving)
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
    values,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .temporary import remove_at_exit

log = logging.getLogger(__name__)


class Metrics:
    """The webhook's metric families, registered in `registry`."""

    def __init__(self, registry: CollectorRegistry = REGISTRY):
        r = registry
        self.reviews = Counter("dispatch_admission_reviews_total", "Admission reviews answered.",
                               ["endpoint", "outcome", "sentinel"], registry=r)
        self.latency = Histogram("dispatch_admission_review_seconds", "Time to answer one admission review.",
                                 ["endpoint"], registry=r,
                                 buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                                          10))
        self.bad_requests = Counter("dispatch_admission_bad_requests_total", "Requests refused before review (4xx).",
                                    ["code"], registry=r)
        self.would_deny = Counter("dispatch_admission_would_deny_total",
                                  "Causes the enforce mode would have denied, admitted in warn mode"
                                  " (contract section 8.1).",
                                  ["sentinel", "rule"], registry=r)
        self.client_timeouts = Counter("dispatch_admission_client_timeouts_total",
                                       "Connections closed because the client was too slow: stage is handshake, "
                                       "request (head and body not sent in time) or write (the answer not read).",
                                       ["stage"], registry=r)
        self.log_dropped = Counter("dispatch_admission_log_dropped_total",
                                   "Review log lines dropped because stderr did not take them (its queue was full).",
                                   registry=r)
        self.request_bytes_held = Gauge("dispatch_admission_request_bytes_held",
                                        "Bytes the worker holding the most holds now for its clients: request "
                                        "heads and bodies as received, parsed forms by their bound, room for each "
                                        "request's answer, answers not yet sent; each worker holds at most "
                                        "--max-body-in-flight.",
                                        multiprocess_mode="livemax", registry=r)
        self.request_bytes_held_peak = Gauge("dispatch_admission_request_bytes_held_peak",
                                             "The most bytes one worker has held at once for its clients (requests, "
                                             "their parsed bounds, answers not yet sent) since it started (never "
                                             "above --max-body-in-flight).",
                                             multiprocess_mode="livemax", registry=r)
        self.settings_switches = Counter("dispatch_admission_settings_switches_total",
                                         "New settings taken while serving, without a restart"
                                         " (contract section 2.1).", registry=r)
        self.api_requests = Counter("dispatch_admission_api_requests_total", "Requests to the Kubernetes API.",
                                    ["verb", "kind"], registry=r)
        self.api_errors = Counter("dispatch_admission_api_errors_total", "Failed requests to the Kubernetes API.",
                                  ["verb", "kind"], registry=r)


_families: Metrics | None = None
_directory: str | None = None  # multiprocess mode's files; None: one process
_lock = threading.Lock()


def count_would_deny(families: Metrics, would_deny: Iterable[tuple[str, str]]) -> None:
    """SPEC 8.1: one count per (sentinel, rule) that `enforce` would have denied (an outcome's `would_deny`)."""
    for sentinel, rule in would_deny:
        families.would_deny.labels(sentinel, rule).inc()


def _made_directory() -> str:
    """A temporary directory of this process's own, removed when it exits."""
    made = tempfile.mkdtemp(prefix="dispatch-admission-metrics-")
    remove_at_exit(made)
    return made


def start(directory: str | None = None) -> Metrics:
    """At `serve`'s start-up, before workers fork: the families in multiprocess mode, in `directory` (or
    PROMETHEUS_MULTIPROC_DIR, else a fresh temporary one, removed at exit), made if absent and emptied of an
    earlier run's files (an emptyDir survives a container restart)."""
    global _families, _directory
    directory = directory or os.environ.get("PROMETHEUS_MULTIPROC_DIR") or _made_directory()
    os.makedirs(directory, exist_ok=True)
    for stale in Path(directory).glob("*.db"):
        stale.unlink()
    with _lock:
        if _families is not None:
            raise RuntimeError("metrics.start() called after the metric families were made")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory  # for the workers' exit hook (mark_process_dead)
        values.ValueClass = values.get_value_class()  # the library's own choice, made again now the variable is set
        _directory = directory
        _families = Metrics()
    return _families


def get() -> Metrics:
    """The families: those start() made, else single-process ones made now (tests, offline commands, and
    bench/baseline.py's app, whose worker sets the room's gauges: with PROMETHEUS_MULTIPROC_DIR set empty,
    prometheus_client would otherwise write their files in the working directory)."""
    global _families
    if _families is None:
        with _lock:
            if _families is None:
                if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
                    values.ValueClass = values.MutexValue
                REGISTRY.register(STATE)
                _families = Metrics()
    return _families


# ---- state reported by the worker that answers the scrape ----

# Where the scrape reads each runtime's readiness: (kind, namespace, name), ready. Judged when scraped,
# from the pod's runtime cache and the settings in use (the cache is the pod's, the settings the worker's).
_readiness: list[Callable[[], Iterable[tuple[tuple[str, str, str], bool]]]] = []
_certificates: list[Callable[[], dict[str, float]]] = []
_settings_valid = [True]

_per_runtime = [False]
# The runtime cache's state, read at scrape time: (the keeper's state as it wrote it, whether a kind is listed).
_cache: list[tuple[Callable[[], dict], Callable[[str], bool]]] = []
KINDS = ("ClusterTrainingRuntime", "TrainingRuntime")


def watch_runtime_cache(state: Callable[[], dict] | None, synced: Callable[[str], bool] = lambda kind: True) -> None:
    """Report the runtime cache from `state()` (webhook.kube.store.STATE's shape) at each scrape; None stops."""
    _cache[:] = [(state, synced)] if state else []


def set_settings_valid(valid: bool) -> None:
    """False while the latest settings could not be used and the last good ones are kept (SPEC 2.1)."""
    _settings_valid[0] = valid


def name_runtimes(on: bool) -> None:
    """Export dispatch_admission_runtime_ready per runtime (True), or only the counts per kind (False)."""
    _per_runtime[0] = on


def judge_runtimes(readiness: Callable[[], Iterable[tuple[tuple[str, str, str], bool]]] | None) -> None:
    """Report `readiness()` (each runtime's key and whether it can carry the mount) at each scrape; None stops."""
    _readiness[:] = [readiness] if readiness else []


def watch_certificates(expiry: Callable[[], dict[str, float]] | None) -> None:
    """Report `expiry()` ({"serving": unix time, "ca": unix time}) as the certificate gauge; None stops."""
    _certificates[:] = [expiry] if expiry else []


class _State(Collector):
    def collect(self) -> Iterator[Metric]:
        certs = GaugeMetricFamily("dispatch_admission_certificate_not_after_seconds",
                                  "When the certificate expires (Unix time): the serving certificate held, "
                                  "and the CA in the certificate directory.", labels=["certificate"])
        for expiry in _certificates:
            try:
                found = expiry()
            except Exception:  # a scrape never fails over this
                found = {}
            for which, when in sorted(found.items()):
                certs.add_metric([which], when)
        yield certs
        items = []
        for readiness in _readiness:
            try:
                items = sorted(readiness())
            except Exception:  # a scrape never fails over this
                log.exception("judging the runtimes for the scrape")
        unfit = GaugeMetricFamily("dispatch_admission_runtimes_cannot_carry",
                                  "Runtimes in the cache that cannot carry the publish mount: TrainJobs naming them "
                                  "are refused (contract section 8.3).", labels=["kind"])
        counts: dict[str, int] = {}
        for (kind, _, _), ok in items:
            counts[kind] = counts.get(kind, 0) + (not ok)
        for kind, count in sorted(counts.items()):
            unfit.add_metric([kind], float(count))
        yield unfit
        if _per_runtime[0]:
            ready = GaugeMetricFamily("dispatch_admission_runtime_ready",
                                      "1 when the runtime can carry the publish mount, 0 when TrainJobs naming it "
                                      "are refused (contract section 8.3).", labels=["kind", "namespace", "name"])
            for (kind, namespace, name), ok in items:
                ready.add_metric([kind, namespace, name], 1.0 if ok else 0.0)
            yield ready
        yield from _cache_families()
        yield GaugeMetricFamily("dispatch_admission_settings_valid",
                                "0 when the latest settings could not be used and the last good ones are kept"
                                " (contract section 2.1), else 1.", value=1.0 if _settings_valid[0] else 0.0)


def _cache_gauges(state: dict, synced_of: Callable[[str], bool]) -> Iterator[Metric]:
    """Per kind: the cache's size, its last list, its age, and whether it has synced."""
    import time

    kinds = state.get("kinds") or {}
    families = {
        "size": GaugeMetricFamily("dispatch_admission_runtime_cache_size", "Runtimes held in the cache.",
                                  labels=["kind"]),
        "listed": GaugeMetricFamily("dispatch_admission_runtime_cache_last_sync_timestamp_seconds",
                                    "When the runtime keeper last completed a list (Unix time).", labels=["kind"]),
        "age": GaugeMetricFamily("dispatch_admission_runtime_cache_age_seconds",
                                 "Seconds since the runtime cache was last confirmed current (a list, a watch event"
                                 " or bookmark, a watch the API server ended): grows while the keeper is down or"
                                 " its watch is stuck.", labels=["kind"]),
    }
    synced = GaugeMetricFamily("dispatch_admission_runtime_cache_synced",
                               "1 when the runtime cache has completed its first list, else 0.", labels=["kind"])
    now = time.time()
    for kind in KINDS:
        found = kinds.get(kind) or {}
        synced.add_metric([kind], 1.0 if synced_of(kind) else 0.0)
        if found.get("synced"):
            families["size"].add_metric([kind], float(found.get("size", 0)))
            families["listed"].add_metric([kind], float(found.get("listed", 0)))
        if found.get("confirmed"):
            families["age"].add_metric([kind], max(0.0, now - float(found["confirmed"])))
    yield from families.values()
    yield synced


def _cache_families() -> Iterator[Metric]:
    """The runtime cache, from the keeper's state in the store (see the module doc)."""
    for state_of, synced_of in _cache:
        try:
            state = state_of() or {}
        except Exception:  # a scrape never fails over this
            log.exception("reading the runtime keeper's state")
            state = {}
        yield from _cache_gauges(state, synced_of)
        yield CounterMetricFamily("dispatch_admission_runtime_keeper_starts",
                                  "Runtime keepers started on this pod's store (each restart adds one).",
                                  value=float(state.get("starts", 0)))
        errors = CounterMetricFamily("dispatch_admission_runtime_keeper_errors",
                                     "The runtime keeper's failed lists and watches (list/watch), live reads (get) and"
                                     " store writes (store).", labels=["operation", "kind"])
        for k, v in sorted((state.get("errors") or {}).items()):
            errors.add_metric(k.split("\x1f", 1), float(v))
        yield errors
        live = CounterMetricFamily("dispatch_admission_runtime_live_reads",
                                   "Live reads of runtimes the cache lacks, for the whole pod, by outcome: found,"
                                   " missing, limited (over the pod's rate: ErrUnavailable), busy, unavailable.",
                                   labels=["outcome"])
        for k, v in sorted((state.get("live") or {}).items()):
            live.add_metric([k], float(v))
        yield live
        not_held = GaugeMetricFamily("dispatch_admission_runtimes_not_held",
                                     "Runtimes the keeper's last list and the watch events since did not hold whole:"
                                     " store-full (not held: a review naming one makes a live read), namespace-share"
                                     " (held as their name and the reason: R5 refuses TrainJobs naming them).",
                                     labels=["kind", "reason"])
        for k, v in sorted((state.get("not_held") or {}).items()):
            not_held.add_metric(k.split("\x1f", 1), float(v))
        yield not_held
        if "store_bytes" in state:
            yield GaugeMetricFamily("dispatch_admission_runtime_store_bytes", "Bytes the runtime store's file uses.",
                                    value=float(state["store_bytes"]))
        for table, name, text in (("requests", "dispatch_admission_api_requests", "Requests to the Kubernetes API."),
                                  ("errors", "dispatch_admission_api_errors",
                                   "Failed requests to the Kubernetes API.")):
            family = CounterMetricFamily(name, text, labels=["verb", "kind"])  # merged into the workers' family
            for k, v in sorted((state.get(table) or {}).items()):
                verb, _, kind = k.partition("\x1f")
                if kind in KINDS:
                    family.add_metric([verb, kind], float(v))
            if family.samples:
                yield family


STATE = _State()


class _Merged:
    """What `generate_latest` reads: the families of several collectors, those of one name made one (the keeper's
    API requests join the workers' family of the same name)."""

    def __init__(self, *collectors):
        self.collectors = collectors

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for collector in self.collectors:
            for family in collector.collect():
                if family.name in merged:
                    merged[family.name].samples.extend(family.samples)
                else:
                    merged[family.name] = family
        return iter(merged.values())


def exposition() -> tuple[bytes, str]:
    if _directory is not None:
        workers = multiprocess.MultiProcessCollector(None, path=_directory)
        return generate_latest(_Merged(workers, STATE)), CONTENT_TYPE_LATEST  # type: ignore[arg-type]
    get()
    return generate_latest(_Merged(REGISTRY)), CONTENT_TYPE_LATEST  # type: ignore[arg-type]
