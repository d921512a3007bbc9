"""Answers kept for TrainJob CREATEs that repeat (webhook.core.answers, issue 49): found only with the same verb,
namespace, spec, settings, runtime and admission time; refusals never kept; bounded in entries and key size."""

import copy
import dataclasses

from tests.helpers import ROUTE1, ROUTE2, Clock, Runtimes, admission, ops_of, review, runtime, settings, trainjob
from webhook.core import answers, patch
from webhook.core.admission import MUTATE, Admission


def decide(adm: Admission, obj: dict, verb: str = "mutate", uid: str = "uid-1") -> tuple[dict, int]:
    """The response and how many plans the review made (0: answered from a kept answer)."""
    before = adm.plans
    resp = adm.review(review(obj, uid=uid), verb)[0]["response"]
    return resp, adm.plans - before


def kept_under(obj: dict) -> answers.Key | None:
    return answers.Answers().find(review(obj), MUTATE, None, Runtimes(), str)[1]


def test_a_repeated_create_is_answered_as_it_was_decided_with_its_own_uid():
    adm = admission()
    first, planned = decide(adm, trainjob(name="a"))
    assert planned == 1 and len(adm.answers) == 1
    again, planned = decide(adm, trainjob(name="b"), uid="uid-2")
    assert planned == 0 and again == {**first, "uid": "uid-2"}
    fresh, _ = decide(admission(), trainjob(name="b"), uid="uid-2")
    assert again == fresh  # what deciding in full answers


def test_each_verb_namespace_and_spec_is_kept_apart():
    adm = admission()
    mutated = patch.apply(trainjob(), ops_of(decide(adm, trainjob())[0]))
    for obj, verb in ((mutated, "validate"), (trainjob(namespace="team-b"), "mutate"),
                      (trainjob(numProcPerNode=2), "mutate")):
        assert decide(adm, obj, verb)[1] == 1
    assert len(adm.answers) == 4
    assert decide(adm, mutated, "validate") == ({"uid": "uid-1", "allowed": True}, 0)


def test_a_refusal_is_not_kept():
    adm = admission()
    refused = trainjob(runtime_name="missing")
    assert decide(adm, refused)[0]["allowed"] is False
    assert decide(adm, refused)[1] == 1 and len(adm.answers) == 0


def test_a_changed_runtime_is_read_and_decided_again():
    runtimes = Runtimes(runtime())
    adm = Admission(settings(ROUTE1), runtimes)
    decide(adm, trainjob())
    reads = runtimes.reads
    assert decide(adm, trainjob())[1] == 0 and runtimes.reads == reads + 1  # read on every review
    runtimes.index.put(runtime(jobs={"node": {"containers": [{"name": "other"}]}}))  # no `node` container: R3
    resp, planned = decide(adm, trainjob())
    assert planned == 1 and resp["allowed"] is False
    runtimes.index.delete(runtime())
    assert decide(adm, trainjob())[0]["allowed"] is False


def test_switched_settings_decide_again():
    adm = Admission(settings(ROUTE1), Runtimes(runtime()), grace=0)
    decide(adm, trainjob())
    assert adm.switch(dataclasses.replace(adm.settings, manager="other.example.com"))
    resp, planned = decide(adm, trainjob())
    assert planned == 1 and ops_of(resp)[0]["value"][0]["manager"] == "other.example.com"


def test_nothing_is_kept_while_the_previous_settings_grace_lasts():
    clock = Clock()
    adm = Admission(settings(ROUTE1), Runtimes(runtime()), monotonic=clock, grace=600)
    adm.switch(dataclasses.replace(adm.settings, manager="other.example.com"))
    decide(adm, trainjob())
    assert len(adm.answers) == 0
    clock.now += 600
    decide(adm, trainjob())
    assert len(adm.answers) == 1


def test_a_new_second_stamps_a_new_time():
    now = [admission().clock.now()]
    adm = Admission(settings(ROUTE1), Runtimes(runtime()), clock=lambda: now[0])
    first, _ = decide(adm, trainjob())
    now[0] = now[0].replace(second=(now[0].second + 1) % 60)
    second, planned = decide(adm, trainjob())
    assert planned == 1 and ops_of(first)[0]["value"][0]["time"] != ops_of(second)[0]["value"][0]["time"]


def test_a_spec_is_kept_up_to_key_limit_bytes_as_json_with_its_namespace():
    def job_of_size(size: int) -> dict:
        job = trainjob(env=[{"name": "A", "value": ""}])
        base = len(answers.orjson.dumps(job["spec"], option=answers.orjson.OPT_SORT_KEYS))
        job["spec"]["trainer"]["env"][0]["value"] = "x" * (size - base - len(job["metadata"]["namespace"]))
        return job

    at, over = job_of_size(answers.KEY_LIMIT), job_of_size(answers.KEY_LIMIT + 1)
    assert kept_under(at) is not None
    assert kept_under(over) is None
    adm = admission()
    decide(adm, at), decide(adm, over)
    assert len(adm.answers) == 1


def test_a_spec_orjson_cannot_write_is_decided_in_full():
    job = trainjob(numProcPerNode=2 ** 64)
    assert kept_under(job) is None
    adm = admission()
    decide(adm, job)
    assert decide(adm, job)[1] == 1 and len(adm.answers) == 0


def test_at_most_entries_answers_are_kept_the_oldest_dropped_first():
    adm = admission()
    adm.answers = answers.Answers(entries=3)
    jobs = [trainjob(namespace=f"ns-{i}") for i in range(4)]
    for job in jobs[:3]:
        decide(adm, job)
    assert len(adm.answers) == 3
    decide(adm, jobs[3])
    assert len(adm.answers) == 3
    assert [decide(adm, job)[1] for job in jobs[1:]] == [0, 0, 0]
    assert decide(adm, jobs[0])[1] == 1


def test_a_kept_answer_hands_out_copies():
    adm = admission(ROUTE2)
    first, _ = decide(adm, trainjob(runtime_name="torch-init"))
    assert first.get("warnings")
    first["warnings"].append("changed by its receiver")
    again, planned = decide(adm, copy.deepcopy(trainjob(runtime_name="torch-init")))
    assert planned == 0 and "changed by its receiver" not in again["warnings"]


# What a rule's hook is handed, by point. Kept answers are sound because no hook sees more than the key (the verb,
# namespace and spec) and what a kept answer is found with (the settings, the runtime, the second): no context
# carries the TrainJob's metadata, the request or its user. A new field here must keep that true, or `Answers.find`
# must key on it too.
CONTEXT_FIELDS = {
    "InEntry": {"settings", "reasons", "field", "name", "item", "job", "container", "mount_path", "normal", "looks"},
    "TrainerEnv": {"settings", "reasons", "spec", "field", "name"},
    "RefGiven": {"reasons", "spec", "ref", "name", "api_group", "kind", "group_ok", "kind_ok"},
    "Lookup": {"reasons", "ref", "runtime"},
    "OfRuntime": {"settings", "reasons", "runtime", "targets"},
    "RuntimeMount": {"settings", "reasons", "runtime", "job", "target", "container", "volume", "source"},
    "AgainstRuntime": {"settings", "reasons", "spec", "ref", "facts", "env"},
    "OwnEntry": {"settings", "reasons", "own", "entry", "previous", "create", "readable", "duplicate"},
    "EntryUpdate": {"settings", "reasons", "own", "old_own"},
    "Room": {"reasons", "count"},
    "Unreadable": {"reasons", "field", "text"},
}


def test_no_hook_sees_what_a_kept_answer_is_not_keyed_on():
    from webhook.core.rule import Point

    for point in Point:
        context = point.value[1]
        got = {f.name for f in dataclasses.fields(context)}
        assert got == CONTEXT_FIELDS[context.__name__], (
            f"{point.name}'s context {context.__name__} changed: {sorted(got)}; if a hook can now see what the key"
            " of a kept answer does not hold (metadata, the request, its user), key on it in webhook.core.answers")


# ---- what an attacker's review of kept answers found (2026-12-07): each decided in full now ----

def test_a_namespace_counts_toward_the_key_limit():
    """A direct caller's namespace of any size would be held by a kept answer (256 of them: the worker's memory)."""
    adm = admission()
    decide(adm, trainjob(namespace="n" * answers.KEY_LIMIT))
    assert len(adm.answers) == 0


def test_nan_and_infinities_are_not_kept_under_null():
    """orjson writes NaN and infinities as null; the body's parser reads them as floats, which the rules refuse."""
    for bad in (float("nan"), float("inf"), float("-inf")):
        adm = admission()
        nulled = trainjob()
        nulled["spec"]["trainer"] = None
        assert decide(adm, nulled)[0]["allowed"]
        odd = trainjob()
        odd["spec"]["trainer"] = bad
        got, planned = decide(adm, odd, uid="uid-2")
        assert planned == 1 and not got["allowed"], (bad, got)
        assert "spec.trainer: must be an object" in got["status"]["message"]


def test_a_fault_of_the_runtime_source_on_a_kept_key_is_decided_in_full():
    class Flaky(Runtimes):
        broken = False

        def get(self, kind, namespace, name):
            if self.broken:
                raise OSError("lmdb: MDB_READERS_FULL")
            return super().get(kind, namespace, name)

    source = Flaky(runtime())
    adm = Admission(settings(ROUTE1), source)
    assert decide(adm, trainjob(name="a"))[0]["allowed"] and len(adm.answers) == 1
    source.broken = True
    got, planned = decide(adm, trainjob(name="b"), uid="uid-2")
    assert planned == 1 and not got["allowed"] and "ErrInternal" in got["status"]["message"]


def test_nothing_is_kept_in_warn_mode():
    """In warn mode a fault admits with a would-deny warning and no patch: kept, it would outlive the fault."""
    from webhook.core.admission import Enforcement

    adm = Admission(settings(ROUTE1), Runtimes(runtime()), enforcement=Enforcement.WARN)
    got = decide(adm, trainjob())[0]
    assert got["allowed"] and "patch" in got and len(adm.answers) == 0


def test_an_answer_planned_with_the_previous_settings_is_not_kept_when_the_grace_ends_before_keeping():
    class Stepping:  # each read a little later: the grace ends between the plan's read and the keeping's
        def __init__(self, now: float):
            self.now = now

        def __call__(self) -> float:
            self.now += 0.001
            return self.now

    old = settings(ROUTE1)
    new = settings({"publish": {"image": ROUTE1["publish"]["image"][:-4] + "beef"}})
    mutated_old = patch.apply(trainjob(), ops_of(decide(Admission(old, Runtimes(runtime())), trainjob())[0]))
    clock = Stepping(1000.0)
    adm = Admission(old, Runtimes(runtime()), monotonic=clock, grace=600)
    adm.switch(new)
    clock.now = adm._live.previous_until - 0.0015
    assert decide(adm, mutated_old, "validate")[0]["allowed"]
    assert len(adm.answers) == 0
    clock.now += 3600
    assert not decide(adm, mutated_old, "validate", uid="u2")[0]["allowed"]  # S4, after the grace


def test_an_empty_metadata_name_takes_the_requests():
    adm = admission()
    obj = trainjob()
    decide(adm, obj)
    obj["metadata"]["name"] = ""
    doc = review(obj, uid="uid-2")
    doc["request"]["name"] = "from-request"
    result, outcome = adm.review(doc, "mutate")
    assert outcome.name == "from-request"
