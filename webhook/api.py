"""A small Python API: check a TrainJob before sending it, as the webhook will.

For Python submitters (the Kubeflow SDK is Python), what the Go adapter's documentation offers its
hosts: parse settings without a cluster (`parse_settings`, like `kubeflow.ParseSettings`), the settings'
JSON Schema (`settings_schema`, like `kubeflow.Schema()`), the runtime capability check
(`capabilities`, like `Capabilities`), and the webhook's answer for a TrainJob (`check`) or a whole
AdmissionReview (`review`). Nothing here touches a cluster; every refusal carries a sentinel of the
error table (`Sentinel`), as the Go adapter's errors do.

    >>> from webhook import api
    >>> settings = api.parse_settings('{"publish": {"image": "registry.example/publish@sha256:' + 64 * "0" + '"}}')
    >>> result = api.check(settings, trainjob, runtimes=[runtime])
    >>> result.allowed, result.warnings, [str(r) for r in result.reasons]
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from .core import patch
from .core.admission import Admission, Enforcement, Verb
from .core.errors import Denied, Reason, Sentinel
from .core.registry import runtime_facts
from .core.runtimes import GROUP, PLURALS, TRAINJOB_KIND, VERSION, Runtime, RuntimeIndex, RuntimeSource
from .core.settings import Settings, parse, schema

__all__ = ["CheckResult", "Denied", "Enforcement", "Reason", "Sentinel", "Settings", "capabilities", "check",
           "parse_settings", "review", "settings_schema"]


def parse_settings(raw: str | bytes | Mapping[str, Any]) -> Settings:
    """Decode and validate a settings document strictly and apply its defaults.

    Raises `Denied` (sentinel ErrInvalid) naming the key path of every problem at once.
    """
    return parse(json.dumps(raw) if isinstance(raw, Mapping) else raw)


def settings_schema() -> dict:
    """The JSON Schema (draft 2020-12) of the settings, `additionalProperties: false` at every level."""
    return json.loads(json.dumps(schema()))


def capabilities(settings: Settings, runtime: Mapping[str, Any]) -> list[Reason]:
    """What stops `runtime` (a ClusterTrainingRuntime or TrainingRuntime) carrying the publish mount under
    these settings: the R3, R4 and R5 reasons (sentinel ErrUnsupported) a TrainJob naming it would get.
    Empty when it can carry it."""
    return list(runtime_facts(runtime if isinstance(runtime, Runtime) else dict(runtime), settings).reasons)


@dataclass(frozen=True)
class CheckResult:
    """The webhook's answer for one TrainJob: mutated, then validated, as the API server would call them."""

    allowed: bool
    trainjob: dict | None        # the TrainJob as the webhook mutates it, when allowed
    warnings: tuple[str, ...]    # what kubectl would print as warnings
    reasons: tuple[Reason, ...]  # why it is refused (every reason), when not
    status: dict | None          # the refusal's metav1.Status, as the API server would return it


def _source(runtimes: Iterable[Mapping] | RuntimeSource) -> RuntimeSource:
    if hasattr(runtimes, "get") and hasattr(runtimes, "ready"):
        return runtimes  # type: ignore[return-value]
    return RuntimeIndex(r if isinstance(r, Runtime) else dict(r) for r in runtimes)  # type: ignore[union-attr]


def admission(settings: Settings, runtimes: Iterable[Mapping] | RuntimeSource, now: datetime | None = None,
              enforcement: Enforcement | str = Enforcement.ENFORCE) -> Admission:
    clock = (lambda: now) if now is not None else (lambda: datetime.now(UTC))
    return Admission(settings, _source(runtimes), clock=clock, enforcement=Enforcement(enforcement))


def _create_review(obj: dict, uid: str) -> dict:
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        meta = {}
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": uid,
        "kind": {"group": GROUP, "version": VERSION, "kind": TRAINJOB_KIND},
        "resource": {"group": GROUP, "version": VERSION, "resource": PLURALS[TRAINJOB_KIND]},
        "name": meta.get("name", ""), "namespace": meta.get("namespace") or "default",
        "operation": "CREATE", "object": obj, "dryRun": True}}


def check_with(adm: Admission, trainjob: Mapping[str, Any], uid: str = "check") -> CheckResult:
    """`check` with an Admission already built (the CLI checks many manifests with one)."""
    obj = json.loads(json.dumps(trainjob))
    mutated_review, outcome = adm.review(_create_review(obj, uid), Verb.MUTATE)
    answer = mutated_review["response"]
    warnings = list(answer.get("warnings", []))
    if not answer["allowed"]:
        return CheckResult(False, None, tuple(warnings), outcome.reasons, answer["status"])
    result = patch.apply(obj, json.loads(base64.b64decode(answer["patch"]))) if "patch" in answer else obj
    validated, outcome = adm.review(_create_review(result, uid), Verb.VALIDATE)
    answer = validated["response"]
    warnings += [w for w in answer.get("warnings", []) if w not in warnings]
    if not answer["allowed"]:
        return CheckResult(False, None, tuple(warnings), outcome.reasons, answer["status"])
    return CheckResult(True, result, tuple(warnings), (), None)


def check(settings: Settings, trainjob: Mapping[str, Any], runtimes: Iterable[Mapping] | RuntimeSource, *,
          now: datetime | None = None, enforcement: Enforcement | str = Enforcement.ENFORCE) -> CheckResult:
    """Mutate then validate one TrainJob (a CREATE) offline, against the given runtimes."""
    return check_with(admission(settings, runtimes, now, enforcement), trainjob)


def review(settings: Settings, runtimes: Iterable[Mapping] | RuntimeSource, admission_review: Mapping[str, Any],
           verb: Verb | str = Verb.MUTATE, *, now: datetime | None = None,
           enforcement: Enforcement | str = Enforcement.ENFORCE) -> dict:
    """The AdmissionReview response the webhook's /mutate, /validate or /runtimes would give.

    Raises `webhook.core.review.BadReview` for a body that is not an AdmissionReview v1.
    """
    response, _ = admission(settings, runtimes, now, enforcement).review(dict(admission_review), verb)
    return dict(response)
