"""Run fn as this process's rank when the ranks already exist: under torchrun, in an srun step, inside a group
the user made, inside a rank qaccel started (a nested distribute), or alone (nprocs=1).

The plain launch's counterpart: here no process is started, only the process group is made (and torn down).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from qaccel.comm import collectives, rendezvous, session
from qaccel.comm.session import RankContext
from qaccel.environment import Environment, Kind, detect, rank_variables
from qaccel.errors import raised_note, type_name
from qaccel.launch import launcher_report, output
from qaccel.launch.protocol import HandBack, Runner
from qaccel.launch.running import rank_session, run_as_rank
from qaccel.options import Config


class InPlace(Runner):
    """fn runs here, as this process's rank: the runner of every process that starts no ranks."""

    starts_ranks = False

    def __init__(self, config: Config, env: Environment, hand_back: HandBack) -> None:
        global _latest
        super().__init__(config, env, hand_back)
        if env.world_size > 1 and not env.kind.creates_processes:  # a launcher's ranks, which join() may join
            _latest = weakref.ref(self)

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], all_results: bool) -> Any:
        return run(fn, args, kwargs, self.config, _now(self.env), all_results, self.hand_back.in_place)

    @property
    def launched(self) -> bool:
        """Whether this process is one of a launcher's ranks whose group qaccel makes, which join() joins."""
        return _joins(_now(self.env))

    def join(self) -> RankContext | None:
        env = _now(self.env)
        return ambient(self.config, env) if _joins(env) else None


def _joins(env: Environment) -> bool:
    return env.kind.started_by_launcher and env.world_size > 1


def _now(env: Environment) -> Environment:
    """``env``, or the launcher's where the group the Accelerator was made in is gone: code run before (an
    Accelerate loop's ``end_training()``) destroyed it. The next session, in distribute() or joined by code outside
    it, then makes its group as the launcher says, under a store prefix of its own; torch's env:// defaults would
    read the destroyed group's stale addresses, and without a group the Accelerator's collectives would act for
    this rank alone."""
    if env.kind is Kind.INITIALIZED and not dist.is_initialized():
        found = detect()
        if found.kind.started_by_launcher and found.world_size == env.world_size:
            return found
    return env


_latest: weakref.ref[InPlace] | None = None  # the runner of this process's latest Accelerator on a launcher's ranks


def join_latest() -> RankContext | None:
    """The running session's rank; or, under torchrun or srun, the ranks of this process's latest Accelerator,
    joined now if they were not yet (for what acts on the ranks without an Accelerator: qaccel.utils); None when
    there are none."""
    current = session.current()
    if current is not None:
        return current
    runner = _latest() if _latest is not None else None
    return runner.join() if runner is not None else None


def run(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    config: Config,
    env: Environment,
    all_results: bool,
    plain: Callable[[Any], Any],
) -> Any:
    """``fn(*args, **kwargs)`` here, as this process's rank; its result (or every rank's, by rank), made ``plain``
    (protocol.HandBack) before the session's end frees what it prepared."""
    running = session.current_run()
    if running is not None:  # a distribute() inside a distributed fn: already a rank of a live group
        with running.call():
            result = fn(*args, **kwargs)
        return collectives.gather_object(result, running.ctx) if all_results else result
    ctx, store = _this_rank(config, env)

    def body() -> Any:
        result = plain(fn(*args, **kwargs))
        return collectives.gather_object(result, ctx) if all_results else result

    return run_as_rank(ctx, config, body, _LauncherReport(ctx), store, where_to_log=env.kind.started_by_launcher)


def _this_rank(config: Config, env: Environment) -> tuple[RankContext, Callable[[int], dist.Store | None]]:
    """This process's rank, its launcher's variables exported, and how its sessions open their rendezvous store
    (the launcher's, numbered by session; none in a single process, whose group finds its own)."""
    ctx = session.plan(env, config.nprocs, config.device_type, config.backend)
    if env.kind.exports_rank_variables:
        _export_rank_variables(env)
    if env.kind.started_by_launcher:  # its ranks share the launcher's stdout and stderr, as ours share the caller's
        output.whole_lines()
    needs_store = env.kind.started_by_launcher and ctx.world_size > 1

    def store(session_number: int) -> dist.Store | None:
        if not needs_store:
            return None
        hosts_store = ctx.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        rendezvous.check(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            env.address_from,
            ctx.rank,
            hosts_store,
            config.timeout,
        )
        return session.env_store(ctx, config.timeout, session_number)

    return ctx, store


def ambient(config: Config, env: Environment) -> RankContext:
    """Join the ranks for the rest of the process, outside any distribute(): under torchrun or srun, a script
    written for Accelerate uses the Accelerator at its top level. The session lasts until the process exits (or
    end_training()); after an uncaught exception it ends without waiting for the other ranks, which their launcher
    then stops."""
    global _ambient
    ctx, store = _this_rank(config, env)
    stack = contextlib.ExitStack()
    stack.enter_context(rank_session(ctx, config, store, where_to_log=True))
    if _ambient is None:
        atexit.register(end_ambient)
    _ambient = stack
    return ctx


def end_ambient() -> None:
    """End the session ambient() opened, if any: after the other ranks finish it, or at once after an uncaught
    exception."""
    global _ambient
    stack, _ambient = _ambient, None
    if stack is None:
        return
    failed = getattr(sys, "last_value", None)  # set by the interpreter when an exception went uncaught
    if failed is None:
        stack.close()
    else:
        stack.__exit__(type(failed), failed, failed.__traceback__)


_ambient: contextlib.ExitStack | None = None


class _LauncherReport:
    """An exception leaving a rank run in place gets a note naming the rank; a cause goes to torchrun's error file
    at once, a symptom holds the rank a moment so that the rank that raised leaves first (launcher_report.py)."""

    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx
        self.recorded = False

    def early(self, exc: BaseException) -> None:
        raised_at = time.time()
        self._note(exc)
        self.recorded = launcher_report.record_cause(exc, raised_at)

    def late(self, exc: BaseException, reported_early: bool) -> None:
        if not reported_early:
            self._note(exc)
        if not self.recorded and not launcher_report.hold_symptom(exc, self.ctx.rank, self.ctx.world_size):
            launcher_report.record_cause(exc)

    def _note(self, exc: BaseException) -> None:
        if self.ctx.world_size > 1:
            exc.add_note(raised_note(self.ctx.rank, self.ctx.world_size, type_name(exc), str(exc), launched=False))


def _export_rank_variables(env: Environment) -> None:
    """Give a launcher's rank (an srun task, an mpirun process, ...) the variables torch's env:// rendezvous and user
    code expect (user-set MASTER_* win: detect() read them)."""
    if env.master_addr is None or env.master_port is None:
        raise RuntimeError(
            f"{env.kind} rank detected but no node list / job id to derive MASTER_ADDR/MASTER_PORT from: set both"
        )
    os.environ.update(rank_variables(env))
