"""`verify` (SPEC 9), the probe itself: the TrainJob it creates, labelled so every probe (and one run's) can be
found, the runtime's replicated jobs, and the nodes a probe can be pinned to (`--per-node`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from ..core import paths

PUBLISH_BINARY = paths.PUBLISH_DIR + "/publish"
DEFAULT_COMMAND = (PUBLISH_BINARY, "--help")
# Labels every probe TrainJob carries: the first finds every probe ever made by verify, the second one run's.
PROBE_LABEL = "dispatch.go.phpboyscout.uk/verify"
RUN_LABEL = "dispatch.go.phpboyscout.uk/verify-run"
# How long after its creation (seconds, on the API server's clock) a probe may be removed by `verify --cleanup`
# or the next verify in its namespace: past the longest a verify still follows it (inspection.verify_cleanup).
TTL_ANNOTATION = "dispatch.go.phpboyscout.uk/verify-ttl-seconds"
# The runtimePatches entry verify writes itself: its labels on the JobSet and pods, the pin to a node
# (--per-node); never the publish mount.
VERIFY_MANAGER = "dispatch.go.phpboyscout.uk/verify"
HOSTNAME_LABEL = "kubernetes.io/hostname"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"


def probe_trainjob(name: str, namespace: str, kind: str, runtime: str, run_id: str,
                   command: Iterable[str] = DEFAULT_COMMAND, image: str | None = None,
                   labels: dict[str, str] | None = None, node: dict[str, Any] | None = None,
                   jobs: Iterable[str] = (), ttl: int | None = None) -> dict[str, Any]:
    """The probe TrainJob: one node, the trainer command, labelled. Trainer copies no TrainJob label to the
    JobSet or its pods, so an entry of verify's own manager puts the labels there (on the JobSet and on
    each of the runtime's replicated `jobs`' pods) and, with `node` (a Node object), pins every pod to it.
    Never the publish mount: that entry is the webhook's to add. `ttl`: seconds after which another verify
    may remove it (TTL_ANNOTATION)."""
    trainer: dict[str, Any] = {"numNodes": 1, "command": list(command)}
    if image:
        trainer["image"] = image
    ours = {PROBE_LABEL: "probe", RUN_LABEL: run_id}
    pod_spec: dict[str, Any] = {}
    if node is not None:
        hostname = ((node.get("metadata") or {}).get("labels") or {}).get(HOSTNAME_LABEL) or node["metadata"]["name"]
        pod_spec["nodeSelector"] = {HOSTNAME_LABEL: hostname}
    patch_jobs = []
    for job in jobs:
        pod: dict[str, Any] = {"metadata": {"labels": dict(ours)}}
        if pod_spec:
            pod["spec"] = json.loads(json.dumps(pod_spec))
        patch_jobs.append({"name": job, "template": {"spec": {"template": pod}}})
    entry = {"manager": VERIFY_MANAGER, "trainingRuntimeSpec": {"template": {
        "metadata": {"labels": dict(ours)}, "spec": {"replicatedJobs": patch_jobs}}}}
    spec: dict[str, Any] = {"runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": kind, "name": runtime},
                  "trainer": trainer, "runtimePatches": [entry]}
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": {**(labels or {}), **ours}}
    if ttl is not None:
        meta["annotations"] = {TTL_ANNOTATION: str(int(ttl))}
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": meta, "spec": spec}


def runtime_jobs(runtime: dict[str, Any]) -> list[str]:
    """The names of the runtime's replicated jobs (each is pinned with --per-node)."""
    spec = ((runtime.get("spec") or {}).get("template") or {}).get("spec") or {}
    return [j["name"] for j in spec.get("replicatedJobs") or [] if isinstance(j, dict) and j.get("name")]


def _tolerates(tolerations: list[dict[str, Any]], taint: dict[str, Any]) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        if t.get("operator") == "Exists":
            if not t.get("key") or t["key"] == taint.get("key"):
                return True
        elif t.get("key") == taint.get("key") and (t.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def runtime_tolerations(runtime: dict[str, Any]) -> list[dict[str, Any]]:
    """The tolerations every replicated job's pod of the runtime carries (a taint must be tolerated by all)."""
    spec = ((runtime.get("spec") or {}).get("template") or {}).get("spec") or {}
    per_job = [(((j.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec", {}).get("tolerations")
               or [] for j in spec.get("replicatedJobs") or [] if isinstance(j, dict)]
    if not per_job:
        return []
    return [t for t in per_job[0] if all(t in others for others in per_job[1:])]


def schedulable_nodes(nodes: list[dict[str, Any]], tolerations: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Nodes a probe can be pinned to: Ready, not cordoned, and no NoSchedule or NoExecute taint the runtime's
    pods do not tolerate. Sorted by name."""
    out = []
    for n in nodes:
        spec, status = n.get("spec") or {}, n.get("status") or {}
        if spec.get("unschedulable"):
            continue
        ready: dict[str, Any] = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
        if ready.get("status") != "True":
            continue
        if any(t.get("effect") in ("NoSchedule", "NoExecute") and not _tolerates(tolerations, t)
               for t in spec.get("taints") or []):
            continue
        out.append(n)
    return sorted(out, key=lambda n: n["metadata"]["name"])
