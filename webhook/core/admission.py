"""The admission decision (SPEC 5, 6 and 8), as controller-runtime separates its Defaulter from its Validator.

A review is read once into a frozen `Plan` (its stage, the entries found, the entry the settings produce for
the named runtime, every reason the rules in force give: those of the `rule.Registry` it is handed), which
`mutation` and `validation` read; the enforcement mode (SPEC 8.1) is applied after either, in one place.

An UPDATE is ratcheted (SPEC 6.3): the old object is judged the same way, and only the reasons it does
not already give refuse; the runtime is read only when the update changes what the runtime rules read.
Settings change while serving (SPEC 2.1): `Admission.switch` takes new ones, the previous settings'
entry stays acceptable on CREATE for a grace period, and an S4 refusal is preceded by one `refresh`.

A review is a `Reviewing`: it runs until it is answered or until it needs a read that would block where its
caller forbade blocking (a runtime the source answers `PENDING` for, the settings read again); then `finish()`,
called where blocking is allowed, makes that read and the review goes on from where it waited. `review()` is both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Iterable
from datetime import UTC, datetime
from functools import lru_cache, partial
from typing import Any, Generic, NamedTuple, TypeVar

from . import patch, rules
from .decision import (
    MUTATE,
    RUNTIMES,
    VALIDATE,
    Decision,
    Enforcement,
    Outcome,
    Plan,
    Stage,
    Verb,
    enforce,
    json_equal,
    mutation,
    ratchet,
    unique,
    validation,
)
from .errors import RULE_INTERNAL, RULE_UNAVAILABLE, ErrInternal, ErrUnavailable, Reason, Reasons
from .patch import Entry
from .registry import DEFAULT, S4
from .review import AdmissionRequest, AdmissionReview, BadReview, build_response, parse_review, short_text
from .rule import Checks, Lookup, Point, Registry
from .runtimes import (
    GROUP,
    KINDS,
    PENDING,
    PLURALS,
    TRAINJOB_KIND,
    Memos,
    Runtime,
    RuntimeFacts,
    RuntimeRef,
    RuntimeSource,
    RuntimeUnavailable,
    utf8_size,
)
from .settings import Settings

log = logging.getLogger(__name__)
T = TypeVar("T")  # what a guarded check returns
Read = Callable[[], Any]  # a read a review waits for (it may block): its result is where the review goes on
Steps = Generator[Read, Any, T]  # a review's work, yielding each read that would block
Result = tuple[AdmissionReview, Outcome]

TRAINJOBS = PLURALS[TRAINJOB_KIND]
RUNTIME_RESOURCES = {PLURALS[kind]: kind for kind in KINDS}  # resource -> kind
BY_KIND = {kind: resource for resource, kind in {TRAINJOBS: TRAINJOB_KIND, **RUNTIME_RESOURCES}.items()}


# The settings a replica switched away from stay acceptable on CREATE this long by default (SPEC 2.1); it is
# also how long a digest switched away from can still be admitted (serve --previous-settings-grace).
PREVIOUS_SETTINGS_GRACE = 600.0


# ---- reading a review ----


def _meta(obj: object) -> dict[str, Any]:
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    return meta if isinstance(meta, dict) else {}


def _runtime_inputs(spec: dict[str, Any]) -> tuple[Any, ...]:
    """What the runtime rules (R1 to R8) read of a TrainJob (SPEC 6.3): an update that changes none of it
    never reads the runtime."""
    trainer = spec.get("trainer")
    trainer = trainer if isinstance(trainer, dict) else {}
    patches = spec.get("runtimePatches")
    return (spec.get("runtimeRef"), trainer.get("numProcPerNode"), trainer.get("env"),
            len(patches) if isinstance(patches, list) else patches)


def _target(req: AdmissionRequest, resources: tuple[str, ...]) -> str | None:
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


def _guarded(checks: Checks, reasons: Reasons, check: Callable[..., T], *args: Any) -> T | None:
    """Run one phase of the checks; a fault in it becomes a reason beside those found before it (SPEC 4)."""
    try:
        return check(*args)
    except RecursionError:
        rules.too_deep(reasons, checks)
    except Exception:
        _internal(reasons)
    return None


def _guarded_steps(checks: Checks, reasons: Reasons, check: Callable[..., Steps[T]], *args: Any) -> Steps[T | None]:
    """`_guarded` for a phase that may wait for a read."""
    try:
        return (yield from check(*args))
    except RecursionError:
        rules.too_deep(reasons, checks)
    except Exception:
        _internal(reasons)
    return None


def _internal(reasons: Reasons) -> None:
    log.exception("internal error while checking")
    reasons.add(ErrInternal, "(webhook)", "internal error in dispatch-admission; see its log for this review",
                RULE_INTERNAL)


def _decided_size(decided: Decided) -> int:
    """What a Decided holds past the entries (shared by every runtime with the same targets), in bytes, roughly."""
    return 512 + sum(utf8_size(t) + 64 for t in decided.facts.targets) + sum(
        utf8_size(r.text) + utf8_size(r.field) + 128 for r in decided.facts.reasons)


def _refuses_s4(decision: Decision) -> bool:
    return any(r.rule == S4.id for r in decision.reasons)


class Reviewing(Generic[T]):
    """One review under way: `result` once answered; else `read`, what it waits for. `finish()`, where blocking is
    allowed, makes each read it waits for and goes on from there to its answer."""

    __slots__ = ("_steps", "read", "result")

    def __init__(self, steps: Steps[T]):
        self._steps = steps
        self.read: Read | None = None
        self.result: T | None = None
        self._go(steps.send, None)

    def _go(self, step: Callable[[Any], Read], value: Any) -> None:
        try:
            self.read = step(value)
        except StopIteration as done:
            self.read, self.result = None, done.value

    def finish(self) -> T:
        while (read := self.read) is not None:
            try:
                value = read()
            except Exception as e:  # the review takes the read's fault where it asked for it
                self._go(self._steps.throw, e)
            else:
                self._go(self._steps.send, value)
        assert self.result is not None
        return self.result


class _Live(NamedTuple):
    """The settings a review is decided with; replaced whole on a switch, so a review reads one consistent
    set (SPEC 2.1)."""

    settings: Settings
    previous: Settings | None          # the settings switched away from, while their grace lasts
    previous_until: float              # monotonic time the grace ends


class Decided(NamedTuple):
    """What the rules decide of one runtime for one set of settings, kept with the runtime."""

    facts: RuntimeFacts
    entry: Entry | None                # what the settings produce for it
    previous: Entry | None             # ... and the previous settings


class _Lookup(NamedTuple):
    """One runtime read, shared by the new and the old object of an UPDATE."""

    runtime: Runtime | None
    reasons: tuple[Reason, ...]        # ErrUnavailable, R2


@lru_cache(maxsize=1024)
def _entry(settings: Settings, targets: tuple[str, ...]) -> Entry:
    """The entry for these settings and target jobs: one object for every runtime with the same targets."""
    return Entry.build(settings, targets)


class Admission:
    """Decides reviews for one runtime source and one enforcement mode, with settings that may change.

    `refresh`, where given, reads the settings once more (the adapter bounds how often) and returns them,
    or None when they cannot be read now: it is called before an S4 refusal on CREATE, because the replica
    that mutated may have seen a settings change first (SPEC 2.1).
    """

    def __init__(self, settings: Settings, runtimes: RuntimeSource,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC),
                 enforcement: Enforcement = Enforcement.ENFORCE,
                 refresh: Callable[[], Settings | None] | None = None,
                 monotonic: Callable[[], float] = time.monotonic, grace: float = PREVIOUS_SETTINGS_GRACE,
                 registry: Registry = DEFAULT):
        self.runtimes = runtimes
        self.registry = registry
        self.checks = registry.in_force()  # the rules in force, for every review it decides
        self.grace = grace  # serve --previous-settings-grace; 0: a digest switched away from is refused at once
        self.clock = patch.Clock(clock)
        self.enforcement = Enforcement(enforcement)
        self.refresh = refresh
        self.monotonic = monotonic
        self._live = _Live(settings, None, 0.0)
        # What the rules decided of each runtime read, for the settings in use (`_live`, replaced whole on a switch).
        self.memos: Memos[Decided] = Memos(_decided_size)

    @property
    def settings(self) -> Settings:
        return self._live.settings

    def switch(self, settings: Settings) -> bool:
        """Decide with `settings` from now on; the ones replaced stay acceptable on CREATE for `grace`
        seconds (none with 0). False when they are the settings already in use."""
        live = self._live
        if settings == live.settings:
            return False
        self._live = _Live(settings, live.settings if self.grace > 0 else None, self.monotonic() + self.grace)
        return True

    # ---- per-runtime facts, worked out once per runtime, settings and rules in force, and kept with it ----

    def facts(self, runtime: Runtime | dict[str, Any]) -> tuple[RuntimeFacts, Entry | None]:
        decided = self._decided(self._live, Runtime.of(runtime))
        return decided.facts, decided.entry

    def _decided(self, live: _Live, runtime: Runtime) -> Decided:
        kept = self.memos.get(runtime, live)
        if kept is not None:
            return kept
        settings, prev = live.settings, live.previous
        facts = rules.runtime_facts(runtime, settings, self.checks)
        targets = facts.targets
        decided = Decided(facts, _entry(settings, targets) if settings.configured and targets else None,
                          _entry(prev, targets) if prev is not None and prev.configured and targets else None)
        self.memos.put(runtime, live, decided)
        return decided

    # ---- reviews ----

    def review(self, doc: Any, verb: Verb | str) -> Result:
        """Answer one AdmissionReview, making any read it needs. Raises BadReview for a body that is not one."""
        return Reviewing(self._review(doc, verb)).finish()

    def begin(self, doc: Any, verb: Verb | str) -> Reviewing[Result]:
        """Answer one AdmissionReview as far as it goes without a read that would block where the caller forbids
        blocking (see `Reviewing`). Raises BadReview for a body that is not one."""
        return Reviewing(self._review(doc, verb))

    def _review(self, doc: Any, verb: Verb | str) -> Steps[Result]:
        if verb.__class__ is not Verb:
            verb = Verb(verb)
        req = parse_review(doc)
        uid, operation = req["uid"], str(req.get("operation", ""))
        if verb is Verb.RUNTIMES:
            return self._review_runtime(req, uid, operation)
        if _target(req, (TRAINJOBS,)) is None:
            return build_response(uid, [], [], []), Outcome(uid=uid, verb=verb, operation=operation)
        name = namespace = ""
        try:
            plan = yield from self._plan(req)
            name, namespace = plan.name, plan.namespace
            warn = self.enforcement is Enforcement.WARN
            decision = mutation(plan) if verb is Verb.MUTATE else validation(plan, warn=warn)
            refresh = self.refresh  # before an S4 refusal: the settings read once more (SPEC 2.1)
            if verb is Verb.VALIDATE and plan.stage is Stage.CREATE and refresh and _refuses_s4(decision):
                fresh = yield refresh
                if fresh is not None and self.switch(fresh):
                    plan = yield from self._plan(req)  # the settings changed: judged again with them
                    decision = validation(plan, warn=warn)
        except BadReview:
            raise
        except RecursionError:  # an object nested deeper than can be compared: the sender's fault
            decision = Decision(reasons=tuple(rules.too_deep(Reasons(), self.checks)))
        except Exception:  # a fault of ours: deny (never admit unchecked), and say so
            log.exception("internal error reviewing uid=%s", uid)
            decision = Decision(reasons=(Reason(ErrInternal, "(webhook)",
                                                "internal error in dispatch-admission; see its log for this uid",
                                                RULE_INTERNAL),))
        decision, would_deny = enforce(decision, verb, self.enforcement)
        name = name or str(req.get("name") or "")
        outcome = Outcome(uid=uid, verb=verb, operation=operation,
                          namespace=namespace or str(req.get("namespace") or ""), name=name, intercepted=True,
                          reasons=decision.reasons, ops=decision.ops, warnings=unique(decision.warnings),
                          would_deny=would_deny)
        return build_response(uid, list(outcome.reasons), outcome.ops, list(outcome.warnings), name), outcome

    def plan(self, req: AdmissionRequest) -> Plan:
        """Read a TrainJob review once: its stage, its entries, the computed entry, every reason."""
        return Reviewing(self._plan(req)).finish()

    def _plan(self, req: AdmissionRequest) -> Steps[Plan]:
        operation = str(req.get("operation", ""))
        obj = req.get("object")
        if not isinstance(obj, dict):
            raise BadReview(f"request.object must be an object for {operation}")
        old = req.get("oldObject") if operation == "UPDATE" else None
        if operation == "UPDATE" and not isinstance(old, dict):
            raise BadReview("request.oldObject must be an object for UPDATE")
        meta = _meta(obj)
        name = meta.get("name")
        if not isinstance(name, str):
            name = str(req.get("name") or "")
        namespace = meta.get("namespace")
        if not (isinstance(namespace, str) and namespace):
            namespace = str(req.get("namespace") or "")
        live = self._live
        if old is not None and (meta.get("deletionTimestamp") or _meta(old).get("deletionTimestamp")):
            return Plan(operation=operation, namespace=namespace, name=name, stage=Stage.DELETING,
                        settings=live.settings, checks=self.checks)
        if old is None:
            return (yield from self._plan_create(live, operation, namespace, name, obj))
        return (yield from self._plan_update(live, operation, namespace, name, obj, old))

    def _spec(self, obj: dict[str, Any], reasons: Reasons) -> tuple[Any, dict[str, Any]]:
        """(spec as sent, spec as a dict to walk): a spec that is no object is a reason, walked as empty."""
        value = obj.get("spec")
        if value.__class__ is dict:
            return value, value
        return value, rules.Walk(reasons, self.checks).obj(value, "spec") or {}

    def _plan_create(self, live: _Live, operation: str, namespace: str, name: str,
                     obj: dict[str, Any]) -> Steps[Plan]:
        settings = live.settings
        reasons = Reasons()
        spec_value, spec = self._spec(obj, reasons)
        found = _guarded(self.checks, reasons, rules.scan, spec, settings, reasons, self.checks) or rules.NO_SCAN
        runtime_reasons = Reasons()
        got = yield from _guarded_steps(self.checks, runtime_reasons, self._runtime_rules, live, spec, namespace,
                                        found.env, reasons, runtime_reasons, {})
        entry, previous = got if got else (None, None)
        reasons.extend(runtime_reasons)
        if previous is not None and self.monotonic() >= live.previous_until:
            previous = None
        return Plan(operation=operation, namespace=namespace, name=name, stage=Stage.CREATE, settings=settings,
                    checks=self.checks, spec=spec_value, count=found.count, readable=found.readable,
                    own=found.own, entry=entry, previous=previous, clock=self.clock.stamp, reasons=tuple(reasons),
                    runtime_reasons=tuple(runtime_reasons))

    def _plan_update(self, live: _Live, operation: str, namespace: str, name: str, obj: dict[str, Any],
                     old: dict[str, Any]) -> Steps[Plan]:
        """SPEC 6.3: the old object judged the same way; only what it does not already give refuses."""
        settings = live.settings
        old_spec = old.get("spec")
        if not isinstance(old_spec, dict):
            old_spec = {}
        old_own = rules.find_own(old_spec, settings.manager)
        stage = Stage.KEEP if old_own else Stage.NO_ENTRY
        spec_value = obj.get("spec")
        if json_equal(spec_value, old.get("spec")):  # labels, annotations, finalizers, status: nothing to judge
            own = old_own
            count = len(old_spec["runtimePatches"]) if isinstance(old_spec.get("runtimePatches"), list) else 0
            return Plan(operation=operation, namespace=namespace, name=name, stage=stage, settings=settings,
                        checks=self.checks, spec=spec_value, count=count, own=own, old_own=old_own,
                        clock=self.clock.stamp)
        reasons = Reasons()
        spec_value, spec = self._spec(obj, reasons)
        found = _guarded(self.checks, reasons, rules.scan, spec, settings, reasons, self.checks) or rules.NO_SCAN
        before = Reasons()
        self._spec(old, before)
        old_found = _guarded(self.checks, before, rules.scan, old_spec, settings, before, self.checks) or rules.NO_SCAN
        runtime_reasons = Reasons()
        entry = None
        if _runtime_inputs(spec) != _runtime_inputs(old_spec) or (found.own is not None and old_own is None):
            lookups: dict[RuntimeRef, _Lookup] = {}  # one read per runtime named, shared by both objects
            got = yield from _guarded_steps(self.checks, runtime_reasons, self._runtime_rules, live, spec, namespace,
                                            found.env, reasons, runtime_reasons, lookups)
            entry = got[0] if got else None
            reasons.extend(runtime_reasons)
            old_runtime = Reasons()
            yield from _guarded_steps(self.checks, old_runtime, self._runtime_rules, live, old_spec, namespace,
                                      old_found.env, before, old_runtime, lookups)
            before.extend(old_runtime)
        new = ratchet(reasons, spec, before, old_spec)
        return Plan(operation=operation, namespace=namespace, name=name, stage=stage, settings=settings,
                    checks=self.checks, spec=spec_value, count=found.count, readable=found.readable,
                    own=found.own, old_own=old_own, entry=entry, clock=self.clock.stamp, reasons=tuple(new),
                    runtime_reasons=tuple(runtime_reasons))

    def _lookup(self, ref: RuntimeRef, lookups: dict[RuntimeRef, _Lookup]) -> Steps[_Lookup]:
        """R2 and availability: the runtime `ref` names, read once per review; a read that would block is waited
        for here, made where blocking is allowed."""
        found = lookups.get(ref)
        if found is None:
            reasons = Reasons()
            try:
                runtime = self.runtimes.get(ref.kind, ref.namespace, ref.name)
                if runtime is PENDING:
                    runtime = yield partial(self.runtimes.get, ref.kind, ref.namespace, ref.name)
                if runtime is PENDING:  # the read was made where blocking is forbidden after all
                    raise RuntimeUnavailable("the runtime cache cannot answer without blocking")
            except RuntimeUnavailable as e:
                runtime = None
                reasons.add(ErrUnavailable, "spec.runtimeRef", f"{ref} cannot be read now ({e}); retry later",
                            RULE_UNAVAILABLE)
            else:
                self.checks.call(Point.RUNTIME_LOOKUP, Lookup(reasons, ref, runtime))
            found = lookups[ref] = _Lookup(runtime, tuple(reasons))
        return found

    def _runtime_rules(self, live: _Live, spec: dict[str, Any], namespace: str, env: Iterable[tuple[str, str]],
                       reasons: Reasons, runtime_reasons: Reasons,
                       lookups: dict[RuntimeRef, _Lookup]) -> Steps[tuple[Entry | None, Entry | None]]:
        """R1 to R7: read the named runtime; the entries the settings (and the previous settings) produce
        for it, when one can be made."""
        ref = rules.runtime_ref(spec, namespace, runtime_reasons, self.checks)
        if ref is None:
            return None, None
        found = yield from self._lookup(ref, lookups)
        runtime_reasons.extend(found.reasons)
        if found.runtime is None:
            return None, None
        decided = self._decided(live, found.runtime)
        runtime_reasons.extend(decided.facts.reasons)
        rules.trainjob_runtime_rules(spec, ref, decided.facts, env, reasons, live.settings, self.checks)
        return decided.entry, decided.previous

    # ---- runtime warnings (SPEC 8.3) ----

    def _review_runtime(self, req: AdmissionRequest, uid: str, operation: str) -> Result:
        """Always allowed; with publish or credentials configured, one warning per R3, R4 or R5 reason."""
        resource = _target(req, tuple(RUNTIME_RESOURCES))
        obj = req.get("object")
        if resource is None or not isinstance(obj, dict):
            return build_response(uid, [], [], []), Outcome(uid=uid, verb=Verb.RUNTIMES, operation=operation)
        meta = _meta(obj)
        name = str(meta.get("name") or req.get("name") or "")
        namespace = str(meta.get("namespace") or req.get("namespace") or "")
        warnings: tuple[str, ...] = ()
        settings = self.settings
        if settings.configured:
            # Judged as the kind the request is for, whatever the object says.
            runtime = Runtime.of({**obj, "kind": RUNTIME_RESOURCES[resource],
                                   "metadata": {**meta, "name": name, "namespace": namespace}})
            facts = rules.runtime_facts(runtime, settings, self.checks)
            what = f"{runtime}: "
            warnings = tuple(f"{r.rule}: TrainJobs on this runtime will be refused: "
                             f"{short_text(r.text.removeprefix(what))}" for r in facts.reasons)
        outcome = Outcome(uid=uid, verb=Verb.RUNTIMES, operation=operation, namespace=namespace, name=name,
                          intercepted=True, warnings=warnings)
        return build_response(uid, [], [], list(warnings), name, kind=RUNTIME_RESOURCES[resource]), outcome


__all__ = ["Admission", "Decision", "Enforcement", "Outcome", "Plan", "Stage", "Verb", "MUTATE", "VALIDATE", "RUNTIMES",
           "BadReview", "KINDS", "mutation", "validation", "enforce"]
