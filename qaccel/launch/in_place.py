"""Run fn as this process's rank when the ranks already exist: under torchrun, in an srun step, inside a group
the user made, inside a rank qaccel started (a nested distribute), or alone (nprocs=1).

The launcher's counterpart: here no process is started, only the process group is made (and torn down).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from qaccel.comm import collectives, session
from qaccel.environment import Environment, rank_variables
from qaccel.errors import raised_note, type_name
from qaccel.launch import launcher_report
from qaccel.options import Config
from qaccel.train import prepare

_NOTE_PREFIX = "[qaccel] raised on rank "


def run(fn: Callable[..., Any], args: tuple, kwargs: dict, config: Config, env: Environment, all_results: bool) -> Any:
    """``fn(*args, **kwargs)`` here, as this process's rank; its result (or every rank's, by rank)."""
    running = session.current()
    if running is not None:  # a distribute() inside a distributed fn: already a rank of a live group
        result = fn(*args, **kwargs)
        return collectives.gather_object(result, running) if all_results else result
    ctx = session.plan(config, env)
    if env.kind.exports_rank_variables:
        _export_rank_variables(env)
    needs_store = env.kind.started_by_launcher and ctx.world_size > 1
    recorded = 0  # id() of the exception written to torchrun's error file, if any
    try:
        store = session.env_store(ctx, config.timeout) if needs_store else None
        with session.session(ctx, config.timeout, store=store, group_of_one=config.strategy == "fsdp",
                           debug=config.debug, where_to_log=env.kind.started_by_launcher):
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                raised_at = time.time()
                session.explain_timeout(exc)
                if ctx.world_size > 1:
                    exc.add_note(raised_note(ctx.rank, ctx.world_size, type_name(exc), str(exc), launched=False))
                # now, before the group is torn down and a peer can see the broken connection and fail first
                if launcher_report.record_cause(exc, raised_at):
                    recorded = id(exc)  # not the exception: its traceback holds this frame, a cycle
                raise
            result = prepare.plain_result(result)  # before the session's end frees what it prepared
            return collectives.gather_object(result, ctx) if all_results else result
    except BaseException as exc:
        # errors of the session itself too: a peer's loss seen in gather_object or in the closing barrier
        if ctx.world_size > 1 and not any(str(n).startswith(_NOTE_PREFIX) for n in getattr(exc, "__notes__", ())):
            exc.add_note(raised_note(ctx.rank, ctx.world_size, type_name(exc), str(exc), launched=False))
        if id(exc) != recorded and not launcher_report.hold_symptom(exc, ctx.rank, ctx.world_size):
            launcher_report.record_cause(exc)
        raise


def _export_rank_variables(env: Environment) -> None:
    """Give an srun task the variables torch's env:// rendezvous and user code expect (user-set MASTER_* win:
    detect() read them)."""
    if env.master_addr is None or env.master_port is None:
        raise RuntimeError("SLURM step detected but no node list / job id to derive MASTER_ADDR/MASTER_PORT from")
    os.environ.update(rank_variables(env))
