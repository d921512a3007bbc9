"""The admission decision (SPEC 5, 6 and 8), as controller-runtime separates its Defaulter from its Validator.

A review is read once into a frozen `Plan`: the operation and its stage (SPEC 6.3), the entries found,
the entry the settings produce for the named runtime, and every reason the rules give, each walk made
once. Two small functions read the plan: `mutation` (operations, warnings, and the reasons that stop
it) and `validation` (reasons and warnings). The enforcement mode (SPEC 8.1) is applied after either,
in one place: in `warn` what `enforce` would deny becomes warnings.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from enum import Enum
from typing import Any, Callable, NamedTuple

from . import patch, rules
from .errors import (RULE_INTERNAL, RULE_UNAVAILABLE, RULE_UPDATE, ErrInternal, ErrInvalid, ErrUnavailable, Reason,
                     Reasons, primary)
from .patch import Entry, Op
from .review import AdmissionRequest, AdmissionReview, BadReview, build_response, parse_review
from .rules import Own, RuntimeFacts
from .runtimes import GROUP, KINDS, RuntimeSource, RuntimeUnavailable, WouldBlock
from .settings import ROUTE_INIT_CONTAINER, Settings

log = logging.getLogger(__name__)

TRAINJOBS = "trainjobs"
RUNTIME_RESOURCES = {"clustertrainingruntimes": "ClusterTrainingRuntime", "trainingruntimes": "TrainingRuntime"}


class Verb(str, Enum):
    """The webhook's three paths."""

    MUTATE = "mutate"
    VALIDATE = "validate"
    RUNTIMES = "runtimes"


MUTATE, VALIDATE, RUNTIMES = Verb.MUTATE, Verb.VALIDATE, Verb.RUNTIMES


class Enforcement(str, Enum):
    """SPEC 8.1: `enforce` answers as the rules say; `warn` never refuses, it tells."""

    ENFORCE = "enforce"
    WARN = "warn"


class Stage(Enum):
    """Where a review stands (SPEC 6.2, 6.3)."""

    CREATE = "create"      # the entry is computed and put in
    ADD = "add"            # UPDATE of a suspended job without the entry: as CREATE
    KEEP = "keep"          # UPDATE of a job with the entry: never rewritten
    RUNNING = "running"    # UPDATE of a running job without the entry: nothing is added
    DELETING = "deleting"  # UPDATE of a job being deleted: never refused nor mutated


class Plan(NamedTuple):
    """One TrainJob review, read once. Immutable (a named tuple: made on every review, it must be cheap)."""

    operation: str
    namespace: str
    name: str
    stage: Stage
    settings: Settings
    spec: Any = None                     # the new spec as sent (the patch's paths are computed from it)
    count: int = 0                       # runtimePatches entries
    readable: bool = True                # runtimePatches absent or a list
    own: Own | None = None               # the webhook's entry in the new object
    old_own: Own | None = None           # ... and in the old one (UPDATE)
    entry: Entry | None = None           # what the settings produce for the named runtime
    clock: Callable[[], str] = str       # the admission time, for a new entry (read only when one is made)
    reasons: tuple[Reason, ...] = ()     # S1-S3, S6, R1-R7 and faults: all but S4, S5, R8 and SPEC 6.3
    runtime_reasons: tuple[Reason, ...] = ()  # why no entry could be computed (R1-R5, faults)
    spec_same: bool = False              # UPDATE leaving spec as it was
    only_entry_added: bool = False       # UPDATE leaving spec as it was but for the webhook's entry, added

    @property
    def configured(self) -> bool:
        return self.settings.configured

    @property
    def manager(self) -> str:
        return self.settings.manager

    def stale(self, entry: dict) -> bool:
        """The entry differs from what the settings produce now (they were rolled out since)."""
        return not self.configured or (self.entry is not None and not self.entry.matches(entry))


class Decision(NamedTuple):
    ops: tuple[Op, ...] = ()
    warnings: tuple[str, ...] = ()
    reasons: tuple[Reason, ...] = ()


class Outcome(NamedTuple):
    """What one review decided, for the response, the log line and the metrics."""

    uid: str
    verb: Verb
    operation: str = ""
    namespace: str = ""
    name: str = ""
    intercepted: bool = False
    reasons: tuple[Reason, ...] = ()
    ops: tuple[Op, ...] = ()
    warnings: tuple[str, ...] = ()
    would_deny: tuple[tuple[str, str], ...] = ()  # (sentinel, rule) that `enforce` would deny, warn mode

    @property
    def allowed(self) -> bool:
        return not self.reasons

    @property
    def sentinel(self) -> str:
        return primary(self.reasons).name if self.reasons else ""


# ---- warnings (SPEC 6.4) ----

W_REPLACED = "replaced the runtimePatches entry under the webhook's manager with the computed one"
W_REMOVED = "removed a runtimePatches entry under the webhook's manager: no publish or credentials are configured"
W_PUT_BACK = "put back the runtimePatches entry of the webhook's manager, which this update removed"
W_STALE = "the publish settings changed since this TrainJob was created: it keeps its old publish mount until recreated"
W_RUNNING = "this running TrainJob predates the webhook's entry: none is added; it comes when the job is next resumed"
W_ROUTE2 = "publish.via initContainer (route 2) has not been run end to end on your cluster: test it before relying on it"
# JobSet v0.12 lets a suspended JobSet's pod template change only in labels, annotations, nodeSelector,
# tolerations and scheduling gates: a JobSet made before the entry cannot take its volume on resume.
W_ADDED_LATE = "publish entry added on update: if this job's JobSet already exists, JobSet refuses the mount; recreate the job"


def w_not_added(reason: Reason) -> str:
    return f"no publish entry added: {reason.field}: {reason.text}"


def w_would_deny(reason: Reason) -> str:
    return f"would deny: {reason.sentinel.name}: {reason.field}: {reason.text}"


# ---- the two verbs ----


def mutation(p: Plan) -> Decision:
    """The mutating endpoint: the operations that put the entry in place, or the reasons it cannot be."""
    if p.stage is Stage.DELETING:
        return Decision()
    if p.spec_same:  # labels, annotations, finalizers: never refused for what the object already was
        return _mutate_unchanged_spec(p)
    reasons = Reasons(p.reasons)
    ops: list[Op] = []
    warnings: list[str] = []
    if p.stage in (Stage.CREATE, Stage.ADD):
        if not p.configured:
            if p.own is not None:
                ops.append(patch.remove_op(p.own.index))
                warnings.append(W_REMOVED)
        elif p.own is None:
            if p.entry is not None and rules.room_for_entry(p.count, reasons):  # R8
                ops.append(patch.append_op(p.spec, p.entry.json(p.clock())))
                if p.stage is Stage.ADD:
                    warnings.append(W_ADDED_LATE)
        elif p.entry is not None and not p.entry.matches(p.own.entry):
            ops.append(patch.replace_op(p.own.index, p.entry.json(p.clock())))  # nobody may pre-seed the mount
            warnings.append(W_REPLACED)
        if p.configured and _route2(p.settings) and not reasons:
            warnings.append(W_ROUTE2)
    elif p.stage is Stage.KEEP:
        if p.own is None:
            if rules.room_for_entry(p.count, reasons):
                ops.append(patch.insert_op(p.spec, p.old_own.index, json.dumps(p.old_own.entry)))
                warnings.append(W_PUT_BACK)
        else:
            _keep(p, reasons, warnings)
    else:  # RUNNING
        _running(p, reasons, warnings)
    return Decision(tuple(ops), tuple(warnings), tuple(reasons))


def _mutate_unchanged_spec(p: Plan) -> Decision:
    """Spec unchanged: the entry is added only to a suspended job that lacks it, and only where the
    rules admit the result; otherwise nothing is added, with a warning saying why."""
    if not p.configured:
        return Decision()
    if p.stage is Stage.KEEP:
        return Decision(warnings=(W_STALE,) if p.stale(p.own.entry) else ())
    if p.stage is Stage.RUNNING:
        return Decision(warnings=(W_RUNNING,))
    found = Reasons(p.reasons)
    if p.entry is not None and not found:
        rules.room_for_entry(p.count, found)
    if found or p.entry is None:
        why = (list(found) + list(p.runtime_reasons))[:1]
        return Decision(warnings=tuple(w_not_added(r) for r in why) or ("no publish entry added",))
    warnings = (W_ADDED_LATE, W_ROUTE2) if _route2(p.settings) else (W_ADDED_LATE,)
    return Decision((patch.append_op(p.spec, p.entry.json(p.clock())),), warnings)


def validation(p: Plan) -> Decision:
    """The validating endpoint: the reasons the object as it will be stored breaks a rule."""
    if p.stage is Stage.DELETING or p.spec_same:
        return Decision()
    if p.only_entry_added:  # judged by S4 on that entry alone (SPEC 6.3)
        reasons = Reasons()
        if p.entry is None:
            reasons.extend(p.runtime_reasons or _s4_unconfigured(p))
        elif not p.entry.matches(p.own.entry):
            _s4(p, reasons)
        return Decision(reasons=tuple(reasons))
    reasons = Reasons(p.reasons)
    warnings: list[str] = []
    if p.stage in (Stage.CREATE, Stage.ADD):
        if not p.configured:
            if p.own is not None:
                reasons.extend(_s4_unconfigured(p))
        elif p.own is None:
            if p.readable:  # S5 (a runtimePatches that is no list is already a reason)
                reasons.add(ErrInvalid, "spec.runtimePatches",
                            f"has no entry of manager {p.manager!r}: the dispatch-admission mutating webhook was bypassed",
                            "S5")
        elif p.entry is not None and not p.entry.matches(p.own.entry):
            _s4(p, reasons)
    elif p.stage is Stage.KEEP:
        if p.own is None:
            reasons.add(ErrInvalid, "spec.runtimePatches",
                        f"the entry of manager {p.manager!r} was removed; it is immutable once written", RULE_UPDATE)
        else:
            _keep(p, reasons, warnings)
    else:
        _running(p, reasons, warnings)
    return Decision(warnings=tuple(warnings), reasons=tuple(reasons))


def _keep(p: Plan, reasons: Reasons, warnings: list[str]) -> None:
    """The entry once written is never rewritten (Trainer's CRD makes it immutable)."""
    if not patch.same(p.own.entry, p.old_own.entry):
        reasons.add(ErrInvalid, f"spec.runtimePatches[{p.own.index}]",
                    f"the entry of manager {p.manager!r} is immutable once written; recreate the TrainJob to change it",
                    RULE_UPDATE)
    elif p.stale(p.own.entry):
        warnings.append(W_STALE)


def _running(p: Plan, reasons: Reasons, warnings: list[str]) -> None:
    """A running job that never had the entry gets none (Trainer refuses runtimePatches changes on it)."""
    if p.own is not None:
        if p.entry is None or not p.entry.matches(p.own.entry):
            _s4(p, reasons)
    elif p.configured:
        warnings.append(W_RUNNING)


def _s4(p: Plan, reasons: Reasons) -> None:
    reasons.add(ErrInvalid, f"spec.runtimePatches[{p.own.index}]",
                f"the entry of manager {p.manager!r} differs from what the webhook's settings produce", "S4")


def _s4_unconfigured(p: Plan) -> list[Reason]:
    return [Reason(ErrInvalid, f"spec.runtimePatches[{p.own.index}]",
                   f"an entry of manager {p.manager!r} is not allowed: this webhook has no publish or credentials"
                   " configured", "S4")]


def _route2(settings: Settings) -> bool:
    return settings.publish is not None and settings.publish.via == ROUTE_INIT_CONTAINER


def enforce(decision: Decision, verb: Verb, enforcement: Enforcement) -> tuple[Decision, tuple]:
    """SPEC 8.1 in one place: in `warn`, what `enforce` would deny is allowed, unchanged, and told.

    The mutating endpoint then adds nothing (an entry on an object `enforce` would refuse would make
    pods that fail later). Would-deny causes are counted on the validating endpoint only, so each
    TrainJob counts once though it passes both.
    """
    if not decision.reasons or enforcement is Enforcement.ENFORCE:
        return decision, ()
    told = tuple(w_would_deny(r) for r in decision.reasons)
    counted = tuple((r.sentinel.name, r.rule) for r in decision.reasons) if verb is Verb.VALIDATE else ()
    return Decision(warnings=_unique(decision.warnings + told)), counted


def _unique(items) -> tuple:
    return tuple(dict.fromkeys(items))


# ---- reading a review ----


def _suspended(spec) -> bool:
    return isinstance(spec, dict) and spec.get("suspend") is True


def _meta(obj) -> dict:
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    return meta if isinstance(meta, dict) else {}


def _without_entry(spec: dict, index: int, old_spec: dict) -> dict:
    """`spec` with the webhook's entry taken out (and the list, where the entry made it)."""
    out = dict(spec)
    rest = list(spec["runtimePatches"])
    del rest[index]
    out["runtimePatches"] = rest
    if not rest and "runtimePatches" not in old_spec:
        del out["runtimePatches"]
    return out


def json_equal(a, b) -> bool:
    return a == b and patch._json_equal(a, b)


def _target(req: AdmissionRequest, resources) -> str | None:
    """The resource a CREATE or UPDATE of a main resource of Trainer's group is for, else None."""
    if req.get("operation") not in ("CREATE", "UPDATE") or req.get("subResource"):
        return None
    res = req.get("resource")
    if isinstance(res, dict) and res:
        return res.get("resource") if res.get("group") == GROUP and res.get("resource") in resources else None
    kind = req.get("kind")
    if isinstance(kind, dict) and kind.get("group") == GROUP:
        by_kind = {"TrainJob": TRAINJOBS, **{v: k for k, v in RUNTIME_RESOURCES.items()}}
        found = by_kind.get(kind.get("kind"))
        return found if found in resources else None
    return None


def _guarded(reasons: Reasons, check: Callable, *args):
    """Run one phase of the checks; a fault in it becomes a reason beside those found before it (SPEC 4)."""
    try:
        return check(*args)
    except WouldBlock:
        raise  # not a fault: the review is answered again where blocking is allowed
    except RecursionError:  # an object nested deeper than can be walked: the sender's fault
        reasons.add(ErrInvalid, "(object)", "nested too deeply", "S2")
    except Exception:
        log.exception("internal error while checking")
        reasons.add(ErrInternal, "(webhook)", "internal error in dispatch-admission; see its log for this review",
                    RULE_INTERNAL)
    return None


class Admission:
    """Decides reviews for one set of settings, one runtime source and one enforcement mode."""

    FACTS_LIMIT = 4096

    def __init__(self, settings: Settings, runtimes: RuntimeSource,
                 clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
                 enforcement: Enforcement = Enforcement.ENFORCE):
        self.settings = settings
        self.runtimes = runtimes
        self.clock = patch.Clock(clock)
        self.enforcement = Enforcement(enforcement)
        # id(runtime object) -> (the object, its facts, its entry). A runtime the watch replaces is a new
        # object, so nothing goes stale; the object is kept to pin its id. Nothing held here is mutable.
        self._facts: dict[int, tuple[dict, RuntimeFacts, Entry | None]] = {}

    # ---- per-runtime facts, worked out once per runtime object ----

    def facts(self, runtime: dict) -> tuple[RuntimeFacts, Entry | None]:
        cached = self._facts.get(id(runtime))
        if cached is None or cached[0] is not runtime:
            facts = rules.runtime_facts(runtime, self.settings)
            entry = Entry.build(self.settings, facts.targets) if self.settings.configured and facts.targets else None
            if len(self._facts) >= self.FACTS_LIMIT:
                self._facts.clear()
            cached = self._facts[id(runtime)] = (runtime, facts, entry)
        return cached[1], cached[2]

    # ---- reviews ----

    def review(self, doc: Any, verb: Verb | str) -> tuple[AdmissionReview, Outcome]:
        """Answer one AdmissionReview. Raises BadReview for a body that is not one."""
        if verb.__class__ is not Verb:
            verb = Verb(verb)
        req = parse_review(doc)
        uid, operation = req["uid"], str(req.get("operation", ""))
        if verb is Verb.RUNTIMES:
            return self._review_runtime(req, uid, operation)
        if _target(req, (TRAINJOBS,)) is None:
            outcome = Outcome(uid, verb, operation)
            return build_response(uid, [], [], []), outcome
        name = namespace = ""
        try:
            plan = self.plan(req)
            name, namespace = plan.name, plan.namespace
            decision = mutation(plan) if verb is Verb.MUTATE else validation(plan)
        except (BadReview, WouldBlock):
            raise
        except RecursionError:  # an object nested deeper than can be compared: the sender's fault
            decision = Decision(reasons=(Reason(ErrInvalid, "(object)", "nested too deeply", "S2"),))
        except Exception:  # a fault of ours: deny (never admit unchecked), and say so
            log.exception("internal error reviewing uid=%s", uid)
            decision = Decision(reasons=(Reason(ErrInternal, "(webhook)",
                                                "internal error in dispatch-admission; see its log for this uid",
                                                RULE_INTERNAL),))
        decision, would_deny = enforce(decision, verb, self.enforcement)
        name = name or str(req.get("name") or "")
        outcome = Outcome(uid, verb, operation, namespace or str(req.get("namespace") or ""), name, True,
                          decision.reasons, decision.ops, _unique(decision.warnings), would_deny)
        return build_response(uid, list(outcome.reasons), outcome.ops, list(outcome.warnings), name), outcome

    def plan(self, req: AdmissionRequest) -> Plan:
        """Read a TrainJob review once: its stage, its entries, the computed entry, every reason."""
        operation = str(req.get("operation", ""))
        obj = req.get("object")
        if not isinstance(obj, dict):
            raise BadReview(f"request.object must be an object for {operation}")
        old = req.get("oldObject") if operation == "UPDATE" else None
        if operation == "UPDATE" and not isinstance(old, dict):
            raise BadReview("request.oldObject must be an object for UPDATE")
        meta = _meta(obj)
        name = meta.get("name") if isinstance(meta.get("name"), str) else str(req.get("name") or "")
        namespace = meta.get("namespace") if isinstance(meta.get("namespace"), str) and meta.get("namespace") else \
            str(req.get("namespace") or "")
        if old is not None and (meta.get("deletionTimestamp") or _meta(old).get("deletionTimestamp")):
            return Plan(operation, namespace, name, Stage.DELETING, self.settings)
        return self._plan(operation, namespace, name, obj, old)

    def _plan(self, operation: str, namespace: str, name: str, obj: dict, old: dict | None) -> Plan:
        settings = self.settings
        reasons = Reasons()
        spec_value = obj.get("spec")
        spec = spec_value if spec_value.__class__ is dict else rules.Walk(reasons, rule="S2").obj(spec_value, "spec") or {}
        found = _guarded(reasons, rules.scan, spec, settings, reasons) or rules.Scan(0, True, None, ())
        old_spec: dict = {}
        old_own = None
        stage = Stage.CREATE
        if old is not None:
            old_spec = old.get("spec") if isinstance(old.get("spec"), dict) else {}
            old_own = rules.find_own(old_spec, settings.manager)
            stage = Stage.KEEP if old_own else Stage.ADD if _suspended(old_spec) else Stage.RUNNING
        runtime_reasons = Reasons()
        entry = _guarded(runtime_reasons, self._runtime, spec, namespace, found.env, reasons, runtime_reasons)
        reasons.extend(runtime_reasons)
        spec_same = old is not None and json_equal(spec_value, old.get("spec"))
        only_entry_added = (old is not None and not spec_same and old_own is None and found.own is not None
                            and json_equal(_without_entry(spec, found.own.index, old_spec), old_spec))
        return Plan(operation, namespace, name, stage, settings, spec_value, found.count, found.readable, found.own,
                    old_own, entry,
                    self.clock.stamp, tuple(reasons), tuple(runtime_reasons), spec_same, only_entry_added)

    def _runtime(self, spec: dict, namespace: str, env, reasons: Reasons, runtime_reasons: Reasons) -> Entry | None:
        """R1 to R7: read the named runtime; the entry the settings produce for it, when one can be made."""
        ref = rules.runtime_ref(spec, namespace, runtime_reasons)
        entry = None
        if ref is not None:
            try:
                runtime = self.runtimes.get(ref.kind, ref.namespace, ref.name)
            except RuntimeUnavailable as e:
                runtime = None
                runtime_reasons.add(ErrUnavailable, "spec.runtimeRef", f"{ref} cannot be read now ({e}); retry later",
                                    RULE_UNAVAILABLE)
            else:
                if runtime is None:
                    rules.not_found(ref, runtime_reasons)
            if runtime is not None:
                facts, entry = self.facts(runtime)
                runtime_reasons.extend(facts.reasons)
                rules.trainjob_runtime_rules(spec, ref, facts, env, reasons)
        return entry

    # ---- runtime warnings (SPEC 8.3) ----

    def _review_runtime(self, req: AdmissionRequest, uid: str, operation: str) -> tuple[AdmissionReview, Outcome]:
        """Always allowed; with publish or credentials configured, one warning per R3, R4 or R5 reason."""
        resource = _target(req, tuple(RUNTIME_RESOURCES))
        obj = req.get("object")
        if resource is None or not isinstance(obj, dict):
            return build_response(uid, [], [], []), Outcome(uid, Verb.RUNTIMES, operation)
        meta = _meta(obj)
        name = str(meta.get("name") or req.get("name") or "")
        namespace = str(meta.get("namespace") or req.get("namespace") or "")
        warnings: tuple[str, ...] = ()
        if self.settings.configured:
            # Judged as the kind the request is for, whatever the object says.
            runtime = {**obj, "kind": RUNTIME_RESOURCES[resource], "metadata": {**meta, "name": name, "namespace": namespace}}
            facts = rules.runtime_facts(runtime, self.settings)
            what = rules.describe(runtime) + ": "
            warnings = tuple(f"{r.rule}: TrainJobs on this runtime will be refused: {r.text.removeprefix(what)}"
                             for r in facts.reasons)
        outcome = Outcome(uid, Verb.RUNTIMES, operation, namespace, name, True, warnings=warnings)
        return build_response(uid, [], [], list(warnings), name, kind=RUNTIME_RESOURCES[resource]), outcome


__all__ = ["Admission", "Decision", "Enforcement", "Outcome", "Plan", "Stage", "Verb", "MUTATE", "VALIDATE", "RUNTIMES",
           "BadReview", "KINDS", "mutation", "validation", "enforce"]
