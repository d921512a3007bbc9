"""SPEC 6.3 (updates are ratcheted, the entry is written on CREATE only) and SPEC 2.1 (settings change while
serving), called as functions.

Kueue v0.19.2's writes to a TrainJob are replayed as the AdmissionReviews the API server sends (read from
its pkg/controller/jobs/trainjob; docs/kueue.md): W1 its create webhook suspends the job
and appends its empty entry; W2a it fills that entry while the job is suspended; W2b it resumes the job;
W3a it suspends a running job to preempt it; W3b it clears its entry.
"""

from __future__ import annotations

import copy

import pytest

from tests.helpers import (
    IMAGE,
    MANAGER,
    NOW,
    ROUTE1,
    Clock,
    Runtimes,
    answer,
    fields,
    mount_patch,
    mutated,
    ops_of,
    runtime,
    sentinels,
    settings,
    trainjob,
)
from webhook.core import patch
from webhook.core.admission import PREVIOUS_SETTINGS_GRACE, Admission
from webhook.core.runtimes import RuntimeIndex

KUEUE = "kueue.x-k8s.io/manager"
OTHER_IMAGE = "registry.example/publish@sha256:" + "c" * 64


def kueue_entry(filled: bool = False) -> dict:
    """Kueue's entry: empty at create (W1, W3b); at admission (W2a) its pod set's labels and scheduling."""
    spec: dict = {}
    if filled:
        spec = {"replicatedJobs": [{"name": "node", "template": {
            "metadata": {"labels": {"kueue.x-k8s.io/podset": "node"}},
            "spec": {"template": {
                "metadata": {"labels": {"kueue.x-k8s.io/podset": "node", "kueue.x-k8s.io/queue-name": "lq"}},
                "spec": {"nodeSelector": {"pool": "a"}, "tolerations": [{"key": "gpu", "operator": "Exists"}],
                         "schedulingGates": [{"name": "kueue.x-k8s.io/topology"}]}}}}}]}
    return {"manager": KUEUE, "trainingRuntimeSpec": {"template": {"spec": spec}}}


def torch_rt(**kw) -> dict:
    return runtime(name="torch-distributed", **kw)


def adm_with(source, doc=None, **kw) -> Admission:
    return Admission(settings(doc), source, clock=lambda: NOW, **kw)


def both(adm, new, old) -> list[dict]:
    return [answer(adm, new, ep, operation="UPDATE", old=old) for ep in ("mutate", "validate")]


def assert_admitted_unpatched(adm, new, old) -> list[dict]:
    answers = both(adm, new, old)
    for resp in answers:
        assert resp["allowed"] and "patch" not in resp, resp
    return answers


def queued_create(adm, ours_first: bool) -> dict:
    """W1 around ours: Kueue's create webhook before or after ours (configuration names order them)."""
    job = trainjob()
    if ours_first:
        job = mutated(adm, job)
        job["spec"]["suspend"] = True
        job["spec"]["runtimePatches"].append(kueue_entry())
    else:
        job["spec"]["suspend"] = True
        job["spec"]["runtimePatches"] = [kueue_entry()]
        job = mutated(adm, job)
    assert answer(adm, job, "validate")["allowed"]
    return job


# ---- Kueue's writes ----

@pytest.mark.parametrize("ours_first", [True, False], ids=["ours-before-kueue", "ours-after-kueue"])
def test_kueue_create_then_admission_resume_preemption_and_clear(ours_first):
    source = Runtimes(torch_rt())
    adm = adm_with(source)
    job = queued_create(adm, ours_first)
    managers = [e["manager"] for e in job["spec"]["runtimePatches"]]
    assert managers == ([MANAGER, KUEUE] if ours_first else [KUEUE, MANAGER])
    ours = copy.deepcopy(job["spec"]["runtimePatches"][managers.index(MANAGER)])
    k = managers.index(KUEUE)

    filled = copy.deepcopy(job)  # W2a
    filled["spec"]["runtimePatches"][k] = kueue_entry(filled=True)
    assert_admitted_unpatched(adm, filled, job)
    running = copy.deepcopy(filled)  # W2b
    running["spec"]["suspend"] = False
    assert_admitted_unpatched(adm, running, filled)
    preempted = copy.deepcopy(running)  # W3a
    preempted["spec"]["suspend"] = True
    reads = source.reads
    assert_admitted_unpatched(adm, preempted, running)
    assert source.reads == reads  # a suspend changes nothing the runtime rules read
    cleared = copy.deepcopy(preempted)  # W3b
    cleared["spec"]["runtimePatches"][k] = kueue_entry()
    assert_admitted_unpatched(adm, cleared, preempted)
    for stored in (filled, running, preempted, cleared):  # our entry, time included, never changed
        assert stored["spec"]["runtimePatches"][managers.index(MANAGER)] == ours


@pytest.mark.parametrize("change", ["edited-R5", "deleted", "lost-node"])
def test_kueue_preempts_a_running_job_whose_runtime_changed(change):
    source = Runtimes(torch_rt())
    adm = adm_with(source)
    running = queued_create(adm, ours_first=True)
    running["spec"]["suspend"] = False
    if change == "deleted":
        source.index = RuntimeIndex([])
    elif change == "edited-R5":
        source.index = RuntimeIndex([torch_rt(jobs={"node": {"containers": [
            {"name": "node", "volumeMounts": [{"name": "x", "mountPath": "/opt/dispatch"}]}],
            "volumes": [{"name": "x", "emptyDir": {}}]}})])
    else:
        source.index = RuntimeIndex([torch_rt(jobs={"node": {"containers": [{"name": "trainer"}]}})])
    preempted = copy.deepcopy(running)
    preempted["spec"]["suspend"] = True
    assert_admitted_unpatched(adm, preempted, running)
    cleared = copy.deepcopy(preempted)
    cleared["spec"]["runtimePatches"][1] = kueue_entry()
    assert_admitted_unpatched(adm, cleared, preempted)
    resumed = copy.deepcopy(cleared)  # re-admitted: Kueue fills its entry and resumes
    resumed["spec"]["runtimePatches"][1] = kueue_entry(filled=True)
    resumed["spec"]["suspend"] = False
    assert_admitted_unpatched(adm, resumed, cleared)


def test_kueue_writes_to_a_job_created_before_the_webhook():
    """No entry is ever added; every write is admitted, with the warning that the job runs without the mount."""
    adm = adm_with(Runtimes(torch_rt()))
    created = trainjob(suspend=True, patches=[kueue_entry()])  # stored before our webhook was installed
    steps = [created]
    for write in ("fill", "resume", "preempt", "clear", "fill", "resume"):
        new = copy.deepcopy(steps[-1])
        if write == "fill":
            new["spec"]["runtimePatches"][0] = kueue_entry(filled=True)
        elif write == "clear":
            new["spec"]["runtimePatches"][0] = kueue_entry()
        else:
            new["spec"]["suspend"] = write == "preempt"
        mutate, validate = assert_admitted_unpatched(adm, new, steps[-1])
        assert any("runs without /opt/dispatch/publish" in w for w in mutate["warnings"]), write
        steps.append(new)


def test_pre_webhook_job_with_a_dispatch_env_or_a_deleted_runtime_can_be_suspended():
    for old in (trainjob(env=[{"name": "DISPATCH_X", "value": "1"}]), trainjob(runtime_name="gone")):
        new = copy.deepcopy(old)
        new["spec"]["suspend"] = True
        assert_admitted_unpatched(adm_with(Runtimes(torch_rt())), new, old)


def test_a_suspend_never_reads_the_runtime_so_an_unreadable_one_is_no_refusal():
    source = Runtimes(torch_rt())
    running = queued_create(adm_with(source), ours_first=True)
    running["spec"]["suspend"] = False
    offline = Runtimes(unavailable=True)
    suspended = copy.deepcopy(running)
    suspended["spec"]["suspend"] = True
    answers = assert_admitted_unpatched(adm_with(offline), suspended, running)
    assert offline.reads == 0 and not any("ErrUnavailable" in str(a) for a in answers)


# ---- ratcheting: a reason the old object gives does not refuse; a new one does ----

def test_a_reason_the_old_object_already_gives_does_not_refuse():
    old = trainjob(env=[{"name": "DISPATCH_X", "value": "1"}], runtime_name="gone", suspend=True)
    new = copy.deepcopy(old)
    new["spec"]["trainer"]["env"].append({"name": "LOG_LEVEL", "value": "debug"})  # the runtime rules are read
    source = Runtimes(torch_rt())
    assert_admitted_unpatched(adm_with(source), new, old)
    assert source.reads == 2  # one read per endpoint, shared by the old and the new object


def old_and_new(**kw) -> tuple[dict, dict]:
    old = trainjob(suspend=True, **kw)
    return old, copy.deepcopy(old)


def refused(adm, new, old) -> tuple[list[str], list[str]]:
    answers = both(adm, new, old)
    for resp in answers:
        assert resp["allowed"] is False, resp
    assert fields(answers[0]) == fields(answers[1])
    return fields(answers[1]), sentinels(answers[1])


def test_a_second_dispatch_env_is_new():
    old, new = old_and_new(env=[{"name": "DISPATCH_X", "value": "1"}])
    new["spec"]["trainer"]["env"].insert(0, {"name": "DISPATCH_Y", "value": "2"})  # moves DISPATCH_X's index
    assert refused(adm_with(Runtimes(torch_rt())), new, old) == (["spec.trainer.env[0].name"], ["ErrInvalid"])


def test_the_same_dispatch_env_twice_is_new():
    old, new = old_and_new(env=[{"name": "DISPATCH_X", "value": "1"}])
    new["spec"]["trainer"]["env"].append({"name": "DISPATCH_X", "value": "1"})
    assert refused(adm_with(Runtimes(torch_rt())), new, old)[1] == ["ErrInvalid"]


def test_an_entry_mounting_under_opt_dispatch_is_new():
    old, new = old_and_new(patches=[mount_patch("/var/scratch")])
    new["spec"]["runtimePatches"].append(mount_patch("/opt/./dispatch//x", manager="b.io/y"))
    got = refused(adm_with(Runtimes(torch_rt())), new, old)
    assert got[0] == ["spec.runtimePatches[1].trainingRuntimeSpec.template.spec.replicatedJobs[0].template.spec"
                      ".template.spec.containers[0].volumeMounts[0].mountPath"]


def test_an_old_bad_entry_moved_by_an_entry_put_before_it_is_not_new():
    """Reasons of an entry are compared by its manager, not its index."""
    old, new = old_and_new(patches=[mount_patch("/opt/dispatch/x", manager="a.io/x")])
    new["spec"]["runtimePatches"].insert(0, kueue_entry(filled=True))
    assert_admitted_unpatched(adm_with(Runtimes(torch_rt())), new, old)


def test_runtime_ref_pointed_at_a_missing_runtime_is_new():
    old, new = old_and_new()
    new["spec"]["runtimeRef"]["name"] = "missing"
    assert refused(adm_with(Runtimes(torch_rt())), new, old) == (["spec.runtimeRef.name"], ["ErrNotFound"])


def test_num_proc_per_node_added_on_a_jax_runtime_is_new():
    jax = runtime(name="jax-distributed", torch=False)
    jax["spec"]["mlPolicy"]["jax"] = {}
    old, new = old_and_new(runtime_name="jax-distributed")
    new["spec"]["trainer"] = {"numProcPerNode": 4}
    assert refused(adm_with(Runtimes(jax)), new, old) == (["spec.trainer.numProcPerNode"], ["ErrUnsupported"])


def test_the_runtime_is_read_only_when_the_update_changes_what_its_rules_read():
    source = Runtimes(torch_rt())
    old, new = old_and_new(patches=[kueue_entry()])
    new["spec"]["runtimePatches"][0] = kueue_entry(filled=True)  # another manager's entry, same count
    new["metadata"]["labels"] = {"a": "b"}
    assert_admitted_unpatched(adm_with(source), new, old)
    assert source.reads == 0
    for change in ({"numProcPerNode": 2}, {"env": [{"name": "A", "value": "1"}]}):
        new = copy.deepcopy(old)
        new["spec"]["trainer"] = change
        assert_admitted_unpatched(adm_with(source), new, old)
    assert source.reads == 4  # twice per change: once per endpoint


# ---- SPEC 2.1: settings that change while serving ----

def entry_from(doc) -> dict:
    return mutated(adm_with(Runtimes(torch_rt()), doc), trainjob())


def test_after_a_switch_the_previous_settings_entry_is_accepted_on_create_for_ten_minutes():
    clock = Clock()
    adm = adm_with(Runtimes(torch_rt()), monotonic=clock)
    old_job = entry_from(ROUTE1)
    assert adm.switch(settings({"publish": {"image": OTHER_IMAGE}}))
    assert not adm.switch(settings({"publish": {"image": OTHER_IMAGE}}))  # the same settings: no switch
    assert answer(adm, old_job, "validate")["allowed"]
    assert answer(adm, entry_from({"publish": {"image": OTHER_IMAGE}}), "validate")["allowed"]
    clock.now += PREVIOUS_SETTINGS_GRACE
    resp = answer(adm, old_job, "validate")
    assert resp["allowed"] is False and "S4" not in str(resp) and fields(resp) == ["spec.runtimePatches[0]"]
    # the mutating endpoint always writes what the current settings produce
    job = trainjob(patches=[old_job["spec"]["runtimePatches"][0]])
    replaced = patch.apply(job, ops_of(answer(adm, job)))
    assert OTHER_IMAGE in str(replaced) and IMAGE not in str(replaced)


def test_before_an_s4_refusal_the_settings_are_read_once_more():
    newer = settings({"publish": {"image": OTHER_IMAGE}})
    calls = []

    def refresh():
        calls.append(1)
        return newer

    adm = adm_with(Runtimes(torch_rt()), refresh=refresh)
    assert answer(adm, entry_from(ROUTE1), "validate")["allowed"] and not calls  # no S4: no read
    assert answer(adm, entry_from({"publish": {"image": OTHER_IMAGE}}), "validate")["allowed"]
    assert calls == [1] and adm.settings == newer
    # now the old entry is the previous settings' and still accepted; a forged one is refused after one read
    assert answer(adm, entry_from(ROUTE1), "validate")["allowed"]
    forged = entry_from({"publish": {"image": "registry.example/evil@sha256:" + "e" * 64}})
    resp = answer(adm, forged, "validate")
    assert resp["allowed"] is False and calls == [1, 1]


def test_an_s4_refusal_stands_when_the_settings_cannot_be_read_again():
    adm = adm_with(Runtimes(torch_rt()), refresh=lambda: None)
    resp = answer(adm, entry_from({"publish": {"image": OTHER_IMAGE}}), "validate")
    assert resp["allowed"] is False and fields(resp) == ["spec.runtimePatches[0]"]


def test_a_review_is_planned_once_also_when_the_settings_are_read_again_before_an_s4_refusal():
    newer = settings({"publish": {"image": OTHER_IMAGE}})
    calls = []
    adm = adm_with(Runtimes(torch_rt()), refresh=lambda: calls.append(1) or newer)
    reviews = [(entry_from({"publish": {"image": OTHER_IMAGE}}), "validate"),  # S4 under the old settings: read
               (entry_from({"publish": {"image": "registry.example/evil@sha256:" + "e" * 64}}), "validate"),  # refused
               (trainjob(), "mutate"), (trainjob(), "validate")]
    for obj, verb in reviews:
        before = adm.plans
        answer(adm, obj, verb)
        assert adm.plans - before == 1, (obj, verb)
    assert calls == [1, 1] and adm.settings == newer
