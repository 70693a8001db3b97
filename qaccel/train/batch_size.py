"""find_executable_batch_size: run a training function again at a smaller batch size after it ran out of memory,
every rank at the same size.

Accelerate's decorator retries in each process alone: the rank out of memory starts over at a smaller size while
its peers wait in a collective for it, and the job hangs or the ranks drift apart. Here an attempt ends on every
rank when one runs out of memory. That rank leaves the process group, so its peers' collectives fail at once. The
ranks then compare outcomes through the rendezvous store, and when any ran out of memory all start again in a new
group at the same smaller size. Every rank thus ends with the same size: the largest of the sequence that fits on
all of them.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import gc
import inspect
import itertools
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

from qaccel import errors
from qaccel.comm import session
from qaccel.comm.sealed import Sealed
from qaccel.options import Backend, count

# Messages of the errors that mean "out of memory" (Accelerate's list): an allocation failed, so a smaller batch
# may fit.
OOM_MESSAGES = (
    " out of memory.",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
    "DefaultCPUAllocator: can't allocate memory",
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",
)
WATCH_INTERVAL_S = 0.2  # how often a rank under NCCL looks for a peer out of memory during an attempt
REDUCTION = 0.9  # each retry's size, as a fraction of the last (Accelerate's, since it stopped halving)


class Outcome(enum.StrEnum):
    RETURNED = "returned"
    OUT_OF_MEMORY = "out of memory"
    RAISED = "raised"
    LOST = "lost contact"  # raised because a peer left the group (one that ran out of memory, maybe)


def should_reduce_batch_size(exception: BaseException) -> bool:
    """Whether ``exception`` says an allocation failed, so that a smaller batch may fit."""
    if isinstance(exception, torch.OutOfMemoryError):
        return True
    return (
        isinstance(exception, RuntimeError)
        and len(exception.args) == 1
        and isinstance(exception.args[0], str)
        and any(message in exception.args[0] for message in OOM_MESSAGES)
    )


def find_executable_batch_size(
    function: Callable[..., Any] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
) -> Any:
    """Call ``function(batch_size, *args, **kwargs)`` from ``starting_batch_size`` down, each retry at 0.9 × the
    last size (or ``reduce_batch_size_fn()``), until no rank runs out of memory; as a decorator too.

    Inside ``distribute()``, under torchrun or srun, an attempt ends on every rank when one runs out of memory, and
    all retry at the same size in a new process group: prepare models, optimizers and loaders inside ``function``,
    since what the failed attempt prepared belongs to the old group and is dropped. Any other error ends the
    search. The size reached is kept for the next call, as Accelerate's is.
    """
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    count("starting_batch_size", starting_batch_size, 1)
    batch_size = starting_batch_size

    def reduce() -> int:
        return int(batch_size * REDUCTION)

    reducer = reduce_batch_size_fn or reduce

    @functools.wraps(function)
    def decorator(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size
        if len(inspect.signature(function).parameters) < len(args) + 1:
            raise TypeError(
                f"find_executable_batch_size passes the batch size to {function.__name__}() as its "
                f"first argument: call it without that argument, e.g. {function.__name__}(*other_args)"
            )
        agreement = Agreement.begin()
        for attempt in itertools.count():
            if batch_size < 1:
                raise RuntimeError("No executable batch size found, reached zero.")
            release_memory()
            try:
                with agreement.watch(attempt) if agreement is not None else contextlib.nullcontext():
                    result, error = function(batch_size, *args, **kwargs), None
            except Exception as exc:  # noqa: BLE001 - _outcome decides: a retry when out of memory, else raised
                result, error = None, exc
            outcome = _outcome(error)
            # the attempt's frames hold its model, batches and group (OUT_OF_MEMORY comes with an error)
            if outcome is Outcome.OUT_OF_MEMORY and error is not None:
                traceback.clear_frames(error.__traceback__)
            if agreement is not None:
                outcome = agreement.settle(attempt, batch_size, outcome)
            if outcome is Outcome.OUT_OF_MEMORY:
                if error is not None:  # a peer's error, here too
                    traceback.clear_frames(error.__traceback__)
                del error, result
                if agreement is None:
                    batch_size = reducer()
                else:
                    agreement.renew(attempt)
                    batch_size = agreement.next_size(attempt, reducer)
                continue
            if error is not None:
                raise error
            return result

    return decorator


class Agreement:
    """The ranks' agreement over one call's attempts, through the session's rendezvous store (its sealed keys)."""

    def __init__(self, run: session.Run, store: Sealed) -> None:
        self.run = run
        self.store = store

    @classmethod
    def begin(cls) -> Agreement | None:
        """The agreement for a call in a session of several ranks, or None (a process alone retries alone)."""
        run = session.current_run()
        if run is None or run.ctx.world_size < 2 or run.store is None:
            return None
        return cls(run, run.store.under(run.key("qaccel_batch_size")))  # every rank calls in the same order

    @contextlib.contextmanager
    def watch(self, attempt: int) -> Iterator[None]:
        """Under NCCL, abort this rank's group as soon as a peer runs out of memory: a collective waiting on the
        GPU for that peer would not fail otherwise (gloo's fail when the peer's connections close)."""
        if self.run.ctx.backend is not Backend.NCCL:
            yield
            return
        stop = threading.Event()

        def abort_when_a_peer_is_out() -> None:
            while not stop.wait(WATCH_INTERVAL_S):
                if self.store.value(f"{attempt}/out_of_memory") is not None:
                    session.leave_group(self.run.ctx)
                    return

        thread = threading.Thread(target=abort_when_a_peer_is_out, name="qaccel-batch-size", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def settle(self, attempt: int, batch_size: int, mine: Outcome) -> Outcome:
        """Every rank's outcome of ``attempt`` combined: out of memory anywhere means out of memory everywhere;
        otherwise each rank keeps its own outcome. A rank that raised does not wait: its error ends the job."""
        ctx = self.run.ctx
        if mine is Outcome.OUT_OF_MEMORY:
            self.store.set(f"{attempt}/out_of_memory", str(ctx.rank))  # for watch()
            session.drop_group(self.run)
        self.store.set(f"{attempt}/rank{ctx.rank}", mine.value)
        if mine is Outcome.RAISED:  # the search ends here; the launcher stops peers waiting for this rank
            return mine
        keys = [f"{attempt}/rank{rank}" for rank in range(ctx.world_size)]
        outcomes = self.store.gather(keys, self.run.timeout)
        if len(outcomes) < len(keys):
            missing = [rank for rank, key in enumerate(keys) if key not in outcomes]
            raise RuntimeError(
                f"find_executable_batch_size: rank(s) {missing} did not finish the attempt at batch "
                f"size {batch_size} within {self.run.timeout:g} s"
            )
        everyone = {Outcome(outcome.decode()) for outcome in outcomes.values()}
        return Outcome.OUT_OF_MEMORY if Outcome.OUT_OF_MEMORY in everyone else mine

    def renew(self, attempt: int) -> None:
        """Every rank into a new group for the next attempt."""
        session.renew_group(self.run, self.store.plain(f"{attempt}/group"))

    def next_size(self, attempt: int, reducer: Callable[[], int]) -> int:
        """The next size, rank 0's: a reducer of the user's may differ between ranks."""
        size = reducer()
        if self.run.ctx.rank == 0:
            self.store.set(f"{attempt}/next", str(size))
        chosen = self.store.gather([f"{attempt}/next"], self.run.timeout)
        if not chosen:
            raise RuntimeError(
                f"find_executable_batch_size: rank 0 gave no next batch size within {self.run.timeout:g} s"
            )
        return int(chosen[f"{attempt}/next"].decode())


def _outcome(error: Exception | None) -> Outcome:
    if error is None:
        return Outcome.RETURNED
    if should_reduce_batch_size(error):
        return Outcome.OUT_OF_MEMORY
    return Outcome.LOST if errors.is_symptom(error) else Outcome.RAISED


def release_memory() -> None:
    """Collect what the last attempt left and give the device's cached memory back, before each attempt."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
