"""qaccel's exceptions, which errors of a rank are only symptoms of another rank's failure, and how a rank's
exception travels to the caller or to its peers (ErrorReport)."""

from __future__ import annotations

import pickle
import signal
import time
import traceback
import warnings
from dataclasses import dataclass, field

import cloudpickle  # pyright: ignore[reportMissingTypeStubs] - it ships none

# Errors a rank raises because a peer left the group: symptoms, reported before their cause more often than not.
_PEER_LOSS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Failed to recv")


# What this process has warned about already (see warn_once): a warning about the process itself, not about a call.
_WARNED: set[tuple[str, ...]] = set()


def warn_once(key: tuple[str, ...], message: str, stacklevel: int) -> None:
    """Warn about something that holds for the whole process (the launcher's world, a logging handler that cannot
    travel) once, however many Accelerators or launches meet it, whatever the warnings filters say."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=stacklevel + 1)


def type_name(exc: BaseException) -> str:
    """The qualified name of an exception's type, as recorded for a failed rank."""
    return f"{type(exc).__module__}.{type(exc).__qualname__}"


def is_peer_loss(exc_type: str, message: str) -> bool:
    """True for an error that only says another rank went away: a symptom, its cause is on that rank."""
    return exc_type.startswith("torch.distributed.Dist") or any(s in message for s in _PEER_LOSS)


def is_symptom(exc: BaseException) -> bool:
    """True when ``exc``, or an exception it was raised from or while handling, only says a peer went away."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if is_peer_loss(type_name(current), str(current)):
            return True
        current = current.__cause__ or current.__context__
    return False


def raised_note(rank: int, world_size: int, exc_type: str, message: str, *, launched: bool) -> str:
    """The note an exception gets naming the rank it came from, for ranks qaccel launched and ranks run in place.

    In place (torchrun, srun) each rank logs alone, so a symptom says the cause is in another rank's log.
    """
    note = f"[qaccel] raised on rank {rank} of {world_size}"
    if is_peer_loss(exc_type, message):
        note += " because it lost contact with another rank"
        note += " (remote traceback above)" if launched else ": the cause is most likely in that rank's log"
    elif launched:
        note += " (remote traceback above)"
    return note


class QaccelError(RuntimeError):
    """Base class for qaccel's own errors."""


class CollectiveMismatchError(QaccelError):
    """Debug mode: the ranks called different collectives, or the same one with different shapes."""


class RendezvousError(QaccelError):
    """The ranks cannot meet where they were told to: names the host, the port and where they came from."""


class CheckpointError(QaccelError):
    """A checkpoint cannot be read or does not fit what this run prepared; names the checkpoint and the file.

    Attributes:
        checkpoint: the checkpoint's folder.
        file: the file at fault, when one is.
        damaged: its files are not what was written (cut short, changed, missing) or cannot be read, as opposed
            to a checkpoint that is intact but was written for other objects.
    """

    def __init__(self, message: str, checkpoint: str, file: str | None = None, damaged: bool = False) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint
        self.file = file
        self.damaged = damaged

    def __reduce__(self):
        return (type(self), (self.args[0], self.checkpoint, self.file, self.damaged))


class RankError(QaccelError):
    """A rank failed and its exception could not be rebuilt in the caller (or it exited without one).

    Attributes:
        rank: the rank that failed.
        exc_type: the qualified name of the exception it raised, if it raised one.
        remote_traceback: its traceback, as text.
    """

    def __init__(self, message: str, rank: int, exc_type: str | None = None, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback

    def __reduce__(self):
        return (type(self), (self.args[0], self.rank, self.exc_type, self.remote_traceback))


class RankKilledError(QaccelError):
    """A rank was killed by a signal (out of memory, SIGKILL, segfault...).

    Attributes:
        rank: the rank that was killed.
        signal_name: the signal, e.g. ``SIGKILL``.
    """

    def __init__(self, rank: int, signal_name: str) -> None:
        super().__init__(f"rank {rank} was killed by signal {signal_name}")
        self.rank = rank
        self.signal_name = signal_name

    def __reduce__(self):
        return (type(self), (self.rank, self.signal_name))


class RemoteTraceback(Exception):
    """Carries a rank's formatted traceback; set as ``__cause__`` so it prints above the re-raised exception."""

    def __init__(self, text: str) -> None:
        super().__init__(text)

    def __str__(self) -> str:
        return "\n\n" + self.args[0].rstrip()


class Preempted(SystemExit):
    """Training stopped after a signal, and its state is saved in ``checkpoint``: run again to resume from it.

    A SystemExit, so a user's ``except Exception`` does not swallow it and, uncaught, the process exits quietly with
    128 + the signal's number, as if the signal had ended it (rank 0 prints what happened).

    Attributes:
        signal_name: the signal that asked to stop, e.g. ``SIGTERM``.
        checkpoint: the checkpoint saved before stopping.
        requeued: True when the SLURM job was requeued to resume from it.
    """

    def __init__(self, signal_name: str, checkpoint: str, requeued: bool = False) -> None:
        super().__init__(128 + signal.Signals[signal_name].value)
        self.signal_name = signal_name
        self.checkpoint = checkpoint
        self.requeued = requeued

    def __str__(self) -> str:
        text = f"stopped by {self.signal_name} after saving state to {self.checkpoint}"
        return text + ("; the SLURM job was requeued and will resume from it" if self.requeued else "")

    def __reduce__(self):
        return (type(self), (self.signal_name, self.checkpoint, self.requeued))


@dataclass(frozen=True)
class ErrorReport:
    """What a failing rank tells the caller or its peers: its exception, pickled if it can be, and its text."""

    rank: int
    type: str
    message: str
    traceback: str
    exc: bytes | None = None  # the exception object itself, when cloudpickle can carry it
    preempted: bool = False  # a Preempted: the rank saved and stopped after a signal
    time: float = field(default_factory=time.time)

    @classmethod
    def of(cls, rank: int, exc: BaseException) -> ErrorReport:
        try:
            exc_bytes: bytes | None = cloudpickle.dumps(exc)  # pyright: ignore[reportUnknownMemberType] - no stubs
        except Exception:  # noqa: BLE001 - whatever stops pickling it, the report carries its text
            exc_bytes = None
        return cls(
            rank, type_name(exc), str(exc), _text(exc, notes=exc_bytes is None), exc_bytes, isinstance(exc, Preempted)
        )

    @property
    def is_peer_loss(self) -> bool:
        """True when the error only says another rank went away: a symptom, its cause is elsewhere."""
        return is_peer_loss(self.type, self.message)


def _text(exc: BaseException, notes: bool) -> str:
    """The formatted traceback; without the notes when the exception travels whole (the caller shows them once)."""
    saved = None if notes else exc.__dict__.pop("__notes__", None)
    try:
        return "".join(traceback.format_exception(exc))
    finally:
        if saved is not None:
            exc.__notes__ = saved


def exception_from(report: ErrorReport) -> BaseException:
    """The rank's own exception object when it survives pickling, else a RankError carrying its text."""
    try:
        exc = pickle.loads(report.exc) if report.exc is not None else None
    except Exception:  # noqa: BLE001 - whatever stops unpickling it, a RankError carries its text
        exc = None
    if not isinstance(exc, BaseException):
        exc = RankError(
            f"rank {report.rank} raised {report.type}: {report.message}", report.rank, report.type, report.traceback
        )
    exc.__cause__ = RemoteTraceback(f"Traceback from rank {report.rank}:\n{report.traceback}")
    return exc
