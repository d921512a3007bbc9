"""The watch cache's list/watch/relist logic, driven by recorded event streams (no API server)."""

from tests.fake_api import Script, StopReflector
from webhook.core.runtimes import RuntimeIndex
from webhook.kube.reflector import Backoff, Gone, Reflector

KIND = "ClusterTrainingRuntime"


def rt(name, rv):
    return {"kind": KIND, "metadata": {"name": name, "resourceVersion": str(rv)}}


def reflector(script, index=None):
    r = Reflector(KIND, index if index is not None else RuntimeIndex(), script.list, script.watch,
                  sleep=script.sleeps.append)
    return r


def test_list_then_watch_applies_events_in_order():
    script = Script([([rt("a", 1), rt("b", 2)], "10")], [[
        {"type": "ADDED", "object": rt("c", 11)},
        {"type": "MODIFIED", "object": {**rt("a", 12), "spec": {"mlPolicy": {"torch": {}}}}},
        {"type": "DELETED", "object": rt("b", 13)},
        {"type": "BOOKMARK", "object": {"kind": KIND, "metadata": {"resourceVersion": "20"}}},
    ], []])
    r = reflector(script)
    # Run one list-and-watch round; the script then fails the list so the loop backs off and stops.
    script.lists.append(StopReflector())
    r.run(rounds=2)
    assert r.synced.is_set()
    assert r.index.get(KIND, "", "a").policies == {"torch"}
    assert r.index.get(KIND, "", "b") is None and r.index.get(KIND, "", "c") is not None
    # The second watch resumes from the bookmark's version, without a relist.
    assert script.calls[:3] == [("list",), ("watch", "10"), ("watch", "20")]


def test_410_gone_relists_at_once():
    script = Script([([rt("a", 1)], "5"), ([rt("b", 9)], "9"), StopReflector()], [
        [{"type": "ERROR", "object": {"code": 410, "message": "too old resource version"}}],
        Gone(),
    ])
    r = reflector(script)
    r.run(rounds=3)
    assert [c[0] for c in script.calls] == ["list", "watch", "list", "watch", "list"]
    assert script.sleeps == [0.5], "410 relists without backoff; only the failed third list backs off"
    # The relist replaced the cache: a deleted runtime is forgotten.
    assert r.index.get(KIND, "", "a") is None and r.index.get(KIND, "", "b") is not None


def test_errors_back_off_exponentially_and_keep_the_cache():
    index = RuntimeIndex()
    script = Script([([rt("a", 1)], "1"), ConnectionError(), ConnectionError(), ConnectionError(), ([rt("a", 1)], "2")],
                    [ConnectionError(), []])
    r = reflector(script, index)
    r.run(rounds=4)
    assert script.sleeps == [0.5, 1.0, 2.0, 4.0]
    assert r.synced.is_set() and index.get(KIND, "", "a") is not None, "known runtimes survive API errors"
    r.run(rounds=1)
    assert script.sleeps[-1] == 0.5, "a successful list resets the backoff"


def test_watch_error_other_than_410_backs_off():
    script = Script([([], "1"), StopReflector()], [[{"type": "ERROR", "object": {"code": 500, "message": "boom"}}]])
    r = reflector(script)
    r.run(rounds=2)
    assert script.sleeps[0] == 0.5


def test_not_synced_before_first_list():
    script = Script([ConnectionError()], [])
    r = reflector(script)
    r.run(rounds=1)
    assert not r.synced.is_set()


def test_backoff_ceiling():
    b = Backoff(1, 8)
    assert [b.next() for _ in range(6)] == [1, 2, 4, 8, 8, 8]
