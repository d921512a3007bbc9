"""AdmissionReview in, AdmissionReview out: the decision for /mutate and /validate (SPEC 5 to 7).

Two error families are kept apart, as kopf does: a broken webhook request (BadReview, answered with
an HTTP 400 by the server or exit 2 by the CLI) and a refused operation (a response with
`allowed: false` and a Status built from the error table). One `build_response` builds every answer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Literal, TypedDict

from . import errors, patch, rules
from .errors import ErrInternal, ErrInvalid, ErrUnavailable, Reasons
from .runtimes import GROUP, RuntimeSource, RuntimeUnavailable
from .settings import ROUTE_INIT_CONTAINER, Settings

log = logging.getLogger(__name__)

API_VERSION = "admission.k8s.io/v1"
RESOURCE = "trainjobs"
MAX_WARNING = 120

Endpoint = Literal["mutate", "validate"]
MUTATE: Endpoint = "mutate"
VALIDATE: Endpoint = "validate"


class GroupVersionResource(TypedDict, total=False):
    group: str
    version: str
    resource: str


class AdmissionRequest(TypedDict, total=False):
    uid: str
    kind: dict
    resource: GroupVersionResource
    subResource: str
    name: str
    namespace: str
    operation: str
    userInfo: dict
    object: dict
    oldObject: dict
    dryRun: bool


class AdmissionResponse(TypedDict, total=False):
    uid: str
    allowed: bool
    status: dict
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


@dataclass
class Outcome:
    """What one review decided, for the response, the log line and the metrics."""

    uid: str
    operation: str = ""
    namespace: str = ""
    name: str = ""
    intercepted: bool = False
    reasons: list[errors.Reason] = field(default_factory=list)
    ops: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def allowed(self) -> bool:
        return not self.reasons

    @property
    def sentinel(self) -> str:
        return errors.primary(self.reasons).name if self.reasons else ""


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


def build_response(outcome: Outcome) -> AdmissionReview:
    """The one place an answer is made: uid echoed, denial Status from the error table, patch when allowed."""
    response: AdmissionResponse = {"uid": outcome.uid, "allowed": outcome.allowed}
    if outcome.reasons:
        response["status"] = errors.status(outcome.reasons, outcome.name)
    elif outcome.ops:
        response["patchType"] = "JSONPatch"
        response["patch"] = patch.encode(outcome.ops)
    if outcome.warnings:
        response["warnings"] = outcome.warnings
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response}


def _intercepted(req: AdmissionRequest) -> bool:
    if req.get("operation") not in ("CREATE", "UPDATE") or req.get("subResource"):
        return False
    res = req.get("resource")
    if isinstance(res, dict) and res:
        return res.get("group") == GROUP and res.get("resource") == RESOURCE
    kind = req.get("kind")
    return isinstance(kind, dict) and kind.get("group") == GROUP and kind.get("kind") == "TrainJob"


def _warning(text: str) -> str:
    # The API server truncates long warnings; ours are written to fit, this keeps them so.
    return text if len(text) <= MAX_WARNING else text[: MAX_WARNING - 3] + "..."


def _suspended(spec: dict) -> bool:
    return spec.get("suspend") is True


class Admission:
    """Decides reviews for one set of settings against one runtime source."""

    def __init__(self, settings: Settings, runtimes: RuntimeSource,
                 clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc)):
        self.settings = settings
        self.runtimes = runtimes
        self.clock = clock
        # id(runtime object) -> (the object, its facts, its entry without time). A runtime the watch
        # replaces is a new object, so entries never go stale; the object is kept to pin its id.
        self._facts: dict[int, tuple[dict, rules.RuntimeFacts, dict | None]] = {}

    def review(self, doc: Any, endpoint: Endpoint) -> tuple[AdmissionReview, Outcome]:
        """Answer one AdmissionReview. Raises BadReview for a body that is not one."""
        req = parse_review(doc)
        outcome = Outcome(uid=req["uid"], operation=str(req.get("operation", "")))
        if _intercepted(req):
            outcome.intercepted = True
            try:
                self._decide(req, endpoint, outcome)
            except BadReview:
                raise
            except RecursionError:  # an object nested deeper than can be compared: the sender's fault
                outcome.ops = []
                outcome.reasons = [errors.Reason(ErrInvalid, "(object)", "nested too deeply")]
            except Exception:  # a fault of ours: deny (never admit unchecked), and say so
                log.exception("internal error reviewing uid=%s", outcome.uid)
                outcome.ops = []
                outcome.reasons = [errors.Reason(ErrInternal, "(webhook)",
                                                 "internal error in dispatch-admission; see its log for this uid")]
        return build_response(outcome), outcome

    # ---- the decision ----

    def _decide(self, req: AdmissionRequest, endpoint: Endpoint, out: Outcome) -> None:
        obj = req.get("object")
        if not isinstance(obj, dict):
            raise BadReview(f"request.object must be an object for {out.operation}")
        old = req.get("oldObject") if out.operation == "UPDATE" else None
        if out.operation == "UPDATE" and not isinstance(old, dict):
            raise BadReview("request.oldObject must be an object for UPDATE")
        settings, manager = self.settings, self.settings.manager
        reasons = Reasons()
        walk = rules.Walk(reasons)
        meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
        out.name = meta.get("name") if isinstance(meta.get("name"), str) else str(req.get("name") or "")
        namespace = meta.get("namespace") if isinstance(meta.get("namespace"), str) else ""
        out.namespace = namespace or str(req.get("namespace") or "")
        spec_value = obj.get("spec")
        spec = walk.obj(spec_value, "spec") or {}
        entries = walk.items(spec.get("runtimePatches"), "spec.runtimePatches")
        own = [(i, e) for i, e in entries if e.get("manager") == manager]
        for i, _ in own[1:]:
            reasons.add(ErrInvalid, f"spec.runtimePatches[{i}].manager", f"{manager!r} appears more than once")
        new_own = own[0] if own else None

        old_spec: dict = {}
        old_own = None
        if old is not None:
            old_spec = old.get("spec") if isinstance(old.get("spec"), dict) else {}
            scratch = rules.Walk(Reasons())
            old_own = next(((i, e) for i, e in scratch.items(old_spec.get("runtimePatches"), "")
                            if e.get("manager") == manager), None)

        if out.operation == "CREATE":
            mode = "compute"
        elif old_own is not None:
            mode = "keep"
        elif settings.configured and (_suspended(old_spec) or _suspended(spec)):
            mode = "compute"
        else:
            mode = "running"
        # On UPDATE the rules judge what changed: an update that leaves spec alone (labels, finalizers)
        # is never refused for what the object already was, nor for a runtime deleted since.
        check = out.operation == "CREATE" or spec != old_spec or mode == "compute"
        found = Reasons() if not check else reasons

        env = rules.trainer_env_names(spec, walk) if check else []
        if check:
            rules.shape_rules(spec, manager, env, reasons)
        template = self._runtime(spec, out.namespace, env, found, check)
        computed = patch.with_time(template, patch.admission_time(self.clock())) if template else None

        if mode == "keep":
            self._keep(endpoint, spec, entries, new_own, old_own, computed, out, reasons)
        elif mode == "compute":
            self._compute(endpoint, spec, entries, new_own, computed, out, reasons)
        else:
            self._running(endpoint, new_own, computed, out, reasons)
        route2 = settings.publish is not None and settings.publish.via == ROUTE_INIT_CONTAINER
        if route2 and mode == "compute" and not reasons:
            out.warnings.append(_warning("publish.via initContainer (route 2) has not been run end to end:"
                                         " test it on your cluster before relying on it"))
        out.reasons = list(reasons)
        if reasons:
            out.ops = []
        out.warnings = [_warning(w) for w in out.warnings]

    def _runtime(self, spec: dict, namespace: str, env, reasons: Reasons, check: bool) -> dict | None:
        """R1 to R7: read the named runtime; the entry it calls for (without time) when it can be used."""
        ref = rules.runtime_ref(spec, namespace, reasons)
        if ref is None:
            return None
        try:
            runtime = self.runtimes.get(ref.kind, ref.namespace, ref.name)
        except RuntimeUnavailable as e:
            reasons.add(ErrUnavailable, "spec.runtimeRef", f"{ref} cannot be read now ({e}); retry later")
            return None
        if runtime is None:
            rules.not_found(ref, reasons)
            return None
        cached = self._facts.get(id(runtime))
        if cached is None or cached[0] is not runtime:
            facts = rules.runtime_facts(ref, runtime, self.settings)
            template = (patch.build_entry(self.settings, list(facts.targets), "")
                        if self.settings.configured and facts.targets else None)
            if len(self._facts) >= 4096:
                self._facts.clear()
            cached = self._facts[id(runtime)] = (runtime, facts, template)
        _, facts, template = cached
        if not facts.targets:
            reasons.extend(facts.reasons)  # R3 stands even where the rules are not otherwise checked
        elif check:
            reasons.extend(facts.reasons)
            rules.trainjob_runtime_rules(spec, ref, facts, env, reasons)
        return template

    def _compute(self, endpoint, spec, entries, new_own, computed, out: Outcome, reasons: Reasons) -> None:
        """CREATE, or UPDATE of a suspended job without the entry: the entry must be the computed one."""
        manager = self.settings.manager
        if not self.settings.configured:
            if new_own is not None:
                i, _ = new_own
                if endpoint == MUTATE:
                    out.ops.append(patch.remove_op(i))
                    out.warnings.append("removed a runtimePatches entry under the webhook's manager: no publish is configured")
                else:  # S4: the settings produce no entry
                    reasons.add(ErrInvalid, f"spec.runtimePatches[{i}]",
                                f"an entry of manager {manager!r} is not allowed: this webhook has no publish or credentials configured")
            return
        if new_own is None:
            if endpoint == VALIDATE:  # S5
                reasons.add(ErrInvalid, "spec.runtimePatches",
                            f"has no entry of manager {manager!r}: the dispatch-admission mutating webhook was bypassed")
            elif computed is not None and rules.room_for_entry(len(entries), reasons):  # R8
                out.ops.append(patch.append_op(spec if spec else None, computed))
            return
        i, entry = new_own
        if computed is None or patch.same(entry, computed):
            return
        if endpoint == MUTATE:
            out.ops.append(patch.replace_op(i, computed))
            out.warnings.append("replaced the runtimePatches entry under the webhook's manager with the computed one")
        else:  # S4
            reasons.add(ErrInvalid, f"spec.runtimePatches[{i}]",
                        f"the entry of manager {manager!r} differs from what the webhook's settings produce")

    def _keep(self, endpoint, spec, entries, new_own, old_own, computed, out: Outcome, reasons: Reasons) -> None:
        """UPDATE of a job that has the entry: it is never rewritten (SPEC 6.3)."""
        old_index, old_entry = old_own
        manager = self.settings.manager
        if new_own is None:
            if endpoint == MUTATE:
                if rules.room_for_entry(len(entries), reasons):
                    out.ops.append(patch.insert_op(spec, old_index, old_entry))
                    out.warnings.append("put back the runtimePatches entry of the webhook's manager, which this update removed")
            else:
                reasons.add(ErrInvalid, "spec.runtimePatches",
                            f"the entry of manager {manager!r} was removed; it is immutable once written")
            return
        i, entry = new_own
        if not patch.same(entry, old_entry):
            reasons.add(ErrInvalid, f"spec.runtimePatches[{i}]",
                        f"the entry of manager {manager!r} is immutable once written; recreate the TrainJob to change it")
        elif not self.settings.configured or (computed is not None and not patch.same(entry, computed)):
            out.warnings.append("the publish settings changed since this TrainJob was created:"
                                " it keeps its old publish mount until recreated")

    def _running(self, endpoint, new_own, computed, out: Outcome, reasons: Reasons) -> None:
        """UPDATE of a running job that never had the entry: never add one (Trainer would refuse it)."""
        manager = self.settings.manager
        if new_own is not None:
            i, entry = new_own
            if computed is None or not patch.same(entry, computed):  # S4
                reasons.add(ErrInvalid, f"spec.runtimePatches[{i}]",
                            f"the entry of manager {manager!r} differs from what the webhook's settings produce")
        elif self.settings.configured:
            out.warnings.append("this running TrainJob predates the webhook's entry: none is added;"
                                " suspend it to get the publish mount")
