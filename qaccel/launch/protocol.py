"""The launchers' protocol: what the facade asks of a way to run fn on the ranks (launchers.py picks one)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Protocol

from qaccel.comm.session import RankContext


class HandBack(NamedTuple):
    """How fn's result leaves its rank, given by the layer that prepared what it may hold (train.prepare): in place,
    prepared objects in the result become the user's own; pickled to another process, each object does."""

    in_place: Callable[[Any], Any]
    pickled: Callable[[Any], Any]


class Launcher(Protocol):
    """One way to run fn on the ranks, seen from the process that calls distribute()."""

    starts_ranks: bool
    """This process starts (or submits) the ranks: work meant for a rank (prepare()) must run inside fn."""

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, all_results: bool) -> Any:
        """``fn(*args, **kwargs)`` on every rank; rank 0's result, or every rank's by rank."""

    def planned(self) -> RankContext:
        """Where this process runs outside any session: its launcher's rank, or rank 0 of the world to start."""

    def join(self) -> RankContext | None:
        """Join the launcher's ranks for the rest of the process (code using the Accelerator outside distribute()
        under torchrun or srun, as Accelerate scripts do); None where there are none to join."""
