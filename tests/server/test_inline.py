"""Reviews answered on the worker's loop: a cache miss that needs a live read goes to a thread instead."""

import pytest

from webhook.cluster import ClusterRuntimes, NoBlocking, blocking_allowed
from webhook.core.runtimes import WouldBlock
from tests.helpers import admission, review, trainjob


class Source:
    def __init__(self):
        self.calls = 0

    def get(self, kind, namespace, name):
        self.calls += 1
        if not blocking_allowed():
            raise WouldBlock("miss")
        return None

    def ready(self):
        return True


def test_would_block_passes_through_the_core_and_the_retry_answers():
    source = Source()
    adm = admission(runtimes=source)
    with NoBlocking():
        with pytest.raises(WouldBlock):
            adm.review(review(trainjob(runtime_name="new")), "mutate")
    assert blocking_allowed()
    resp = adm.review(review(trainjob(runtime_name="new")), "mutate")[0]["response"]
    assert resp["status"]["code"] == 404 and source.calls == 2  # not found, after the (allowed) live read


def test_cluster_runtimes_raise_would_block_on_a_miss_only_where_blocking_is_forbidden():
    cluster = ClusterRuntimes.__new__(ClusterRuntimes)  # no API client: only the cache path is exercised
    from webhook.core.runtimes import RuntimeIndex

    class Synced:
        synced = type("E", (), {"is_set": staticmethod(lambda: True)})()

    cluster.index = RuntimeIndex([{"kind": "ClusterTrainingRuntime", "metadata": {"name": "known"}}])
    cluster.reflectors = {"ClusterTrainingRuntime": Synced(), "TrainingRuntime": Synced()}
    cluster.clock, cluster._missing = (lambda: 0.0), {}
    read = []
    cluster._live_read = lambda *key: read.append(key)
    with NoBlocking():
        assert cluster.get("ClusterTrainingRuntime", "", "known").name == "known"
        with pytest.raises(WouldBlock):
            cluster.get("ClusterTrainingRuntime", "", "unknown")
    assert read == []
    cluster.get("ClusterTrainingRuntime", "", "unknown")
    assert read == [("ClusterTrainingRuntime", "", "unknown")]


def test_a_confirmed_miss_is_remembered_for_a_second():
    """The negative cache: a name that does not exist, asked again and again, costs one live read a second."""
    from webhook.cluster import NEGATIVE_SECONDS
    from webhook.core.runtimes import RuntimeIndex

    class Synced:
        synced = type("E", (), {"is_set": staticmethod(lambda: True)})()

    now = [100.0]
    cluster = ClusterRuntimes.__new__(ClusterRuntimes)
    cluster.index, cluster.clock, cluster._missing = RuntimeIndex(), (lambda: now[0]), {}
    cluster.reflectors = {"ClusterTrainingRuntime": Synced(), "TrainingRuntime": Synced()}
    read = []
    cluster._live_read = lambda *key: read.append(key)
    for _ in range(5):
        assert cluster.get("ClusterTrainingRuntime", "", "nope") is None
    assert len(read) == 1
    with NoBlocking():  # answered from memory: no thread needed either
        assert cluster.get("ClusterTrainingRuntime", "", "nope") is None
    now[0] += NEGATIVE_SECONDS
    assert cluster.get("ClusterTrainingRuntime", "", "nope") is None and len(read) == 2
    cluster.index.put({"kind": "ClusterTrainingRuntime", "metadata": {"name": "nope"}})  # the watch brings it
    assert cluster.get("ClusterTrainingRuntime", "", "nope").name == "nope"
