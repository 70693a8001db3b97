"""Stopping cleanly on a signal: after SIGTERM, Ctrl-C's SIGINT (a second one stops at once) or the warning signal a
cluster sends before a time limit or a preemption, every rank finishes the work it is doing, saves state, and
leaves; after the warning signal, under SLURM, the job is also requeued.

Ranks receive a signal at slightly different moments, possibly in different steps, so none may act on its own:
Stopper agrees on the check point where all stop, within about CHECK_EVERY_S of the signal reaching any rank, however
the time between steps is spent (see Stopper). Nothing of it runs in a step but a counter and a comparison.

The handler only notes the signal (and wakes the thread that announces it). Launchers signal a worker's whole
process group (torchrun's agent) or every process of a step (SLURM), so a rank's children get the signal too, and a
DataLoader worker dying of it would make its rank's loader raise before the step ends: DataLoader workers of an
armed rank ignore the armed signals (they still exit with their rank). Other forked children (pool workers) get
back SIGTERM's and SIGINT's previous handlers, as a Python-level handler would keep them from dying of the SIGTERM
their pool sends, and ignore the requeue signal.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from qaccel.comm import collectives
from qaccel.comm.sealed import Sealed
from qaccel.comm.session import RankContext, current_run
from qaccel.environment import slurm_job_state
from qaccel.errors import Preempted

CHECK_EVERY_S = 0.5  # how often each rank looks whether another announced a stop: a stop is agreed within about this
STORE_TIMEOUT = datetime.timedelta(seconds=60)  # one operation of the stop's store connection (they take µs)
CLOSE_WAIT_S = 5.0  # for the watching thread to return at the session's end
NEVER = 1 << 62  # Stopper.stop_at with no stop agreed: no check point count reaches it
_CPU = torch.device("cpu")


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

    Signal handlers belong to the process, so one Armed is installed at a time, shared by the stops armed
    (resume() in a distribute() call inside fn arms one more); the at-fork hooks below read it to keep forked
    children out of it.
    """

    def __init__(self, signals: set[signal.Signals]) -> None:
        self.owner_pid = os.getpid()
        self.received = 0  # the first armed signal received; 0: none
        # called with the first signal, from the handler: they may not take locks (the main thread may hold them)
        self.listeners: list[Callable[[int], None]] = []
        self.previous: dict[int, Any] = {}  # armed signal -> the handler it had before
        self.mask_before_fork: set[int] | None = None
        self.users = 0  # the stops armed with it: the last to disarm gives the handlers back
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
            for listener in list(self.listeners):
                listener(signum)

    def restore(self) -> None:
        """Give the armed signals back their previous handlers."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()


_armed: Armed | None = None  # the process's armed signals, if any


def arm(signals: set[signal.Signals], listener: Callable[[int], None] | None = None) -> Armed:
    """Note ``signals`` instead of dying of them, and call ``listener`` with the first, until disarm()."""
    global _armed
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("resume() installs signal handlers, which Python allows only in the main thread")
    _fork_hooks()
    if _armed is None:
        _armed = Armed(signals)
    else:
        _armed.add(signals)
    _armed.users += 1
    if listener is not None:
        _armed.listeners.append(listener)
    return _armed


def disarm(listener: Callable[[int], None] | None = None) -> int:
    """Undo one arm(). The last one gives the armed signals back their previous handlers and returns the signal
    received, if any (0 otherwise, and while another stop keeps them armed: it acts on the signal)."""
    global _armed
    if _armed is None:
        return 0
    if listener is not None and listener in _armed.listeners:
        _armed.listeners.remove(listener)
    _armed.users -= 1
    if _armed.users > 0:
        return 0
    received = _armed.received
    _armed.restore()
    _armed = None
    return received


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


@functools.cache
def _fork_hooks() -> None:
    """Registered once, when signals are first armed: importing qaccel registers nothing."""
    os.register_at_fork(before=_block_before_fork, after_in_parent=_unblock, after_in_child=_child_defaults)


class Stopper:
    """One session's stop on a signal: where every rank stops (the same check point), and the stop itself: save,
    requeue (SLURM), raise Preempted.

    Check points are the training loops' step boundaries and epoch starts (data.py); every rank passes the same ones
    in the same order, and ``count`` numbers them. Alone, a rank stops at the first one after its signal. In a world,
    a thread of each rank watches the session's store (``_Board``): a rank that got a signal announces it there, and
    every rank sees the announcement within CHECK_EVERY_S. Then each says where its next check point is (its count
    + 1) and all stop at the furthest of these: no rank has passed it, and none needs more than the work it is doing
    now (a step, an evaluation, a callback, a checkpoint) to reach it. A rank that reaches a check point while that
    is being agreed waits for it there. When fn returns, the ranks agree (one all-reduce) whether any got a signal:
    if one did, the session ends as a stop too, wherever it came.
    """

    def __init__(
        self, ctx: RankContext, save: Callable[[], str], requeue_signal: signal.Signals | None, timeout: float
    ) -> None:
        self.ctx = ctx
        self.save = save
        self.requeue_signal = requeue_signal
        self.timeout = timeout
        self.count = 0  # check points passed
        self.stop_at = NEVER  # the check point to stop at; 0 while the ranks agree on it (wait at the next one)
        self.signal = 0  # the signal the ranks agreed to stop on
        self.acted = False  # the stop ran (saved, or failed trying)
        self.board: _Board | None = None
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None  # what broke the watching thread, raised at the next check point
        self.agreed = threading.Event()
        self.ending = False  # the session ends: the watching thread returns
        run = current_run()
        store = None if run is None else run.store
        if ctx.world_size > 1 and store is None:
            raise RuntimeError(
                f"resume() on rank {ctx.rank} of {ctx.world_size}: the ranks agree on a stop through "
                "their process group's rendezvous store, and this group has none (made by the MPI "
                "backend?); start the ranks with qaccel, torchrun or srun"
            )
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        self.listener = self._alone if ctx.world_size == 1 else self._wake
        self.armed = arm(
            {signal.SIGTERM, signal.SIGINT} | ({requeue_signal} if requeue_signal is not None else set()), self.listener
        )
        if ctx.world_size == 1 and self.armed.received:  # armed already, by a stop this one is nested in
            self.stop_at = 0
        if ctx.world_size > 1:
            assert run is not None and store is not None
            connection = store.connection(STORE_TIMEOUT) or store
            board = connection.under(run.key("qaccel_stop"))
            self.board = _Board(board, ctx.rank, ctx.world_size, lambda: self.ending)
            self.thread = threading.Thread(target=self._watch, name="qaccel-stop", daemon=True)
            self.thread.start()

    def boundary(self) -> None:
        """A check point (every rank passes the same ones): stop here if it is where the ranks agreed to."""
        self.count += 1
        if self.count >= self.stop_at:
            self._at_gate()

    def _at_gate(self) -> None:
        if self.board is None:
            if self.armed.received:
                self._stop(self.armed.received)
            return
        if not self.agreed.wait(self.timeout):
            raise RuntimeError(
                f"rank {self.ctx.rank}: the ranks did not agree where to stop within {self.timeout:g} "
                "s of a signal (a rank's stop thread is not answering)"
            )
        if self.error is not None:
            raise RuntimeError(
                f"rank {self.ctx.rank}: agreeing on a stop through the rendezvous store failed: {self.error}"
            ) from self.error
        if self.count >= self.stop_at:
            self._stop(self.signal)

    def _watch(self) -> None:
        """The watching thread: announce this rank's signal, watch for anyone's, then agree where to stop."""
        board = self.board
        assert board is not None
        try:
            announced = False
            while not self.ending:
                if self.armed.received and not announced:
                    announced = True
                    board.announce(self.armed.received)
                signum = board.announced()
                if signum:
                    self.stop_at = 0  # before reading count: a check point passed after this read waits here
                    furthest = board.agree(self.count + 1)
                    if furthest is None:  # the session ended first
                        return
                    self.signal, self.stop_at = signum, furthest
                    self.agreed.set()
                    return
                self._sleep(CHECK_EVERY_S)
        except Exception as exc:  # noqa: BLE001 - raised by the main thread at its next check point
            self.error, self.stop_at = exc, 0
            self.agreed.set()

    def _sleep(self, seconds: float) -> None:
        """Sleep ``seconds``, or until a signal or close() writes to the wake pipe."""
        poller = select.poll()
        poller.register(self.wake_r, select.POLLIN)
        if poller.poll(seconds * 1000):
            os.read(self.wake_r, 64)

    def _alone(self, signum: int) -> None:
        self.stop_at = 0  # a world of one stops at its next check point

    def _wake(self, signum: int = 0) -> None:
        """Wake the watching thread (from the signal handler too: a pipe takes no lock)."""
        with contextlib.suppress(OSError):
            os.write(self.wake_w, b"w")

    def close(self, finished: bool) -> None:
        """End of the session. When fn returned, the ranks agree whether any got a signal that no check point acted
        on: if one did, the session ends as a stop. A signal that comes after that is raised again once the
        previous handlers are back: a signal is never swallowed."""
        try:
            if finished and not self.acted:
                signum = self.signal or self.armed.received
                if self.ctx.world_size > 1:  # every rank's fn returned: all are here, or failed (which raises)
                    signum = int(collectives.all_reduce_dict({"signal": signum}, "max", self.ctx, _CPU)["signal"])
                if signum:
                    self._stop(signum)
        finally:
            self.ending = True
            self._wake()
            if self.thread is not None:
                self.thread.join(CLOSE_WAIT_S)
            late = disarm(self.listener)
            os.close(self.wake_r)
            os.close(self.wake_w)
            if late and not self.acted:
                signal.raise_signal(late)

    def _stop(self, signum: int) -> None:
        self.acted = True
        sig = signal.Signals(signum)
        path = self.save()
        requeued = sig == self.requeue_signal and "SLURM_JOB_ID" in os.environ
        if requeued and self.ctx.rank == 0:
            requeued = _requeue(os.environ["SLURM_JOB_ID"])
        if self.ctx.rank == 0:
            _say(f"qaccel: {Preempted(sig.name, path, requeued)}")
        raise Preempted(sig.name, path, requeued)


class _Board:
    """A stop's shared state in the session's rendezvous store, sealed (sealed.py): the signal announced (none yet
    while the key is missing; the first announcement stands), and where each rank's next check point is."""

    def __init__(self, store: Sealed, rank: int, world_size: int, ending: Callable[[], bool]) -> None:
        self.store, self.rank, self.world_size, self.ending = store, rank, world_size, ending

    def announce(self, signum: int) -> None:
        self.store.set_first("signal", str(signum))

    def announced(self) -> int:
        value = self.store.value("signal")
        return int(value) if value else 0

    def agree(self, next_point: int) -> int | None:
        """Tell where this rank's next check point is; once every rank has, the furthest of them (None: the
        session ended first)."""
        self.store.set(f"next/{self.rank}", str(next_point))
        names = [f"next/{rank}" for rank in range(self.world_size)]
        while not self.ending():
            points = self.store.gather(names, STORE_TIMEOUT.total_seconds(), stop=self.ending)
            if len(points) == len(names):
                return max(int(point) for point in points.values())
        return None


def _requeue(job_id: str) -> bool:
    """``scontrol requeue`` this SLURM job (once: rank 0 only); False, with the reason printed, if SLURM refused."""
    try:
        done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60, check=False)
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
