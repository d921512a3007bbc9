"""The harness of the pods Trainer v2.3.0 and JobSet v0.12.0 build (tests/trainer_pods.py): each step, and the
collisions it must report. The last tests replay issue 34's findings on Trainer's own stock runtimes."""

from __future__ import annotations

import yaml

from tests.e2e import toolchain
from tests.helpers import pod_patch, runtime, trainjob
from tests.trainer_pods import CLAIMS, RUNTIME, TRAINER_ENV, Collision, added_by, build_pods, collisions_with, missing

OURS = "dispatch.go.phpboyscout.uk/publish"


def stock(path: str) -> dict:
    return yaml.safe_load((toolchain.trainer_module() / "manifests" / "base" / "runtimes" / path).read_text())


def job_with(*patches, **trainer) -> dict:
    return trainjob(name="tj", patches=list(patches), **trainer)


def node_pod(**pod) -> dict:
    return runtime(jobs={"node": {"containers": [{"name": "node", "image": "pytorch", **pod.pop("node", {})}], **pod}})


def mounts(pod, container="node", lst="containers") -> list[dict]:
    return next(c for c in pod.spec[lst] if c["name"] == container).get("volumeMounts", [])


def test_the_runtime_alone_is_its_pods():
    rt = node_pod(volumes=[{"name": "data", "emptyDir": {}}],
                  node={"volumeMounts": [{"name": "data", "mountPath": "/d"}]})
    pods = build_pods(rt, job_with())
    assert list(pods) == ["node"]
    assert pods["node"].spec["volumes"] == [{"name": "data", "emptyDir": {}}]
    assert mounts(pods["node"]) == [{"name": "data", "mountPath": "/d"}]
    assert pods["node"].collisions == [] and pods["node"].duplicates() == []


def test_entries_merge_in_list_order_volumes_by_name_mounts_by_path():
    first = pod_patch("a.example.com/first", {"volumes": [{"name": "v", "emptyDir": {}}],
                                              "containers": [{"name": "node", "volumeMounts": [
                                                  {"name": "v", "mountPath": "/x"}]}]})
    second = pod_patch("b.example.com/second", {"volumes": [{"name": "v", "secret": {"secretName": "s"}}],
                                                "containers": [{"name": "node", "volumeMounts": [
                                                    {"name": "w", "mountPath": "/x", "readOnly": True}]}]})
    pods = build_pods(node_pod(), job_with(first, second))
    pod = pods["node"]
    # Merged key by key, as a strategic merge patch without $retainKeys does: both sources are left in the volume.
    assert pod.spec["volumes"] == [{"name": "v", "emptyDir": {}, "secret": {"secretName": "s"}}]
    assert mounts(pod) == [{"name": "w", "mountPath": "/x", "readOnly": True}]
    assert set(pod.collisions) == {
        Collision("node", "", "volume", "v", "patch a.example.com/first", "patch b.example.com/second"),
        Collision("node", "node", "mount", "/x", "patch a.example.com/first", "patch b.example.com/second")}
    assert collisions_with(pods, "patch a.example.com/first") == collisions_with(pods, "patch b.example.com/second")
    assert len(collisions_with(pods, "patch a.example.com/first")) == 2


def test_an_entry_with_two_volumes_of_one_name_collides_with_itself():
    twice = pod_patch(OURS, {"volumes": [{"name": "v", "emptyDir": {}}, {"name": "v", "secret": {"secretName": "s"}}]})
    assert collisions_with(build_pods(node_pod(), job_with(twice)), f"patch {OURS}") == [
        f"node: volume 'v' of patch {OURS} replaces the one of patch {OURS}"]


def test_an_entry_replaces_the_runtimes_mount_of_one_path():
    rt = node_pod(volumes=[{"name": "data", "emptyDir": {}}],
                  node={"volumeMounts": [{"name": "data", "mountPath": "/d"}]})
    ours = pod_patch(OURS, {"volumes": [{"name": "cred", "secret": {"secretName": "s"}}],
                            "containers": [{"name": "node", "volumeMounts": [{"name": "cred", "mountPath": "/d"}]}]})
    pods = build_pods(rt, job_with(ours))
    assert mounts(pods["node"]) == [{"name": "cred", "mountPath": "/d"}]
    assert [str(c) for c in pods["node"].collisions] == [
        f"node/node: mount '/d' of patch {OURS} replaces the one of {RUNTIME}"]
    assert missing(pods, ours) == []  # what the entry wrote is there; what it replaced is not


def test_identical_items_do_not_collide_and_new_ones_are_appended():
    rt = node_pod(volumes=[{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
                  node={"volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]})
    same = pod_patch("x.example.com/p", {"volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}},
                                                     {"name": "more", "emptyDir": {}}],
                                         "containers": [{"name": "node", "volumeMounts": [
                                             {"name": "dshm", "mountPath": "/dev/shm"}]}]})
    pod = build_pods(rt, job_with(same))["node"]
    assert pod.collisions == []
    assert [v["name"] for v in pod.spec["volumes"]] == ["dshm", "more"]


def test_replicated_jobs_keep_the_runtimes_order_and_containers_merge_by_name():
    rt = runtime(jobs={"launcher": {"containers": [{"name": "node", "image": "a"}]},
                       "node": {"containers": [{"name": "node", "image": "b"}, {"name": "side", "image": "c"}]}})
    entry = {"manager": OURS, "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
        {"name": "node", "template": {"spec": {"template": {"spec": {"containers": [
            {"name": "side", "volumeMounts": [{"name": "v", "mountPath": "/s"}]}]}}}}},
        {"name": "launcher", "template": {"spec": {"template": {"spec": {
            "volumes": [{"name": "v", "emptyDir": {}}]}}}}},
    ]}}}}
    pods = build_pods(rt, job_with(entry))
    assert list(pods) == ["launcher", "node"]
    assert [c["name"] for c in pods["node"].spec["containers"]] == ["node", "side"]
    assert mounts(pods["node"], "side") == [{"name": "v", "mountPath": "/s"}]
    assert pods["node"].spec["containers"][1]["image"] == "c"
    assert pods["launcher"].spec["volumes"] == [{"name": "v", "emptyDir": {}}]


def test_absent_null_and_empty_lists_change_nothing():
    rt = node_pod(volumes=[{"name": "data", "emptyDir": {}}])
    entry = pod_patch("x.example.com/p", {"volumes": [], "nodeSelector": None, "containers": None})
    assert build_pods(rt, job_with(entry, {"manager": "y.example.com/q"}))["node"].spec["volumes"] == \
        [{"name": "data", "emptyDir": {}}]


def test_trainer_env_is_upserted_into_node_of_the_trainer_jobs():
    rt = runtime(jobs={"node": {"containers": [{"name": "node", "env": [{"name": "A", "value": "runtime"}]},
                                               {"name": "side", "env": [{"name": "A", "value": "side"}]}]}})
    rt["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["metadata"] = {
        "labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}}
    pod = build_pods(rt, job_with(env=[{"name": "A", "value": "job"}, {"name": "B", "value": "b"}]))["node"]
    assert pod.spec["containers"][0]["env"] == [{"name": "A", "value": "job"}, {"name": "B", "value": "b"}]
    assert pod.spec["containers"][1]["env"] == [{"name": "A", "value": "side"}]
    assert pod.collisions == [Collision("node", "node", "env", "A", RUNTIME, TRAINER_ENV)]


def test_the_mpi_plugin_mounts_its_keys_and_the_launchers_hostfile_after_the_patches():
    rt = stock("deepspeed_distributed.yaml")  # mpi with sshAuthMountPath /home/mpiuser/.ssh; jobs launcher and node
    pods = build_pods(rt, job_with())
    assert {"name": "mpi-hostfile", "mountPath": "/etc/mpi"} in mounts(pods["launcher"])
    assert {"name": "mpi-hostfile", "mountPath": "/etc/mpi"} not in mounts(pods["node"])
    for job in ("launcher", "node"):
        assert {"name": "mpi-ssh-auth", "mountPath": "/home/mpiuser/.ssh"} in mounts(pods[job])
        assert "mpi-ssh-auth" in [v["name"] for v in pods[job].spec["volumes"]]
    del rt["spec"]["mlPolicy"]["mpi"]["sshAuthMountPath"]  # the CRD's default
    assert {"name": "mpi-ssh-auth", "mountPath": "/root/.ssh"} in mounts(build_pods(rt, job_with())["node"])


def test_the_flux_plugin_mounts_its_paths_and_adds_its_installer():
    rt = node_pod()
    rt["spec"]["mlPolicy"] = {"numNodes": 1, "flux": {}}
    pod = build_pods(rt, job_with())["node"]
    assert {m["mountPath"] for m in mounts(pod)} == {"/mnt/flux", "/opt/software", "/etc/flux-config", "/curve",
                                                     "/dev/shm"}
    installer = mounts(pod, "flux-installer", "initContainers")
    assert {m["mountPath"] for m in installer} == {"/mnt/flux", "/etc/flux-config"}
    assert {v["name"] for v in pod.spec["volumes"]} == {"spack-install", "flux-install", "tj-flux-entrypoint",
                                                        "shared-memory", "flux-curve"}


def test_the_trainjob_status_plugin_mounts_every_container_of_the_first_trainer_job():
    rt = runtime(jobs={"init": {"containers": [{"name": "i"}]},
                       "node": {"containers": [{"name": "node"}, {"name": "side"}]}})
    rt["spec"]["template"]["spec"]["replicatedJobs"][1]["template"]["metadata"] = {
        "labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}}
    pods = build_pods(rt, job_with())
    status = {"name": "kubeflow-trainer-token", "mountPath": "/var/run/secrets/kubeflow/trainer", "readOnly": True}
    assert status in mounts(pods["node"]) and status in mounts(pods["node"], "side")
    assert "volumeMounts" not in pods["init"].spec["containers"][0]


def test_jobset_adds_a_claim_volume_where_a_container_mounts_it():
    rt = stock("torchtune/llama3_2/llama3_2_1B.yaml")  # claim template `initializer`, mounted at /workspace
    pods = build_pods(rt, job_with())
    claim = {"name": "initializer", "persistentVolumeClaim": {"claimName": "initializer-tj"}}
    for job in ("dataset-initializer", "model-initializer", "node"):
        assert claim in pods[job].spec["volumes"], job
        assert pods[job].duplicates() == []
    rt["spec"]["template"]["spec"]["replicatedJobs"][2]["template"]["spec"]["template"]["spec"]["containers"][0][
        "volumeMounts"] = []
    assert claim not in build_pods(rt, job_with())["node"].spec["volumes"]


# ---- issue 34's findings, on Trainer's stock runtimes: what the corpus's check (d) catches ----


def credential_entry(name: str, path: str, jobs=("node",)) -> dict:
    """What the webhook's entry holds for one credential (SPEC 6.1), written out by hand."""
    return {"manager": OURS, "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
        {"name": j, "template": {"spec": {"template": {"spec": {
            "volumes": [{"name": name, "secret": {"secretName": "s3-credentials"}}],
            "containers": [{"name": "node", "volumeMounts": [{"name": name, "mountPath": path, "readOnly": True}]}],
        }}}}} for j in jobs]}}}}


def test_a_credential_named_like_a_claim_template_makes_two_volumes_of_one_name():
    pods = build_pods(stock("torchtune/llama3_2/llama3_2_1B.yaml"),
                      job_with(credential_entry("initializer", "/var/run/dispatch/creds")))
    assert pods["node"].duplicates() == ["volume 'initializer'"]
    assert collisions_with(pods, f"patch {OURS}") == [
        f"node: volume 'initializer' of {CLAIMS} duplicates the one of patch {OURS}"]


def test_a_credential_at_workspace_replaces_the_torchtune_runtimes_mount():
    pods = build_pods(stock("torchtune/llama3_2/llama3_2_1B.yaml"),
                      job_with(credential_entry("checkpoint-store", "/workspace")))
    assert collisions_with(pods, f"patch {OURS}") == [
        f"node/node: mount '/workspace' of patch {OURS} replaces the one of {RUNTIME}"]


def test_a_credential_at_etc_mpi_vanishes_from_the_launcher():
    entry = credential_entry("checkpoint-store", "/etc/mpi", jobs=("launcher", "node"))
    pods = build_pods(stock("deepspeed_distributed.yaml"), job_with(entry))
    assert collisions_with(pods, f"patch {OURS}") == [
        f"launcher/node: mount '/etc/mpi' of plugin mpi replaces the one of patch {OURS}"]
    assert missing(pods, entry) == ["launcher/node: mount '/etc/mpi'"]


def test_a_credential_elsewhere_meets_nothing_on_any_stock_runtime():
    for path in ("torch_distributed.yaml", "deepspeed_distributed.yaml", "torchtune/qwen2_5/qwen2_5_1.5B.yaml"):
        rt = stock(path)
        jobs = [rj["name"] for rj in rt["spec"]["template"]["spec"]["replicatedJobs"]
                if any(c["name"] == "node" for c in rj["template"]["spec"]["template"]["spec"]["containers"])]
        entry = credential_entry("checkpoint-store", "/var/run/dispatch/creds", jobs)
        pods = build_pods(rt, job_with(entry))
        assert collisions_with(pods, f"patch {OURS}") == [] and missing(pods, entry) == [], path


def test_jobs_and_containers_an_entry_names_that_the_runtime_lacks_are_appended_and_reported():
    """Trainer v2.3.0's webhook checks the patches against the template they were merged into, so it never sees
    these (tests/e2e/test_corpus.py shows it admitting them): the harness reports them instead."""
    pod = {"template": {"spec": {"template": {"spec": {"initContainers": [{"name": "dispatch-publish"}],
                                                       "containers": [{"name": "node"}, {"name": "x"}]}}}}}
    entry = {"manager": OURS, "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
        {"name": "node", **pod}, {"name": "other", **pod}]}}}}
    pods = build_pods(node_pod(), job_with(entry))
    assert [c["name"] for c in pods["node"].spec["containers"]] == ["node", "x"]
    assert added_by(pods, f"patch {OURS}") == [
        f"node: patch {OURS} adds initContainer 'dispatch-publish', which the runtime lacks",
        f"node: patch {OURS} adds container 'x', which the runtime lacks",
        f"other: patch {OURS} adds replicated job 'other', which the runtime lacks"]
    assert added_by(pods, "patch example.com/other") == []
    assert added_by(build_pods(node_pod(), job_with(pod_patch(OURS, {"containers": [{"name": "node"}]}))),
                    f"patch {OURS}") == []
