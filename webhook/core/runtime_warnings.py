"""The runtime warnings (SPEC 8.3): a review of a ClusterTrainingRuntime or TrainingRuntime is always allowed; with
publish or credentials configured, it carries one warning per R3, R4 or R5 reason the TrainJobs naming it would get.
"""

from __future__ import annotations

from . import rules
from .decision import Outcome, Verb
from .request import RUNTIME_RESOURCES, metadata, target
from .review import AdmissionRequest, build_response, short_text
from .reviewing import Result
from .rule import Checks
from .runtimes import Runtime
from .settings import Settings


def runtime_review(req: AdmissionRequest, uid: str, operation: str, settings: Settings, checks: Checks) -> Result:
    """Always allowed; with publish or credentials configured, one warning per R3, R4 or R5 reason."""
    resource = target(req, tuple(RUNTIME_RESOURCES))
    obj = req.get("object")
    if resource is None or not isinstance(obj, dict):
        return build_response(uid, [], [], []), Outcome(uid=uid, verb=Verb.RUNTIMES, operation=operation)
    meta = metadata(obj)
    name = str(meta.get("name") or req.get("name") or "")
    namespace = str(meta.get("namespace") or req.get("namespace") or "")
    warnings: tuple[str, ...] = ()
    if settings.configured:
        # Judged as the kind the request is for, whatever the object says.
        runtime = Runtime.of({**obj, "kind": RUNTIME_RESOURCES[resource],
                               "metadata": {**meta, "name": name, "namespace": namespace}})
        facts = rules.runtime_facts(runtime, settings, checks)
        what = f"{runtime}: "
        warnings = tuple(f"{r.rule}: TrainJobs on this runtime will be refused: "
                         f"{short_text(r.text.removeprefix(what))}" for r in facts.reasons)
    outcome = Outcome(uid=uid, verb=Verb.RUNTIMES, operation=operation, namespace=namespace, name=name,
                      intercepted=True, warnings=warnings)
    return build_response(uid, [], [], list(warnings), name, kind=RUNTIME_RESOURCES[resource]), outcome
