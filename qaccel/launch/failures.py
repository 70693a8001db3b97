"""What went wrong on a launched rank, and which of several failures is the cause to raise in the caller.

When one rank fails, the others usually fail too, only because it left: their errors are symptoms. The
launcher collects a ``RankFailure`` per failed rank and ``root_cause`` picks the one to report.
"""

from __future__ import annotations

import pickle
import signal
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field

import cloudpickle

from qaccel.errors import (
    Preempted,
    RankError,
    RankKilledError,
    RemoteTraceback,
    is_peer_loss,
    raised_note,
    type_name,
)


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


def cause_exception(failures: Sequence[RankFailure], world_size: int, launched: bool) -> tuple[BaseException, int]:
    """The exception to raise in the caller and its rank: the root cause's own, with its rank, its remote traceback
    and the ranks that failed after it attached."""
    cause = root_cause(failures)
    if cause.report is None:
        code = cause.exitcode
        if code is not None and code < 0:
            exc: BaseException = RankKilledError(cause.rank, signal.Signals(-code).name)
        else:
            exc = RankError(f"rank {cause.rank} exited with code {code} without returning or raising", cause.rank)
    else:
        exc = exception_from(cause.report)
        exc.add_note(raised_note(cause.rank, world_size, cause.report.type, cause.report.message, launched=launched))
    others = sorted((f for f in failures if f is not cause and f.report is not None), key=lambda f: f.rank)
    if others:
        exc.add_note("[qaccel] also failed after it: " + "; ".join(f"rank {f.rank}: {f.report.type}" for f in others))
    return exc, cause.rank


def exception_from(report: ErrorReport) -> BaseException:
    """The rank's own exception object when it survives pickling, else a RankError carrying its text."""
    try:
        exc = pickle.loads(report.exc) if report.exc is not None else None
    except Exception:
        exc = None
    if not isinstance(exc, BaseException):
        exc = RankError(f"rank {report.rank} raised {report.type}: {report.message}", report.rank, report.type,
                        report.traceback)
    exc.__cause__ = RemoteTraceback(f"Traceback from rank {report.rank}:\n{report.traceback}")
    return exc
