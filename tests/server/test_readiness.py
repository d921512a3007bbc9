"""SPEC 8.3: dispatch_admission_runtime_ready follows the pod's runtime cache (the keeper's store, filled by
list and watch), judged at scrape time by the core's runtime rules with the settings in use."""

import pytest
from prometheus_client import CollectorRegistry

from tests.fake_api import Script, StopReflector
from tests.helpers import ROUTE1, ROUTE2, runtime, settings
from webhook.core.registry import runtime_facts
from webhook.kube.cluster import ClusterRuntimes
from webhook.kube.reflector import Reflector
from webhook.kube.store import StoreWriter
from webhook.kube.store_reader import StoreReader
from webhook.process import metrics

KIND = "ClusterTrainingRuntime"


def ready_series() -> dict:
    metrics.name_runtimes(True)  # serve --runtime-metric-labels
    registry = CollectorRegistry()
    registry.register(metrics.STATE)
    return {tuple(s.labels[k] for k in ("kind", "namespace", "name")): s.value
            for m in registry.collect() if m.name == "dispatch_admission_runtime_ready" for s in m.samples}


@pytest.fixture
def store(tmp_path):
    writer = StoreWriter(str(tmp_path))
    yield writer, ClusterRuntimes(StoreReader(str(tmp_path), env=writer.env), live=None)
    metrics.judge_runtimes(None)


def test_spec_8_3_readiness_gauge_follows_list_watch_and_delete(store):
    writer, cluster = store
    current = [settings(ROUTE2)]
    good = runtime("good",
                   jobs={"node": {"initContainers": [{"name": "dispatch-publish"}], "containers": [{"name": "node"}]}})
    bad = runtime("bad")  # no init container: route 2 cannot carry the mount (R4)
    edited = runtime("good", jobs={"node": {"containers": [{"name": "node"}]}})  # the init container removed
    gone = runtime("gone")
    for obj, rv in ((good, 1), (bad, 2), (edited, 3), (gone, 4)):
        obj["metadata"]["resourceVersion"] = str(rv)
    seen = []
    metrics.judge_runtimes(lambda: cluster.readiness(
        lambda rt: seen.append(rt.name) or runtime_facts(rt, current[0]).can_carry, lambda: current[0]))
    script = Script([([good, bad, gone], "10"), StopReflector()], [[]])
    Reflector(KIND, writer, script.list, script.watch, sleep=script.sleeps.append).run(rounds=2)
    assert ready_series() == {(KIND, "", "good"): 1.0, (KIND, "", "bad"): 0.0, (KIND, "", "gone"): 0.0}
    assert sorted(seen) == ["bad", "gone", "good"]
    assert ready_series() and len(seen) == 3, "an unchanged runtime is not judged again at the next scrape"
    script = Script([([good, bad, gone], "10"), StopReflector()], [[
        {"type": "MODIFIED", "object": edited},
        {"type": "DELETED", "object": gone},
    ], []])
    Reflector(KIND, writer, script.list, script.watch, sleep=script.sleeps.append).run(rounds=2)
    assert ready_series() == {(KIND, "", "good"): 0.0, (KIND, "", "bad"): 0.0}
    assert seen[3:] == ["good"], "only the edited runtime is judged again"
    current[0] = settings(ROUTE1)  # route 1 needs no init container: both can carry now
    assert ready_series() == {(KIND, "", "good"): 1.0, (KIND, "", "bad"): 1.0}
    assert sorted(seen[4:]) == ["bad", "good"], "new settings: every runtime judged again"


def test_spec_8_3_readiness_after_list_only(store):
    writer, cluster = store
    route2 = settings(ROUTE2)
    good = runtime("ok",
                   jobs={"node": {"initContainers": [{"name": "dispatch-publish"}], "containers": [{"name": "node"}]}})
    metrics.judge_runtimes(lambda: cluster.readiness(lambda rt: runtime_facts(rt, route2).can_carry, lambda: route2))
    script = Script([([good], "1"), StopReflector()], [[]])
    Reflector(KIND, writer, script.list, script.watch, sleep=script.sleeps.append).run(rounds=2)
    assert ready_series() == {(KIND, "", "ok"): 1.0}


def test_runtimes_are_counted_not_named_by_default():
    """Without serve --runtime-metric-labels, /metrics names no runtime (a tenant's names, or series a tenant
    could multiply): only how many of each kind cannot carry the mount."""
    verdicts = {(KIND, "", "a"): True, (KIND, "", "b"): False, (KIND, "", "c"): False,
                ("TrainingRuntime", "team-a", "d"): True}
    metrics.judge_runtimes(lambda: verdicts.items())
    try:
        metrics.name_runtimes(False)
        registry = CollectorRegistry()
        registry.register(metrics.STATE)
        families = {m.name: m for m in registry.collect()}
        assert "dispatch_admission_runtime_ready" not in families
        counts = {s.labels["kind"]: s.value for s in families["dispatch_admission_runtimes_cannot_carry"].samples}
        assert counts == {KIND: 2.0, "TrainingRuntime": 0.0}
        assert ready_series() == {k: float(v) for k, v in verdicts.items()}
    finally:
        metrics.judge_runtimes(None)
