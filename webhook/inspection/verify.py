"""`verify` (SPEC 9), the part without I/O: the stage a probe reached read from its stored TrainJob, its pods and
their events, and what to do on each failure. The probe TrainJob is `verify_probe`'s, the stored pod template
against the settings `verify_template`'s, the report (table or JSON) `verify_report`'s. The adapter
(`webhook.commands.verify`) reads the cluster and calls these.

A probe goes through the stages in order: `admitted` (the webhook's entry is on the stored TrainJob),
`scheduled` (the pod is bound to a node), `pulled` (the image volume or the route-2 init container's image
is on the node), `started` (the node container's process exists), `ran` (it exited with a code other than
126 or 127, which are the shell's "cannot execute" and "not found").
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..core import paths
from ..core.patch import PUBLISH_DEST_ENV, entry_pod_specs, entry_secrets
from ..core.registry import NODE_CONTAINER
from ..core.settings import PUBLISH_VOLUME
from . import verify_causes as causes
from .verify_probe import PUBLISH_BINARY

NOT_EXECUTED = (126, 127)  # the shell's "found but cannot execute" and "not found"
PULL_REASONS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull", "RegistryUnavailable")
START_REASONS = ("StartError", "ContainerCannotRun", "RunContainerError", "CreateContainerError",
                 "CreateContainerConfigError")
OUTPUT_LINES = 5


class Stage(str, Enum):
    ADMITTED = "admitted"
    SCHEDULED = "scheduled"
    PULLED = "pulled"
    STARTED = "started"
    RAN = "ran"


STAGES = tuple(Stage)


def next_stage(stage: Stage | None) -> Stage:
    return STAGES[0] if stage is None else STAGES[min(STAGES.index(stage) + 1, len(STAGES) - 1)]


@dataclass(frozen=True)
class Failure:
    stage: Stage
    message: str    # the cluster's own words
    hint: str       # what to do
    cause: str = ""  # what it is, when the cluster named it (verify_causes: secret-missing, unschedulable, ...)


@dataclass(frozen=True)
class Status:
    """Where a probe is now: the last stage it reached, and either its end or what it waits for."""
    reached: Stage | None
    done: bool = False
    failure: Failure | None = None
    waiting: str = ""                 # why it has not reached the next stage yet (the cluster's message)
    hint: str = ""                    # what to do, should the wait end in the timeout
    cause: str = ""                   # the kind of cause it waits on (verify_causes)
    pod: str = ""
    node: str = ""
    exit_code: int | None = None
    container: str = ""               # the container whose log holds the output to report
    previous: bool = False            # that output is of the container's previous run

    @property
    def ran(self) -> bool:
        return self.reached is Stage.RAN and self.failure is None


# ---- the entry on the stored TrainJob ----

def find_entry(trainjob: dict[str, Any] | None, manager: str) -> dict[str, Any] | None:
    for e in ((trainjob or {}).get("spec") or {}).get("runtimePatches") or []:
        if isinstance(e, dict) and e.get("manager") == manager:
            return e
    return None


@dataclass(frozen=True)
class Route:
    """The publish route the stored entry carries: route 2 when it adds an init container."""
    init_container: str | None

    @property
    def number(self) -> int:
        return 2 if self.init_container else 1


def route_of(entry: dict[str, Any] | None) -> Route:
    for pod in entry_pod_specs(entry):
        for init in pod.get("initContainers") or []:
            if any(m.get("mountPath") == paths.PUBLISH_DIR for m in init.get("volumeMounts") or []):
                return Route(init.get("name"))
    return Route(None)


def entry_publish_image(entry: dict[str, Any] | None) -> str:
    for pod in entry_pod_specs(entry):
        for v in pod.get("volumes") or []:
            if v.get("name") == PUBLISH_VOLUME and isinstance(v.get("image"), dict):
                return v["image"].get("reference") or ""
    return ""


# ---- the stage, from the stored TrainJob, its pods and their events ----

def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == kind), {})


def _statuses(pod: dict[str, Any], key: str) -> dict[str, dict[str, Any]]:
    return {s.get("name"): s for s in (pod.get("status") or {}).get(key) or []}


def _has_node_container(pod: dict[str, Any]) -> bool:
    return any(c.get("name") == NODE_CONTAINER for c in (pod.get("spec") or {}).get("containers") or [])


def probe_pod(pods: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The probe's node pod: the newest not being deleted (a Job may replace a failed pod), else the newest."""
    mine = [p for p in pods if _has_node_container(p)]
    if not mine:
        return None
    live = [p for p in mine if not p["metadata"].get("deletionTimestamp")] or mine
    return max(live, key=lambda p: (p["metadata"].get("creationTimestamp") or "", p["metadata"]["name"]))


def _terminated(status: dict[str, Any]) -> tuple[dict[str, Any] | None, bool]:
    """The container's termination (state, else lastState) and whether it is of the previous run."""
    state, last = status.get("state") or {}, status.get("lastState") or {}
    if "terminated" in state:
        return state["terminated"] or {}, False
    if "terminated" in last:
        return last["terminated"] or {}, True
    return None, False


def _term_text(term: dict[str, Any]) -> str:
    text = (term.get("message") or "").strip()
    head = f"{term.get('reason') or 'Terminated'}, exit code {term.get('exitCode')}"
    return f"{head}: {text}" if text else head


def _pull_event(events: list[dict[str, Any]]) -> str:
    """The kubelet's latest pull failure, as its event says it (image volumes report only there)."""
    found = [e for e in events if e.get("reason") == "Failed"
             and (e.get("message") or "").startswith("Failed to pull image")]
    if not found:
        return ""
    found.sort(key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
    message: str = found[-1]["message"]
    return message


def classify(trainjob: dict[str, Any] | None, pods: list[dict[str, Any]], events: list[dict[str, Any]],
             manager: str) -> Status:
    """The stage the probe reached and whether it ended there. Ends are: no entry (the webhook did not
    mutate it), a pull error, a start error, an exit, and a cause that waiting cannot resolve (verify_causes:
    a missing Secret, ConfigMap or claim, a pod no node can take). Anything else the pod waits on (a busy
    node, a claim being bound, an autoscaler at work) ends only with the timeout (`timed_out`)."""
    entry = find_entry(trainjob, manager)
    if entry is None:
        return Status(None, done=True, failure=Failure(Stage.ADMITTED, NO_ENTRY, hint_for(Stage.ADMITTED, NO_ENTRY)))
    pod = probe_pod(pods)
    if pod is None:
        suspended = ((trainjob or {}).get("spec") or {}).get("suspend")
        why = "no pod yet"
        if suspended:
            cond = _condition(trainjob or {}, "Suspended")
            why = f"no pod yet: the TrainJob is suspended ({cond.get('message') or 'spec.suspend is true'})"
        return Status(Stage.ADMITTED, waiting=why)
    return _ProbePod(trainjob, pod, events, entry).judge()


class _ProbePod:
    """The probe's pod, judged stage by stage: scheduled, pulled (and its volumes mounted), started, ran."""

    def __init__(self, trainjob: dict[str, Any] | None, pod: dict[str, Any], events: list[dict[str, Any]],
                 entry: dict[str, Any]):
        self.pod, self.entry, self.route = pod, entry, route_of(entry)
        self.name, self.node = pod["metadata"]["name"], (pod.get("spec") or {}).get("nodeName") or ""
        self.namespace = (pod["metadata"].get("namespace")
                          or ((trainjob or {}).get("metadata") or {}).get("namespace") or "")
        self.credentials = dict(entry_secrets(entry))
        self.events = [e for e in events if (e.get("involvedObject") or {}).get("name") == self.name]
        self.node_status = _statuses(pod, "containerStatuses").get(NODE_CONTAINER, {})
        init = self.route.init_container
        self.init_status = _statuses(pod, "initContainerStatuses").get(init, {}) if init else {}
        self.node_state = self.node_status.get("state") or {}
        self.node_started = "running" in self.node_state or _terminated(self.node_status)[0] is not None
        self.nothing_started = (not self.node_started and "running" not in (self.init_status.get("state") or {})
                                and not _terminated(self.init_status)[0])

    def at(self, stage: Stage | None, **kw: Any) -> Status:
        return Status(stage, pod=self.name, node=self.node, **kw)

    def failed(self, stage: Stage, message: str, cause: causes.Cause | None = None, **kw: Any) -> Status:
        hint = cause.hint if cause is not None else hint_for(stage, message, self.route)
        return self.at(STAGES[STAGES.index(stage) - 1], done=True,
                       failure=Failure(stage, message, hint, cause.kind if cause is not None else ""), **kw)

    def waits(self, stage: Stage, cause: causes.Cause) -> Status:
        return self.at(stage, waiting=cause.message, hint=cause.hint, cause=cause.kind)

    def pull_failed(self, message: str) -> Status:
        return self.failed(Stage.PULLED, message, causes.Cause(causes.IMAGE_PULL, message, causes.pull_hint(
            message, entry_publish_image(self.entry)), final=True))

    def judge(self) -> Status:
        if _condition(self.pod, "PodScheduled").get("status") != "True" and not self.node:
            cause = causes.scheduling_cause(self.pod, self.events, self.namespace)
            return self.failed(Stage.SCHEDULED, cause.message, cause) if cause.final else self.waits(Stage.ADMITTED,
                                                                                                      cause)
        # the kubelet mounts the pod's volumes before it pulls: a Secret or ConfigMap that is not there holds it
        mount = causes.mount_cause(self.events, self.namespace, self.credentials) if self.nothing_started else None
        return self.pulled(mount) or self.started() or self.creating(mount)

    def pulled(self, mount: causes.Cause | None) -> Status | None:
        """The init container's image (route 2) and the image volume (route 1) reach the node; its volumes mount."""
        for status in (self.init_status, self.node_status):
            waiting = (status.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in PULL_REASONS:
                return self.pull_failed(f"{waiting['reason']}: {waiting.get('message') or _pull_event(self.events)}")
        pull_error = _pull_event(self.events)
        if pull_error and self.nothing_started:
            return self.pull_failed(pull_error)
        if mount is not None and mount.final:
            return self.failed(Stage.PULLED, mount.message, mount)
        return None

    def started(self) -> Status | None:
        """Route 2's init container copied (exited 0); the node container started, ran, or is running."""
        init = self.route.init_container
        if init:
            term, previous = _terminated(self.init_status)
            if term is not None and term.get("exitCode") != 0 and not self.node_started:
                return self.failed(Stage.STARTED, f"init container {init} {_term_text(term)}", container=init,
                                   previous=previous)
        term, previous = _terminated(self.node_status)
        waiting = self.node_state.get("waiting") or {}
        if term is not None:
            code = term.get("exitCode")
            if term.get("reason") in START_REASONS or code in NOT_EXECUTED:
                return self.failed(Stage.STARTED, _term_text(term), exit_code=code)
            return self.at(Stage.RAN, done=True, exit_code=code, container=NODE_CONTAINER, previous=previous)
        if waiting.get("reason") in START_REASONS:
            message = waiting.get("message") or ""
            return self.failed(Stage.STARTED, f"{waiting['reason']}: {message}".rstrip(": "),
                               causes.config_cause(message, self.namespace, self.credentials))
        if "running" in self.node_state:
            return self.at(Stage.STARTED, waiting="running: waiting for it to exit")
        if self.init_status and not _terminated(self.init_status)[0]:
            if "running" in (self.init_status.get("state") or {}):
                return self.at(Stage.PULLED, waiting=f"init container {init} is running")
        return None

    def creating(self, mount: causes.Cause | None) -> Status:
        """Nothing has started yet, or the pod failed as a whole."""
        status = self.pod.get("status") or {}
        waiting = self.node_state.get("waiting") or {}
        reason = waiting.get("reason") or status.get("phase") or "Pending"
        text = waiting.get("message") or ""
        if status.get("phase") == "Failed":
            return self.failed(Stage.STARTED, f"pod failed: {status.get('reason')}: {status.get('message')}")
        # still creating: what the kubelet last warned about says more than `ContainerCreating`
        held = (mount or causes.node_warning(self.events)) if self.nothing_started else None
        if held is not None:
            return self.waits(Stage.SCHEDULED, held)
        return self.at(Stage.SCHEDULED, waiting=f"{reason}: {text}" if text else reason)


def timed_out(status: Status, seconds: float) -> Status:
    """The probe at the deadline: it failed at the stage after the one it reached, with what it waited for."""
    if status.done:
        return status
    stage = next_stage(status.reached)
    message = f"not {stage.value} after {seconds:g}s: {status.waiting or 'no news from the cluster'}"
    return Status(status.reached, done=True, failure=Failure(stage, message, status.hint or hint_for(stage, message),
                                                             status.cause),
                  waiting=status.waiting, pod=status.pod, node=status.node)


def interrupted(status: Status, signal_name: str) -> Status:
    if status.done:
        return status
    stage = next_stage(status.reached)
    message = f"interrupted by {signal_name} while {status.waiting or 'waiting'}"
    return Status(status.reached, done=True, failure=Failure(stage, message, "run verify again and let it finish"),
                  pod=status.pod, node=status.node)


def refused(message: str) -> Status:
    """The API server refused the probe's create on a webhook's word (ours, or another)."""
    return Status(None, done=True, failure=Failure(Stage.ADMITTED, message, hint_for(Stage.ADMITTED, message)))


# ---- what to do ----

NO_ENTRY = "the stored TrainJob has no entry: the webhook did not mutate it"


def hint_for(stage: Stage, message: str, route: Route | None = None) -> str:
    low = message.lower()
    if stage is Stage.ADMITTED:
        if message == NO_ENTRY:
            return ("install the webhook (helm install), or check that its MutatingWebhookConfiguration selects this "
                    "namespace and these labels (namespaceSelector, objectSelector) and that --settings names its "
                    "manager")
        return ("the webhook refused the probe on this runtime: fix what the message names "
                "(`dispatch-admission audit` lists each runtime that cannot carry the mount)")
    if stage is Stage.SCHEDULED:
        if "suspended" in low:
            return ("the TrainJob stays suspended: where Kueue queues TrainJobs, pass "
                    "--label kueue.x-k8s.io/queue-name=QUEUE (and a longer --timeout if the queue is busy)")
        return ("no node takes the probe: free or add what the scheduler names (GPUs, CPU, memory, taints), or "
                "verify a runtime whose requests fit; a longer --timeout if nodes are scaling up")
    if stage is Stage.PULLED:
        return ("the node cannot pull the image: check that publish.image's digest exists in its registry, that the "
                "node can reach the registry, and the pull secrets; image volumes need Kubernetes 1.35+ "
                "(or the ImageVolume feature gate) and a runtime that supports them (containerd 2.1+, CRI-O 1.31+)")
    if stage is Stage.STARTED:
        if "permission denied" in low:
            return ("the publish volume is mounted noexec on this node's container runtime: use route 2 "
                    "(publish.via: initContainer) there")
        if "no such file or directory" in low or "not found" in low:
            if route is not None and route.number == 2:
                return (f"route 2: the init container copied nothing to {paths.PUBLISH_DIR}: its command must copy "
                        f"the binary to ${PUBLISH_DEST_ENV}/publish")
            return (f"{PUBLISH_BINARY} is not in the mounted image: check that publish.image is the publish image "
                    "(the binary `publish` at its root)")
        if "init container" in low:
            return "the init container failed: read its log (kubectl logs POD -c INIT) and fix its command or image"
        return "the container could not start: read the message, then `kubectl describe pod` on a kept probe (--keep)"
    return "read the probe's output above"
