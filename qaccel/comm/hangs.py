"""Say where every rank is when a job hangs: after a collective's timeout, and on SIGUSR2.

Every rank of a world of two or more runs a watcher thread for its session, blocked on a key of the rendezvous
store. A rank whose collective timed out writes where it was into the store and sets every rank's key; each
watcher answers with where its rank's main thread is (the stack of the user's code, the qaccel collective it is
in and how many it completed) and, under torchrun or srun, prints that to its own log. The rank that timed out
waits a few seconds for the answers and adds them to its exception, so the caller of a plain launch raises one
error that lists every rank. The watcher runs while the main thread is blocked in a collective (torch releases
the GIL there), which a Python signal handler could not.

SIGUSR2 makes each rank that gets it print where it is, and carry on: a signal reaches the process while its main
thread is blocked, through a wakeup pipe a second thread reads.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import linecache
import os
import signal
import socket
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, cast

from qaccel.comm.stderr import write_stderr

if TYPE_CHECKING:
    from qaccel.comm.sealed import Sealed

REPORT_WAIT_S = 3.0  # how long a rank that timed out waits for the others' answers
CLOSE_WAIT_S = 2.0  # for the watcher to return from the store once woken
STACK_DEPTH = 6  # frames of the user's code shown per rank
_NEVER = datetime.timedelta(days=365)
# qaccel (the whole package, wherever this module sits in it) and torch
_OWN_DIRS = tuple(
    os.path.dirname(cast(str, sys.modules[name].__file__)) + os.sep for name in (__name__.partition(".")[0], "torch")
)
_STDLIB_DIR = sysconfig.get_paths()["stdlib"] + os.sep


@dataclass
class Calls:
    """The qaccel collectives of one session on this rank: how many completed and which one runs now."""

    completed: int = 0
    current: str | None = None
    since: float = 0.0

    def enter(self, name: str) -> None:
        self.current, self.since = name, time.monotonic()

    def leave(self) -> None:
        self.current = None
        self.completed += 1

    def state(self, timed_out: bool = False) -> str:
        done = f"{self.completed} completed before"
        if self.current is None:
            return f"not in a qaccel collective ({self.completed} completed)"
        verb = "timed out in" if timed_out else "waiting in"
        return f"{verb} {self.current} after {time.monotonic() - self.since:.1f} s (its collective #{self.completed + 1}; {done})"


@dataclass(frozen=True)
class Frame:
    """One line of a stack: where, and the code on that line."""

    filename: str
    lineno: int
    function: str
    calls: str = ""  # the library function this line called into, when there is one

    def site(self) -> str:
        return f"{_short(self.filename)}:{self.lineno}"

    def code(self) -> str:
        return linecache.getline(self.filename, self.lineno).strip()


def _short(filename: str) -> str:
    relative = os.path.relpath(filename) if os.path.isabs(filename) else filename
    return filename if relative.startswith("..") else relative


def _is_library(filename: str) -> bool:
    """qaccel, torch or the standard library: what a user's stack calls into, not the user's code."""
    if filename.startswith(_OWN_DIRS) or filename.startswith(("<frozen ", "<string>")):  # <string>: forkserver
        return True
    return filename.startswith(_STDLIB_DIR) and "-packages" + os.sep not in filename


def _qualified(frame: FrameType) -> str:
    return f"{frame.f_globals.get('__name__', '?')}.{frame.f_code.co_qualname}"


def user_stack(frames: list[tuple[FrameType, int]]) -> list[Frame]:
    """The user's frames of a stack given outermost first, each naming the library function it called into."""
    out: list[Frame] = []
    for i, (frame, lineno) in enumerate(frames):
        if _is_library(frame.f_code.co_filename):
            continue
        entry = frames[i + 1][0] if i + 1 < len(frames) and _is_library(frames[i + 1][0].f_code.co_filename) else None
        out.append(
            Frame(frame.f_code.co_filename, lineno, frame.f_code.co_qualname, _qualified(entry) if entry else "")
        )
    return out


def live_frames(frame: FrameType | None) -> list[tuple[FrameType, int]]:
    """A running thread's stack from its frame outward, given outermost first."""
    frames = []
    while frame is not None:
        frames.append((frame, frame.f_lineno))
        frame = frame.f_back
    return frames[::-1]


def traceback_frames(tb: TracebackType | None) -> list[tuple[FrameType, int]]:
    frames = []
    while tb is not None:
        frames.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return frames


def call_site(frame: FrameType | None) -> str:
    """file:line of the user's code that led to ``frame`` (the caller of qaccel), for messages."""
    stack = user_stack(live_frames(frame))
    return stack[-1].site() if stack else "?"


@dataclass
class Where:
    """Where one rank is: what it is doing and its user code's stack; travels through the store as JSON."""

    rank: int
    state: str
    stack: list[tuple[str, int, str, str, str]] = field(default_factory=list)  # file, line, function, code, calls
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)

    @classmethod
    def of(cls, rank: int, calls: Calls, frames: list[tuple[FrameType, int]], state: str | None = None) -> Where:
        stack = user_stack(frames)[-STACK_DEPTH:]
        return cls(rank, state or calls.state(), [(f.filename, f.lineno, f.function, f.code(), f.calls) for f in stack])

    def summary(self) -> str:
        return f"rank {self.rank}: {self.doing()}"

    def doing(self) -> str:
        """What the rank is doing and where in the user's code, in a few words."""
        if not self.stack:
            return f"{self.state}, outside the user's code"
        file, line, function, code, calls = self.stack[-1]
        into = f" -> {calls}" if calls and not code else ""
        return f"{self.state} at {_short(file)}:{line} in {function}: {code}{into}"

    def details(self) -> str:
        lines = [f"rank {self.rank} (pid {self.pid} on {self.host}), its code (most recent call last):"]
        for file, line, function, code, calls in self.stack:
            lines.append(f'  File "{file}", line {line}, in {function}')
            if code:
                lines.append(f"    {code}")
        return "\n".join(lines)


def report(title: str, wheres: list[Where], missing: list[int]) -> str:
    """The text a user reads: one line per rank, then each rank's stack."""
    lines = [title]
    lines += [f"  {w.summary()}" for w in wheres]
    lines += [f"  rank {r}: no answer within {REPORT_WAIT_S:.0f} s (gone, or its Python is blocked)" for r in missing]
    lines += [w.details() for w in wheres]
    return "\n".join(lines)


_TIMEOUT_WORDS = ("timed out", "operation timeout", "wait timeout", "socket timeout")  # gloo, NCCL, the store


def is_timeout(exc: BaseException) -> bool:
    """A collective (or the store under it) gave up waiting for a peer."""
    text = str(exc).lower()
    return isinstance(exc, (RuntimeError, TimeoutError)) and any(words in text for words in _TIMEOUT_WORDS)


class Watch:
    """This rank's watcher for one session: answers requests through the store, and SIGUSR2."""

    def __init__(
        self, rank: int, world_size: int, timeout: float, store: Sealed | None, to_log: bool, session_number: int
    ) -> None:
        """``store``: qaccel's keys in the group's rendezvous store (None for a group made without one, e.g. MPI's:
        then this rank still says where it is, but cannot ask the others). ``session_number``: keeps sessions' keys
        apart. Requests and answers are sealed (sealed.py), answers also encrypted: they hold the user's source."""
        self.rank, self.world_size, self.timeout, self.to_log = rank, world_size, timeout, to_log
        self.calls = Calls()
        self.store = None if store is None else store.under(f"qaccel_where/{session_number}/")
        self.main = threading.get_ident()
        self.explained = False
        # blocked on, as long as the job runs
        self.listener = None if self.store is None else self.store.connection(_NEVER)
        if self.listener is not None:
            self.thread = threading.Thread(target=self._listen, name="qaccel-where", daemon=True)
            self.thread.start()
        self.usr2 = _Usr2(self) if threading.current_thread() is threading.main_thread() else None

    def close(self) -> None:
        """End the threads, and wait for the watcher: one still inside the store's C++ code when the interpreter
        exits is ended there by Python, which aborts the process ("terminate called without an active exception",
        seen under torchrun)."""
        if self.usr2 is not None:
            self.usr2.close()
            self.usr2 = None  # it points back here: no cycle is left for the collector
        if self.listener is None or self.store is None:
            return
        with contextlib.suppress(Exception):  # the store's server is gone, and with it the watcher's wait
            self.store.set(self._key("wake", self.rank), "end")
        self.thread.join(CLOSE_WAIT_S)

    def run(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` as the qaccel collective ``name``: counted, and explained if it times out."""
        self.calls.enter(name)
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:
            if is_timeout(exc):
                self.explain(exc, live_frames(sys._getframe(1)))
            raise
        finally:
            self.calls.leave()

    @staticmethod
    def _key(kind: str, rank: int) -> str:
        return f"{kind}/{rank}"

    def where_now(self, state: str | None = None) -> Where:
        """Where the main thread is now (from another thread)."""
        frame = sys._current_frames().get(self.main)
        return Where.of(self.rank, self.calls, live_frames(frame), state)

    def _listen(self) -> None:
        assert self.listener is not None
        try:
            wake = self._key("wake", self.rank)
            while (request := self.listener.get(wake)) is None:  # not sealed by this run: not a request
                self.listener.delete(wake)
            if request == b"end" or self.explained:
                return
            where = self.where_now()
            self.listener.set(self._key("report", self.rank), json.dumps(where.__dict__), secret=True)
            if self.to_log:
                write_stderr(
                    f"[qaccel] {request.decode()}; where rank {self.rank} of {self.world_size} is:\n"
                    f"{where.summary()}\n{where.details()}\n"
                )
        except Exception:  # noqa: BLE001 - the session (or the store's server) ended under it
            return

    def explain(self, exc: BaseException, frames: list[tuple[FrameType, int]]) -> None:
        """Ask every rank where it is and add their answers to ``exc``, the timeout this rank's collective hit."""
        if self.explained:
            return
        self.explained = True
        if self.calls.current is None:  # DDP's, or the user's own torch.distributed call
            n = self.calls.completed
            state = f"timed out in a collective qaccel did not make ({n} qaccel collective{'s' * (n != 1)} completed)"
        else:
            state = self.calls.state(timed_out=True)
        mine = Where.of(self.rank, self.calls, frames, state)
        others = [r for r in range(self.world_size) if r != self.rank]
        request = f"rank {self.rank} timed out after {self.timeout:g} s"
        try:
            if self.listener is None or self.store is None:
                raise RuntimeError("this process group has no store that can be shared between threads")
            self.store.set(self._key("report", self.rank), json.dumps(mine.__dict__), secret=True)  # if one asks
            for rank in others:
                self.store.set(self._key("wake", rank), request)
            wheres, missing = self._answers(others)
        except Exception as store_error:  # noqa: BLE001 - still say where this rank is
            wheres, missing = [], others
            exc.add_note(f"[qaccel] could not ask the other ranks where they are: {store_error}")
        title = f"[qaccel] a collective waited longer than timeout={self.timeout:g}s; where every rank was:"
        exc.add_note(report(title, sorted([mine, *wheres], key=lambda w: w.rank), missing))

    def _answers(self, ranks: list[int]) -> tuple[list[Where], list[int]]:
        assert self.store is not None
        keys = {r: self._key("report", r) for r in ranks}
        answers = self.store.gather(list(keys.values()), REPORT_WAIT_S, secret=True)
        wheres = [Where(**json.loads(answers[key])) for key in keys.values() if key in answers]
        return wheres, [r for r, key in keys.items() if key not in answers]


class _Usr2:
    """SIGUSR2 prints where this rank is, also while its main thread is blocked in a collective.

    The signal's byte arrives through Python's wakeup fd, read by a thread; installed only where SIGUSR2 has its
    default action (a handler of the user's wins) and no one else owns the wakeup fd (asyncio, say).
    """

    def __init__(self, watch: Watch) -> None:
        self.watch = watch
        self.read_end, self.write_end = os.pipe()
        os.set_blocking(self.write_end, False)
        self.previous_fd = -2  # not installed
        if signal.getsignal(signal.SIGUSR2) is not signal.SIG_DFL:
            self._close_pipe()
            return
        previous = signal.set_wakeup_fd(self.write_end, warn_on_full_buffer=False)
        if previous != -1:
            signal.set_wakeup_fd(previous)
            self._close_pipe()
            return
        self.previous_fd = previous
        _fork_hooks()
        signal.signal(signal.SIGUSR2, _ignore)
        threading.Thread(target=self._read, name="qaccel-sigusr2", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.read_end, 64)
            except OSError:
                return
            if not data:
                os.close(self.read_end)
                return
            if signal.SIGUSR2 in data and signal.getsignal(signal.SIGUSR2) is _ignore:
                where = self.watch.where_now()
                write_stderr(
                    f"[qaccel] SIGUSR2: rank {self.watch.rank} of {self.watch.world_size} is "
                    f"{where.doing()}\n{where.details()}\n"
                )

    def close(self) -> None:
        if self.previous_fd == -2:
            return
        if signal.getsignal(signal.SIGUSR2) is _ignore:
            signal.signal(signal.SIGUSR2, signal.SIG_DFL)
        signal.set_wakeup_fd(self.previous_fd)
        os.close(self.write_end)  # the reader sees EOF and ends

    def _close_pipe(self) -> None:
        os.close(self.read_end)
        os.close(self.write_end)


TORCHRUN_MARKS = (b"torchrun", b"torch.distributed.run", b"torch.distributed.launch")


def ask_where(pid: int) -> list[int]:
    """Send SIGUSR2 to the ranks behind ``pid``; the pids signalled.

    A torchrun agent's workers are signalled, not the agent (SIGUSR2 would end it). Any other process gets it
    itself: a plain launch's caller passes it on to its ranks; a rank, or an srun task, answers.
    """
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()  # FileNotFoundError: no such process
    targets = [pid]
    if any(mark in cmdline for mark in TORCHRUN_MARKS):
        targets = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(p) == pid]
        if not targets:
            raise ProcessLookupError(f"torchrun (pid {pid}) has no workers running")
    for target in targets:
        os.kill(target, signal.SIGUSR2)
    return targets


def _parent(proc: Path) -> int | None:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _ignore(signum: int, frame: Any) -> None:
    """SIGUSR2's Python-level handler: the reader thread answers; this only keeps the default action away."""


def _child_after_fork() -> None:
    """A forked child (a DataLoader worker) neither shares the rank's wakeup pipe nor answers SIGUSR2 for it."""
    if signal.getsignal(signal.SIGUSR2) is _ignore:
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        except ValueError:  # not the main thread
            pass


@functools.cache
def _fork_hooks() -> None:
    """Registered once, when a rank first answers SIGUSR2: importing qaccel registers nothing."""
    os.register_at_fork(after_in_child=_child_after_fork)
