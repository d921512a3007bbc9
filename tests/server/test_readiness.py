"""SPEC 8.3: dispatch_admission_runtime_ready follows the watch cache, judged by the core's runtime rules."""

from prometheus_client import CollectorRegistry

from webhook import metrics
from webhook.cluster import Readiness, Reflector
from webhook.core.rules import runtime_facts
from webhook.core.runtimes import RuntimeIndex
from tests.helpers import ROUTE2, runtime, settings
from tests.server.test_reflector import Script, StopReflector

KIND = "ClusterTrainingRuntime"


def ready_series() -> dict:
    registry = CollectorRegistry()
    registry.register(metrics.STATE)
    return {tuple(s.labels[k] for k in ("kind", "namespace", "name")): s.value
            for m in registry.collect() if m.name == "dispatch_admission_runtime_ready" for s in m.samples}


def test_spec_8_3_readiness_gauge_follows_list_watch_and_delete():
    route2 = settings(ROUTE2)
    good = runtime("good", jobs={"node": {"initContainers": [{"name": "dispatch-publish"}], "containers": [{"name": "node"}]}})
    bad = runtime("bad")  # no init container: route 2 cannot carry the mount (R4)
    edited = runtime("good", jobs={"node": {"containers": [{"name": "node"}]}})  # the init container removed
    gone = runtime("gone")
    for obj, rv in ((good, 1), (bad, 2), (edited, 3), (gone, 4)):
        obj["metadata"]["resourceVersion"] = str(rv)
    metrics.forget_runtimes()
    script = Script([([good, bad, gone], "10"), StopReflector()], [[
        {"type": "MODIFIED", "object": edited},
        {"type": "DELETED", "object": gone},
    ], []])
    seen = []
    r = Reflector(KIND, RuntimeIndex(), script.list, script.watch, sleep=script.sleeps.append,
                  readiness=Readiness(lambda rt: seen.append(rt.name) or runtime_facts(rt, route2).can_carry))
    r.run(rounds=2)
    assert ready_series() == {(KIND, "", "good"): 0.0, (KIND, "", "bad"): 0.0}
    assert seen == ["good", "bad", "gone", "good"]


def test_spec_8_3_readiness_after_list_only():
    metrics.forget_runtimes()
    route2 = settings(ROUTE2)
    good = runtime("ok", jobs={"node": {"initContainers": [{"name": "dispatch-publish"}], "containers": [{"name": "node"}]}})
    script = Script([([good], "1"), StopReflector()], [[]])
    r = Reflector(KIND, RuntimeIndex(), script.list, script.watch, sleep=script.sleeps.append,
                  readiness=Readiness(lambda rt: runtime_facts(rt, route2).can_carry))
    r.run(rounds=2)
    assert ready_series() == {(KIND, "", "ok"): 1.0}
