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


class StampedEntry(dict):
    """A computed entry with its admission time. Its trainingRuntimeSpec is the per-runtime template,
    shared by every review and never mutated, so its JSON is encoded once (see `encode`)."""


_SPEC_JSON: dict[int, tuple[object, str]] = {}


def with_time(entry: dict, time: str) -> StampedEntry:
    return StampedEntry(manager=entry["manager"], time=time, trainingRuntimeSpec=entry["trainingRuntimeSpec"])


def _value_json(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_value_json(v) for v in value) + "]"
    if isinstance(value, StampedEntry):
        spec = value["trainingRuntimeSpec"]
        memo = _SPEC_JSON.get(id(spec))
        if memo is None or memo[0] is not spec:
            if len(_SPEC_JSON) >= 4096:
                _SPEC_JSON.clear()
            memo = _SPEC_JSON[id(spec)] = (spec, json.dumps(spec))  # the object is kept to pin its id
        return (f'{{"manager": {json.dumps(value["manager"])}, "time": {json.dumps(value["time"])},'
                f' "trainingRuntimeSpec": {memo[1]}}}')
    return json.dumps(value)


def same(a: dict, b: dict) -> bool:
    """Entries compared as JSON values, `time` left out (SPEC 5, S4)."""
    a = {k: v for k, v in a.items() if k != "time"}
    b = {k: v for k, v in b.items() if k != "time"}
    return a == b and _json_equal(a, b)


def _json_equal(a, b) -> bool:
    """Python's == says True == 1 == 1.0; as JSON values they differ (`readOnly: 1` is not `true`)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return all(_json_equal(v, b[k]) for k, v in a.items())
    if isinstance(a, list):
        return all(_json_equal(x, y) for x, y in zip(a, b))
    return True  # equal scalars of one type (== already held)


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
    """The AdmissionResponse `patch` field: the RFC 6902 operations as base64 JSON.

    Equal to json.dumps(ops) (the tests decode and apply it with jsonpatch), but the entry content,
    the same for every review of a runtime, is serialised once rather than on every review.
    """
    text = "[" + ", ".join(
        "{" + ", ".join(f"{json.dumps(k)}: {_value_json(v)}" for k, v in op.items()) + "}" for op in ops) + "]"
    return base64.b64encode(text.encode()).decode()


def apply(obj: dict, ops: list[dict]) -> dict:
    """Apply a patch as the API server would (for `check` and for tests)."""
    return jsonpatch.apply_patch(obj, ops)
