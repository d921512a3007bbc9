"""`verify` (SPEC 9): why a probe's pod is held back, in the cluster's own words, read from what the kubelet
and the scheduler write on the pod (its events, its PodScheduled condition, its containers' waiting states),
with what to do about it, and whether waiting can resolve it (`final`: verify fails at once instead of
sitting out --timeout).

The messages matched here are the ones Kubernetes v1.37 writes (read from its source, and seen on the test
suite's node):
- the kubelet's FailedMount event: `MountVolume.SetUp failed for volume "V" : secret "S" not found` (or
  `configmap "C" not found`), for a Secret or ConfigMap volume, projected or not;
- a container waiting in CreateContainerConfigError: `secret "S" not found`, `couldn't find key K in Secret
  NS/S` (env and envFrom);
- the scheduler's FailedScheduling event and PodScheduled condition: `0/N nodes are available: <reasons>.
  preemption: 0/N nodes are available: <per-node outcome>.` The preemption part is the scheduler's verdict on
  waiting: `Preemption is not helpful for scheduling` on every node means no node fits the pod however many
  other pods go away (its request exceeds each node's allocatable, a taint, a node selector, a missing
  claim); `No preemption victims found for incoming pod` means a node would fit once others finish.
A cluster that grows on demand says so on the pod (cluster-autoscaler's `TriggeredScaleUp`, Karpenter's
`Nominated`), and a preemption under way sets `status.nominatedNodeName`: then waiting can resolve it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

SECRET_MISSING = "secret-missing"
CONFIGMAP_MISSING = "configmap-missing"
KEY_MISSING = "key-missing"
PVC_MISSING = "pvc-missing"
PVC_PENDING = "pvc-pending"
UNSCHEDULABLE = "unschedulable"
MOUNT_FAILED = "mount-failed"
IMAGE_PULL = "image-pull"
NODE_WARNING = "node-warning"

UNRESOLVABLE = "Preemption is not helpful for scheduling"
SCALE_UP_EVENTS = ("TriggeredScaleUp", "Nominated")  # cluster-autoscaler; Karpenter
# The kubelet's warnings that hold a pod before its containers exist (pkg/kubelet/events). Not every warning:
# `MissingClusterDNS`, say, comes with pods that run.
HOLDING_EVENTS = ("FailedCreatePodSandBox", "FailedPodSandBoxStatus", "FailedAttachVolume", "FailedMapVolume",
                  "FailedMountOnFilesystemMismatch", "FailedPrepareDynamicResources", "FailedCreatePodContainer",
                  "NetworkNotReady", "FailedNodeDeclaredFeaturesCheck")
NO_NODES = "no nodes available to schedule pods"
UNBOUND_CLAIMS = "pod has unbound immediate PersistentVolumeClaims"
EPHEMERAL_CLAIM = "waiting for ephemeral volume controller to create the persistentvolumeclaim"

_MOUNT = re.compile(r'^MountVolume\.SetUp failed for volume "(?P<volume>[^"]*)" : (?P<error>.*)$', re.S)
_MISSING = re.compile(r'\b(?P<kind>secret|configmap) "(?P<name>[^"]+)" not found')
_KEY = re.compile(r"couldn't find key (?P<key>\S+) in (?P<kind>Secret|ConfigMap) (?P<ns>[^/\s]+)/(?P<name>\S+)")
_PVC_MISSING = re.compile(r'persistentvolumeclaim "(?P<name>[^"]+)" not found')
_PREEMPTION = re.compile(r"preemption: 0/(?P<nodes>\d+) nodes are available: (?P<outcome>.*?)\.?\s*$", re.S)
_OUTCOME = re.compile(r"(\d+) ([^,]+)")
# `Failed to pull image "I"`, `Back-off pulling image "I"`, `failed to pull and unpack image "I"` (containerd)
_PULLED_IMAGE = re.compile(r'pull(?:ing)?(?: and unpack)? image "(?P<image>[^"]+)"', re.I)
_KIND_NAME = {"secret": "Secret", "configmap": "ConfigMap"}


@dataclass(frozen=True)
class Cause:
    kind: str      # one of the constants above
    message: str   # the cluster's own words
    hint: str      # what to do
    final: bool    # waiting cannot resolve it


def _when(event: dict[str, Any]) -> str:
    return (event.get("lastTimestamp") or event.get("eventTime") or
            (event.get("metadata") or {}).get("creationTimestamp") or "")


def latest(events: Iterable[dict[str, Any]], reasons: Iterable[str]) -> dict[str, Any] | None:
    """The most recent event with one of `reasons` (events of one pod; RFC 3339 times sort as text)."""
    wanted = set(reasons)
    found = [e for e in events if e.get("reason") in wanted]
    return max(found, key=_when) if found else None


def _missing_hint(kind: str, name: str, namespace: str, volume: str, credentials: dict[str, str]) -> str:
    what = _KIND_NAME[kind]
    if kind == "secret" and credentials.get(volume) == name:
        return (f"create the Secret {name} in namespace {namespace}: it is credential {volume} of the webhook's "
                f"settings, so every TrainJob in {namespace} waits for it the same way (`dispatch-admission audit` "
                f"lists each namespace missing a credential's Secret)")
    used = f"the runtime's volume {volume} mounts it" if volume else "a container of the runtime reads it"
    return f"create the {what} {name} in namespace {namespace} ({used}), or verify a runtime that does not need it"


def mount_cause(events: Iterable[dict[str, Any]], namespace: str, credentials: dict[str, str]) -> Cause | None:
    """The kubelet's latest FailedMount: a missing Secret or ConfigMap is final (the kubelet retries, but
    nothing verify does will make it), any other mount failure is what the pod waits on."""
    event = latest(events, ("FailedMount",))
    if event is None:
        return None
    message = (event.get("message") or "").strip()
    mount = _MOUNT.match(message)
    volume = mount.group("volume") if mount else ""
    missing = _MISSING.search(message)
    if missing:
        kind = SECRET_MISSING if missing.group("kind") == "secret" else CONFIGMAP_MISSING
        return Cause(kind, message, _missing_hint(missing.group("kind"), missing.group("name"), namespace, volume,
                                                  credentials), final=True)
    where = f"volume {volume}" if volume else "a volume"
    return Cause(MOUNT_FAILED, message, f"the kubelet cannot mount {where} of the pod: read the message, and "
                                        "`kubectl describe pod` on a kept probe (--keep)", final=False)


def config_cause(message: str, namespace: str, credentials: dict[str, str]) -> Cause | None:
    """A container's CreateContainerConfigError naming a missing Secret, ConfigMap or key (its env)."""
    key = _KEY.search(message)
    if key:
        return Cause(KEY_MISSING, message, f"add the key {key.group('key')} to the {key.group('kind')} "
                                           f"{key.group('name')} in namespace {key.group('ns')}, or fix the "
                                           "runtime's env that names it", final=True)
    missing = _MISSING.search(message)
    if missing:
        kind = SECRET_MISSING if missing.group("kind") == "secret" else CONFIGMAP_MISSING
        return Cause(kind, message, _missing_hint(missing.group("kind"), missing.group("name"), namespace, "",
                                                  credentials), final=True)
    return None


def _unresolvable_everywhere(message: str) -> bool:
    """The scheduler's preemption verdict: every node rejects the pod for a reason no eviction changes."""
    m = _PREEMPTION.search(message)
    if not m:
        return False
    nodes = int(m.group("nodes"))
    outcome = {reason.strip(): int(n) for n, reason in _OUTCOME.findall(m.group("outcome"))}
    return nodes > 0 and outcome == {UNRESOLVABLE: nodes}


def scheduling_cause(pod: dict[str, Any], events: Iterable[dict[str, Any]], namespace: str) -> Cause:
    """Why the pod is not bound to a node. One stated order of sources: the PodScheduled condition's message is
    the verdict; the latest FailedScheduling event only stands in while the condition has none, and never ends
    the probe. The scheduler writes both in the same cycle but they reach a watcher in either order, so a verdict
    taken from whichever came first made the reported cause depend on the race."""
    events = list(events)
    cond: dict[str, Any] = next((c for c in (pod.get("status") or {}).get("conditions") or []
                                 if c.get("type") == "PodScheduled"), {})
    if cond.get("message"):
        return _scheduler_verdict(f"{cond.get('reason') or 'Unschedulable'}: {cond['message']}", pod, events,
                                  namespace)
    event = latest(events, ("FailedScheduling",))
    if event is None:
        return Cause(UNSCHEDULABLE, "the pod is not bound to a node yet", "", final=False)
    stand_in = _scheduler_verdict(f"FailedScheduling: {event.get('message') or ''}", pod, events, namespace)
    return dataclasses.replace(stand_in, final=False)


def _scheduler_verdict(message: str, pod: dict[str, Any], events: list[dict[str, Any]], namespace: str) -> Cause:
    claim = _PVC_MISSING.search(message)
    if claim:
        return Cause(PVC_MISSING, message, f"create the PersistentVolumeClaim {claim.group('name')} in namespace "
                                           f"{namespace}, or verify a runtime that does not mount it", final=True)
    if UNBOUND_CLAIMS in message or EPHEMERAL_CLAIM in message:
        return Cause(PVC_PENDING, message, f"a PersistentVolumeClaim the pod mounts is not bound: `kubectl get pvc "
                                           f"-n {namespace}` (its StorageClass needs a provisioner, or a "
                                           "PersistentVolume must match it); verify waits for it until --timeout",
                     final=False)
    growing = latest(events, SCALE_UP_EVENTS)
    nominated = (pod.get("status") or {}).get("nominatedNodeName")
    if growing is not None or nominated:
        why = (f"{growing.get('reason')}: {growing.get('message')}" if growing is not None
               else f"preempting pods on node {nominated}")
        return Cause(UNSCHEDULABLE, f"{message} ({why})", "the cluster is making room for the probe: give it a "
                                                           "longer --timeout if it ends first", final=False)
    if _unresolvable_everywhere(message) or NO_NODES in message:
        return Cause(UNSCHEDULABLE, message, "no node can take the probe, however many other pods finish: add or "
                                             "change a node for what the scheduler names (GPUs, CPU, memory beyond "
                                             "any node's allocatable, a taint, a node selector), or verify a runtime "
                                             "whose pods fit", final=True)
    return Cause(UNSCHEDULABLE, message, "no node has room for the probe now: free what the scheduler names (GPUs, "
                                         "CPU, memory), or give it a longer --timeout", final=False)


def pulled_image(message: str) -> str:
    """The image a pull error names, if it names one."""
    m = _PULLED_IMAGE.search(message)
    return m.group("image") if m else ""


def pull_hint(message: str, publish_image: str) -> str:
    image = pulled_image(message)
    if image and image != publish_image:
        return (f"the node cannot pull {image} (not the publish image: the runtime's, or --image): check that it "
                "exists in its registry, that the node can reach the registry, and the pull secrets")
    return ("the node cannot pull the image: check that publish.image's digest exists in its registry, that the "
            "node can reach the registry, and the pull secrets; image volumes need Kubernetes 1.35+ "
            "(or the ImageVolume feature gate) and a runtime that supports them (containerd 2.1+, CRI-O 1.31+)")


def node_warning(events: Iterable[dict[str, Any]]) -> Cause | None:
    """The kubelet's latest warning that holds a scheduled pod before its containers exist (a sandbox that
    cannot be made, a volume not attached): what the pod waits on when nothing above names it."""
    event = latest(events, HOLDING_EVENTS)
    if event is None:
        return None
    return Cause(NODE_WARNING, f"{event.get('reason')}: {(event.get('message') or '').strip()}",
                 "read the message; `kubectl describe pod` on a kept probe (--keep) shows the rest", final=False)


def missing_credential(secret: str, volume: str, namespace: str) -> str:
    """verify's refusal, before any probe, when a credential's Secret is not in the probe's namespace."""
    return (f"Secret {secret} not found in namespace {namespace}: credential {volume} of the webhook's settings mounts "
            f"it in every TrainJob there, whose pods would wait for it and never start; create it in {namespace}, or "
            "run verify in a namespace that has it")
