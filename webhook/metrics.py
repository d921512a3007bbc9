"""Prometheus metrics.

Gunicorn runs several worker processes, so counters, histograms and the cache gauges use
prometheus_client's multiprocess mode when PROMETHEUS_MULTIPROC_DIR is set (`serve` sets it): a scrape
answered by any worker reports the sum (or min/max) over the live workers.

Three families describe state every worker holds a full copy of (the serving certificate it loaded,
the runtimes in its watch cache, whether its latest settings could be used) and are reported at scrape time by the worker that answers, from its
own copy, rather than through the multiprocess files: a scrape shows one value per certificate and
per runtime, a deleted runtime's series goes away with it (multiprocess files cannot remove a series),
and the gunicorn master, which never serves, contributes nothing stale.

The names are a contract (alerts and the dashboard query them):

- dispatch_admission_reviews_total{endpoint,outcome,sentinel}       counter
- dispatch_admission_review_seconds{endpoint}                       histogram
- dispatch_admission_bad_requests_total{code}                       counter (4xx before review)
- dispatch_admission_would_deny_total{sentinel,rule}                counter (warn mode, SPEC 8.1)
- dispatch_admission_runtime_cache_size{kind}                       gauge (max over live workers)
- dispatch_admission_runtime_cache_last_sync_timestamp_seconds{kind} gauge (max over workers)
- dispatch_admission_runtime_cache_synced{kind}                     gauge 0/1 (min over live workers)
- dispatch_admission_runtime_ready{kind,namespace,name}             gauge 0/1 (SPEC 8.3)
- dispatch_admission_certificate_not_after_seconds{certificate}     gauge, "serving" and "ca"
- dispatch_admission_client_timeouts_total{stage}                    counter (SPEC 7 deadlines)
- dispatch_admission_api_requests_total{verb,kind}, dispatch_admission_api_errors_total{verb,kind}
- dispatch_admission_settings_valid                                 gauge 0/1 (SPEC 2.1)
- dispatch_admission_settings_switches_total                        counter (settings taken while serving)
"""

from __future__ import annotations

import os
import threading
from typing import Callable, Iterator

from prometheus_client import (CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest, multiprocess)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

REVIEWS = Counter("dispatch_admission_reviews_total", "Admission reviews answered.",
                  ["endpoint", "outcome", "sentinel"])
LATENCY = Histogram("dispatch_admission_review_seconds", "Time to answer one admission review.", ["endpoint"],
                    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
BAD_REQUESTS = Counter("dispatch_admission_bad_requests_total", "Requests refused before review (4xx).", ["code"])
WOULD_DENY = Counter("dispatch_admission_would_deny_total",
                     "Causes the enforce mode would have denied, admitted in warn mode (SPEC 8.1).",
                     ["sentinel", "rule"])
CACHE_SIZE = Gauge("dispatch_admission_runtime_cache_size", "Runtimes held in the cache.", ["kind"],
                   multiprocess_mode="livemax")
CACHE_SYNC = Gauge("dispatch_admission_runtime_cache_last_sync_timestamp_seconds",
                   "When the runtime cache last completed a list.", ["kind"], multiprocess_mode="max")
CACHE_SYNCED = Gauge("dispatch_admission_runtime_cache_synced",
                     "1 when the runtime cache has completed its first list (in every live worker), else 0.",
                     ["kind"], multiprocess_mode="livemin")
CLIENT_TIMEOUTS = Counter("dispatch_admission_client_timeouts_total",
                          "Connections closed because the client was too slow: stage is handshake, request "
                          "(head and body not sent in time) or write (the answer not read).", ["stage"])
SETTINGS_SWITCHES = Counter("dispatch_admission_settings_switches_total",
                            "New settings taken while serving, without a restart (SPEC 2.1).")
API_REQUESTS = Counter("dispatch_admission_api_requests_total", "Requests to the Kubernetes API.", ["verb", "kind"])
API_ERRORS = Counter("dispatch_admission_api_errors_total", "Failed requests to the Kubernetes API.", ["verb", "kind"])


# ---- state reported by the worker that answers the scrape ----

_runtimes: dict[tuple[str, str, str], bool] = {}
_runtimes_lock = threading.Lock()
_certificates: list[Callable[[], dict[str, float]]] = []
_settings_valid = [True]


def set_settings_valid(valid: bool) -> None:
    """False while the latest settings could not be used and the last good ones are kept (SPEC 2.1)."""
    _settings_valid[0] = valid


def set_runtime_ready(kind: str, namespace: str, name: str, ready: bool) -> None:
    """Whether the runtime in this process's cache can carry the publish mount (SPEC 8.3)."""
    with _runtimes_lock:
        _runtimes[(kind, namespace or "", name)] = ready


def forget_runtime(kind: str, namespace: str, name: str) -> None:
    """The runtime left the cache (deleted): its series goes away."""
    with _runtimes_lock:
        _runtimes.pop((kind, namespace or "", name), None)


def forget_runtimes(kind: str | None = None) -> None:
    """Drop every runtime of `kind` (all with None), e.g. before a relist puts back what exists."""
    with _runtimes_lock:
        for key in [k for k in _runtimes if kind is None or k[0] == kind]:
            del _runtimes[key]


def watch_certificates(expiry: Callable[[], dict[str, float]] | None) -> None:
    """Report `expiry()` ({"serving": unix time, "ca": unix time}) as the certificate gauge; None stops."""
    _certificates[:] = [expiry] if expiry else []


class _State(Collector):
    def collect(self) -> Iterator[GaugeMetricFamily]:
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
        ready = GaugeMetricFamily("dispatch_admission_runtime_ready",
                                  "1 when the runtime can carry the publish mount, 0 when TrainJobs naming it "
                                  "are refused (SPEC 8.3).", labels=["kind", "namespace", "name"])
        with _runtimes_lock:
            items = sorted(_runtimes.items())
        for (kind, namespace, name), ok in items:
            ready.add_metric([kind, namespace, name], 1.0 if ok else 0.0)
        yield ready
        yield GaugeMetricFamily("dispatch_admission_settings_valid",
                                "0 when the latest settings could not be used and the last good ones are kept"
                                " (SPEC 2.1), else 1.", value=1.0 if _settings_valid[0] else 0.0)


STATE = _State()
_multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
if not _multiprocess:
    REGISTRY.register(STATE)


def exposition() -> tuple[bytes, str]:
    if _multiprocess:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        registry.register(STATE)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(), CONTENT_TYPE_LATEST
