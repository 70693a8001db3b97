"""A failure met on some ranks, raised on every rank.

The ranks tell each other whether they failed in a collective they make anyway (a gather of what each rank sends, or
rank 0's broadcast of its result), and each raises the exception of the lowest rank that failed: the same type,
words and notes everywhere (its own object on that rank, a copy on the others, with that rank's traceback as the
cause; a RankError with its text where the exception cannot travel). So no rank is left waiting in a collective
the failing one never joins, and code that catches the error on every rank goes on training in step.
"""

from __future__ import annotations

from collections.abc import Sequence

from qaccel.errors import ErrorReport, exception_from


def told(exc: BaseException | None, rank: int) -> ErrorReport | None:
    """What this rank sends its peers: its failure, or None."""
    return None if exc is None else ErrorReport.of(rank, exc)


def raise_first(reports: Sequence[ErrorReport | None], own: BaseException | None, rank: int, note: str) -> None:
    """Raise the failure of the lowest rank in ``reports`` (what each rank told, by rank) with ``note`` added, its
    ``{rank}`` filled; return when no rank failed. ``own``: this rank's failure (raised as itself when it is the
    first), ``rank``: this rank."""
    first = next((report for report in reports if report is not None), None)
    if first is None:
        return
    if first.rank == rank and own is not None:
        exc = own
    else:
        exc = exception_from(first)
        if own is not None:
            exc.add_note(f"[qaccel] rank {rank} failed too: {type(own).__name__}: {own}")
    exc.add_note(note.format(rank=first.rank))
    raise exc
