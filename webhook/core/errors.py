"""The error table (SPEC 4): every denial is built from it, in one place.

A denial names every reason at once. The HTTP code and status reason come from the first sentinel,
in table order, among the reasons; each cause keeps its own sentinel at the start of its message.
A denial is bounded (50 causes, a 16 KiB message), so a huge object cannot make a huge answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import Enum
from typing import Any, NamedTuple


class Sentinel(Enum):
    # value: (HTTP code, status reason, Kubernetes CauseType); declaration order is precedence order.
    ErrInvalid = (422, "Invalid", "FieldValueInvalid")
    ErrUnsupported = (403, "Forbidden", "FieldValueNotSupported")
    ErrNotFound = (404, "NotFound", "FieldValueNotFound")
    ErrUnavailable = (503, "ServiceUnavailable", "UnexpectedServerResponse")
    ErrInternal = (500, "InternalError", "InternalError")

    def __init__(self, code: int, reason: str, cause_type: str):
        # Plain attributes (not properties over .value): read on every denial.
        self.code, self.reason, self.cause_type = code, reason, cause_type
        self.label = self._name_


ErrInvalid = Sentinel.ErrInvalid
ErrUnsupported = Sentinel.ErrUnsupported
ErrNotFound = Sentinel.ErrNotFound
ErrUnavailable = Sentinel.ErrUnavailable
ErrInternal = Sentinel.ErrInternal

# When each sentinel is given, as the docs' error table says it (tests/unit/test_docs.py keeps the page equal).
WHEN = {
    ErrInvalid: "the object or the settings break a rule their author can fix: a mount under `/opt/dispatch`, a"
                " reserved volume or env name, a forged or edited publish entry, a tag-referenced image",
    ErrUnsupported: "well-formed, but the runtime cannot carry it: no `node` container, no init container (route 2),"
                    " `numProcPerNode` on a runtime that ignores it, a runtime that mounts under `/opt/dispatch` or"
                    " uses a reserved volume name, an unknown runtime kind or apiGroup, `runtimePatches` full",
    ErrNotFound: "the named runtime does not exist",
    ErrUnavailable: "the runtime cannot be read now (API unreachable, cache not synced); retry",
    ErrInternal: "a fault of the webhook itself (the request is refused, never admitted unchecked)",
}

_PRECEDENCE = {s: i for i, s in enumerate(Sentinel)}

# The `rule` of a reason that is no SPEC 5 rule (SPEC 8.1's metric label).
RULE_UPDATE = "update"
RULE_UNAVAILABLE = "unavailable"
RULE_INTERNAL = "internal"
RULE_SETTINGS = "settings"
RULE_MALFORMED = "malformed"  # an object the walks cannot read (registry.MALFORMED)

MAX_CAUSES = 50
MAX_MESSAGE = 16 * 1024


class Reason(NamedTuple):
    """One broken rule: which sentinel, which field, what is wrong, and which rule said so. `subject`, where
    given, is what the text starts with (a runtime, `Kind name: `), so a short form can put it last (SPEC 6.4)."""

    sentinel: Sentinel
    field: str
    text: str
    rule: str = ""
    subject: str = ""

    def __str__(self) -> str:
        return f"{self.field}: {self.text}"


def primary(reasons: Sequence[Reason]) -> Sentinel:
    if len(reasons) == 1:
        return reasons[0].sentinel
    return min((r.sentinel for r in reasons), key=_PRECEDENCE.__getitem__)


def _bounded(reasons: list[Reason]) -> tuple[list[Reason], int]:
    """At most MAX_CAUSES reasons to list, the last of them saying how many were left out."""
    if len(reasons) <= MAX_CAUSES:
        return reasons, 0
    kept = reasons[: MAX_CAUSES - 1]
    left = len(reasons) - len(kept)
    first = primary(reasons)
    return kept + [Reason(first, "(more)", f"{left} more reasons left out")], left


def message(reasons: list[Reason], first: Sentinel | None = None, shown: list[Reason] | None = None) -> str:
    """`SENTINEL: FIELD: TEXT; FIELD: TEXT`; a reason of another sentinel names its own. At most 16 KiB."""
    first = first or primary(reasons)
    shown = shown if shown is not None else _bounded(reasons)[0]
    parts = [f"{r.field}: {r.text}" if r.sentinel is first else f"{r.field}: {r.sentinel.label}: {r.text}"
             for r in shown]
    text = f"{first.label}: " + "; ".join(parts)
    if len(text.encode()) > MAX_MESSAGE:
        cut = text.encode()[: MAX_MESSAGE - 64].decode(errors="ignore")
        text = cut + f" ... ({len(text.encode()) - len(cut.encode())} more bytes left out)"
    return text


def status(reasons: list[Reason], name: str, group: str = "trainer.kubeflow.org", kind: str = "TrainJob") -> dict[str,
                                                                                                                  Any]:
    """A metav1.Status for a denial, with one cause per reason (bounded); the code comes from all reasons."""
    first = primary(reasons)
    shown, _ = _bounded(reasons)
    return {
        "metadata": {},
        "status": "Failure",
        "message": message(reasons, first, shown),
        "reason": first.reason,
        "code": first.code,
        "details": {
            "name": name,
            "group": group,
            "kind": kind,
            "causes": [
                {"reason": r.sentinel.cause_type, "message": f"{r.sentinel.label}: {r.text}"[:2048],
                 "field": r.field[:1024]}
                for r in shown
            ],
        },
    }


class Denied(Exception):
    """Raised where a whole operation is refused: settings, runtime files, a review that breaks rules."""

    def __init__(self, reasons: list[Reason]):
        assert reasons, "a denial needs at least one reason"
        self.reasons = list(reasons)
        super().__init__(message(self.reasons))

    @property
    def sentinel(self) -> Sentinel:
        return primary(self.reasons)


class Reasons(list[Reason]):
    """Collects every reason a check finds, so a denial names all of them, not only the first.

    Each reason is kept once: the same reason found twice (by two walks of one field) is not repeated.
    """

    _seen: set[tuple[Sentinel, str, str]] | None = None  # made on the first reason: most reviews find none

    def __init__(self, *args: Iterable[Reason]) -> None:
        super().__init__()
        for r in (args[0] if args else ()):
            self.append(r)

    def add(self, sentinel: Sentinel, field: str, text: str, rule: str = "") -> None:
        self.append(Reason(sentinel, field, text, rule))

    def append(self, reason: Reason) -> None:
        if self._seen is None:
            self._seen = set()
        key = (reason.sentinel, reason.field, reason.text)
        if key not in self._seen:
            self._seen.add(key)
            super().append(reason)

    def extend(self, reasons: Iterable[Reason]) -> None:
        for r in reasons:
            self.append(r)

    def raise_if_any(self) -> None:
        if self:
            raise Denied(list(self))
