"""Prometheus metrics. Gunicorn runs several worker processes, so metrics use prometheus_client's
multiprocess mode when PROMETHEUS_MULTIPROC_DIR is set (`serve` sets it): a scrape of any worker
reports the sum over all of them.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client import CONTENT_TYPE_LATEST

REVIEWS = Counter("dispatch_admission_reviews_total", "Admission reviews answered.",
                  ["endpoint", "outcome", "sentinel"])
LATENCY = Histogram("dispatch_admission_review_seconds", "Time to answer one admission review.", ["endpoint"],
                    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
BAD_REQUESTS = Counter("dispatch_admission_bad_requests_total", "Requests refused before review (4xx).", ["code"])
CACHE_SIZE = Gauge("dispatch_admission_runtime_cache_size", "Runtimes held in the cache.", ["kind"],
                   multiprocess_mode="livemax")
CACHE_SYNC = Gauge("dispatch_admission_runtime_cache_last_sync_timestamp_seconds",
                   "When the runtime cache last completed a list.", ["kind"], multiprocess_mode="max")
API_REQUESTS = Counter("dispatch_admission_api_requests_total", "Requests to the Kubernetes API.", ["verb", "kind"])
API_ERRORS = Counter("dispatch_admission_api_errors_total", "Failed requests to the Kubernetes API.", ["verb", "kind"])


def exposition() -> tuple[bytes, str]:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(), CONTENT_TYPE_LATEST
