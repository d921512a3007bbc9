"""A review under way (webhook.core.admission): its work is a generator that yields each read that would block
where its caller forbade blocking (a runtime the source answers `PENDING` for, the settings read again); a
`Reviewing` runs it until it is answered or waits for such a read, and `finish()`, called where blocking is
allowed, makes that read and goes on from where it waited. The guards turn a fault in one phase of the checks
into a reason beside those found before it (SPEC 4).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

from . import rules
from .decision import Outcome
from .errors import RULE_INTERNAL, ErrInternal, Reasons
from .review import AdmissionReview
from .rule import Checks

log = logging.getLogger("webhook.core.admission")
T = TypeVar("T")  # what a guarded check returns
Read = Callable[[], Any]  # a read a review waits for (it may block): its result is where the review goes on
Steps = Generator[Read, Any, T]  # a review's work, yielding each read that would block
Result = tuple[AdmissionReview, Outcome]


class Reviewing(Generic[T]):
    """One review under way: `result` once answered; else `read`, what it waits for. `finish()`, where blocking is
    allowed, makes each read it waits for and goes on from there to its answer."""

    __slots__ = ("_steps", "read", "result")

    def __init__(self, steps: Steps[T]):
        self._steps = steps
        self.read: Read | None = None
        self.result: T | None = None
        self._go(steps.send, None)

    @classmethod
    def answered(cls, result: T) -> Reviewing[T]:
        """A review answered without waiting for anything."""
        done: Reviewing[T] = cls.__new__(cls)
        done.read, done.result = None, result
        return done

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


def guarded(checks: Checks, reasons: Reasons, check: Callable[..., T], *args: Any) -> T | None:
    """Run one phase of the checks; a fault in it becomes a reason beside those found before it (SPEC 4)."""
    try:
        return check(*args)
    except RecursionError:
        rules.too_deep(reasons, checks)
    except Exception:
        internal(reasons)
    return None


def guarded_steps(checks: Checks, reasons: Reasons, check: Callable[..., Steps[T]], *args: Any) -> Steps[T | None]:
    """`guarded` for a phase that may wait for a read."""
    try:
        return (yield from check(*args))
    except RecursionError:
        rules.too_deep(reasons, checks)
    except Exception:
        internal(reasons)
    return None


def internal(reasons: Reasons) -> None:
    log.exception("internal error while checking")
    reasons.add(ErrInternal, "(webhook)", "internal error in dispatch-admission; see its log for this review",
                RULE_INTERNAL)
