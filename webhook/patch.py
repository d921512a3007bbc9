"""The mutation (SPEC 6.1): the webhook's runtimePatches entry, and the JSONPatch that puts it in place.

The patch is a handful of targeted operations computed from the object as sent (indices into the
list the API server holds), not a diff of two whole copies: the same result, at a fraction of the cost.
"""

from __future__ import annotations

import base64
import json
from datetime import datetime, timezone

import jsonpatch
from jsonpointer import JsonPointer

from . import paths
from .rules import NODE_CONTAINER, PodSpec
from .settings import PUBLISH_VOLUME, ROUTE_IMAGE_VOLUME, Settings

PUBLISH_DEST_ENV = "DISPATCH_PUBLISH_DEST"
RUNTIME_PATCHES = ("spec", "runtimePatches")


def rfc3339(moment: datetime) -> str:
    """As Kubernetes writes a metav1.Time: UTC, to the second, with a Z."""
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


_last_stamp: tuple[int, str] = (0, "")


def admission_time(moment: datetime) -> str:
    """rfc3339, formatted once per second (it is on every review's path)."""
    global _last_stamp
    second = int(moment.timestamp())
    if _last_stamp[0] != second:
        _last_stamp = (second, rfc3339(moment))
    return _last_stamp[1]


def build_entry(settings: Settings, targets: list[PodSpec], time: str) -> dict:
    """The entry keyed by `settings.manager`, one replicated job patch per target job."""
    publish = settings.publish
    vols: list[dict] = []
    node_mounts: list[dict] = []
    init: list[dict] = []
    if publish is not None:
        if publish.via == ROUTE_IMAGE_VOLUME:
            vols.append({"name": PUBLISH_VOLUME, "image": {"reference": publish.image, "pullPolicy": "IfNotPresent"}})
        else:
            vols.append({"name": PUBLISH_VOLUME, "emptyDir": {}})
            init.append({
                "name": publish.init_container,
                "env": [{"name": PUBLISH_DEST_ENV, "value": paths.PUBLISH_DIR}],
                "volumeMounts": [{"name": PUBLISH_VOLUME, "mountPath": paths.PUBLISH_DIR}],
            })
        node_mounts.append({"name": PUBLISH_VOLUME, "mountPath": paths.PUBLISH_DIR, "readOnly": True})
    for cred in settings.credentials:
        vols.append({"name": cred.name, "secret": {"secretName": cred.secret}})
        node_mounts.append({"name": cred.name, "mountPath": cred.mount_path, "readOnly": True})
    jobs = []
    for pod in targets:
        spec: dict = {"volumes": vols}
        if init:
            spec["initContainers"] = init
        spec["containers"] = [{"name": NODE_CONTAINER, "volumeMounts": node_mounts}]
        jobs.append({"name": pod.job, "template": {"spec": {"template": {"spec": spec}}}})
    # Deep-copied so no two entries (or jobs) share structure a caller might later mutate.
    return json.loads(json.dumps({
        "manager": settings.manager,
        "time": time,
        "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": jobs}}},
    }))


def with_time(entry: dict, time: str) -> dict:
    """A computed entry stamped with its admission time; the content is shared, never mutated."""
    return {"manager": entry["manager"], "time": time, "trainingRuntimeSpec": entry["trainingRuntimeSpec"]}


def same(a: dict, b: dict) -> bool:
    """Entries compared as JSON values, `time` left out (SPEC 5, S4)."""
    return {k: v for k, v in a.items() if k != "time"} == {k: v for k, v in b.items() if k != "time"}


def _pointer(*parts) -> str:
    return JsonPointer.from_parts([str(p) for p in parts]).path  # escapes `~` and `/` per RFC 6901


def append_op(spec: dict | None, entry: dict) -> dict:
    """Add `entry` after the existing entries, creating the list (or spec) where absent."""
    if not isinstance(spec, dict):
        return {"op": "add", "path": _pointer("spec"), "value": {"runtimePatches": [entry]}}
    if not isinstance(spec.get("runtimePatches"), list):
        return {"op": "add", "path": _pointer(*RUNTIME_PATCHES), "value": [entry]}
    return {"op": "add", "path": _pointer(*RUNTIME_PATCHES, "-"), "value": entry}


def insert_op(spec: dict, index: int, entry: dict) -> dict:
    if not isinstance(spec.get("runtimePatches"), list):
        return {"op": "add", "path": _pointer(*RUNTIME_PATCHES), "value": [entry]}
    index = min(index, len(spec["runtimePatches"]))
    return {"op": "add", "path": _pointer(*RUNTIME_PATCHES, index), "value": entry}


def replace_op(index: int, entry: dict) -> dict:
    return {"op": "replace", "path": _pointer(*RUNTIME_PATCHES, index), "value": entry}


def remove_op(index: int) -> dict:
    return {"op": "remove", "path": _pointer(*RUNTIME_PATCHES, index)}


def encode(ops: list[dict]) -> str:
    """The AdmissionResponse `patch` field: a base64 RFC 6902 document."""
    return base64.b64encode(jsonpatch.JsonPatch(ops).to_string().encode()).decode()


def apply(obj: dict, ops: list[dict]) -> dict:
    """Apply a patch as the API server would (for `check` and for tests)."""
    return jsonpatch.apply_patch(obj, ops)
