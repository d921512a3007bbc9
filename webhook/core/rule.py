"""What a rule is: its id, where SPEC says it, its sentinel, and the hooks it puts at the review's points.

A review calls the hooks of the rules in force (`Checks`, built by a `registry.Registry`) at typed points
(`Point`): on the way through a TrainJob (`rules.scan`: each volume, mount and env of another entry, each
`spec.trainer.env` name), through a runtime (`rules.runtime_facts`: the runtime and its target jobs, each
volume a container mounts), and at the review's stages (the runtime reference, the runtime lookup, the
TrainJob against its runtime, the webhook's own entry, an update of it, room for it, what cannot be read).
Each point passes one context object, a frozen dataclass of the point's kind (`Point.context`), carrying
what a rule there may need and the `reasons` it appends to. A hook makes its reasons through its rule
(`rule.refuse`), so a reason's id and sentinel are the rule's own. `webhook/core/registry.py` holds the rules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, NamedTuple

from .errors import Reason, Reasons, Sentinel
from .runtimes import Job, Mounter, Runtime, RuntimeFacts, RuntimeRef
from .settings import Settings

if TYPE_CHECKING:  # patch imports the rules' constants: a type only, to keep the import one way
    from .patch import Entry


class Own(NamedTuple):
    """The webhook's entry in a TrainJob: its index in runtimePatches and its content."""

    index: int  # type: ignore[assignment]  # the field shadows tuple.index, as a NamedTuple field may
    entry: dict[str, Any]


# ---- the contexts: one frozen dataclass per kind of point ----


@dataclass(frozen=True, slots=True)
class InEntry:
    """One item of another manager's runtimePatches entry: a volume, a mount or an env (S1, S2, S3, S6)."""

    settings: Settings
    reasons: Reasons
    field: str                          # the item's field (`...volumes[0].name`, `...volumeMounts[1].mountPath`)
    name: Any                           # its name as sent (a volume's, a mount's volume, an env's)
    item: dict[str, Any]                # the volume, mount or env as sent
    job: str = ""                       # the replicated job's name
    container: dict[str, Any] | None = None  # the container or init container (mounts and env)
    mount_path: str = ""                # a mount's path as sent ...
    normal: str = ""                    # ... normalised ...
    looks: str = ""                     # ... and its look-alike characters read as ASCII, normalised


@dataclass(frozen=True, slots=True)
class TrainerEnv:
    """One `spec.trainer.env` name (S3)."""

    settings: Settings
    reasons: Reasons
    spec: dict[str, Any]
    field: str
    name: str


@dataclass(frozen=True, slots=True)
class OfRuntime:
    """A runtime as a source took it, and its target jobs (R3, R4, R5)."""

    settings: Settings
    reasons: Reasons
    runtime: Runtime
    targets: tuple[Job, ...]            # the jobs whose pod has a `node` container (empty when oversize)


@dataclass(frozen=True, slots=True)
class RuntimeMount:
    """One volume a container or init container of a runtime's job mounts, by name (R5)."""

    settings: Settings
    reasons: Reasons
    runtime: Runtime
    job: Job
    target: bool                        # the job is a target job (R3)
    container: Mounter
    volume: str                         # the volume's name
    source: str                         # the pod's volume of that name: its source (`hostPath`, ...); "" if none


@dataclass(frozen=True, slots=True)
class RefGiven:
    """`spec.runtimeRef` as sent (R1): each field None where absent, the walk having said where one is malformed."""

    reasons: Reasons
    spec: dict[str, Any]
    ref: dict[str, Any] | None          # None where absent or not an object
    name: Any
    api_group: str | None               # None where absent or not a string (then `group_ok` says which)
    kind: str | None
    group_ok: bool                      # apiGroup is absent or a string
    kind_ok: bool


@dataclass(frozen=True, slots=True)
class Lookup:
    """The runtime the reference names, looked up (R2): `runtime` None when it does not exist."""

    reasons: Reasons
    ref: RuntimeRef
    runtime: Runtime | None


@dataclass(frozen=True, slots=True)
class AgainstRuntime:
    """The TrainJob against the runtime it names (R6, R7)."""

    settings: Settings
    reasons: Reasons
    spec: dict[str, Any]
    ref: RuntimeRef
    facts: RuntimeFacts
    env: tuple[tuple[str, str], ...]    # (path, name) of spec.trainer.env


@dataclass(frozen=True, slots=True)
class OwnEntry:
    """The webhook's entry where a review judges it (S4, S5): at `/validate` on CREATE, where an UPDATE brings
    it to a job without it, and each entry of its manager after the first (`duplicate`)."""

    settings: Settings
    reasons: Reasons
    own: Own | None                     # the entry in the object, None when it lacks one
    entry: Entry | None = None          # what the settings produce for the runtime (None: none could be made)
    previous: Entry | None = None       # ... and the previous settings, in their grace period (SPEC 2.1)
    create: bool = False                # a CREATE (S5 judges only those)
    readable: bool = True               # runtimePatches is absent or a list
    duplicate: int | None = None        # the index of a second entry of the manager


@dataclass(frozen=True, slots=True)
class EntryUpdate:
    """An UPDATE of a job whose old object holds the entry (SPEC 6.3): `own` None where the update removes it."""

    settings: Settings
    reasons: Reasons
    own: Own | None
    old_own: Own


@dataclass(frozen=True, slots=True)
class Room:
    """The webhook's entry about to be added to `count` entries (R8)."""

    reasons: Reasons
    count: int


@dataclass(frozen=True, slots=True)
class Unreadable:
    """What a walk cannot read: a field of the wrong type, an object nested too deeply."""

    reasons: Reasons
    field: str
    text: str


class Point(Enum):
    """Where the review calls hooks, and the context it gives them."""

    # value: (where, for people; the context's type)
    ENTRY_VOLUME = ("`rules.scan`: each volume of another entry", InEntry)
    ENTRY_MOUNT_PATH = ("`rules.scan`: each mountPath in another entry", InEntry)
    ENTRY_MOUNT_NAME = ("`rules.scan`: each mount's volume name in another entry", InEntry)
    ENTRY_ENV = ("`rules.scan`: each env name of another entry's containers", InEntry)
    TRAINER_ENV = ("`rules.scan`: each `spec.trainer.env` name", TrainerEnv)
    RUNTIME_REF = ("`rules.runtime_ref`: the runtime reference", RefGiven)
    RUNTIME_LOOKUP = ("`Admission._lookup`: the runtime looked up", Lookup)
    RUNTIME_OVERSIZE = ("`rules.runtime_facts`: a runtime too large to check", OfRuntime)
    RUNTIME = ("`rules.runtime_facts`: the runtime and its target jobs", OfRuntime)
    RUNTIME_MOUNT = ("`rules.runtime_facts`: each volume a runtime's container mounts", RuntimeMount)
    TRAINJOB_RUNTIME = ("`rules.trainjob_runtime_rules`: the TrainJob against its runtime", AgainstRuntime)
    OWN_ENTRY = ("`decision.validation`, `rules.scan`: the webhook's own entry (absent, differing, repeated)",
                 OwnEntry)
    ENTRY_UPDATE = ("`decision`: an UPDATE of a job whose old object holds the entry", EntryUpdate)
    ROOM = ("`rules.room_for_entry`: room for the entry", Room)
    UNREADABLE = ("`rules.Walk`: what cannot be read", Unreadable)

    def __init__(self, where: str, context: type) -> None:
        self.where, self.context = where, context


# hook(rule, context): it appends what it finds to `context.reasons`, made through `rule.refuse`.
Hook = Callable[["Rule", Any], None]


@dataclass(frozen=True, eq=False)
class Rule:
    """One rule (SPEC 5, 6.3), or one of the labels a reason carries that no rule of SPEC gives."""

    id: str
    section: str                    # where SPEC says it
    sentinel: Sentinel              # what it refuses with
    refuses: str                    # what it refuses, for people
    reads: tuple[str, ...]          # the fields and facts it reads
    hooks: Mapping[Point, Hook] = field(default_factory=dict)  # its checks, by the point they are made at
    also: tuple[Sentinel, ...] = ()   # another sentinel some of its reasons carry (R1: a missing name)
    verdict: str = "violation"        # the audit's verdict on a TrainJob it refuses (SPEC 8.2)
    switchable: bool = True           # False: the sweep's off-switch cannot remove it

    @property
    def where(self) -> str:
        """Where its checks are made: the points it hooks."""
        return "; ".join(p.where for p in self.hooks)

    def refuse(self, field: str, text: str, *, sentinel: Sentinel | None = None, subject: str = "") -> Reason:
        """A reason of this rule: its id, and its sentinel (or one of `also`)."""
        if sentinel is None:
            sentinel = self.sentinel
        elif sentinel is not self.sentinel and sentinel not in self.also:
            raise ValueError(f"rule {self.id} does not refuse with {sentinel.label}")
        return Reason(sentinel, field, text, self.id, subject)


class Checks:
    """The rules in force for a review, and their hooks by point: built once by a registry and passed to the
    walks, so a rule switched off (the sweep) is never asked, and no reason is filtered afterwards."""

    __slots__ = ("rules", "_at")

    def __init__(self, rules: Iterable[Rule]) -> None:
        self.rules: tuple[Rule, ...] = tuple(rules)
        self._at: dict[Point, tuple[tuple[Rule, Hook], ...]] = {
            p: tuple((r, r.hooks[p]) for r in self.rules if p in r.hooks) for p in Point}

    def at(self, point: Point) -> tuple[tuple[Rule, Hook], ...]:
        return self._at[point]

    def call(self, point: Point, context: Any) -> None:
        """The hooks at `point`, in registry order, each given `context` (of the point's type)."""
        assert context.__class__ is point.context, (point, context.__class__)
        for rule, hook in self._at[point]:
            hook(rule, context)


class Registry:
    """The rules a program knows, and which of them are in force: handed to `Admission` (and through it to
    the walks), so two registries never meet. `registered` adds rules for a while (a test's), `switched_off`
    removes some for a while (the sweep); `in_force` is one `Checks` while neither changes."""

    def __init__(self, rules: Iterable[Rule], malformed: Rule) -> None:
        self.malformed = malformed      # never switched off: what cannot be read is always refused
        self.rules: tuple[Rule, ...] = tuple(rules)
        self.by_id: dict[str, Rule] = {r.id: r for r in self.rules}
        self._off: frozenset[str] = frozenset()
        self._in_force: Checks | None = None

    def rule(self, rule_id: str) -> Rule:
        return self.by_id[rule_id]

    def find(self, label: str) -> Rule | None:
        """The rule a reason's label names, the malformed pseudo-rule included; None for the other labels."""
        return self.malformed if label == self.malformed.id else self.by_id.get(label)

    def in_force(self) -> Checks:
        """Every registered rule but those switched off, and the malformed pseudo-rule, in registry order."""
        if self._in_force is None:
            self._in_force = Checks([r for r in self.rules if r.id not in self._off] + [self.malformed])
        return self._in_force

    def _set(self, rules: tuple[Rule, ...], off: frozenset[str]) -> None:
        self.rules, self.by_id, self._off, self._in_force = rules, {r.id: r for r in rules}, off, None

    @contextmanager
    def registered(self, *new: Rule) -> Iterator[None]:
        """While inside, `new` are rules like the others (after them, in order): admissions built then apply
        them, the audit and the docs list them, the sweep can switch them off."""
        taken = [r.id for r in new if r.id in self.by_id or r.id == self.malformed.id]
        if taken:
            raise ValueError(f"rule id already used: {', '.join(taken)}")
        self._set(self.rules + new, self._off)
        try:
            yield
        finally:
            self._set(tuple(r for r in self.rules if r not in new), self._off)

    @contextmanager
    def switched_off(self, *rule_ids: str) -> Iterator[None]:
        """While inside, admissions built then do not apply the rules named: they give no reason anywhere
        (the sweep's way of removing one)."""
        unknown = [r for r in rule_ids if r not in self.by_id]
        if unknown:
            raise KeyError(f"no such rule (or one that cannot be switched off): {', '.join(unknown)}")
        before = self._off
        self._set(self.rules, before | frozenset(rule_ids))
        try:
            yield
        finally:
            self._set(self.rules, before)
