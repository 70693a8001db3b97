"""What went wrong on a launched rank, and which of several failures is the cause to raise in the caller.

When one rank fails, the others usually fail too, only because it left: their errors are symptoms. The
launcher collects a ``RankFailure`` per failed rank and ``root_cause`` picks the one to report.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field

import cloudpickle

from qaccel.errors import Preempted, is_peer_loss, type_name


@dataclass(frozen=True)
class ErrorReport:
    """What a failing rank writes for the caller: its exception, pickled if it can be, and its text."""

    rank: int
    type: str
    message: str
    traceback: str
    exc: bytes | None = None  # the exception object itself, when cloudpickle can carry it
    preempted: bool = False  # a Preempted: the rank saved and stopped after a signal
    time: float = field(default_factory=time.time)

    @classmethod
    def of(cls, rank: int, exc: BaseException) -> ErrorReport:
        try:
            exc_bytes: bytes | None = cloudpickle.dumps(exc)
        except Exception:
            exc_bytes = None
        return cls(rank, type_name(exc), str(exc), _text(exc, notes=exc_bytes is None), exc_bytes,
                   isinstance(exc, Preempted))

    @property
    def is_peer_loss(self) -> bool:
        """True when the error only says another rank went away: a symptom, its cause is elsewhere."""
        return is_peer_loss(self.type, self.message)


def _text(exc: BaseException, notes: bool) -> str:
    """The formatted traceback; without the notes when the exception travels whole (the caller shows them once)."""
    saved = None if notes else exc.__dict__.pop("__notes__", None)
    try:
        return "".join(traceback.format_exception(exc))
    finally:
        if saved is not None:
            exc.__notes__ = saved


@dataclass(frozen=True)
class RankFailure:
    """One failed rank: the error it reported, or, when it reported none, the exit code it died with."""

    rank: int
    report: ErrorReport | None = None
    exitcode: int | None = None  # None: not exited when seen (it reported and was still tearing down)

    @property
    def is_silent(self) -> bool:
        """Died without reporting (a signal, os._exit): a cause, since a raise elsewhere cannot kill a rank."""
        return self.report is None

    @property
    def is_symptom(self) -> bool:
        """Reported only that a peer went away."""
        return self.report is not None and self.report.is_peer_loss

    @property
    def is_stop(self) -> bool:
        """Saved and raised Preempted after a signal: its peers are doing the same, so let them finish."""
        return self.report is not None and self.report.preempted


def root_cause(failures: Sequence[RankFailure]) -> RankFailure:
    """The failure to raise: the first rank seen dying silently, else the earliest report that is not a
    symptom, else the earliest report."""
    if not failures:
        raise ValueError("root_cause() needs at least one failure")
    silent = [f for f in failures if f.is_silent]
    if silent:
        return silent[0]
    return min(failures, key=lambda f: (f.is_symptom, f.report.time))
