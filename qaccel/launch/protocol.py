"""The runners' protocol: what the facade asks of a way to run fn on the ranks (runners.py picks one), with what
every runner answers alike. (A launcher, in qaccel's words, is the program that started this process's ranks:
torchrun, srun, mpirun, ...; environment/ detects them.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from qaccel.comm import session
from qaccel.comm.session import RankContext
from qaccel.environment import Environment
from qaccel.options import Config


class HandBack(NamedTuple):
    """How fn's result leaves its rank, given by the layer that prepared what it may hold (train.prepare): in place,
    prepared objects in the result become the user's own; pickled to another process, each object does."""

    in_place: Callable[[Any], Any]
    pickled: Callable[[Any], Any]


class Runner:
    """One way to run fn on the ranks, seen from the process that calls distribute(); each runner gives ``run``.

    ``planned()`` is where this process runs outside any session (its launcher's rank, or rank 0 of the world to
    start); ``join()`` joins the launcher's ranks for the rest of the process, where there are such ranks (code
    using the Accelerator outside distribute() under torchrun or srun, as Accelerate scripts do).
    """

    starts_ranks = True
    """This process starts (or submits) the ranks: work meant for a rank (prepare()) must run inside fn."""

    def __init__(self, config: Config, env: Environment, hand_back: HandBack) -> None:
        self.config, self.env, self.hand_back = config, env, hand_back

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], all_results: bool) -> Any:
        """``fn(*args, **kwargs)`` on every rank; rank 0's result, or every rank's by rank."""
        raise NotImplementedError

    def planned(self) -> RankContext:
        return session.plan(self.env, self.config.nprocs, self.config.device_type, self.config.backend)

    def join(self) -> RankContext | None:
        return None
