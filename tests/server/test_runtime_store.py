"""The keeper's side of the runtime cache (issue 33): list pages read item by item whatever their size, counts
kept without a scan, the store bounded, the keeper's state as the serving container exports it."""

from __future__ import annotations

import io
import tracemalloc

import orjson
import pytest
from prometheus_client import CollectorRegistry

from tests.helpers import metric_table, runtime
from webhook.core.runtimes import MAX_STORED_BYTES, Runtime
from webhook.kube.reflector import ReadStats
from webhook.kube.runtime_api import Page
from webhook.kube.store import StoreWriter
from webhook.kube.store_reader import StoreReader
from webhook.process import metrics

KIND = "ClusterTrainingRuntime"


def large_runtime(name: str, env_entries: int = 12_000) -> dict:
    """A runtime near the API server's object size limit: thousands of env entries on its node container."""
    rt = runtime(name)
    rt["metadata"]["resourceVersion"] = "7"
    node = rt["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    node["env"] = [{"name": f"VARIABLE_{i:06d}", "value": "v" * 80} for i in range(env_entries)]
    return rt


def answer_bytes(items: list, metadata_first: bool) -> bytes:
    meta = {"continue": "token-1", "resourceVersion": "42"}
    if metadata_first:  # as the API server streams a list (KEP-5116)
        return orjson.dumps({"kind": "List", "apiVersion": "v1", "metadata": meta, "items": items})
    return orjson.dumps({"apiVersion": "v1", "items": items, "kind": "List", "metadata": meta})  # sorted keys


@pytest.mark.parametrize("metadata_first", [True, False])
def test_a_page_is_read_item_by_item_and_its_metadata_either_side(metadata_first):
    items = [runtime(f"r{i}") for i in range(300)]
    items[5]["metadata"]["annotations"] = {"note": '"metadata": {"continue": "forged"}'}
    page = Page(io.BytesIO(answer_bytes(items, metadata_first)))
    assert [i["metadata"]["name"] for i in page] == [f"r{i}" for i in range(300)]
    assert page.metadata() == {"continue": "token-1", "resourceVersion": "42"}


def test_a_page_of_large_runtimes_holds_one_at_a_time():
    """30 runtimes of about 1.2 MB each (as in the security review, which saw the keeper at 444 MiB): read as a
    stream, the JSON held at once is one item's, not the page's (measured with tracemalloc)."""
    one = large_runtime("one")
    size_one = len(orjson.dumps(one))
    raw = answer_bytes([large_runtime(f"big-{i}") for i in range(30)], metadata_first=False)
    assert size_one > 1_000_000 and len(raw) > 30 * 1_000_000
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        orjson.loads(orjson.dumps(one))
        one_item_peak = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        kept = [Runtime.of(i, KIND) for i in Page(io.BytesIO(raw))]
        page_peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert len(kept) == 30 and all(not r.oversize for r in kept)
    assert page_peak < 3 * one_item_peak, (page_peak, one_item_peak)


def test_counts_are_kept_by_the_writes_not_by_a_scan(tmp_path):
    writer = StoreWriter(str(tmp_path))
    writer.replace(KIND, [runtime(f"r{i}") for i in range(50)])
    assert writer.count(KIND) == 50
    writer.put(runtime("r1"))  # an update: no new key
    writer.put(runtime("new"))
    writer.delete(runtime("r2"))
    writer.delete(runtime("never-there"))
    assert writer.count(KIND) == 50

    class NoScans:
        def begin(self, *a, **kw):
            raise AssertionError("count() must not read the store")

    env, writer.env = writer.env, NoScans()
    try:
        assert writer.count(KIND) == 50
    finally:
        writer.env = env
    assert len(StoreReader(str(tmp_path), env=env)) == 50


def test_a_runtime_is_stored_in_at_most_its_bound(tmp_path):
    big = runtime("big", jobs={"node": {"containers": [{"name": "node"}],
                                        "volumes": [{"name": f"{i:04d}" + "v" * 500} for i in range(1990)]}})
    taken = Runtime.of(big)
    assert taken.oversize and len(taken.to_bytes()) < 1024
    near = runtime("near", jobs={"node": {"containers": [{"name": "node"}],
                                          "volumes": [{"name": f"{i:04d}" + "v" * 55} for i in range(1000)]}})
    assert not Runtime.of(near).oversize and len(Runtime.of(near).to_bytes()) < MAX_STORED_BYTES + 4096


def scrape(state: dict, synced=lambda kind: True) -> dict[tuple[str, tuple], float]:
    metrics.watch_runtime_cache(lambda: state, synced)
    try:
        registry = CollectorRegistry()
        registry.register(metrics.STATE)
        text = b"".join(metrics.generate_latest(metrics._Merged(registry)).splitlines(keepends=True)).decode()
    finally:
        metrics.watch_runtime_cache(None)
    return metric_table(text)


def test_the_keepers_state_is_exported_by_the_serving_container():
    import time

    stats = ReadStats(clock=lambda: time.time() - 30)
    stats.listed(KIND, 12)
    stats.request("list", KIND)
    stats.error("list/watch", KIND)
    stats.live_read("limited")
    state = stats.snapshot()
    state.update(starts=3, store_bytes=4096, not_held={f"{KIND}\x1fstore-full": 3})
    got = scrape(state, synced=lambda kind: kind == KIND)
    assert got[("dispatch_admission_runtime_cache_size", (("kind", KIND),))] == 12
    assert got[("dispatch_admission_runtime_cache_synced", (("kind", KIND),))] == 1
    assert got[("dispatch_admission_runtime_cache_synced", (("kind", "TrainingRuntime"),))] == 0
    assert 29 < got[("dispatch_admission_runtime_cache_age_seconds", (("kind", KIND),))] < 60
    assert got["dispatch_admission_runtime_keeper_starts_total", ()] == 3
    assert got[("dispatch_admission_runtime_keeper_errors_total",
                (("kind", KIND), ("operation", "list/watch")))] == 1
    assert got[("dispatch_admission_runtime_live_reads_total", (("outcome", "limited"),))] == 1
    assert got[("dispatch_admission_api_requests_total", (("kind", KIND), ("verb", "list")))] == 1
    assert got["dispatch_admission_runtime_store_bytes", ()] == 4096
    assert got[("dispatch_admission_runtimes_not_held", (("kind", KIND), ("reason", "store-full")))] == 3


def test_counters_go_on_from_the_store_when_a_keeper_starts_again():
    first = ReadStats()
    first.request("list", KIND)
    first.live_read("found")
    second = ReadStats()
    second.resume(first.snapshot())
    second.request("list", KIND)
    assert second.snapshot()["requests"] == {f"list\x1f{KIND}": 2} and second.snapshot()["live"] == {"found": 1}
