"""Reviews answered on the worker's loop: a runtime that needs a live read is read on a thread, and the review goes
on there from the point where it waited (issue 49: nothing before it is done again)."""

import pytest

from tests.helpers import admission, review, trainjob
from webhook.core import admission as admission_mod
from webhook.core.runtimes import PENDING
from webhook.kube.cluster import ClusterRuntimes
from webhook.process.blocking import NoBlocking, blocking_allowed


class Source:
    def __init__(self):
        self.calls = 0

    def get(self, kind, namespace, name):
        self.calls += 1
        if not blocking_allowed():
            return PENDING
        return None

    def ready(self):
        return True


def test_a_review_waits_at_the_miss_and_goes_on_from_there(monkeypatch):
    scans = []
    scan = admission_mod.rules.scan
    monkeypatch.setattr(admission_mod.rules, "scan", lambda *a: scans.append(1) or scan(*a))
    source = Source()
    adm = admission(runtimes=source)
    with NoBlocking():
        reviewing = adm.begin(review(trainjob(runtime_name="new")), "mutate")
    assert reviewing.result is None and reviewing.read is not None and source.calls == 1 and scans == [1]
    assert blocking_allowed()
    resp = reviewing.finish()[0]["response"]
    assert resp["status"]["code"] == 404 and source.calls == 2  # not found, after the (allowed) live read
    assert scans == [1]  # the TrainJob was read once: the review went on from the runtime read


def test_a_review_answered_without_a_miss_is_answered_at_once():
    adm = admission()
    with NoBlocking():
        reviewing = adm.begin(review(trainjob()), "mutate")
    assert reviewing.read is None and reviewing.result is not None
    assert reviewing.finish() is reviewing.result


def test_a_read_that_fails_on_the_thread_is_the_review_s_unavailable_reason():
    from webhook.core.runtimes import RuntimeUnavailable

    class Down(Source):
        def get(self, kind, namespace, name):
            if not blocking_allowed():
                return PENDING
            raise RuntimeUnavailable("the API server is down")

    with NoBlocking():
        reviewing = admission(runtimes=Down()).begin(review(trainjob(runtime_name="new")), "mutate")
    resp = reviewing.finish()[0]["response"]
    assert not resp["allowed"] and "the API server is down" in resp["status"]["message"]


def test_a_source_still_pending_where_blocking_is_allowed_is_unavailable():
    class Stuck(Source):
        def get(self, kind, namespace, name):
            return PENDING

    resp = admission(runtimes=Stuck()).review(review(trainjob(runtime_name="new")), "mutate")[0]["response"]
    assert not resp["allowed"] and "cannot answer without blocking" in resp["status"]["message"]


class API:
    """The live reads a worker makes on a miss, counted (found: the names that exist in the API server)."""

    def __init__(self, found=()):
        self.reads, self.found = [], set(found)

    def get(self, kind, namespace, name):
        self.reads.append((kind, namespace, name))
        return {"kind": kind, "metadata": {"name": name}} if name in self.found else None


@pytest.fixture
def cluster(tmp_path):
    """A worker's view of the pod's store, both kinds listed, with the given clock and API."""
    from webhook.kube.store import StoreWriter
    from webhook.kube.store_reader import StoreReader

    writer = StoreWriter(str(tmp_path))
    for kind in ("ClusterTrainingRuntime", "TrainingRuntime"):
        writer.replace(kind, [])

    def make(api, clock=lambda: 0.0):
        return writer, ClusterRuntimes(StoreReader(str(tmp_path), env=writer.env), api, clock=clock)

    return make


def test_cluster_runtimes_answer_a_miss_pending_only_where_blocking_is_forbidden(cluster):
    api = API()
    writer, runtimes = cluster(api)
    writer.put({"kind": "ClusterTrainingRuntime", "metadata": {"name": "known"}})
    with NoBlocking():
        assert runtimes.get("ClusterTrainingRuntime", "", "known").name == "known"
        assert runtimes.get("ClusterTrainingRuntime", "", "unknown") is PENDING
    assert api.reads == []
    runtimes.get("ClusterTrainingRuntime", "", "unknown")
    assert api.reads == [("ClusterTrainingRuntime", "", "unknown")]


def test_a_confirmed_miss_is_remembered_for_a_second(cluster):
    """The negative cache: a name that does not exist, asked again and again, costs one live read a second."""
    from webhook.kube.cluster import NEGATIVE_SECONDS

    now = [100.0]
    api = API()
    writer, runtimes = cluster(api, clock=lambda: now[0])
    for _ in range(5):
        assert runtimes.get("ClusterTrainingRuntime", "", "nope") is None
    assert len(api.reads) == 1
    with NoBlocking():  # answered from memory: no thread needed either
        assert runtimes.get("ClusterTrainingRuntime", "", "nope") is None
    now[0] += NEGATIVE_SECONDS
    assert runtimes.get("ClusterTrainingRuntime", "", "nope") is None and len(api.reads) == 2
    writer.put({"kind": "ClusterTrainingRuntime", "metadata": {"name": "nope"}})  # the watch brings it
    assert runtimes.get("ClusterTrainingRuntime", "", "nope").name == "nope"


def test_a_runtime_found_by_a_live_read_is_kept_until_the_watch_brings_it(cluster):
    """Created since the keeper last wrote: found by the worker's live read, then answered from memory for a
    few seconds (the watch brings it to the store meanwhile), not read again for each review."""
    from webhook.kube.cluster import FOUND_SECONDS

    now = [0.0]
    api = API(found={"new"})
    writer, runtimes = cluster(api, clock=lambda: now[0])
    assert runtimes.get("ClusterTrainingRuntime", "", "new").name == "new"
    with NoBlocking():
        assert runtimes.get("ClusterTrainingRuntime", "", "new").name == "new"
    assert len(api.reads) == 1
    now[0] += FOUND_SECONDS
    api.found.clear()  # deleted before the watch wrote it: the next review reads again and finds nothing
    assert runtimes.get("ClusterTrainingRuntime", "", "new") is None and len(api.reads) == 2


def test_no_runtime_is_answered_before_the_first_list(tmp_path):
    """A worker whose pod's keeper has not listed a kind yet answers ErrUnavailable (SPEC 7), not 'not found'."""
    from webhook.core.runtimes import RuntimeUnavailable
    from webhook.kube.store import StoreWriter
    from webhook.kube.store_reader import StoreReader

    writer = StoreWriter(str(tmp_path))
    runtimes = ClusterRuntimes(StoreReader(str(tmp_path), env=writer.env), API())
    assert not runtimes.ready()
    with pytest.raises(RuntimeUnavailable):
        runtimes.get("ClusterTrainingRuntime", "", "any")
    writer.replace("ClusterTrainingRuntime", [])
    writer.replace("TrainingRuntime", [])
    assert runtimes.ready() and runtimes.get("ClusterTrainingRuntime", "", "any") is None
