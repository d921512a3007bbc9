"""The master's process helpers: glibc's heap settings, and the hook that drops a dead worker's gauges."""

import os
from types import SimpleNamespace

from webhook.process import heap
from webhook.serving.gunicorn_config import _mark_dead


def test_glibc_takes_every_heap_option():
    assert heap.tune() is True  # mallopt answers 1 for each option it took
    heap.trim()  # and trimming is callable after it


def test_a_dead_worker_s_live_gauges_leave_the_metrics_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    (tmp_path / "gauge_livesum_4242.db").write_bytes(b"")
    called = []
    _mark_dead(lambda server, worker: called.append(worker.pid))(None, SimpleNamespace(pid=4242))
    assert not (tmp_path / "gauge_livesum_4242.db").exists() and called == [4242]


def test_a_master_without_a_metrics_directory_still_reaps_its_workers(monkeypatch):
    """bench/baseline.py serves with the webhook's gunicorn settings but keeps no metrics."""
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    called = []
    _mark_dead(lambda server, worker: called.append(worker.pid))(None, SimpleNamespace(pid=4242))
    assert called == [4242] and "PROMETHEUS_MULTIPROC_DIR" not in os.environ
