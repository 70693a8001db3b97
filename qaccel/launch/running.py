"""Running fn as one rank of a session, the same way for ranks qaccel started and ranks run in place: the session
set up and torn down around it, and a failure handed to the launcher's side exactly once."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol, TypeVar

import torch.distributed as dist

from qaccel.comm import session
from qaccel.comm.session import RankContext
from qaccel.options import Config

R = TypeVar("R")


class FailureReport(Protocol):
    """Where a rank's failure goes: a file and a message for the caller of a plain launch, torchrun's error file."""

    def early(self, exc: BaseException) -> None:
        """fn raised: report it now, before the session is torn down and a peer can see the broken connection and
        report its own error first."""

    def late(self, exc: BaseException, reported_early: bool) -> None:
        """The session has ended with ``exc``: fn's error (``reported_early``), or the session's own (its set-up,
        the closing barrier, a peer's loss seen there)."""


def rank_session(
    ctx: RankContext,
    config: Config,
    store: Callable[[int], dist.Store | None],
    key: bytes | None = None,
    **options: bool,
) -> contextlib.AbstractContextManager[RankContext]:
    """The session of rank ``ctx`` as ``config`` sets it up (FSDP's group of one, debug); ``key``: what seals qaccel's
    keys in the store (None: rank 0's); ``options``: more of ``session.session``'s switches."""
    return session.session(
        ctx,
        config.timeout,
        store=store,
        group_of_one=config.strategy.needs_a_group_alone,
        debug=config.debug,
        key=key,
        **options,
    )


def run_as_rank(
    ctx: RankContext,
    config: Config,
    body: Callable[[], R],
    report: FailureReport,
    store: Callable[[int], dist.Store | None],
    key: bytes | None = None,
    **options: bool,
) -> R:
    """``body()`` in a session of rank ``ctx``; ``store(session_number)`` opens the rendezvous store (inside, so that
    its failure is reported too); ``key`` and ``options``: see rank_session."""
    early = 0  # id() of the exception reported early: not the exception, whose traceback holds this frame
    try:
        with rank_session(ctx, config, store, key, **options):
            try:
                return body()
            except BaseException as exc:
                session.explain_timeout(exc)
                report.early(exc)
                early = id(exc)
                raise
    except BaseException as exc:
        report.late(exc, reported_early=id(exc) == early)
        raise
