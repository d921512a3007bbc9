"""`verify` (SPEC 9) without a cluster: the stage read from a stored TrainJob, its pods and events; the stored pod
template against the settings; the hints; the report; and the run (create, follow, clean up on every path)
against a fake cluster. The real thing runs on the one-node cluster in tests/e2e/test_verify.py."""

from __future__ import annotations

import io
import json
import os
import signal

import pytest

from tests.helpers import IMAGE, MANAGER
from tests.verify_fakes import (
    ENTRY1,
    ENTRY2,
    NOT_FOUND,
    S1,
    Clock,
    FakeCluster,
    cluster_node,
    event,
    pod,
    run,
    stored,
)
from webhook.commands import cli
from webhook.commands import verify as adapter
from webhook.core.patch import Entry
from webhook.core.settings import parse
from webhook.inspection import verify as v
from webhook.inspection import verify_probe as vp
from webhook.inspection import verify_report as r
from webhook.inspection import verify_template as vt

# ---- the stage ----

def test_no_entry_fails_at_admitted_with_the_words_of_the_spec():
    st = v.classify(stored(None), [], [], MANAGER)
    assert st.done and st.reached is None
    assert st.failure.stage is v.Stage.ADMITTED
    assert st.failure.message == "the stored TrainJob has no entry: the webhook did not mutate it"
    assert "MutatingWebhookConfiguration" in st.failure.hint


def test_an_entry_of_another_manager_is_not_ours():
    st = v.classify(stored(dict(ENTRY1, manager="example.com/other")), [], [], MANAGER)
    assert st.failure.stage is v.Stage.ADMITTED


def test_admitted_without_a_pod_waits_and_says_why_when_suspended():
    st = v.classify(stored(), [], [], MANAGER)
    assert st.reached is v.Stage.ADMITTED and not st.done and st.waiting == "no pod yet"
    st = v.classify(stored(suspend=True), [], [], MANAGER)
    assert "suspended" in st.waiting
    out = v.timed_out(st, 30)
    assert out.failure.stage is v.Stage.SCHEDULED and "not scheduled after 30s" in out.failure.message
    assert "kueue.x-k8s.io/queue-name" in out.failure.hint


def test_unschedulable_is_not_an_end_until_the_timeout_and_then_names_the_scheduler_reason():
    msg = "0/1 nodes are available: 1 Insufficient cpu. preemption: 0/1 nodes are available"
    st = v.classify(stored(), [pod(scheduled=False, unschedulable_message=msg)], [], MANAGER)
    assert st.reached is v.Stage.ADMITTED and not st.done and msg in st.waiting
    out = v.timed_out(st, 10)
    assert out.done and out.failure.stage is v.Stage.SCHEDULED
    assert "Insufficient cpu" in out.failure.message and "not scheduled after 10s" in out.failure.message


def test_the_scheduler_event_is_read_when_the_condition_has_no_message():
    st = v.classify(stored(), [pod(scheduled=False)],
                    [event("FailedScheduling", "0/3 nodes: Insufficient nvidia.com/gpu")],
                    MANAGER)
    assert "Insufficient nvidia.com/gpu" in st.waiting


def test_a_pull_error_on_the_node_container_ends_at_pulled():
    st = v.classify(stored(), [pod(node_state={"waiting": {"reason": "ErrImagePull", "message": "manifest unknown"}})],
                    [], MANAGER)
    assert st.done and st.reached is v.Stage.SCHEDULED
    assert st.failure.stage is v.Stage.PULLED and "ErrImagePull: manifest unknown" == st.failure.message
    assert "digest" in st.failure.hint


def test_an_image_volume_pull_error_is_read_from_the_kubelet_event():
    msg = 'Failed to pull image "reg/publish@sha256:00": rpc error: code = NotFound desc = not found'
    st = v.classify(stored(), [pod(node_state={"waiting": {"reason": "ContainerCreating"}})],
                    [event("Failed", msg)], MANAGER)
    assert st.failure.stage is v.Stage.PULLED and st.failure.message == msg


def test_route2_init_container_pull_error_ends_at_pulled():
    st = v.classify(stored(ENTRY2), [pod(route2=True, init_state={"waiting": {"reason": "ImagePullBackOff",
                                                                              "message": "Back-off pulling"}})],
                    [], MANAGER)
    assert st.failure.stage is v.Stage.PULLED


def test_route2_copies_nothing_fails_at_started_with_the_route2_hint():
    term = {"reason": "StartError", "exitCode": 128, "message": NOT_FOUND}
    p = pod(route2=True, init_state={"terminated": {"exitCode": 0, "reason": "Completed"}},
            node_state={"waiting": {"reason": "CrashLoopBackOff"}}, node_last={"terminated": term})
    st = v.classify(stored(ENTRY2), [p], [], MANAGER)
    assert st.done and st.reached is v.Stage.PULLED and st.failure.stage is v.Stage.STARTED
    assert "no such file or directory" in st.failure.message and "StartError, exit code 128" in st.failure.message
    assert "route 2" in st.failure.hint and "DISPATCH_PUBLISH_DEST" in st.failure.hint
    assert st.container == "", "nothing to read: the process never started"


def test_route1_not_found_hints_at_the_publish_image_and_noexec_at_route2():
    term = {"reason": "StartError", "exitCode": 128, "message": NOT_FOUND}
    st = v.classify(stored(), [pod(node_state={"terminated": term})], [], MANAGER)
    assert st.failure.stage is v.Stage.STARTED and "publish.image" in st.failure.hint
    term = dict(term, message='exec: "/opt/dispatch/publish": permission denied')
    st = v.classify(stored(), [pod(node_state={"terminated": term})], [], MANAGER)
    assert "noexec" in st.failure.hint and "route 2" in st.failure.hint


@pytest.mark.parametrize("code", [126, 127])
def test_exit_126_and_127_mean_the_binary_did_not_start(code):
    st = v.classify(stored(), [pod(node_state={"terminated": {"reason": "Error", "exitCode": code}})], [], MANAGER)
    assert st.failure.stage is v.Stage.STARTED


@pytest.mark.parametrize("code", [0, 1, 3])
def test_any_other_exit_code_ran(code):
    st = v.classify(stored(), [pod(node_state={"terminated": {"reason": "Completed", "exitCode": code}})], [], MANAGER)
    assert st.done and st.ran and st.reached is v.Stage.RAN and st.exit_code == code and st.container == "node"


def test_running_is_started_and_waits():
    st = v.classify(stored(), [pod(node_state={"running": {}})], [], MANAGER)
    assert st.reached is v.Stage.STARTED and not st.done


def test_a_failing_init_container_fails_started_and_names_it():
    p = pod(route2=True, init_state={"terminated": {"exitCode": 1, "reason": "Error"}},
            node_state={"waiting": {"reason": "PodInitializing"}})
    st = v.classify(stored(ENTRY2), [p], [], MANAGER)
    assert st.failure.stage is v.Stage.STARTED and "init container dispatch-publish" in st.failure.message
    assert st.container == "dispatch-publish"


def test_the_newest_live_pod_is_the_probe_pod():
    old = pod(node_state={"terminated": {"exitCode": 0}})
    new = pod(node_state={"running": {}})
    new["metadata"] = {"name": "b", "creationTimestamp": "2026-12-01T10:01:00Z"}
    assert v.probe_pod([old, new]) is new
    new["metadata"]["deletionTimestamp"] = "x"
    assert v.probe_pod([old, new]) is old


# ---- the probe ----

def test_the_probe_runs_the_binary_on_one_node_labelled_and_never_adds_the_publish_entry():
    job = vp.probe_trainjob("verify-1", "ns", "ClusterTrainingRuntime", "torch", "run1", labels={"q": "a"},
                           jobs=["node"])
    assert job["spec"]["trainer"] == {"numNodes": 1, "command": ["/opt/dispatch/publish", "--help"]}
    ours = {vp.PROBE_LABEL: "probe", vp.RUN_LABEL: "run1"}
    assert job["metadata"]["labels"] == {"q": "a", **ours}
    assert job["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                         "name": "torch"}
    [entry] = job["spec"]["runtimePatches"]
    assert entry["manager"] == vp.VERIFY_MANAGER != MANAGER, "verify never adds the webhook's entry itself"
    template = entry["trainingRuntimeSpec"]["template"]
    assert template["metadata"] == {"labels": ours}, "Trainer copies these to the JobSet"
    assert template["spec"]["replicatedJobs"] == [{"name": "node", "template": {"spec": {"template": {
        "metadata": {"labels": ours}}}}}], "and these to the pods; nothing else (no volume, no mount)"


def test_per_node_pins_every_job_in_the_entry_of_its_own_manager():
    node = {"metadata": {"name": "n1", "labels": {"kubernetes.io/hostname": "host-1"}}}
    job = vp.probe_trainjob("verify-1", "ns", "TrainingRuntime", "t", "r", image="img", node=node,
                           jobs=["launcher", "node"])
    [entry] = job["spec"]["runtimePatches"]
    assert entry["manager"] == vp.VERIFY_MANAGER
    jobs = entry["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert [j["name"] for j in jobs] == ["launcher", "node"]
    assert all(j["template"]["spec"]["template"]["spec"] == {"nodeSelector": {"kubernetes.io/hostname": "host-1"}}
               for j in jobs)
    assert job["spec"]["trainer"]["image"] == "img"


def test_schedulable_nodes_are_ready_uncordoned_and_their_taints_tolerated():
    gpu = {"key": "nvidia.com/gpu", "effect": "NoSchedule", "value": "present"}
    nodes = [cluster_node("b"), cluster_node("a"), cluster_node("down", ready="False"),
             cluster_node("cordoned", unschedulable=True), cluster_node("gpu", taints=[gpu]),
             cluster_node("soft", taints=[{"key": "x", "effect": "PreferNoSchedule"}])]
    assert [n["metadata"]["name"] for n in vp.schedulable_nodes(nodes, [])] == ["a", "b", "soft"]
    tol = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert "gpu" in [n["metadata"]["name"] for n in vp.schedulable_nodes(nodes, tol)]


# ---- the pod template against the settings ----

def test_template_checks_pass_on_what_the_settings_produce():
    checks = vt.template_checks(pod(), ENTRY1, S1, Entry.build(S1, ["node"]))
    assert [(c.what, c.ok) for c in checks] == [("entry", True), ("node container mount", True),
                                               ("image volume", True)]


def test_template_checks_name_a_read_write_mount_and_another_digest():
    other = IMAGE[:-1] + "0"
    checks = {c.what: c for c in vt.template_checks(pod(read_only=False, volume_image=other), ENTRY1, S1)}
    assert not checks["node container mount"].ok and checks["node container mount"].found == "/opt/dispatch read-write"
    assert not checks["image volume"].ok and checks["image volume"].found == other
    assert checks["image volume"].expected == IMAGE


def test_template_checks_without_settings_read_the_entry_and_route2_the_init_container():
    assert all(c.ok for c in vt.template_checks(pod(), ENTRY1, None))
    checks = vt.template_checks(pod(route2=True), ENTRY2, None)
    assert [c.what for c in checks] == ["node container mount", "publish volume",
                                        "init container dispatch-publish mount"]
    assert all(c.ok for c in checks)
    stale = Entry.build(parse(json.dumps({"publish": {"image": IMAGE[:-1] + "1"}})), ["node"])
    assert not vt.template_checks(pod(), ENTRY1, S1, stale)[0].ok


# ---- the report ----

def _probes():
    ok = r.Probe("verify-a", "ns", "ClusterTrainingRuntime/torch",
                 status=v.Status(v.Stage.RAN, done=True, exit_code=0, node="node-a", container="node"),
                 output="publish ran from /opt/dispatch/publish\npublish args: --help",
                 checks=vt.template_checks(pod(), ENTRY1, S1))
    bad = r.Probe("verify-b", "ns", "ClusterTrainingRuntime/torch",
                  status=v.classify(stored(None), [], [], MANAGER))
    return ok, bad


def test_table_one_line_per_probe_then_the_verdict():
    ok, bad = _probes()
    text = r.render_table([ok, bad])
    lines = text.splitlines()
    assert lines[0].split() == ["PROBE", "NODE", "REACHED", "RESULT"]
    assert lines[1].split()[:3] == ["verify-a", "node-a", "ran"] and "exit code 0" in lines[1]
    assert "output: publish ran from /opt/dispatch/publish | publish args: --help" in text
    assert "ok: image volume: " + IMAGE in text
    bad_line = next(line for line in lines if line.startswith("verify-b"))
    assert "FAILED at admitted: the stored TrainJob has no entry: the webhook did not mutate it" in bad_line
    assert "    what to do: install the webhook" in text
    assert lines[-1] == ("FAILED: 1 of 2 probes on ClusterTrainingRuntime/torch did not run the binary "
                         "(failed at: admitted)")
    assert r.exit_code([ok, bad]) == 1 and r.exit_code([ok]) == 0 and r.exit_code([]) == 1
    assert r.render_table([ok]).splitlines()[-1].startswith("ok: 1 of 1 probes")


def test_json_one_object_per_probe_with_its_stages():
    ok, bad = _probes()
    got = json.loads(r.render_json([ok, bad]))
    assert [p["name"] for p in got] == ["verify-a", "verify-b"]
    assert got[0]["ran"] is True and got[0]["exitCode"] == 0 and got[0]["failure"] is None
    assert [s["state"] for s in got[0]["stages"]] == ["reached"] * 5
    assert got[1]["failure"]["stage"] == "admitted"
    assert [s["state"] for s in got[1]["stages"]] == ["failed"] + ["not-reached"] * 4
    assert got[0]["checks"][0] == {"check": "node container mount", "expected": "/opt/dispatch read-only",
                                   "found": "/opt/dispatch read-only", "ok": True}


# ---- the run, against a fake cluster ----

def test_run_ran_reports_and_deletes():
    running = [pod(node_state={"running": {}})]
    done = [pod(node_state={"terminated": {"reason": "Completed", "exitCode": 0}})]
    cluster = FakeCluster(script=[running, running, done])
    code, out, _ = run(cluster, settings=S1)
    assert code == 0, out
    assert "ran, exit code 0" in out and "output: publish ran from" in out
    assert cluster.deleted and not cluster.jobs


def test_run_times_out_at_scheduled_and_still_deletes():
    cluster = FakeCluster(script=[[pod(scheduled=False, unschedulable_message="0/1 nodes: Insufficient cpu")]])
    code, out, _ = run(cluster, timeout=5)
    assert code == 1
    assert "FAILED at scheduled: not scheduled after 5s: Unschedulable: 0/1 nodes: Insufficient cpu" in out
    assert cluster.deleted and not cluster.jobs


def test_keep_leaves_the_probe():
    cluster = FakeCluster(script=[[pod(node_state={"terminated": {"exitCode": 0}})]])
    code, out, _ = run(cluster, keep=True)
    assert code == 0 and not cluster.deleted and cluster.jobs and "(probes kept: --keep)" in out


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_a_signal_mid_run_deletes_the_probes_and_reports(sig, code):
    cluster = FakeCluster(script=[[pod(node_state={"running": {}})]],
                          on_poll=lambda n: n == 3 and os.kill(os.getpid(), sig))
    before = signal.getsignal(sig)
    got, out, _ = run(cluster)
    assert got == code and cluster.deleted and not cluster.jobs
    assert f"interrupted by {signal.Signals(sig).name}" in out
    assert signal.getsignal(sig) is before, "the handlers are put back"


def test_per_node_makes_one_pinned_probe_per_node():
    cluster = FakeCluster(script=[[pod(node_state={"terminated": {"exitCode": 0}})]])
    code, out, _ = run(cluster, per_node=True, output="json")
    [probe] = json.loads(out)
    [job_name] = cluster.deleted
    assert probe["name"] == job_name and code == 0


def test_missing_runtime_is_unusable():
    with pytest.raises(adapter.Unusable, match="ClusterTrainingRuntime missing not found"):
        adapter.Verify(adapter.Options(runtime="missing"), FakeCluster(), io.StringIO(), io.StringIO(), False).run()


def test_forbidden_create_is_unusable_and_a_webhook_denial_is_a_probe_answer(monkeypatch):
    from kubernetes.client.exceptions import ApiException

    forbidden = ApiException(status=403, reason="Forbidden")
    forbidden.body = json.dumps({"message": 'trainjobs.trainer.kubeflow.org is forbidden: User "u" cannot create'})
    cluster = FakeCluster(create_error=forbidden)
    with pytest.raises(adapter.Unusable, match="cannot create TrainJobs in namespace ns: .* is forbidden"):
        run(cluster)
    assert cluster.deleted == [], "a create the API server refused made nothing to delete"
    denied = ApiException(status=403, reason="Forbidden")
    denied.body = json.dumps({"message": 'admission webhook "validate.dispatch" denied the request: ErrUnsupported: x'})
    code, out, _ = run(FakeCluster(create_error=denied))
    assert code == 1 and "FAILED at admitted: admission webhook" in out


def test_runtime_argument_forms():
    assert adapter.parse_runtime("torch") == ("ClusterTrainingRuntime", "torch")
    assert adapter.parse_runtime("trainingruntime/x") == ("TrainingRuntime", "x")
    assert adapter.parse_runtime("clustertrainingruntimes/x") == ("ClusterTrainingRuntime", "x")
    with pytest.raises(adapter.Unusable):
        adapter.parse_runtime("Deployment/x")


def test_cli_verify_unusable_is_one_line_and_exit_2(capsys, tmp_path):
    code = cli.main(["verify", "--runtime", "Pod/x"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--runtime 'Pod/x'" in err
    code = cli.main(["verify", "--runtime", "torch", "--label", "nokey"])
    assert code == 2 and "--label 'nokey': expected KEY=VALUE" in capsys.readouterr().err


def test_cli_command_takes_the_rest_of_the_line():
    args = cli.parser().parse_args(["verify", "--runtime", "t", "--command", "/opt/dispatch/publish", "--help", "-x"])
    assert args.probe_command == ["/opt/dispatch/publish", "--help", "-x"] and args.command == "verify"


def test_progress_line_only_when_stdout_is_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    cluster = FakeCluster(script=[[pod(node_state={"running": {}})], [pod(node_state={"terminated": {"exitCode": 0}})]])
    out, err, clock = Tty(), Tty(), Clock()
    adapter.Verify(adapter.Options(runtime="torch"), cluster, out, err, progress=True, clock=clock,
                   sleep=clock.sleep).run()
    assert "started (running: waiting for it to exit)" in err.getvalue()
    code, out2, err2 = run(FakeCluster(script=[[pod(node_state={"terminated": {"exitCode": 0}})]]))
    assert err2 == ""
