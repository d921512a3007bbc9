"""The AdmissionReview envelope (admission.k8s.io/v1): its shapes, reading a request, and the one place
an answer is built.

Two error families are kept apart, as kopf does: a broken webhook request (BadReview, answered with an
HTTP 400 by the server or exit 2 by the CLI) and a refused operation (a response with `allowed: false`
and a Status built from the error table).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, TypedDict

from . import errors, patch

API_VERSION = "admission.k8s.io/v1"
MAX_WARNING = 120
LONG_NAME = 24  # a quoted name longer than this is shortened in a warning, before the warning is cut


class GroupVersionResource(TypedDict, total=False):
    group: str
    version: str
    resource: str


class AdmissionRequest(TypedDict, total=False):
    uid: str
    kind: dict[str, Any]
    resource: GroupVersionResource
    subResource: str
    name: str
    namespace: str
    operation: str
    userInfo: dict[str, Any]
    object: dict[str, Any]
    oldObject: dict[str, Any]
    dryRun: bool


class AdmissionResponse(TypedDict, total=False):
    uid: str
    allowed: bool
    status: dict[str, Any]
    patch: str
    patchType: str
    warnings: list[str]


class AdmissionReview(TypedDict, total=False):
    apiVersion: str
    kind: str
    request: AdmissionRequest
    response: AdmissionResponse


class BadReview(ValueError):
    """The body is not a usable AdmissionReview v1: the webhook call itself is broken (HTTP 400)."""


def parse_review(doc: Any) -> AdmissionRequest:
    if not isinstance(doc, dict):
        raise BadReview("the body must be a JSON object (an AdmissionReview)")
    if doc.get("apiVersion") != API_VERSION or doc.get("kind") != "AdmissionReview":
        raise BadReview(f"expected apiVersion {API_VERSION} and kind AdmissionReview, "
                        f"got {str(doc.get('apiVersion'))[:64]!r} {str(doc.get('kind'))[:64]!r}")
    req = doc.get("request")
    if not isinstance(req, dict):
        raise BadReview("request is missing or not an object")
    uid = req.get("uid")
    if not isinstance(uid, str) or not uid:
        raise BadReview("request.uid is missing or not a non-empty string")
    return req  # type: ignore[return-value]


def warning(text: str) -> str:
    """A warning as the API server passes it on: one plain sentence, at most 120 characters."""
    text = " ".join(text.split())
    return text if len(text) <= MAX_WARNING else text[: MAX_WARNING - 3] + "..."


_QUOTED = re.compile(rf"'([^']{{{LONG_NAME + 1},}})'")
# A field inside a runtimePatches entry repeats the path to the pod spec: kept to the job and what follows.
_POD_PATH = re.compile(r"\.trainingRuntimeSpec\.template\.spec\.(replicatedJobs\[\d+\])"
                       r"\.template\.spec\.template\.spec\.")


def short_name(name: str) -> str:
    return name if len(name) <= LONG_NAME else f"{name[:12]}...{name[-(LONG_NAME - 15):]}"


def short_text(text: str, subject: str = "") -> str:
    """A reason's text for a warning (SPEC 6.4): what to change first (the `subject` it starts with, a runtime,
    goes last), long names shortened, so a warning cut at 120 characters still says which job lacks what."""
    if subject and text.startswith(subject + ": "):
        kind, _, name = subject.partition(" ")
        text = f"{text[len(subject) + 2:]} ({kind} {short_name(name)})"
    return _QUOTED.sub(lambda m: f"'{short_name(m.group(1))}'", text)


def short_reason(reason: errors.Reason) -> str:
    """`FIELD: TEXT` of a reason, shortened for a warning (`short_text`; a field inside an entry to its job)."""
    field = _POD_PATH.sub(r"..\1..", reason.field)  # spec.runtimePatches[0]..replicatedJobs[0]..containers[0]...
    return f"{field}: {short_text(reason.text, reason.subject)}"


def build_response(uid: str, reasons: list[errors.Reason], ops: Iterable[patch.Op], warnings: list[str],
                   name: str = "", kind: str = "TrainJob") -> AdmissionReview:
    """The one place an answer is made: uid echoed, a denial's Status from the error table, a patch when allowed."""
    response: AdmissionResponse = {"uid": uid, "allowed": not reasons}
    ops = list(ops)
    if reasons:
        response["status"] = errors.status(reasons, name, kind=kind)
    elif ops:
        response["patchType"] = "JSONPatch"
        response["patch"] = patch.encode(ops)
    if warnings:
        response["warnings"] = [warning(w) for w in warnings]
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response}
