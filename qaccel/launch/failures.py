"""What went wrong on a launched rank, and which of several failures is the cause to raise in the caller.

When one rank fails, the others usually fail too, only because it left: their errors are symptoms. The
launcher collects a ``RankFailure`` per failed rank and ``root_cause`` picks the one to report.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from qaccel.errors import (
    ErrorReport,
    RankError,
    RankKilledError,
    exception_from,
    raised_note,
)


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
    # none is silent: each has a report
    return min(failures, key=lambda f: (f.is_symptom, cast(ErrorReport, f.report).time))


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
        kinds = (f"rank {f.rank}: {cast(ErrorReport, f.report).type}" for f in others)  # others have a report
        exc.add_note("[qaccel] also failed after it: " + "; ".join(kinds))
    return exc, cause.rank
