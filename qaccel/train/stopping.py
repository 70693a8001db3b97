"""Stopping cleanly on a signal: after SIGTERM, Ctrl-C's SIGINT (a second one stops at once) or the warning signal a
cluster sends before a time limit or a preemption, every rank finishes its step, saves state, and leaves; after
the warning signal, under SLURM, the job is also requeued.

Ranks receive a signal at slightly different moments, possibly in different steps, so none may act on its own.
Each prepared training loop asks at its step boundaries (train/data.py); the ranks combine what they received
with one small asynchronous all-reduce (MAX of the signal number), started at one boundary and read at a later
one. All ranks read the same value at the same boundary, so all stop after the same step. An all-reduce per step
would cost up to 20 % of a small CPU step (measured: benchmarks/step_overhead.py --only resume), so the ranks
agree every CHECK_EVERY_S seconds instead: the same all-reduce carries each rank's time per step, and from its
result every rank computes the same number of steps to the next check.

The handler only notes the signal. Launchers signal a worker's whole process group (torchrun's agent) or every
process of a step (SLURM), so a rank's children get the signal too, and a DataLoader worker dying of it would make
its rank's loader raise before the step ends: DataLoader workers of an armed rank ignore the armed signals (they
still exit with their rank). Other forked children (pool workers) get back SIGTERM's and SIGINT's previous handlers,
as a Python-level handler would keep them from dying of the SIGTERM their pool sends, and ignore the requeue
signal.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from qaccel.comm.session import RankContext
from qaccel.environment import slurm_job_state
from qaccel.errors import Preempted
from qaccel.options import Backend

CHECK_EVERY_S = 0.5  # how often the ranks agree whether to stop: a stop comes within about twice this
MAX_CHECK_STEPS = 10_000



def as_signal(value: int | str | signal.Signals, name: str) -> signal.Signals:
    """``value`` as a signal ("SIGUSR1", "USR1", 10 or signal.SIGUSR1); ValueError naming ``name`` otherwise."""
    try:
        if isinstance(value, str):
            return signal.Signals[value if value.startswith("SIG") else "SIG" + value]
        if isinstance(value, int) and not isinstance(value, bool):
            return signal.Signals(value)
    except (KeyError, ValueError):
        pass
    raise ValueError(f"{name} must be a signal name such as 'SIGUSR1' or a signal number; got {value!r}")


class Armed:
    """The signals this process notes instead of dying of them, and the first one received.

    Signal handlers belong to the process, so one Armed is installed at a time (by the session's resume());
    the at-fork hooks below read it to keep forked children out of it.
    """

    def __init__(self, signals: set[signal.Signals]) -> None:
        self.owner_pid = os.getpid()
        self.received = 0  # the first armed signal received; 0: none
        self.previous: dict[int, Any] = {}  # armed signal -> the handler it had before
        self.mask_before_fork: set[int] | None = None
        self.add(signals)

    def add(self, signals: set[signal.Signals]) -> None:
        for sig in signals:
            if sig not in self.previous:
                self.previous[sig] = signal.signal(sig, self._note)

    def _note(self, signum: int, frame: Any) -> None:
        if os.getpid() != self.owner_pid:  # a forked child, signalled before its at-fork reset ran: die as it should
            signal.signal(signum, self.previous.get(signum, signal.SIG_DFL))
            os.kill(os.getpid(), signum)
            return
        if signum == signal.SIGINT and self.received:  # a second Ctrl-C, or one after another stop: stop now
            raise KeyboardInterrupt
        if not self.received:
            self.received = signum

    def restore(self) -> None:
        """Give the armed signals back their previous handlers."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()


_armed: Armed | None = None  # the process's armed signals, if any


def arm(signals: set[signal.Signals]) -> Armed:
    """Note ``signals`` instead of dying of them, from now until disarm()."""
    global _armed
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("resume() installs signal handlers, which Python allows only in the main thread")
    if _armed is None:
        _armed = Armed(signals)
    else:
        _armed.add(signals)
    return _armed


def disarm() -> None:
    """Give the armed signals back their previous handlers and forget any signal received."""
    global _armed
    if _armed is not None:
        _armed.restore()
        _armed = None


def _armed_signals() -> set[int]:
    return set(_armed.previous) if _armed is not None else set()


def _block_before_fork() -> None:
    """Hold the armed signals back across a fork: one reaching the child before its reset would be lost."""
    if _armed is not None and _armed.previous:
        _armed.mask_before_fork = signal.pthread_sigmask(signal.SIG_BLOCK, set(_armed.previous))


def _unblock() -> None:
    if _armed is not None and _armed.mask_before_fork is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, _armed.mask_before_fork)
        _armed.mask_before_fork = None


def _child_defaults() -> None:
    """In a forked child: SIGTERM's and SIGINT's handlers from before arming; the requeue signal ignored.

    A signal that came between the fork and this reset was held back (blocked) and is delivered now, to the reset
    handler; noted by Armed._note instead, Python would drop it when the handler became SIG_DFL, and a pool worker
    terminated that early lived on, hanging Pool.terminate (seen 1 run in ~20 under load).
    """
    global _armed
    if _armed is None:
        return
    armed, _armed = _armed, None  # the child's own: the parent's Armed no longer applies
    try:
        for sig, handler in armed.previous.items():
            signal.signal(sig, handler if sig in (signal.SIGTERM, signal.SIGINT) else signal.SIG_IGN)
    except ValueError:  # forked from a thread other than the main one: Armed._note's pid check covers it
        pass
    finally:
        if armed.mask_before_fork is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, armed.mask_before_fork)


def shield_workers(loader: Any) -> None:
    """Make the DataLoader workers ``loader`` starts from now on ignore the armed signals (see the module's doc)."""
    init = loader.worker_init_fn
    if not (isinstance(init, functools.partial) and init.func is _ignoring):
        loader.worker_init_fn = functools.partial(_ignoring, tuple(_armed_signals()), init)


def unshield_workers(loader: Any) -> None:
    """Undo shield_workers: the workers ``loader`` starts from now on get its own ``worker_init_fn`` only."""
    init = loader.worker_init_fn
    if isinstance(init, functools.partial) and init.func is _ignoring:
        loader.worker_init_fn = init.args[1]


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Hold the armed signals back in this thread while a DataLoader forks its workers.

    Each worker inherits them blocked and unblocks them only in _ignoring, once it ignores them: a SIGTERM sent to
    the job as an epoch's workers start (torchrun signals the rank's process group) would otherwise kill a worker
    before its init ran, and its rank would fail instead of saving (seen in CI). The rank gets its own copy when
    the block ends. Nothing is held while no signal is armed.
    """
    armed = _armed_signals()
    if not armed:
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, armed)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _ignoring(signals: tuple[int, ...], init: Callable[[int], Any] | None, worker_id: int) -> None:
    """A DataLoader worker's init: ignore ``signals`` (dropping any held back since its fork), then run the user's
    ``worker_init_fn``."""
    for sig in signals:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
    if init is not None:
        init(worker_id)


os.register_at_fork(before=_block_before_fork, after_in_parent=_unblock, after_in_child=_child_defaults)


class Stopper:
    """One session's agreement on when to stop, and the stop itself: save, requeue (SLURM), raise Preempted."""

    def __init__(self, ctx: RankContext, save: Callable[[], str], requeue_signal: signal.Signals | None) -> None:
        self.armed = arm({signal.SIGTERM, signal.SIGINT} | ({requeue_signal} if requeue_signal is not None else set()))
        self.ctx = ctx
        self.save = save
        self.requeue_signal = requeue_signal
        self.flag = torch.zeros(2, dtype=torch.float64)  # [signal received, seconds per step]: MAX over ranks
        self.pending: Any = None
        self.interval = 1  # steps between checks: the same on every rank, as it comes from reduced values
        self.countdown = 1
        self.window = 0  # steps the all-reduce in flight measured (0: none yet)
        self.launched = 0.0  # when this rank started it
        # The flag lives on the CPU; NCCL reduces only GPU tensors, so NCCL worlds use a gloo group for it.
        self.group = dist.new_group(backend="gloo") if ctx.world_size > 1 and ctx.backend is not Backend.GLOO else None

    def boundary(self) -> None:
        """Called by every rank after the same optimizer steps: stop here if the ranks agreed a signal came."""
        if self.ctx.world_size == 1:
            if self.armed.received:
                self._stop(signal.Signals(self.armed.received))
            return
        self.countdown -= 1
        if self.countdown > 0:
            return
        now = time.perf_counter()
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
            signum, per_step = int(self.flag[0]), float(self.flag[1])
            if signum:
                self._stop(signal.Signals(signum))
            if per_step > 0:
                self.interval = max(1, min(MAX_CHECK_STEPS, int(CHECK_EVERY_S / per_step)))
        self.flag[0] = self.armed.received
        self.flag[1] = (now - self.launched) / self.window if self.window else 0.0
        self.window = self.countdown = self.interval if self.launched else 1
        self.launched = now
        self.pending = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def close(self, finished: bool) -> None:
        """End of the session: let an agreement in flight complete (unless the session failed) and disarm."""
        try:
            if finished and self.pending is not None:
                self.pending.wait()
        finally:
            self.pending = None
            disarm()

    def _stop(self, sig: signal.Signals) -> None:
        path = self.save()
        requeued = sig == self.requeue_signal and "SLURM_JOB_ID" in os.environ
        if requeued and self.ctx.rank == 0:
            requeued = _requeue(os.environ["SLURM_JOB_ID"])
        if self.ctx.rank == 0:
            _say(f"qaccel: {Preempted(sig.name, path, requeued)}")
        raise Preempted(sig.name, path, requeued)


def _requeue(job_id: str) -> bool:
    """``scontrol requeue`` this SLURM job (once: rank 0 only); False, with the reason printed, if SLURM refused."""
    try:
        done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        _say(f"qaccel: could not requeue SLURM job {job_id}: {exc}")
        return False
    if done.returncode == 0:
        return True
    # A requeue stops the job's processes at once, scontrol among them, sometimes before it exits 0: the count of
    # restarts says whether it took.
    if slurm_job_state(job_id)[1] > int(os.environ.get("SLURM_RESTART_COUNT", "0")):
        return True
    _say(f"qaccel: scontrol requeue {job_id} failed (returncode {done.returncode}): {done.stderr.strip()}")
    return False


def _say(line: str) -> None:
    """``line`` on stderr in one write: under srun the job's output file is shared with SLURM's own messages, and
    print writes the newline apart when stderr is unbuffered (PYTHONUNBUFFERED)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
