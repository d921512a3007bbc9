"""What a rule is: its id, where SPEC says it, its sentinel, and the checks it hooks into the walks.

A TrainJob is walked once (`rules.scan`), a runtime once per settings (`rules.runtime_facts`); at each
`Point` the walk calls the hooks of the rules in force (`Checks`), in registry order. A hook makes its
reasons through its rule (`rule.refuse`), so a reason's id and sentinel are the rule's own. The few checks
that depend on the review's stage rather than on a walk (the webhook's own entry, updates, the runtime
lookup, room for the entry) are made in the functions `Rule.checked_in` names, through the rule too, and
only while it is in force (`Checks.on`). `webhook/core/registry.py` holds the rules themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from .errors import Reason, Reasons, Sentinel

# hook(rule, reasons, settings, *what the point gives): it appends what it finds to `reasons`.
Hook = Callable[..., None]


class Point(Enum):
    """Where a walk calls hooks, and what it gives them (after the rule, the reasons and the settings)."""

    # value: (where, for people; what the hook is given)
    ENTRY_VOLUME = ("`rules.scan`: each volume of another entry", "field, name")
    ENTRY_MOUNT_PATH = ("`rules.scan`: each mountPath in another entry", "field, mount_path, normal, look_alike")
    ENTRY_MOUNT_NAME = ("`rules.scan`: each mount's volume name in another entry", "field, name")
    ENTRY_ENV = ("`rules.scan`: each env name of another entry's containers", "field, name")
    TRAINER_ENV = ("`rules.scan`: each `spec.trainer.env` name", "field, name")
    RUNTIME_OVERSIZE = ("`rules.runtime_facts`: a runtime too large to check", "runtime")
    RUNTIME = ("`rules.runtime_facts`: the runtime and its target jobs", "runtime, targets")
    TRAINJOB_RUNTIME = ("`rules.trainjob_runtime_rules`: the TrainJob against its runtime", "spec, ref, facts, env")

    def __init__(self, where: str, gives: str) -> None:
        self.where, self.gives = where, gives


@dataclass(frozen=True, eq=False)
class Rule:
    """One rule (SPEC 5, 6.3), or one of the labels a reason carries that no rule of SPEC gives."""

    id: str
    section: str                    # where SPEC says it
    sentinel: Sentinel              # what it refuses with
    refuses: str                    # what it refuses, for people
    reads: tuple[str, ...]          # the fields and facts it reads
    hooks: Mapping[Point, Hook] = field(default_factory=dict)  # its checks in the walks
    checked_in: tuple[str, ...] = ()  # the functions making its reasons outside the walks' hooks
    also: tuple[Sentinel, ...] = ()   # another sentinel some of its reasons carry (R1: a missing name)
    verdict: str = "violation"        # the audit's verdict on a TrainJob it refuses (SPEC 8.2)
    switchable: bool = True           # False: the sweep's off-switch cannot remove it

    @property
    def where(self) -> str:
        """Where its checks are made: the walks' points it hooks, then the functions named."""
        return "; ".join([p.where for p in self.hooks] + [f"`{f}`" for f in self.checked_in])

    def refuse(self, field: str, text: str, *, sentinel: Sentinel | None = None, subject: str = "") -> Reason:
        """A reason of this rule: its id, and its sentinel (or one of `also`)."""
        if sentinel is None:
            sentinel = self.sentinel
        elif sentinel is not self.sentinel and sentinel not in self.also:
            raise ValueError(f"rule {self.id} does not refuse with {sentinel.label}")
        return Reason(sentinel, field, text, self.id, subject)


class Checks:
    """The rules in force for a walk, and their hooks by point: built once (`registry.in_force`) and passed
    to the walk, so a rule switched off (the sweep) is never asked, and no reason is filtered afterwards."""

    __slots__ = ("rules", "ids", "_at")

    def __init__(self, rules: Iterable[Rule]) -> None:
        self.rules: tuple[Rule, ...] = tuple(rules)
        self.ids: frozenset[str] = frozenset(r.id for r in self.rules)
        self._at: dict[Point, tuple[tuple[Rule, Hook], ...]] = {
            p: tuple((r, r.hooks[p]) for r in self.rules if p in r.hooks) for p in Point}

    def on(self, rule: Rule) -> bool:
        return rule.id in self.ids

    def at(self, point: Point) -> tuple[tuple[Rule, Hook], ...]:
        return self._at[point]

    def call(self, point: Point, reasons: Reasons, settings: Any, *args: Any) -> None:
        for rule, hook in self._at[point]:
            hook(rule, reasons, settings, *args)
