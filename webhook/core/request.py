"""What an AdmissionReview's request is for (webhook.core.admission): the resource a CREATE or UPDATE of Trainer's
group targets, the object's name and namespace, and what the runtime rules read of a TrainJob's spec.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .review import AdmissionRequest
from .runtimes import GROUP, KINDS, PLURALS, TRAINJOB_KIND

TRAINJOBS = PLURALS[TRAINJOB_KIND]
RUNTIME_RESOURCES = {PLURALS[kind]: kind for kind in KINDS}  # resource -> kind
BY_KIND = {kind: resource for resource, kind in {TRAINJOBS: TRAINJOB_KIND, **RUNTIME_RESOURCES}.items()}


def metadata(obj: object) -> dict[str, Any]:
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    return meta if isinstance(meta, dict) else {}


def names(req: Mapping[str, object], obj: dict[str, Any]) -> tuple[str, str]:
    """The TrainJob's name and namespace: its metadata's, else the request's."""
    meta = metadata(obj)
    name = meta.get("name")
    if not isinstance(name, str):
        name = str(req.get("name") or "")
    namespace = meta.get("namespace")
    if not (isinstance(namespace, str) and namespace):
        namespace = str(req.get("namespace") or "")
    return name, namespace


def runtime_inputs(spec: dict[str, Any]) -> tuple[Any, ...]:
    """What the runtime rules (R1 to R8) read of a TrainJob (SPEC 6.3): an update that changes none of it
    never reads the runtime."""
    trainer = spec.get("trainer")
    trainer = trainer if isinstance(trainer, dict) else {}
    patches = spec.get("runtimePatches")
    return (spec.get("runtimeRef"), trainer.get("numProcPerNode"), trainer.get("env"),
            len(patches) if isinstance(patches, list) else patches)


def target(req: AdmissionRequest, resources: tuple[str, ...]) -> str | None:
    """The resource a CREATE or UPDATE of a main resource of Trainer's group is for, else None."""
    if req.get("operation") not in ("CREATE", "UPDATE") or req.get("subResource"):
        return None
    res = req.get("resource")
    if isinstance(res, dict) and res:
        return res.get("resource") if res.get("group") == GROUP and res.get("resource") in resources else None
    kind = req.get("kind")
    if isinstance(kind, dict) and kind.get("group") == GROUP:
        kind_name: Any = kind.get("kind")  # any JSON value: one not in BY_KIND finds nothing
        found = BY_KIND.get(kind_name)
        return found if found in resources else None
    return None
