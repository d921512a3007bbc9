"""Issue 35, item 7: verify cleans up after itself. The TTL each probe carries and the decision it drives
(`inspection.verify_cleanup`), the deletes with the probe's UID as a precondition, `verify --cleanup` and the sweep
before a run, the cap on probes per run, and the credentials' Secrets checked before the first probe;
against the fake cluster of tests/verify_fakes.py. The real thing: tests/e2e/test_verify.py."""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime

import pytest

from tests.verify_fakes import S1, FakeCluster, cluster_node, pod, run
from webhook.commands import cli
from webhook.commands import verify as adapter
from webhook.commands import verify_cleanup as cleanup_cmd
from webhook.core.settings import parse
from webhook.inspection import verify_cleanup as c
from webhook.inspection import verify_probe as vp

NOW = datetime(2026, 12, 2, 10, 0, 0, tzinfo=UTC)
DATE = "Wed, 02 Dec 2026 10:00:00 GMT"  # NOW as the API server's Date header says it


def probe(name="verify-aaaaaa", created="2026-12-02T09:00:00Z", ttl="1800", labels=None, entry=True, uid=None,
          namespace="ns") -> dict:
    """A probe TrainJob as the API server stores it (the fields verify and the cleanup read)."""
    doc = vp.probe_trainjob(name, namespace, "ClusterTrainingRuntime", "torch", "run1", jobs=["node"])
    doc["metadata"].update(uid=uid or f"uid-{name}", creationTimestamp=created)
    if ttl is not None:
        doc["metadata"]["annotations"] = {vp.TTL_ANNOTATION: ttl}
    if labels is not None:
        doc["metadata"]["labels"] = labels
    if not entry:
        doc["spec"]["runtimePatches"] = []
    return doc


# ---- the TTL and the decision ----

def test_a_probe_carries_its_ttl_past_the_run_and_an_hour_more_when_kept():
    assert c.probe_ttl(300, 90, keep=False) == 300 + 90 + c.TTL_MARGIN
    assert c.probe_ttl(300, 90, keep=True) == 300 + 90 + c.TTL_MARGIN + c.KEPT_TTL
    assert c.probe_ttl(0.5, 90, keep=False) == 391, "whole seconds, rounded up"
    doc = vp.probe_trainjob("verify-1", "ns", "ClusterTrainingRuntime", "t", "r", ttl=690)
    assert doc["metadata"]["annotations"] == {vp.TTL_ANNOTATION: "690"}


def test_expiry_is_creation_plus_ttl_on_the_servers_clock():
    assert c.server_now(DATE) == NOW
    assert c.server_now("garbage") is None and c.server_now(None) is None
    [young] = c.leftovers([probe(created="2026-12-02T09:40:00Z", ttl="1800")], NOW)
    assert not young.expired and young.expires == datetime(2026, 12, 2, 10, 10, tzinfo=UTC)
    [old] = c.leftovers([probe(created="2026-12-02T09:30:00Z", ttl="1800")], NOW)
    assert old.expired, "expires exactly now"
    assert (old.namespace, old.name, old.uid, old.run) == ("ns", "verify-aaaaaa", "uid-verify-aaaaaa", "run1")


@pytest.mark.parametrize("ttl", [None, "soon", "-5", "0"])
def test_without_a_readable_ttl_a_probe_lives_a_day(ttl):
    [p] = c.leftovers([probe(created="2026-12-01T10:00:01Z", ttl=ttl)], NOW)
    assert not p.expired
    [p] = c.leftovers([probe(created="2026-12-01T10:00:00Z", ttl=ttl)], NOW)
    assert p.expired


def test_only_probes_verify_made_are_leftovers():
    other = probe(name="team-job", labels={"team": "a"})
    labelled_only = probe(name="labelled", entry=False)  # the label is easily put on any TrainJob
    no_time = probe(name="no-time", created="")
    found = c.leftovers([other, labelled_only, no_time, probe()], NOW)
    assert [(p.name, p.expired) for p in found] == [("no-time", False), ("verify-aaaaaa", True)]


# ---- the cap ----

def test_the_cap_names_the_flag_and_what_each_probe_asks_for():
    runtime = {"spec": {"template": {"spec": {"replicatedJobs": [{"name": "node", "template": {"spec": {"template": {
        "spec": {"containers": [{"name": "node", "resources": {"limits": {"nvidia.com/gpu": 8, "memory": "1Gi"},
                                                                "requests": {"cpu": "4"}}}]}}}}}]}}}}
    assert c.runtime_asks(runtime) == "nvidia.com/gpu: 8"
    assert c.over_cap(10, 10, "") is None
    assert c.over_cap(11, 10, "nvidia.com/gpu: 8") == (
        "--per-node would make 11 probes, one per schedulable node, more than --max-probes 10 (each asks for what the"
        " runtime's pods do: nvidia.com/gpu: 8): pass --max-probes 11 to probe them all")


def test_per_node_above_the_cap_is_refused_before_anything_is_made():
    cluster = FakeCluster(nodes=[cluster_node("n1"), cluster_node("n2"), cluster_node("n3")])
    with pytest.raises(adapter.Unusable, match=r"--per-node would make 3 probes, .* more than --max-probes 2"):
        run(cluster, per_node=True, max_probes=2)
    assert cluster.jobs == {} and cluster.dry_runs == 0
    code, out, _ = run(FakeCluster(nodes=[cluster_node("n1"), cluster_node("n2")], script=[[pod(node_state={
        "terminated": {"exitCode": 0}})]]), per_node=True, max_probes=2)
    assert code == 0 and out.count("ran, exit code 0") == 2


def test_cli_max_probes_default_and_bad_values(capsys):
    assert cli.parser().parse_args(["verify", "--runtime", "t"]).max_probes == c.MAX_PROBES == 10
    with pytest.raises(SystemExit) as e:
        cli.parser().parse_args(["verify", "--runtime", "t", "--max-probes", "0"])
    assert e.value.code == 2 and "--max-probes" in capsys.readouterr().err


# ---- deletes with the UID ----

def test_a_probe_replaced_by_someone_elses_object_of_its_name_is_left_alone():
    def replace(n):
        if n == 2:  # the probe deleted, and a TrainJob of the same name made by someone else
            [name] = cluster.jobs
            cluster.jobs[name] = dict(cluster.jobs[name], metadata=dict(cluster.jobs[name]["metadata"], uid="theirs"))
    cluster = FakeCluster(script=[[pod(node_state={"running": {}})]], on_poll=replace)
    code, out, err = run(cluster, timeout=5)
    assert code == 1 and "the probe TrainJob was deleted by someone else" in out
    assert cluster.deleted == [] and [j["metadata"]["uid"] for j in cluster.jobs.values()] == ["theirs"]
    assert err == ""


def test_a_create_whose_answer_was_lost_is_found_by_its_run_label_and_deleted():
    class LostAnswer(FakeCluster):
        def create(self, namespace, doc, dry_run=False):
            super().create(namespace, doc, dry_run)
            if not dry_run:
                raise TimeoutError("read timed out")

    cluster = LostAnswer()
    with pytest.raises(adapter.Unusable, match="cannot create TrainJobs in namespace ns: TimeoutError"):
        run(cluster)
    assert len(cluster.deleted) == 1 and cluster.jobs == {}


def test_the_cluster_delete_sends_the_uid_as_a_precondition():
    from kubernetes.client.exceptions import ApiException

    sent = []

    class Custom:
        def delete_namespaced_custom_object(self, *args, body=None, **kw):
            sent.append(body)
            if body.preconditions.uid == "stale":
                raise ApiException(status=409, reason="Conflict")

    cluster = adapter.Cluster.__new__(adapter.Cluster)
    cluster.custom = Custom()
    assert cluster.delete("ns", "verify-1", "uid-1") is True
    assert cluster.delete("ns", "verify-1", "stale") is False
    assert [(b.preconditions.uid, b.propagation_policy) for b in sent] == [("uid-1", "Background"),
                                                                          ("stale", "Background")]


# ---- --cleanup and the sweep before a run ----

def seeded(*docs) -> FakeCluster:
    cluster = FakeCluster()
    cluster.date = DATE
    for d in docs:
        cluster.jobs[d["metadata"]["name"]] = d
    return cluster


def test_cleanup_removes_the_expired_probes_only_and_says_what_it_kept():
    cluster = seeded(probe("verify-old", created="2026-12-02T08:00:00Z"),
                     probe("verify-new", created="2026-12-02T09:50:00Z"),
                     probe("team-job", created="2026-12-01T00:00:00Z", entry=False))
    out = io.StringIO()
    assert cleanup_cmd.run(cleanup_cmd.Options(namespace="ns"), out, cluster) == 0
    assert cluster.deleted == ["verify-old"] and set(cluster.jobs) == {"verify-new", "team-job"}
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["NAMESPACE", "PROBE", "RUN", "EXPIRES", "RESULT"]
    assert lines[1].split()[:5] == ["ns", "verify-new", "run1", "2026-12-02T10:20:00Z", "kept:"]
    assert lines[2].split() == ["ns", "verify-old", "run1", "2026-12-02T08:30:00Z", "removed"]
    assert lines[3].startswith("removed 1 of 2 probes in namespace ns; to remove a probe that has not expired: ")


def test_cleanup_json_and_a_failed_delete_exits_1():
    class Failing(FakeCluster):
        def delete(self, namespace, name, uid):
            raise RuntimeError("etcd is down")

    cluster = Failing()
    cluster.date = DATE
    cluster.jobs["verify-old"] = probe("verify-old", created="2026-12-02T08:00:00Z")
    out = io.StringIO()
    assert cleanup_cmd.run(cleanup_cmd.Options(namespace="ns", output="json"), out, cluster) == 1
    [got] = json.loads(out.getvalue())
    assert got["name"] == "verify-old" and got["expired"] and got["expires"] == "2026-12-02T08:30:00Z"
    assert got["result"].startswith("not removed: delete: RuntimeError: etcd is down")


def test_cleanup_that_cannot_list_is_unusable():
    class Forbidden(FakeCluster):
        def probes(self, namespace):
            raise PermissionError("trainjobs is forbidden")

    with pytest.raises(adapter.Unusable, match="cannot list TrainJobs in every namespace: PermissionError"):
        cleanup_cmd.run(cleanup_cmd.Options(all_namespaces=True), io.StringIO(), Forbidden())


def test_a_run_first_removes_the_expired_probes_of_earlier_runs():
    cluster = seeded(probe("verify-old", created="2026-12-02T08:00:00Z"),
                     probe("verify-live", created="2026-12-02T09:59:00Z"))
    cluster.script = [[pod(node_state={"terminated": {"exitCode": 0}})]]
    code, out, err = run(cluster)
    assert code == 0
    assert err == "verify: removed 1 expired probes in namespace ns: verify-old\n"
    assert cluster.deleted[0] == "verify-old" and "verify-live" in cluster.jobs, "a live probe is another run's"


@pytest.mark.parametrize("args,message", [
    (["verify"], "--runtime KIND/NAME is required (or --cleanup"),
    (["verify", "--cleanup", "--runtime", "t"], "--cleanup makes no probe: leave out --runtime"),
    (["verify", "--runtime", "t", "--all-namespaces"], "--all-namespaces goes with --cleanup only"),
    (["verify", "--cleanup", "--all-namespaces", "--namespace", "a"], "--namespace or --all-namespaces, not both"),
])
def test_cli_cleanup_flags(capsys, args, message):
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


# ---- the credentials' Secrets, before the first probe ----

def test_a_missing_credential_secret_fails_at_once_naming_it_and_the_namespace():
    cluster = FakeCluster(secrets=())
    with pytest.raises(adapter.Unusable) as e:
        run(cluster, settings=parse(json.dumps(SETTINGS_WITH_CREDENTIAL)))
    assert str(e.value).startswith("Secret s3-credentials not found in namespace ns: credential checkpoint-store of"
                                   " the webhook's settings mounts it in every TrainJob there")
    assert cluster.jobs == {} and cluster.dry_runs == 0, "no probe made; --settings named the credentials"


def test_without_settings_the_credentials_are_read_from_a_dry_run_through_the_webhook():
    credential = {"name": "checkpoint-store", "secret": {"secretName": "s3-credentials"}}

    class WithCredential(FakeCluster):  # the fake webhook's entry (test_verify's ENTRY1), with a credential
        def create(self, namespace, doc, dry_run=False):
            job = super().create(namespace, doc, dry_run)
            own = job["spec"]["runtimePatches"][-1] = json.loads(json.dumps(job["spec"]["runtimePatches"][-1]))
            own["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"][
                "spec"]["volumes"].append(credential)
            return job

    cluster = WithCredential(secrets=())
    with pytest.raises(adapter.Unusable, match="Secret s3-credentials not found in namespace ns"):
        run(cluster)
    assert cluster.dry_runs == 1 and cluster.jobs == {}
    cluster = WithCredential(script=[[pod(node_state={"terminated": {"exitCode": 0}})]])
    assert run(cluster)[0] == 0 and cluster.dry_runs == 1


def test_a_secret_verify_may_not_read_is_said_and_the_run_goes_on():
    cluster = FakeCluster(secrets=None, script=[[pod(node_state={"terminated": {"exitCode": 0}})]])
    code, _, err = run(cluster, settings=parse(json.dumps(SETTINGS_WITH_CREDENTIAL)))
    assert code == 0
    assert err.startswith("verify: cannot tell whether Secret s3-credentials (credential checkpoint-store) exists in"
                          " namespace ns: secrets \"s3-credentials\" is forbidden")


SETTINGS_WITH_CREDENTIAL = {"manager": S1.manager, "publish": {"image": S1.publish.image},
                            "credentials": [{"name": "checkpoint-store", "secret": "s3-credentials",
                                             "mountPath": "/var/run/dispatch/creds"}]}


def test_a_user_who_may_not_list_trainjobs_goes_without_the_sweep_unsaid():
    class NoList(FakeCluster):
        def probes(self, namespace):
            raise PermissionError("trainjobs is forbidden")

    cluster = NoList(script=[[pod(node_state={"terminated": {"exitCode": 0}})]])
    code, _, err = run(cluster)
    assert code == 0 and err == ""
