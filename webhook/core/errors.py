"""The error table (SPEC 4): every denial is built from it, in one place.

A denial names every reason at once. The HTTP code and status reason come from the first sentinel,
in table order, among the reasons; each cause keeps its own sentinel at the start of its message.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Sentinel(Enum):
    # value: (HTTP code, status reason, cause type); declaration order is precedence order.
    ErrInvalid = (422, "Invalid", "FieldValueInvalid")
    ErrUnsupported = (403, "Forbidden", "FieldValueNotSupported")
    ErrNotFound = (404, "NotFound", "FieldValueNotFound")
    ErrUnavailable = (503, "ServiceUnavailable", "ServiceUnavailable")
    ErrInternal = (500, "InternalError", "InternalError")

    @property
    def code(self) -> int:
        return self.value[0]

    @property
    def reason(self) -> str:
        return self.value[1]

    @property
    def cause_type(self) -> str:
        return self.value[2]


ErrInvalid = Sentinel.ErrInvalid
ErrUnsupported = Sentinel.ErrUnsupported
ErrNotFound = Sentinel.ErrNotFound
ErrUnavailable = Sentinel.ErrUnavailable
ErrInternal = Sentinel.ErrInternal

_PRECEDENCE = {s: i for i, s in enumerate(Sentinel)}


@dataclass(frozen=True)
class Reason:
    """One broken rule: which sentinel, which field, what is wrong."""

    sentinel: Sentinel
    field: str
    text: str

    def __str__(self) -> str:
        return f"{self.field}: {self.text}"


def primary(reasons: list[Reason]) -> Sentinel:
    return min((r.sentinel for r in reasons), key=_PRECEDENCE.__getitem__)


def message(reasons: list[Reason]) -> str:
    """`SENTINEL: FIELD: TEXT; FIELD: TEXT`; a reason of another sentinel names its own."""
    first = primary(reasons)
    parts = [str(r) if r.sentinel is first else f"{r.field}: {r.sentinel.name}: {r.text}" for r in reasons]
    return f"{first.name}: " + "; ".join(parts)


def status(reasons: list[Reason], name: str, group: str = "trainer.kubeflow.org", kind: str = "TrainJob") -> dict:
    """A metav1.Status for a denial, with one cause per reason."""
    first = primary(reasons)
    return {
        "metadata": {},
        "status": "Failure",
        "message": message(reasons),
        "reason": first.reason,
        "code": first.code,
        "details": {
            "name": name,
            "group": group,
            "kind": kind,
            "causes": [
                {"reason": r.sentinel.cause_type, "message": f"{r.sentinel.name}: {r.text}", "field": r.field}
                for r in reasons
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


class Reasons(list):
    """Collects every reason a check finds, so a denial names all of them, not only the first."""

    def add(self, sentinel: Sentinel, field: str, text: str) -> None:
        self.append(Reason(sentinel, field, text))

    def raise_if_any(self) -> None:
        if self:
            raise Denied(list(self))
