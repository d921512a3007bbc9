"""The mutation (SPEC 6.1): the webhook's runtimePatches entry, and the JSONPatch that puts it in place.

The entry's content depends only on the settings and the runtime's target jobs, so it is built and
encoded once per runtime object (`Entry`), immutable, and only `time` is stamped per review. The patch
is a handful of targeted operations computed from the object as sent (indices into the list the API
server holds), each holding its value as JSON text: nothing handed out can be changed by its receiver.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import jsonpatch
from jsonpointer import JsonPointer

from . import paths
from .runtimes import NODE as NODE_CONTAINER
from .settings import PUBLISH_VOLUME, ROUTE_IMAGE_VOLUME, Settings

PUBLISH_DEST_ENV = "DISPATCH_PUBLISH_DEST"
RUNTIME_PATCHES = ("spec", "runtimePatches")


def rfc3339(moment: datetime) -> str:
    """As Kubernetes writes a metav1.Time: UTC, to the second, with a Z."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Clock:
    """The admission time as text, formatted at most once a second (it is on every review's path)."""

    def __init__(self, now: Callable[[], datetime] = lambda: datetime.now(UTC)):
        self.now = now
        self._last: tuple[int, str] = (-1, "")

    def stamp(self) -> str:
        moment = self.now()
        second = int(moment.timestamp())
        last = self._last  # one read: another thread may replace it, never half of it
        if last[0] != second:
            last = self._last = (second, rfc3339(moment))
        return last[1]


def _content(settings: Settings, targets: Iterable[str]) -> dict[str, Any]:
    """`trainingRuntimeSpec` of the entry: one replicated job patch per target job."""
    publish = settings.publish
    vols: list[dict[str, Any]] = []
    node_mounts: list[dict[str, Any]] = []
    init: list[dict[str, Any]] = []
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
    for job in targets:
        spec: dict[str, Any] = {"volumes": vols}
        if init:
            spec["initContainers"] = init
        spec["containers"] = [{"name": NODE_CONTAINER, "volumeMounts": node_mounts}]
        jobs.append({"name": job, "template": {"spec": {"template": {"spec": spec}}}})
    # Through JSON, so no two jobs share structure.
    content: dict[str, Any] = json.loads(json.dumps({"template": {"spec": {"replicatedJobs": jobs}}}))
    return content


@dataclass(frozen=True)
class Entry:
    """The entry the settings produce for one runtime, without its time. Immutable: its content is held
    as JSON text, and the parsed form it compares against is private and never handed out."""

    manager: str
    content_json: str
    _content: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def build(cls, settings: Settings, targets: Iterable[str]) -> Entry:
        content = _content(settings, targets)
        return cls(settings.manager, json.dumps(content), content)

    def json(self, time: str) -> str:
        return (f'{{"manager": {json.dumps(self.manager)}, "time": {json.dumps(time)},'
                f' "trainingRuntimeSpec": {self.content_json}}}')

    def as_dict(self, time: str) -> dict[str, Any]:
        """A fresh copy of the stamped entry."""
        entry: dict[str, Any] = json.loads(self.json(time))
        return entry

    def matches(self, entry: dict[str, Any]) -> bool:
        """Whether `entry` is this one, as JSON values, `time` left out (SPEC 5)."""
        return same(entry, {"manager": self.manager, "trainingRuntimeSpec": self._content})


def entry_pod_specs(entry: dict[str, Any] | None) -> Iterable[dict[str, Any]]:
    """The pod specs a stored entry patches, one per replicated job (a stored entry is read defensively: it
    may have been written by anyone)."""
    content = ((entry or {}).get("trainingRuntimeSpec") or {}) if isinstance(entry, dict) else {}
    for job in ((content.get("template") or {}).get("spec") or {}).get("replicatedJobs") or []:
        if isinstance(job, dict):
            pod = (((job.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec")
            if isinstance(pod, dict):
                yield pod


def entry_secrets(entry: dict[str, Any] | None) -> list[tuple[str, str]]:
    """(volume name, Secret name) of each Secret volume a stored entry adds: the credentials it mounts."""
    out: list[tuple[str, str]] = []
    for pod in entry_pod_specs(entry):
        for v in pod.get("volumes") or []:
            secret = v.get("secret") if isinstance(v, dict) else None
            if isinstance(secret, dict) and secret.get("secretName"):
                pair = (str(v.get("name") or ""), str(secret["secretName"]))
                if pair not in out:
                    out.append(pair)
    return out


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Entries compared as JSON values, `time` left out (SPEC 5, S4)."""
    a = {k: v for k, v in a.items() if k != "time"}
    b = {k: v for k, v in b.items() if k != "time"}
    return a == b and _json_equal(a, b)


def _json_equal(a: Any, b: Any) -> bool:
    """Python's == says True == 1 == 1.0; as JSON values they differ (`readOnly: 1` is not `true`)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return all(_json_equal(v, b[k]) for k, v in a.items())
    if isinstance(a, list):
        return all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    return True  # equal scalars of one type (== already held)


@dataclass(frozen=True)
class Op:
    """One RFC 6902 operation; its value is JSON text."""

    op: str
    path: str
    value_json: str | None = None

    def json(self) -> str:
        value = "" if self.value_json is None else f', "value": {self.value_json}'
        return f'{{"op": "{self.op}", "path": {json.dumps(self.path)}{value}}}'

    def as_dict(self) -> dict[str, Any]:
        op: dict[str, Any] = json.loads(self.json())
        return op


def _pointer(*parts: str | int) -> str:
    return JsonPointer.from_parts([str(p) for p in parts]).path  # escapes `~` and `/` per RFC 6901


_PATCHES = _pointer(*RUNTIME_PATCHES)  # every operation is on this list (or creates it, or spec)


def append_op(spec: Any, entry_json: str) -> Op:
    """Add the entry after the existing entries, creating the list (or spec) where absent."""
    if not isinstance(spec, dict):
        return Op("add", "/spec", f'{{"runtimePatches": [{entry_json}]}}')
    if not isinstance(spec.get("runtimePatches"), list):
        return Op("add", _PATCHES, f"[{entry_json}]")
    return Op("add", _PATCHES + "/-", entry_json)


def insert_op(spec: dict[str, Any], index: int, entry_json: str) -> Op:
    """Put an entry back at `index` (or last, where the list is now shorter)."""
    if not isinstance(spec.get("runtimePatches"), list):
        return Op("add", _PATCHES, f"[{entry_json}]")
    index = min(index, len(spec["runtimePatches"]))
    return Op("add", f"{_PATCHES}/{index}", entry_json)


def replace_op(index: int, entry_json: str) -> Op:
    return Op("replace", f"{_PATCHES}/{index}", entry_json)


def remove_op(index: int) -> Op:
    return Op("remove", f"{_PATCHES}/{index}")


def encode(ops: Iterable[Op]) -> str:
    """The AdmissionResponse `patch` field: the RFC 6902 operations as base64 JSON."""
    return base64.b64encode(("[" + ", ".join(op.json() for op in ops) + "]").encode()).decode()


def apply(obj: dict[str, Any], ops: Iterable[Op | dict[str, Any]]) -> dict[str, Any]:
    """Apply a patch as the API server would (for `check`, the Python API and tests)."""
    patched: dict[str, Any] = jsonpatch.apply_patch(obj, [op.as_dict() if isinstance(op, Op) else op for op in ops])
    return patched
