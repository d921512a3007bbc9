"""Live reads on a cache miss, bounded per pod (issue 33, item 3): the keeper's answers (one read in flight per
name, a token bucket per namespace (issue 47) under the pod's ceiling, a cap on reads at once,
what it found and missed remembered) and the worker's side over a real Unix socket."""

from __future__ import annotations

import threading
import time

import pytest

from tests.helpers import runtime
from webhook.core.runtimes import Runtime, RuntimeUnavailable
from webhook.kube import live_reads
from webhook.kube.cluster import ClusterRuntimes
from webhook.kube.store import StoreWriter
from webhook.kube.store_reader import StoreReader
from webhook.process.blocking import NoBlocking

KIND = "ClusterTrainingRuntime"


class API:
    """The API server's GET, counted; `slow` makes each read wait (reads in flight overlap)."""

    def __init__(self, found=(), slow: float = 0.0, fail: Exception | None = None):
        self.found, self.slow, self.fail = set(found), slow, fail
        self.reads: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()

    def get(self, kind, namespace, name):
        with self._lock:
            self.reads.append((kind, namespace, name))
        if self.slow:
            time.sleep(self.slow)
        if self.fail:
            raise self.fail
        return runtime(name) if name in self.found else None


def test_a_name_that_cannot_exist_is_missing_without_a_read():
    api = API()
    answers = live_reads.Answers(api.get)
    for name in ("UPPER", "a" * 254, "", "x/y", "-lead", "sp ace", "\u0430bc"):
        assert answers.answer(KIND, "", name)[0] == "missing"
    assert answers.answer("TrainingRuntime", "Not_A_Namespace", "ok")[0] == "missing"
    assert answers.answer("Pod", "", "ok")[0] == "missing"
    assert api.reads == []


def test_one_namespace_emptying_its_bucket_does_not_limit_another():
    """Issue 47: a tenant's dry-run creates naming random runtimes in its namespace empty its own bucket; another
    namespace's live reads, and the ClusterTrainingRuntimes', go on."""
    now = [0.0]
    api = API(found={"new-runtime"})
    answers = live_reads.Answers(api.get, rate=2.0, burst=3, clock=lambda: now[0])
    ns = "TrainingRuntime"
    flood = [answers.answer(ns, "tenant-a", f"random-{i}")[0] for i in range(50)]
    assert flood == ["missing"] * 3 + ["limited"] * 47
    assert answers.answer(ns, "tenant-b", "new-runtime")[0] == "found"
    assert answers.answer(KIND, "", "new-runtime")[0] == "found"
    assert [answers.answer(ns, "tenant-b", f"b-{i}")[0] for i in range(3)] == ["missing", "missing", "limited"]
    assert answers.answer(ns, "tenant-a", "still-limited")[0] == "limited"


def test_random_cluster_runtime_names_empty_the_asking_namespaces_bucket_only():
    """A ClusterTrainingRuntime's live read is paid for by the namespace of the TrainJob naming it: one tenant's
    random cluster names do not refuse another tenant's new ClusterTrainingRuntime (one bucket for all of them did),
    and what a read found is answered to every namespace from memory, with no token."""
    now = [0.0]
    api = API(found={"new-cluster-runtime"})
    answers = live_reads.Answers(api.get, rate=2.0, burst=3, clock=lambda: now[0])
    flood = [answers.answer(KIND, "tenant-a", f"random-{i}")[0] for i in range(50)]
    assert flood == ["missing"] * 3 + ["limited"] * 47
    assert answers.answer(KIND, "tenant-b", "new-cluster-runtime")[0] == "found"
    assert answers.answer(KIND, "tenant-a", "new-cluster-runtime")[0] == "found", "remembered, whoever asked"
    assert answers.answer("TrainingRuntime", "tenant-a", "any")[0] == "limited", "one bucket a namespace, both kinds"
    assert len(api.reads) == 4
    assert [answers.answer(KIND, "", f"c-{i}")[0] for i in range(4)] == ["missing"] * 3 + ["limited"]
    assert answers.answer(KIND, "x" * 64, "c-x")[0] == "limited", "no namespace is that long: the shared bucket"
    assert answers.answer(KIND, "y" * 63, "c-y")[0] == "missing"


def test_the_buckets_are_bounded_and_the_pod_keeps_a_ceiling():
    """At most BUCKETS namespaces hold a bucket (the least recently used forgotten), and reviews spread over
    namespaces still read the API server at most POD_SHARES times a namespace's burst at once."""
    now = [0.0]
    buckets = live_reads.Buckets(rate=1.0, burst=1, clock=lambda: now[0], most=3)
    assert [buckets.take(f"ns-{i}") for i in range(5)] == [True] * 5  # a burst of 1 each, within the ceiling of 5
    assert len(buckets) == 3
    assert buckets.take("ns-6") is False, "the pod's ceiling (5 at once) is empty"
    now[0] += 0.5  # the ceiling has 2.5 tokens again, each namespace's bucket half of one
    assert buckets.take("ns-4") is False, "ns-4's own bucket is still empty"
    assert buckets.take("ns-0") is True, "forgotten, ns-0 starts again full"
    assert [buckets.take("ns-0") for _ in range(2)] == [False, False]
    assert len(live_reads.Buckets(10.0, 20)._buckets) == 0 and live_reads.BUCKETS == 1000
    answers = live_reads.Answers(API().get, rate=1.0, burst=1, clock=lambda: now[0])
    got = [answers.answer("TrainingRuntime", f"ns-{i}", "x")[0] for i in range(live_reads.BUCKETS + 50)]
    assert got.count("missing") == live_reads.POD_SHARES and len(answers.buckets) == live_reads.BUCKETS


def test_a_namespace_refused_by_the_ceiling_keeps_its_token():
    """One tenant's flood empties the pod's ceiling: another namespace's reads refused by it meanwhile do not spend
    that namespace's own tokens, so it reads again as soon as the ceiling refills."""
    now = [0.0]
    buckets = live_reads.Buckets(rate=0.1, burst=2, clock=lambda: now[0])
    while buckets.take("flood"):
        pass
    for i in range(live_reads.BUCKETS):  # the flood across namespaces empties the ceiling
        buckets.take(f"flood-{i}")
    assert [buckets.take("quiet") for _ in range(5)] == [False] * 5, "the ceiling is empty"
    now[0] += 10 / live_reads.POD_SHARES * 2  # the ceiling refills 2 tokens; "quiet"'s own bucket under 1 more
    assert [buckets.take("quiet") for _ in range(2)] == [True, True], "quiet's burst was not spent while refused"


def test_over_the_rate_the_answer_is_limited_at_once():
    now = [0.0]
    api = API()
    answers = live_reads.Answers(api.get, rate=2.0, burst=3, clock=lambda: now[0])
    got = [answers.answer(KIND, "", f"random-{i}")[0] for i in range(10)]
    assert got == ["missing"] * 3 + ["limited"] * 7 and len(api.reads) == 3
    now[0] += 1.0  # two more tokens a second later
    got = [answers.answer(KIND, "", f"later-{i}")[0] for i in range(4)]
    assert got == ["missing", "missing", "limited", "limited"] and len(api.reads) == 5


def test_one_read_in_flight_per_name_shared_by_every_asker():
    api = API(found={"new"}, slow=0.3)
    answers = live_reads.Answers(api.get, rate=100, burst=100)
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(answers.answer(KIND, "", "new"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(api.reads) == 1, "eight askers, one read"
    assert [r[0] for r in results] == ["found"] * 8
    assert Runtime.from_bytes(results[0][1]).name == "new"


def test_reads_at_once_are_capped():
    api = API(slow=0.5)
    answers = live_reads.Answers(api.get, rate=100, burst=100, in_flight=2)
    results: list = []
    threads = [threading.Thread(target=lambda i=i: results.append(answers.answer(KIND, "", f"n{i}")[0]))
               for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["busy"] * 3 + ["missing"] * 2 and len(api.reads) == 2


def test_found_and_missing_are_remembered_for_a_while():
    now = [0.0]
    api = API(found={"new"})
    answers = live_reads.Answers(api.get, rate=100, burst=100, clock=lambda: now[0])
    for _ in range(3):
        assert answers.answer(KIND, "", "new")[0] == "found"
        assert answers.answer(KIND, "", "gone")[0] == "missing"
    assert len(api.reads) == 2
    now[0] += live_reads.MISSING_SECONDS
    answers.answer(KIND, "", "gone")
    answers.answer(KIND, "", "new")
    assert len(api.reads) == 3, "a miss is read again after a second, a runtime found after five"
    now[0] += live_reads.FOUND_SECONDS
    answers.answer(KIND, "", "new")
    assert len(api.reads) == 4


def test_a_workers_remembered_names_are_read_and_written_from_two_threads_at_once(monkeypatch):
    """The worker's loop reads what live reads answered while a review on a thread writes it: names forgotten (the
    bound) between a read's lookup and its move to the end raised KeyError before the lock."""
    import sys

    from webhook.kube import cluster

    monkeypatch.setattr(cluster, "REMEMBERED", 50)
    remembered, errors = cluster._Remembered(), []

    def run(step):
        try:
            for i in range(60_000):
                step(("TrainingRuntime", "ns", str(i % 120)))
        except Exception as e:
            errors.append(repr(e))

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two bytecodes, as on a loaded worker
    try:
        threads = [threading.Thread(target=run, args=(lambda k: remembered.put(k, 1e9, None),)),
                   *[threading.Thread(target=run, args=(lambda k: remembered.get(k, 0.0),)) for _ in range(2)]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert errors == []


def test_an_api_error_is_unavailable_and_not_remembered():
    api = API(fail=RuntimeUnavailable("the API server answered 500"))
    answers = live_reads.Answers(api.get, rate=100, burst=100)
    for _ in range(2):
        outcome, why = answers.answer(KIND, "", "x")
        assert outcome == "unavailable" and b"500" in why
    assert len(api.reads) == 2


@pytest.fixture
def keeper_socket(tmp_path):
    """A keeper's socket answering from `API`, and the worker's side of it."""
    made = []

    def start(api: API, **kw):
        server = live_reads.Server(str(tmp_path), live_reads.Answers(api.get, **kw))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        made.append(server)
        return live_reads.LiveReads(str(tmp_path))

    yield start
    for server in made:
        server.shutdown()
        server.server_close()


def test_the_worker_asks_the_keeper_over_its_socket(keeper_socket):
    api = API(found={"new"})
    reads = keeper_socket(api, rate=1.0, burst=2)
    assert reads.get(KIND, "team-a", "new").name == "new"
    assert reads.get(KIND, "team-a", "absent") is None
    with pytest.raises(RuntimeUnavailable, match="for namespace team-a are over their limit"):
        reads.get(KIND, "team-a", "third")
    assert reads.get(KIND, "team-b", "third") is None, "the TrainJob's namespace pays: team-b's bucket is full"
    assert reads.get(KIND, "", "new").name == "new", "remembered: no token needed"
    assert reads.get(KIND, "", "Not-Valid") is None
    assert len(api.reads) == 3


def test_no_keeper_is_unavailable_not_missing(tmp_path):
    with pytest.raises(RuntimeUnavailable, match="keeper cannot be asked"):
        live_reads.LiveReads(str(tmp_path)).get(KIND, "", "any")


def test_a_cached_runtime_is_answered_whatever_the_live_reads(tmp_path, keeper_socket):
    """Over the pod's rate, a review naming a runtime the store holds is answered as ever; one the store lacks
    gets ErrUnavailable (503) for that review only."""
    from tests.helpers import admission, answer, review, trainjob

    writer = StoreWriter(str(tmp_path))
    for kind in ("ClusterTrainingRuntime", "TrainingRuntime"):
        writer.replace(kind, [runtime("torch-distributed")] if kind == KIND else [])
    api = API()
    source = ClusterRuntimes(StoreReader(str(tmp_path), env=writer.env), keeper_socket(api, rate=0.001, burst=1))
    adm = admission(runtimes=source)
    assert answer(adm, trainjob(runtime_name="random-1"))["status"]["code"] == 404
    limited = answer(adm, trainjob(runtime_name="random-2"))
    assert limited["status"]["code"] == 503 and "over their limit" in limited["status"]["message"]
    for _ in range(20):
        assert answer(adm, trainjob())["allowed"]
    with NoBlocking():  # the worker remembers the miss a second: no thread, no socket
        assert answer(adm, trainjob(runtime_name="random-1"))["status"]["code"] == 404
        assert adm.begin(review(trainjob(runtime_name="random-3")), "mutate").read is not None  # waits for a thread
    assert len(api.reads) == 1
