"""What the rules decide of one review (SPEC 5, 6, 8): the verbs, the `Plan` a review is read into, and the two
small functions that read it, as controller-runtime separates its Defaulter from its Validator: `mutation`
(operations, warnings, and the reasons that stop it) and `validation` (reasons and warnings). The enforcement
mode (SPEC 8.1) is applied after either, in one place (`enforce`); an UPDATE is ratcheted (`ratchet`, SPEC 6.3).
webhook.core.admission reads reviews into plans and answers them.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple

from . import patch, rules
from .errors import Reason, Reasons, Sentinel, primary
from .patch import Entry, Op
from .review import short_reason
from .rule import Checks, EntryUpdate, Own, OwnEntry, Point
from .settings import ROUTE_INIT_CONTAINER, Settings


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
    KEEP = "keep"          # UPDATE of a job with the entry: never rewritten
    NO_ENTRY = "no-entry"  # UPDATE of a job created without the entry: none is ever added
    DELETING = "deleting"  # UPDATE of a job being deleted: never refused nor mutated


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """One TrainJob review, read once. Immutable, and built with keywords only (16 fields: a positional
    slip would go unseen)."""

    operation: str
    namespace: str
    name: str
    stage: Stage
    settings: Settings
    checks: Checks                       # the rules in force
    spec: Any = None                     # the new spec as sent (the patch's paths are computed from it)
    count: int = 0                       # runtimePatches entries
    readable: bool = True                # runtimePatches absent or a list
    own: Own | None = None               # the webhook's entry in the new object
    old_own: Own | None = None           # ... and in the old one (UPDATE)
    entry: Entry | None = None           # what the settings produce for the named runtime
    previous: Entry | None = None        # ... and what the previous settings produced, in their grace period
    clock: Callable[[], str] = str       # the admission time, for a new entry (read only when one is made)
    reasons: tuple[Reason, ...] = ()     # S1-S3, S6, R1-R7 and faults (on UPDATE, only those the old object
                                         # does not give): all but S4, S5, R8 and SPEC 6.3's own
    runtime_reasons: tuple[Reason, ...] = ()  # why no entry could be computed (R1-R5, faults)

    @property
    def configured(self) -> bool:
        return self.settings.configured

    @property
    def manager(self) -> str:
        return self.settings.manager

    def stale(self, entry: dict[str, Any]) -> bool:
        """The entry differs from what the settings produce now (they were rolled out since)."""
        return not self.configured or (self.entry is not None and not self.entry.matches(entry))


class Decision(NamedTuple):
    ops: tuple[Op, ...] = ()
    warnings: tuple[str, ...] = ()
    reasons: tuple[Reason, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """What one review decided, for the response, the log line and the metrics. Keywords only."""

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
# The entry is written on CREATE only (SPEC 6.3): the CRD makes an entry's volumes immutable, and JobSet refuses
# a volume change to an existing JobSet's pod template, so an entry added later would keep the job from resuming.
W_NO_ENTRY = "this TrainJob has no publish entry: it runs without /opt/dispatch/publish; recreate it to get the mount"
W_ROUTE2 = ("publish.via initContainer (route 2) has not been run end to end on your cluster: "
            "test it before relying on it")


def w_would_deny(reason: Reason) -> str:
    return f"would deny: {reason.sentinel.name}: {short_reason(reason)}"


# ---- the two verbs ----


def mutation(p: Plan) -> Decision:
    """The mutating endpoint: the operations that put the entry in place, or the reasons it cannot be."""
    if p.stage is Stage.DELETING:
        return Decision()
    reasons = Reasons(p.reasons)
    ops: list[Op] = []
    warnings: list[str] = []
    if p.stage is Stage.CREATE:
        if not p.configured:
            if p.own is not None:
                ops.append(patch.remove_op(p.own.index))
                warnings.append(W_REMOVED)
        elif p.own is None:
            if p.entry is not None and rules.room_for_entry(p.count, reasons, p.checks):
                ops.append(patch.append_op(p.spec, p.entry.json(p.clock())))
        elif p.entry is not None and not p.entry.matches(p.own.entry):
            ops.append(patch.replace_op(p.own.index, p.entry.json(p.clock())))  # nobody may pre-seed the mount
            warnings.append(W_REPLACED)
        if p.configured and _route2(p.settings) and not reasons:
            warnings.append(W_ROUTE2)
    elif p.stage is Stage.KEEP:
        assert p.old_own is not None  # KEEP: the old object holds the entry
        if p.own is None:  # a re-applied manifest that never held it: put it back as it was
            if rules.room_for_entry(p.count, reasons, p.checks):
                ops.append(patch.insert_op(p.spec, p.old_own.index, json.dumps(p.old_own.entry)))
                warnings.append(W_PUT_BACK)
        else:
            _updated(p, reasons)
    else:  # NO_ENTRY: never added on an update
        if p.own is not None:
            _own_entry_added(p, reasons)
        elif p.configured and not reasons:
            warnings.append(W_NO_ENTRY)
    return Decision(tuple(ops), tuple(warnings), tuple(reasons))


def validation(p: Plan, *, warn: bool = False) -> Decision:
    """The validating endpoint: the reasons the object as it will be stored breaks a rule. In `warn` (SPEC 8.1)
    an entry the mutating endpoint left out on purpose is not blamed on a bypass (S5): the reasons that kept
    it out are given instead."""
    if p.stage is Stage.DELETING:
        return Decision()
    reasons = Reasons(p.reasons)
    if p.stage is Stage.CREATE:
        kept_out = mutation(p).reasons if warn and p.configured and p.own is None else ()
        if kept_out:
            reasons.extend(kept_out)
        elif p.own is None or not p.configured or p.entry is not None:  # else why no entry is said already
            _own_entry(p, reasons, create=True)
    elif p.stage is Stage.KEEP:
        _updated(p, reasons)
    elif p.own is not None:
        _own_entry_added(p, reasons)
    return Decision(reasons=tuple(reasons))


def _own_entry(p: Plan, reasons: Reasons, *, create: bool) -> None:
    """The hooks at `Point.OWN_ENTRY` (S4, S5) on the entry in the object."""
    p.checks.call(Point.OWN_ENTRY, OwnEntry(p.settings, reasons, p.own, p.entry, p.previous if create else None,
                                            create, p.readable))


def _updated(p: Plan, reasons: Reasons) -> None:
    """The hooks at `Point.ENTRY_UPDATE` (SPEC 6.3): the entry, once written, is neither changed nor removed."""
    assert p.old_own is not None  # KEEP: the old object holds the entry
    p.checks.call(Point.ENTRY_UPDATE, EntryUpdate(p.settings, reasons, p.own, p.old_own))


def _own_entry_added(p: Plan, reasons: Reasons) -> None:
    """An entry of the webhook's manager that an update brings to a job created without one: judged by S4,
    unless no entry could be computed for a reason that says why (ratcheted away from `p.reasons`)."""
    if p.configured and p.entry is None and p.runtime_reasons:
        reasons.extend(p.runtime_reasons)
    else:
        _own_entry(p, reasons, create=False)


def _route2(settings: Settings) -> bool:
    return settings.publish is not None and settings.publish.via == ROUTE_INIT_CONTAINER


def enforce(decision: Decision, verb: Verb,
            enforcement: Enforcement) -> tuple[Decision, tuple[tuple[str, str], ...]]:
    """SPEC 8.1 in one place: in `warn`, what `enforce` would deny is allowed, unchanged, and told.

    The mutating endpoint then adds nothing (an entry on an object `enforce` would refuse would make
    pods that fail later). Would-deny causes are counted on the validating endpoint only, so each
    TrainJob counts once though it passes both.
    """
    if not decision.reasons or enforcement is Enforcement.ENFORCE:
        return decision, ()
    told = tuple(w_would_deny(r) for r in decision.reasons)
    counted = tuple((r.sentinel.name, r.rule) for r in decision.reasons) if verb is Verb.VALIDATE else ()
    return Decision(warnings=unique(decision.warnings + told)), counted


def unique(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


_ENTRY_FIELD = re.compile(r"^spec\.runtimePatches\[(\d+)\]")
_ENV_FIELD = re.compile(r"^spec\.trainer\.env\[\d+\]")


def _ratchet_key(reason: Reason, spec: dict[str, Any]) -> tuple[Sentinel, str, str]:
    """A reason as ratcheting compares it (SPEC 6.3): by sentinel, field and text, an entry's field named by
    its manager rather than its index (another entry put before it moves the index, not the reason), and
    spec.trainer.env's by the name the text carries."""
    field = reason.field
    m = _ENTRY_FIELD.match(field)
    if m:
        patches = spec.get("runtimePatches")
        i = int(m.group(1))
        entry = patches[i] if isinstance(patches, list) and i < len(patches) else None
        manager = entry.get("manager") if isinstance(entry, dict) else None
        if isinstance(manager, str):
            field = f"spec.runtimePatches[manager={manager}]" + field[m.end():]
    else:
        field = _ENV_FIELD.sub("spec.trainer.env[*]", field)
    return reason.sentinel, field, reason.text


def ratchet(new: list[Reason], new_spec: dict[str, Any], old: list[Reason], old_spec: dict[str, Any]) -> list[Reason]:
    """The reasons of the new object that the old one, judged the same way, does not give (counted, so a
    second equal violation is new)."""
    if not old:
        return list(new)
    left = Counter(_ratchet_key(r, old_spec) for r in old)
    out = []
    for r in new:
        key = _ratchet_key(r, new_spec)
        if left[key] > 0:
            left[key] -= 1
        else:
            out.append(r)
    return out


def json_equal(a: Any, b: Any) -> bool:
    return a == b and patch._json_equal(a, b)
