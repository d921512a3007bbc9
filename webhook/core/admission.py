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
A CREATE that admits is kept (webhook.core.answers): the same spec in the same namespace, with the same settings,
runtime and admission time, is answered from it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from functools import lru_cache, partial
from typing import Any, NamedTuple

from . import answers, patch, rules
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
from .memos import Memos
from .patch import Entry
from .registry import DEFAULT, S4
from .request import TRAINJOBS, metadata, names, runtime_inputs, target
from .review import AdmissionRequest, BadReview, build_response, parse_review
from .reviewing import Result, Reviewing, Steps, guarded, guarded_steps
from .rule import Lookup, OwnEntry, Point, Registry
from .runtime_warnings import runtime_review
from .runtimes import (
    KINDS,
    PENDING,
    Runtime,
    RuntimeFacts,
    RuntimeRef,
    RuntimeSource,
    RuntimeUnavailable,
    utf8_size,
)
from .settings import Settings

log = logging.getLogger(__name__)


# The settings a replica switched away from stay acceptable on CREATE this long by default (SPEC 2.1); it is
# also how long a digest switched away from can still be admitted (serve --previous-settings-grace).
PREVIOUS_SETTINGS_GRACE = 600.0


def _decided_size(decided: Decided) -> int:
    """What a Decided holds past the entries (shared by every runtime with the same targets), in bytes, roughly."""
    return 512 + sum(utf8_size(t) + 64 for t in decided.facts.targets) + sum(
        utf8_size(r.text) + utf8_size(r.field) + 128 for r in decided.facts.reasons)


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
        self.plans = 0  # reviews planned: one plan per review at most
        self.answers = answers.Answers()  # the admitting answers of CREATEs that repeat (webhook.core.answers)

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
        return self.begin(doc, verb).finish()

    def begin(self, doc: Any, verb: Verb | str) -> Reviewing[Result]:
        """Answer one AdmissionReview as far as it goes without a read that would block where the caller forbids
        blocking (see `Reviewing`). Raises BadReview for a body that is not one."""
        if verb.__class__ is not Verb:
            verb = Verb(verb)
        kept, key = self.answers.find(doc, verb, self._live, self.runtimes, self.clock.stamp)
        if kept is not None:
            return Reviewing.answered(kept)
        req = parse_review(doc)
        if verb is Verb.RUNTIMES:
            return Reviewing.answered(runtime_review(req, req["uid"], str(req.get("operation", "")), self.settings,
                                                     self.checks))
        return Reviewing(self._review(req, verb, key))

    def _keep(self, key: answers.Key, live: _Live, stamp: str, plan: Plan, lookups: dict[RuntimeRef, _Lookup],
              result: Result) -> None:
        """Keep an answer decided with one runtime read, the settings `live` throughout, outside any grace period
        (nor planned with the previous settings: the grace may end between the plan and here), within one
        second, and when enforcing (webhook.core.answers)."""
        if (len(lookups) != 1 or self._live is not live or plan.stage is not Stage.CREATE
                or plan.settings is not live.settings or stamp != self.clock.stamp() or plan.previous is not None
                or (live.previous is not None and self.monotonic() < live.previous_until)
                or self.enforcement is not Enforcement.ENFORCE):  # warn: a fault admits, and must not be kept
            return
        (ref, found), = lookups.items()
        if found.runtime is not None and not found.reasons:
            self.answers.keep(key, live, stamp, (ref, found.runtime), result)

    def _review(self, req: AdmissionRequest, verb: Verb, key: answers.Key | None = None) -> Steps[Result]:
        uid, operation = req["uid"], str(req.get("operation", ""))
        if target(req, (TRAINJOBS,)) is None:
            return build_response(uid, [], [], []), Outcome(uid=uid, verb=verb, operation=operation)
        name = namespace = ""
        lookups: dict[RuntimeRef, _Lookup] = {}  # one read per runtime named, shared by everything the review does
        plan = None
        try:
            refresh = self.refresh  # before an S4 refusal: the settings read once more (SPEC 2.1)
            if verb is Verb.VALIDATE and operation == "CREATE" and refresh and (yield from self._s4(req, lookups)):
                fresh = yield refresh
                if fresh is not None:
                    self.switch(fresh)  # then the one plan is made with them
            live, stamp = self._live, self.clock.stamp() if key is not None else ""
            plan = yield from self._plan(req, lookups)
            name, namespace = plan.name, plan.namespace
            warn = self.enforcement is Enforcement.WARN
            decision = mutation(plan) if verb is Verb.MUTATE else validation(plan, warn=warn)
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
        result = build_response(uid, list(outcome.reasons), outcome.ops, list(outcome.warnings), name), outcome
        if key is not None and plan is not None:
            self._keep(key, live, stamp, plan, lookups, result)
        return result

    def _s4(self, req: AdmissionRequest, lookups: dict[RuntimeRef, _Lookup]) -> Steps[bool]:
        """Whether S4 refuses the entry a CREATE holds under the settings in use (its hooks asked of that entry
        alone): then they are read once more before the review is planned (SPEC 2.1). A fault here is the
        plan's to find."""
        live = self._live
        obj = req.get("object")
        spec = obj.get("spec") if isinstance(obj, dict) else None
        try:
            own = rules.find_own(spec, live.settings.manager)
            if own is None or not isinstance(obj, dict) or not isinstance(spec, dict):
                return False
            entry = previous = None
            ref = rules.runtime_ref(spec, names(req, obj)[1], Reasons(), self.checks)
            found = (yield from self._lookup(ref, lookups)) if ref is not None else None
            if found is not None and found.runtime is not None:
                decided = self._decided(live, found.runtime)
                entry = decided.entry
                previous = decided.previous if self.monotonic() < live.previous_until else None
            reasons = Reasons()
            self.checks.call(Point.OWN_ENTRY, OwnEntry(live.settings, reasons, own, entry, previous, True, True))
        except Exception:
            return False
        return any(r.rule == S4.id for r in reasons)

    def plan(self, req: AdmissionRequest) -> Plan:
        """Read a TrainJob review once: its stage, its entries, the computed entry, every reason."""
        return Reviewing(self._plan(req)).finish()

    def _plan(self, req: AdmissionRequest, lookups: dict[RuntimeRef, _Lookup] | None = None) -> Steps[Plan]:
        self.plans += 1
        operation = str(req.get("operation", ""))
        obj = req.get("object")
        if not isinstance(obj, dict):
            raise BadReview(f"request.object must be an object for {operation}")
        old = req.get("oldObject") if operation == "UPDATE" else None
        if operation == "UPDATE" and not isinstance(old, dict):
            raise BadReview("request.oldObject must be an object for UPDATE")
        name, namespace = names(req, obj)
        live = self._live
        if old is not None and (metadata(obj).get("deletionTimestamp") or metadata(old).get("deletionTimestamp")):
            return Plan(operation=operation, namespace=namespace, name=name, stage=Stage.DELETING,
                        settings=live.settings, checks=self.checks)
        if old is None:
            lookups = {} if lookups is None else lookups
            return (yield from self._plan_create(live, operation, namespace, name, obj, lookups))
        return (yield from self._plan_update(live, operation, namespace, name, obj, old))

    def _spec(self, obj: dict[str, Any], reasons: Reasons) -> tuple[Any, dict[str, Any]]:
        """(spec as sent, spec as a dict to walk): a spec that is no object is a reason, walked as empty."""
        value = obj.get("spec")
        if value.__class__ is dict:
            return value, value
        return value, rules.Walk(reasons, self.checks).obj(value, "spec") or {}

    def _plan_create(self, live: _Live, operation: str, namespace: str, name: str,
                     obj: dict[str, Any], lookups: dict[RuntimeRef, _Lookup]) -> Steps[Plan]:
        settings = live.settings
        reasons = Reasons()
        spec_value, spec = self._spec(obj, reasons)
        found = guarded(self.checks, reasons, rules.scan, spec, settings, reasons, self.checks) or rules.NO_SCAN
        runtime_reasons = Reasons()
        got = yield from guarded_steps(self.checks, runtime_reasons, self._runtime_rules, live, spec, namespace,
                                        found.env, reasons, runtime_reasons, lookups)
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
        found = guarded(self.checks, reasons, rules.scan, spec, settings, reasons, self.checks) or rules.NO_SCAN
        before = Reasons()
        self._spec(old, before)
        old_found = guarded(self.checks, before, rules.scan, old_spec, settings, before, self.checks) or rules.NO_SCAN
        runtime_reasons = Reasons()
        entry = None
        if runtime_inputs(spec) != runtime_inputs(old_spec) or (found.own is not None and old_own is None):
            lookups: dict[RuntimeRef, _Lookup] = {}  # one read per runtime named, shared by both objects
            got = yield from guarded_steps(self.checks, runtime_reasons, self._runtime_rules, live, spec, namespace,
                                            found.env, reasons, runtime_reasons, lookups)
            entry = got[0] if got else None
            reasons.extend(runtime_reasons)
            old_runtime = Reasons()
            yield from guarded_steps(self.checks, old_runtime, self._runtime_rules, live, old_spec, namespace,
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


__all__ = ["Admission", "Decision", "Enforcement", "Outcome", "Plan", "Stage", "Verb", "MUTATE", "VALIDATE", "RUNTIMES",
           "BadReview", "KINDS", "mutation", "validation", "enforce"]
