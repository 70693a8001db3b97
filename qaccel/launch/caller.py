"""Start the ranks of a one-node world, ship fn to them, bring back results and exceptions, stop all on failure.

Start method: ranks are forked from multiprocessing's forkserver, with torch and ``torch._dynamo`` loaded
(server.py: forked from the caller when that is provably safe, else a fresh interpreter; a first launch that
would wait for its imports is served by a quick server forked at the call). The server never
touches CUDA, so every rank is CUDA-safe, and each rank costs a fork (~20 ms) instead of a new interpreter (~1 s).
Ranks never re-import the caller's ``__main__``: fn and its arguments travel by value with cloudpickle, so
lambdas, closures and notebook functions work, and a script without an ``if __name__ == "__main__":`` guard
cannot start ranks recursively.

Each rank then sets itself up as a torchrun worker would be (worker.py) and takes over the settings the
caller's top-level code made (inherit.py). A rank leads its own process group, so stopping it stops what it
started (DataLoader workers, pools), as torchrun's agent does. With ``rank_prefix`` its fds 1 and 2 are pipes the
caller reads, prefixing each line with the rank (output.py).

Files that carry fn, results and errors live in a private temporary directory (mode 0700, run_dir.py)
removed afterwards, or by a later launch if the caller was killed.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.process
import multiprocessing.spawn
import multiprocessing.util
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import torch.distributed as dist

from qaccel import storage
from qaccel.comm import sealed
from qaccel.environment import Environment
from qaccel.errors import ErrorReport, Preempted, RankError
from qaccel.launch import inherit, output, pickling, server, worker
from qaccel.launch.failures import RankFailure, cause_exception
from qaccel.launch.protocol import HandBack, Runner
from qaccel.launch.run_dir import run_directory
from qaccel.options import Config

# The ranks' group meets in a FileStore of the run directory, which no other user can open (False: in the caller's
# TCPStore on 127.0.0.1, which any local user can; benchmarks/auth.py measures what the private one costs).
PRIVATE_STORE = True
STOP_GRACE_S = 3.0
CAUSE_GRACE_S = 3.0
_PREPARE_LOCK = threading.Lock()


class PlainLaunch(Runner):
    """The ranks start here, on this node: the runner for a plain process with ``nprocs`` > 1. Made with its
    Accelerator, so the server the ranks are forked from starts warming up at once."""

    def __init__(self, config: Config, env: Environment, hand_back: HandBack) -> None:
        super().__init__(config, env, hand_back)
        server.warm_up(config.start_method)

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], all_results: bool) -> Any:
        return launch(fn, args, kwargs, self.config, all_results, self.hand_back.pickled)


def launch(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    config: Config,
    all_results: bool,
    plain: Callable[[Any], Any],
) -> Any:
    """Run ``fn(*args, **kwargs)`` on ``config.nprocs`` new ranks; return rank 0's result (or all, by rank), each
    object in it made ``plain`` in its rank (protocol.HandBack).

    After a rank fails, all ranks are started again, up to ``config.max_restarts`` times (not after a Ctrl-C, a
    signal, or a Preempted stop); each attempt's ranks see its number in ``TORCHELASTIC_RESTART_COUNT``.
    """
    with server.serving(config.start_method, config.nprocs):
        return _launch(fn, args, kwargs, config, all_results, plain)


def _launch(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    config: Config,
    all_results: bool,
    plain: Callable[[Any], Any],
) -> Any:
    ctx = multiprocessing.get_context(config.start_method)
    environ = dict(os.environ)  # the forkserver's copy dates from its start; ranks get the caller's of now
    environ["TORCHELASTIC_MAX_RESTARTS"] = str(config.max_restarts)
    with _sigint_after():
        payload = _dumps_payload(fn, args, kwargs)
    umask = _umask()  # a umask set since the server started reaches the ranks and what they write
    procs: list = []
    stop: int | None = None  # the loop below ends only at a break, with stop the signal the caller was told to stop by
    with _forwarding_signals(procs) as received, run_directory() as run_dir:
        storage.write_bytes(payload, Path(run_dir, "payload"), durable=False)
        for attempt in itertools.count():
            environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt)
            failures = _attempt(ctx, procs, run_dir, config, all_results, plain, environ, received, umask)
            stop = next((sig for sig in received if sig in STOP_SIGNALS), None)
            if not failures and stop is None:
                results = [_read_result(run_dir, rank) for rank in range(config.nprocs if all_results else 1)]
                return results if all_results else results[0]
            if not failures:  # told to stop, and the ranks finished before they could act on it: no result
                if stop == signal.SIGINT:
                    raise KeyboardInterrupt
                break
            failure, rank = _failure_exception(run_dir, config.nprocs, failures)
            if received or isinstance(failure, Preempted) or attempt >= config.max_restarts:
                if attempt:
                    failure.add_note(f"[qaccel] the failure of the last attempt, after {attempt} restart(s)")
                if isinstance(failure, Preempted) and received == [signal.SIGINT]:
                    raise _interrupted(failure) from None
                if not received or isinstance(failure, Preempted):
                    raise failure
                stop = received[0]
                break
            print("".join(traceback.format_exception(failure)).rstrip(), file=sys.stderr)
            print(
                f"qaccel: rank {rank} failed ({type(failure).__name__}); restarting all {config.nprocs} ranks "
                f"(restart {attempt + 1} of {config.max_restarts})",
                file=sys.stderr,
                flush=True,
            )
            _clear_reports(run_dir)
    _die_of(cast(int, stop))  # the ranks ended because the caller was told to stop: end the way it was told


def _attempt(
    ctx: Any,
    procs: list,
    run_dir: str,
    config: Config,
    all_results: bool,
    plain: Callable[[Any], Any],
    environ: dict[str, str],
    received: _Received,
    umask: int,
) -> list[RankFailure]:
    """Start the ranks, wait for them, stop them; the failures seen (none: every rank returned).

    The ranks' group meets in a FileStore of the run directory, which no other user can open, with qaccel's keys
    sealed by a key made for the attempt (comm/sealed.py); the caller's TCPStore on 127.0.0.1 (MASTER_PORT) serves
    only code of the user's that makes its own group with env://, as torchrun's store would."""
    store = _loopback_store(config.timeout)
    key = sealed.new_key()
    group_store = os.path.join(run_dir, f"store-{environ['TORCHELASTIC_RESTART_COUNT']}") if PRIVATE_STORE else ""
    procs.clear()
    readers = []
    outputs: list[output.PrefixedOutput] = []  # with rank_prefix: each rank's stdout and stderr, read here
    succeeded = False  # a rank that failed to start, or a Ctrl-C, counts as a failure: stop the others at once
    try:
        for rank in range(config.nprocs):
            reader, writer = ctx.Pipe(duplex=True)
            streams = output.PrefixedOutput(rank) if config.rank_prefix else None
            if streams is not None:
                outputs.append(streams)
            spec = worker.RankSpec(
                run_dir,
                rank,
                config.nprocs,
                store.port,
                config,
                all_results or rank == 0,
                plain,
                dict(environ),
                group_store,
                key,
                umask,
            )
            ends = streams.ends if streams is not None else None
            proc = ctx.Process(target=worker.rank_main, args=(spec, writer, ends), name=f"qaccel-rank-{rank}")
            with _sigint_after():  # a Ctrl-C during start() comes once the rank is among those _stop() stops
                _start_without_main(proc)
                procs.append(proc)
                readers.append(reader)
            writer.close()
            if streams is not None:
                streams.close_ends()
        if received:  # a signal came while the ranks were starting: they get it too
            _forward(procs, received[0])
        failures = _supervise(procs, readers, run_dir, received.wake)
        succeeded = not failures
        return failures
    finally:
        _stop(procs, failed=not succeeded)
        for reader in readers:
            reader.close()
        output.finish(outputs)  # every line the ranks wrote is out before distribute() returns or raises
        del store


def _umask() -> int:
    """This process's umask, read without setting it (Linux's /proc says it; setting it back and forth would leave
    a file another thread creates meanwhile open to all)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def _clear_reports(run_dir: str) -> None:
    for path in Path(run_dir).glob("error-*"):
        path.unlink()
    for path in Path(run_dir).glob("result-*"):
        path.unlink()


# Signals the caller passes on to its ranks (they lead process groups of their own, so a signal sent to the
# caller's group does not reach them): a scheduler's or a user's request to stop, which ranks that called
# resume() answer by saving and raising Preempted. Ctrl-C's SIGINT reaches the caller only: see _on_ctrl_c.
# SIGUSR2 is `qaccel where` (ranks say where they are and go on): passed on, not recorded as received.
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
# Those that ask the caller itself to stop: told so, it never returns a result, whatever its ranks did with them.
# (SIGUSR1 warns of a time limit: ranks that called resume() answer it by stopping; ranks that finish have no need.)
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


class _Received(list):
    """The signals received that ask to stop (or warn), in order; ``wake``: a pipe's read end that any signal the
    caller handles makes readable (signal.set_wakeup_fd), or None."""

    wake: int | None = None


@contextlib.contextmanager
def _forwarding_signals(procs: list) -> Iterator[_Received]:
    """While ranks run, pass FORWARDED_SIGNALS the caller gets (where it has no handler of its own) on to them;
    the list yielded holds the signals received that ask to stop (or warn), in order.

    A signal may be delivered to any thread of the caller that does not block it (the rendezvous store's own, for
    one), and Python runs its handler in the main thread only once that thread runs again: waiting for the ranks,
    it would not, for as long as they run. So every signal also writes to a pipe the wait listens to."""
    received = _Received()
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def forward(signum: int, frame: Any) -> None:
        if signum != signal.SIGUSR2 and signum not in received:
            received.append(signum)
        _forward(procs, signum)

    previous = {}
    for sig in FORWARDED_SIGNALS:
        if signal.getsignal(sig) is signal.SIG_DFL:
            previous[sig] = signal.signal(sig, forward)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not when the user handles Ctrl-C
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, _on_ctrl_c(procs, received))
    wake, woken = os.pipe()
    os.set_blocking(wake, False)
    os.set_blocking(woken, False)
    previous_wakeup = signal.set_wakeup_fd(woken, warn_on_full_buffer=False)
    received.wake = wake
    try:
        yield received
    finally:
        signal.set_wakeup_fd(previous_wakeup)
        os.close(wake)
        os.close(woken)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _on_ctrl_c(procs: list, received: list[int]) -> Callable[[int, Any], None]:
    """The caller's SIGINT handler while ranks run. When every rank can stop cleanly (it called resume(), which
    handles SIGTERM by saving at its next check point), the first Ctrl-C asks them to, as a scheduler's SIGTERM does;
    otherwise, and at the second Ctrl-C, KeyboardInterrupt as usual (the ranks are stopped at once)."""

    def interrupt(signum: int, frame: Any) -> None:
        if received or not _can_stop_cleanly(procs):
            raise KeyboardInterrupt
        received.append(signal.SIGINT)
        print(
            "qaccel: Ctrl-C: every rank finishes what it is doing, saves its state and stops (Ctrl-C again stops "
            "them at once)",
            file=sys.stderr,
            flush=True,
        )
        _forward(procs, signal.SIGTERM)

    return interrupt


def _can_stop_cleanly(procs: list) -> bool:
    """True when every running rank handles SIGTERM (Linux's /proc tells which signals a process catches)."""
    running = [proc for proc in procs if proc.pid is not None and proc.exitcode is None]
    if not running:
        return False
    for proc in running:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
        except OSError:
            return False
        caught = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0")
        if not int(caught, 16) >> (signal.SIGTERM - 1) & 1:
            return False
    return True


def _interrupted(stop: Preempted) -> KeyboardInterrupt:
    """What a Ctrl-C that stopped the ranks cleanly raises in the caller: a KeyboardInterrupt saying where they saved."""
    exc = KeyboardInterrupt()
    exc.add_note(f"[qaccel] the ranks saved their state to {stop.checkpoint} and stopped: run again to resume")
    return exc


def _forward(procs: list, signum: int) -> None:
    for proc in procs:
        if proc.pid is not None and proc.exitcode is None:
            try:
                os.kill(proc.pid, signum)
            except ProcessLookupError:
                pass


def _die_of(signum: int) -> None:
    """End this process as ``signum``'s default action would have (the ranks were stopped and cleaned up first)."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    raise SystemExit(128 + signum)  # for a signal whose default action is not to terminate


@contextlib.contextmanager
def _sigint_after() -> Iterator[None]:
    """Hold Ctrl-C back for the block (in the main thread), and raise it when the block ends: while the call is
    pickled, where it was lost (the launch went on as if none had come: tests/launch/test_interrupt.py,
    "forkserver importing"), and while a rank's process is started (below)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # Blocking SIGINT in this thread is not enough: another thread of the caller's can take it, and Python then
    # runs the handler in this thread at its next instruction, inside the block. That raised KeyboardInterrupt
    # in start() after the forkserver had forked the rank: a rank whose pid the caller never learnt, left waiting
    # for its peers (seen under load). So the handler only notes the Ctrl-C until the block ends.
    came: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: came.append(signum))
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
        if came:
            signal.raise_signal(signal.SIGINT)  # the Ctrl-C, now, to the handler it was meant for


def _dumps_payload(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """fn, its arguments and the caller's top-level settings, pickled; a failure names the argument at fault.

    Settings that cannot travel (a warnings category of the script holding a lock, say) do not stop the launch:
    the ranks then start with their own, and the caller is warned.
    """
    settings = inherit.capture()
    try:
        return pickling.dumps((settings, fn, args, kwargs))
    except Exception as exc:  # noqa: BLE001 - whatever stops pickling the settings: warned, the call goes alone
        payload = pickling.dumps_call(fn, args, kwargs)
        warnings.warn(
            f"qaccel: the caller's top-level settings (logging, warnings filters, RNG states, ...) cannot "
            f"be sent to the ranks ({exc}); the ranks start with their own",
            stacklevel=4,
        )
        return payload


def _loopback_store(timeout: float) -> dist.TCPStore:
    """The rendezvous store, listening on 127.0.0.1 only, on a port the kernel picked and that is never released
    before the store owns it: no bind-close-rebind race between concurrent launches."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    fd = sock.detach()
    try:
        return dist.TCPStore(
            "127.0.0.1",
            port,
            None,
            True,
            datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
            master_listen_fd=fd,
        )
    except BaseException:
        # A Ctrl-C can land after the store took the socket over and closed it on its way out: then closing it
        # again fails (EBADF), and that error must not replace the KeyboardInterrupt (seen in CI).
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def _start_without_main(proc: multiprocessing.process.BaseProcess) -> None:
    """Start ``proc`` without making it re-import the caller's ``__main__`` (fn already travels by value)."""
    original = multiprocessing.spawn.get_preparation_data

    def preparation_data(name: str) -> dict:
        data = original(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    # A Ctrl-C in the middle of start() would leave the forkserver's new child reading a half-sent request: it
    # prints an EOFError traceback of its own beside the caller's. SIGINT is held back until start() returns.
    with _PREPARE_LOCK, _sigint_after():
        multiprocessing.spawn.get_preparation_data = preparation_data
        try:
            proc.start()
        finally:
            multiprocessing.spawn.get_preparation_data = original


def _supervise(procs: list, readers: list, run_dir: str, wake: int | None = None) -> list[RankFailure]:
    """Wait for every rank; return at the first failure that can be a cause (empty: all succeeded).

    When the first failures are only peers losing their connection, listen CAUSE_GRACE_S longer: the rank that
    broke the group usually reports just after them (its ``finally`` blocks run first), and stopping it then
    would lose the real error. ``wake`` (readable when a signal came) ends a wait so that its handler runs.
    """
    sentinels = {proc.sentinel: rank for rank, proc in enumerate(procs)}
    open_readers = {reader: rank for rank, reader in enumerate(readers)}
    failures: list[RankFailure] = []
    deadline: float | None = None
    while sentinels:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready_now = multiprocessing.connection.wait(
            [*sentinels, *open_readers, *([wake] if wake is not None else [])], timeout
        )
        if not ready_now:
            break  # the grace period is over: the symptoms are all there is
        if wake in ready_now:
            _drain(wake)  # the signal's handler ran on the way back from the wait (or runs now, in this thread)
        for ready in ready_now:
            if ready in open_readers:
                rank = open_readers.pop(ready)
                try:
                    cast(multiprocessing.connection.Connection, ready).recv()  # a key of open_readers: a rank's pipe
                    failures.append(RankFailure(rank, _read_report(run_dir, rank)))
                except EOFError:
                    pass
            elif ready in sentinels:
                rank = sentinels.pop(ready)
                procs[rank].join()
                if procs[rank].exitcode != 0:
                    failures.append(RankFailure(rank, _read_report(run_dir, rank), procs[rank].exitcode))
        if failures:
            if not all(f.is_symptom or f.is_stop for f in failures):
                return failures
            deadline = deadline or time.monotonic() + CAUSE_GRACE_S
    return failures


def _drain(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):
        while os.read(fd, 512):
            pass


def _stop(procs: list, failed: bool) -> None:
    """Stop each rank's process group (the rank and whatever it started), also after a success: a worker or pool
    a rank left behind goes with it. SIGTERM first, SIGKILL for what is left after a grace period.

    After a failure a rank still running is SIGKILLed at once, as its peers are gone: one that called resume()
    would take SIGTERM as a request to save at its next check point (which it cannot reach), and meanwhile its DataLoader
    would report its workers' deaths. Nothing it saved is lost: checkpoints are written aside and renamed.
    """
    started = [p for p in procs if p.pid is not None]
    if failed:
        for proc in started:
            if proc.exitcode is None:
                _signal_rank(proc, signal.SIGKILL, group=False)
    for proc in started:
        _signal_rank(proc, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in started:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in started:
        _signal_rank(proc, signal.SIGKILL)
        proc.join()


def _signal_rank(proc: multiprocessing.process.BaseProcess, sig: signal.Signals, group: bool = True) -> None:
    """Signal a rank's process group (its id is the rank's pid), and the rank itself in case it has not made
    its group yet; groups and ranks already gone are skipped."""
    if group:
        try:
            os.killpg(cast(int, proc.pid), sig)  # set: _stop signals only the ranks that started
        except (ProcessLookupError, PermissionError):
            pass
    if proc.exitcode is None:
        try:
            os.kill(cast(int, proc.pid), sig)
        except ProcessLookupError:
            pass


def _failure_exception(run_dir: str, world_size: int, seen: list[RankFailure]) -> tuple[BaseException, int]:
    """The exception to raise in the caller and its rank: the root cause, with rank and remote traceback attached.

    Read once the ranks are stopped: a rank seen dying may have reported just before, and ranks stopped on the
    way may have reported too (those count only if they did: being stopped is not a failure).
    """
    seen_ranks = {f.rank for f in seen}
    failures = [RankFailure(f.rank, _read_report(run_dir, f.rank), f.exitcode) for f in seen]
    failures += [
        RankFailure(rank, report)
        for rank in range(world_size)
        if rank not in seen_ranks and (report := _read_report(run_dir, rank)) is not None
    ]
    return cause_exception(failures, world_size, launched=True)


def _read_result(run_dir: str, rank: int) -> Any:
    path = Path(run_dir, f"result-{rank}")
    if not path.exists():
        raise RankError(f"rank {rank} exited with code 0 without returning (os._exit in fn?)", rank)
    data = path.read_bytes()
    try:
        return pickle.loads(data)
    except Exception as exc:
        raise RankError(f"rank {rank}'s result could not be unpickled in the caller: {exc!r}", rank) from exc


def _read_report(run_dir: str, rank: int) -> ErrorReport | None:
    path = Path(run_dir, f"error-{rank}")
    return pickle.loads(path.read_bytes()) if path.exists() else None
