"""Issue 35, item 8: verify names the real cause. The probe pod's events and conditions, as the kubelet and the
scheduler of Kubernetes v1.37.2 wrote them on the test suite's node (tests/unit/data/verify_shapes.json),
classified into a cause with its own "what to do", and an end at once when waiting cannot resolve it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import MANAGER
from tests.verify_fakes import stored
from webhook.core.patch import Entry
from webhook.core.settings import parse
from webhook.inspection import verify as v
from webhook.inspection import verify_causes as causes

SHAPES = json.loads((Path(__file__).parent / "data" / "verify_shapes.json").read_text())["pods"]
NS = "team-q"
CREDENTIAL = {"name": "checkpoint-store", "secret": "s3-credentials", "mountPath": "/var/run/dispatch/creds"}
PUBLISH = "127.0.0.1:52055/dispatch/publish@sha256:" + "0" * 64  # the digest the image volume pod asked for


def entry(credentials=(), image=PUBLISH) -> dict:
    s = parse(json.dumps({"manager": MANAGER, "publish": {"image": image}, "credentials": list(credentials)}))
    return Entry.build(s, ["node"]).as_dict("2026-12-02T09:09:58Z")


def seen(name: str, trainjob_entry: dict | None = None, extra_events=(), **status) -> v.Status:
    """classify() on one captured pod and its events."""
    shape = json.loads(json.dumps(SHAPES[name]))
    shape["pod"]["status"].update(status)
    return v.classify(stored(trainjob_entry or entry()), [shape["pod"]], shape["events"] + list(extra_events), MANAGER)


# ---- the kubelet: volumes and container config ----

def test_a_credentials_secret_missing_ends_at_once_with_the_kubelets_words_and_says_every_trainjob_waits():
    st = seen("missing-secret", entry([CREDENTIAL]))
    assert st.done and st.reached is v.Stage.SCHEDULED and st.node == "dispatch-e2e-node"
    f = st.failure
    assert (f.stage, f.cause) == (v.Stage.PULLED, causes.SECRET_MISSING)
    assert f.message == 'MountVolume.SetUp failed for volume "checkpoint-store" : secret "s3-credentials" not found'
    assert f.hint.startswith(f"create the Secret s3-credentials in namespace {NS}: it is credential checkpoint-store "
                             f"of the webhook's settings, so every TrainJob in {NS} waits for it the same way")


def test_a_secret_or_configmap_the_runtime_mounts_is_named_as_the_runtimes():
    st = seen("missing-secret")  # the same volume, but no credential of the settings
    assert st.failure.hint == (f"create the Secret s3-credentials in namespace {NS} (the runtime's volume "
                               "checkpoint-store mounts it), or verify a runtime that does not need it")
    st = seen("missing-configmap")
    assert (st.failure.cause, st.failure.message) == (
        causes.CONFIGMAP_MISSING, 'MountVolume.SetUp failed for volume "cfg" : configmap "train-config" not found')
    assert st.failure.hint.startswith(f"create the ConfigMap train-config in namespace {NS} (the runtime's volume cfg")
    st = seen("missing-projected")
    assert st.failure.cause == causes.SECRET_MISSING and "Secret proj-secret" in st.failure.hint


@pytest.mark.parametrize("name,cause,message,hint", [
    ("env-missing-secret", causes.SECRET_MISSING, 'secret "env-secret" not found',
     f"create the Secret env-secret in namespace {NS} (a container of the runtime reads it)"),
    ("envfrom-missing-cm", causes.CONFIGMAP_MISSING, 'configmap "envfrom-cm" not found',
     f"create the ConfigMap envfrom-cm in namespace {NS}"),
    ("env-missing-key", causes.KEY_MISSING, "couldn't find key nokey in ConfigMap team-q/present-cm",
     "add the key nokey to the ConfigMap present-cm in namespace team-q"),
])
def test_a_container_config_error_names_what_is_missing(name, cause, message, hint):
    st = seen(name)
    assert st.done and st.failure.stage is v.Stage.STARTED and st.failure.cause == cause
    assert st.failure.message == f"CreateContainerConfigError: {message}"
    assert st.failure.hint.startswith(hint)


def test_another_mount_failure_is_waited_on_and_named_by_the_timeout():
    event = {"type": "Warning", "reason": "FailedMount", "lastTimestamp": "2026-12-02T09:11:00Z",
             "involvedObject": {"kind": "Pod", "namespace": NS, "name": "missing-configmap"},
             "message": 'MountVolume.SetUp failed for volume "data" : mount failed: exit status 32'}
    shape = SHAPES["missing-configmap"]
    events = [e for e in shape["events"] if e["reason"] != "FailedMount"] + [event]
    st = v.classify(stored(entry()), [shape["pod"]], events, MANAGER)
    assert not st.done and st.cause == causes.MOUNT_FAILED and st.waiting == event["message"]
    out = v.timed_out(st, 240)
    assert out.failure.message == f"not pulled after 240s: {event['message']}" and out.failure.cause == "mount-failed"
    assert out.failure.hint.startswith("the kubelet cannot mount volume data of the pod")


def test_a_sandbox_the_node_cannot_make_is_what_the_pod_waits_on_and_other_warnings_are_not():
    shape = SHAPES["missing-configmap"]
    events = [e for e in shape["events"] if e["reason"] != "FailedMount"]
    st = v.classify(stored(entry()), [shape["pod"]], events, MANAGER)
    assert not st.done and st.waiting == "ContainerCreating" and st.cause == ""
    warning = dict(SHAPES["pull-error"]["events"][1], involvedObject={"name": "missing-configmap"})
    assert warning["reason"] == "MissingClusterDNS"  # the kubelet warns so on every pod of this node: it holds none
    assert v.classify(stored(entry()), [shape["pod"]], events + [warning], MANAGER).waiting == "ContainerCreating"
    sandbox = {"type": "Warning", "reason": "FailedCreatePodSandBox", "lastTimestamp": "2026-12-02T09:11:00Z",
               "involvedObject": {"name": "missing-configmap"},
               "message": 'Failed to create pod sandbox: rpc error: code = Unknown desc = failed to setup network'}
    st = v.classify(stored(entry()), [shape["pod"]], events + [sandbox], MANAGER)
    assert st.cause == causes.NODE_WARNING and st.waiting == f"FailedCreatePodSandBox: {sandbox['message']}"


# ---- the kubelet: images ----

def test_a_trainer_image_that_cannot_be_pulled_is_named_apart_from_the_publish_image():
    st = seen("pull-error")
    training = "127.0.0.1:52055/e2e/training@sha256:" + "0" * 64
    assert st.done and st.failure.stage is v.Stage.PULLED and st.failure.cause == causes.IMAGE_PULL
    assert st.failure.message.startswith("ErrImagePull: rpc error: code = NotFound desc = failed to pull and unpack")
    assert st.failure.hint.startswith(f"the node cannot pull {training} (not the publish image: the runtime's, or "
                                      "--image)")


def test_the_publish_image_that_cannot_be_pulled_gets_the_publish_advice():
    st = seen("image-volume-pull-error")
    assert st.failure.stage is v.Stage.PULLED and st.failure.message.startswith(
        f'ImagePullBackOff: Back-off pulling image "{PUBLISH}": ErrImagePull: ')
    assert st.failure.hint.startswith("the node cannot pull the image: check that publish.image's digest exists")


# ---- the scheduler ----

@pytest.mark.parametrize("name,reason", [("too-big", "1 Insufficient cpu"),
                                         ("no-such-node", "1 node(s) didn't match Pod's node affinity/selector")])
def test_a_pod_no_node_can_take_ends_at_once(name, reason):
    st = seen(name)
    assert st.done and st.reached is v.Stage.ADMITTED and st.failure.stage is v.Stage.SCHEDULED
    assert st.failure.cause == causes.UNSCHEDULABLE
    assert st.failure.message == (f"Unschedulable: 0/1 nodes are available: {reason}. preemption: 0/1 nodes are "
                                  "available: 1 Preemption is not helpful for scheduling.")
    assert st.failure.hint.startswith("no node can take the probe, however many other pods finish")


def test_a_pod_that_fits_once_others_finish_waits_until_the_timeout():
    st = seen("busy")
    assert not st.done and st.cause == causes.UNSCHEDULABLE
    assert "No preemption victims found for incoming pod" in st.waiting
    out = v.timed_out(st, 240)
    assert out.failure.stage is v.Stage.SCHEDULED and out.failure.message.startswith("not scheduled after 240s: ")
    assert out.failure.hint.startswith("no node has room for the probe now")


def test_an_autoscaler_or_a_preemption_making_room_is_waited_for():
    scale_up = {"type": "Normal", "reason": "TriggeredScaleUp", "lastTimestamp": "2026-12-02T09:10:05Z",
                "involvedObject": {"name": "too-big"}, "source": {"component": "cluster-autoscaler"},
                "message": "pod triggered scale-up: [{gpu-pool 0->1 (max: 4)}]"}
    st = seen("too-big", extra_events=[scale_up])
    assert not st.done and st.waiting.endswith("(TriggeredScaleUp: pod triggered scale-up: [{gpu-pool 0->1 (max: 4)}])")
    st = seen("too-big", nominatedNodeName="gpu-7")
    assert not st.done and st.waiting.endswith("(preempting pods on node gpu-7)")


def test_a_claim_that_does_not_exist_ends_at_once_and_one_not_bound_is_waited_for():
    st = seen("missing-claim")
    assert st.done and st.failure.stage is v.Stage.SCHEDULED and st.failure.cause == causes.PVC_MISSING
    assert st.failure.message == ('Unschedulable: 0/1 nodes are available: persistentvolumeclaim "no-claim" not found.'
                                  ' not found')
    assert st.failure.hint == (f"create the PersistentVolumeClaim no-claim in namespace {NS}, or verify a runtime "
                               "that does not mount it")
    for name in ("pending-claim", "pending-claim-class"):
        st = seen(name)
        assert not st.done and st.cause == causes.PVC_PENDING, name
        assert "pod has unbound immediate PersistentVolumeClaims" in st.waiting
        assert v.timed_out(st, 60).failure.hint.startswith("a PersistentVolumeClaim the pod mounts is not bound")


def test_a_running_pod_is_not_held_by_its_warnings():
    st = seen("holder")
    assert not st.done and st.reached is v.Stage.STARTED and st.waiting == "running: waiting for it to exit"


def test_the_scheduler_event_stands_in_for_a_condition_without_a_message_but_never_ends_the_probe():
    """One order of sources: the condition is the verdict. The event arriving first (a watcher may see either
    first) says why the pod waits, and the probe then ends on the condition's words, whichever came first."""
    shape = json.loads(json.dumps(SHAPES["too-big"]))
    with_condition = causes.scheduling_cause(shape["pod"], shape["events"], NS)
    shape["pod"]["status"]["conditions"][0].pop("message")
    cause = causes.scheduling_cause(shape["pod"], shape["events"], NS)
    assert not cause.final
    assert cause.message.startswith("FailedScheduling: 0/1 nodes are available: 1 Insufficient cpu.")
    assert cause.hint == with_condition.hint
    assert with_condition.final and with_condition.message.startswith("Unschedulable: 0/1 nodes are available: 1 ")
    assert not causes.scheduling_cause(shape["pod"], [], NS).final


def test_the_credential_refusal_names_the_secret_and_the_namespace():
    assert causes.missing_credential("s3-credentials", "checkpoint-store", NS) == (
        "Secret s3-credentials not found in namespace team-q: credential checkpoint-store of the webhook's settings "
        "mounts it in every TrainJob there, whose pods would wait for it and never start; create it in team-q, or run "
        "verify in a namespace that has it")
