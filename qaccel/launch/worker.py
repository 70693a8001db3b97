"""What a rank process started by qaccel sets up before user code runs, so that it looks like a torchrun worker.

- **Own session and process group**, as torchrun's agent gives each worker (``start_new_session``): the launcher
  stops a rank by signalling its group, so the DataLoader workers and pools it started stop with it.
- **``fork`` for the processes a rank creates** (DataLoader workers, ``multiprocessing`` pools), as a torchrun
  worker on Linux gets. A rank never re-imports the user's script (fn travels by value), so a child started with
  spawn or forkserver could not find a Dataset class defined in the script; a forked child inherits it. Forking
  is also what makes an epoch's workers start in milliseconds. It is CUDA-safe in the way torchrun's is: workers
  forked from a rank that uses CUDA must not use CUDA themselves (torch raises "Cannot re-initialize CUDA in
  forked subprocess"); DataLoader workers don't, and pinning runs in a thread of the rank.
- **Ctrl-C raises KeyboardInterrupt**, as in any Python process: the forkserver it was forked from ignores SIGINT
  (so that a Ctrl-C while it imports torch does not print a second traceback), and that setting is undone here.
- **Output that survives a stop**: stdout is line-buffered (each line reaches the caller whole and at once, so
  lines of two ranks never split each other), and both streams are flushed before a failure is reported.
- **torch._dynamo imported with the garbage collector paused** (a third faster) when the rank needs it (an
  optimizer's or DDP's constructor) and was forked before the server had imported it (a first launch, see
  server.serving).
- **SIGTERM kills at once** (its default action, as in a torchrun worker). A Python-level handler would run only
  between bytecodes: a rank blocked in a collective would wait for the SIGKILL, and a forked child that inherits
  it can miss the signal while it starts, which left ``multiprocessing.Pool.__exit__`` waiting forever for a
  worker about 1 run in 6.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cloudpickle
import torch.distributed as dist

from qaccel import imports, storage
from qaccel.comm import session
from qaccel.environment import STARTED_BY_QACCEL, Environment, Kind, qaccel_run_id, rank_variables
from qaccel.errors import ErrorReport
from qaccel.launch import caller_state, inherit, output
from qaccel.launch.running import run_as_rank
from qaccel.options import Config

CHILD_START_METHOD = "fork"


def become_worker(environ: dict[str, str], umask: int) -> None:
    """Turn this freshly started rank process into a torchrun-like worker with environment ``environ`` and the
    caller's ``umask`` (the server it was forked from has the one of its own start)."""
    os.setsid()
    os.umask(umask)
    imports.import_quietly_when_needed()  # forked before the server imported torch._dynamo: see server.serving
    os.environ.clear()
    os.environ.update(environ)
    multiprocessing.set_start_method(CHILD_START_METHOD, force=True)
    output.whole_lines()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a spawned rank inherits the caller's mask


@dataclass(frozen=True)
class RankSpec:
    """What one rank process is told at start, through the forkserver's pipe (no one else can read it); everything
    else it reads from the run directory."""

    run_dir: str
    rank: int
    world_size: int
    port: int  # the caller's TCPStore, MASTER_PORT: for code of the user's that joins env:// itself, as under torchrun
    config: Config
    keep_result: bool
    plain: Callable[[Any], Any]  # what an object of the result is outside its rank (protocol.HandBack.pickled)
    environ: dict[str, str]
    store: str  # the file the ranks' group meets in (a FileStore in the private run directory); "": the TCPStore
    key: bytes  # seals qaccel's keys in that store (comm/sealed.py)
    umask: int  # the caller's, at the launch


def _torchrun_extras(spec: RankSpec) -> dict[str, str]:
    """The rest of what torchrun gives a worker, so that third-party code takes a rank for one: a run id
    (``torch.distributed.is_torchelastic_launched()``, which Lightning reads), the store to join for ``env://``
    (qaccel's, at MASTER_PORT) and NCCL's error handling, each unless the caller set it; and the marker of a qaccel
    rank (environment.STARTED_BY_QACCEL). The thread count follows in rank_main."""
    extras = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    return {
        **extras,
        **spec.environ,
        "TORCHELASTIC_RUN_ID": qaccel_run_id(os.path.basename(spec.run_dir)),
        STARTED_BY_QACCEL: str(os.getppid()),
    }


def _watch_caller(lifeline: multiprocessing.connection.Connection) -> None:
    """SIGKILL this rank once the caller's end of ``lifeline`` closes: a dead caller leaves no rank behind.

    (PR_SET_PDEATHSIG cannot do this: a forkserver child's parent is the forkserver, which itself stays up
    while any of its children holds the caller's 'alive' fd.)
    """
    try:
        lifeline.recv_bytes()
    except (EOFError, OSError):
        pass
    os.killpg(0, signal.SIGKILL)  # this rank's group: the rank and what it started


def rank_main(
    spec: RankSpec,
    caller: multiprocessing.connection.Connection,
    streams: tuple[multiprocessing.connection.Connection, ...] | None = None,
) -> None:
    """Entry point of a rank process: set up the rank, run fn, record its result or its exception. ``streams``:
    the caller's pipes for its stdout and stderr (rank_prefix)."""
    if streams is not None:
        output.redirect(streams)
    config = spec.config
    layout = Environment(
        Kind.PLAIN,
        rank=spec.rank,
        local_rank=spec.rank,
        world_size=spec.world_size,
        local_world_size=spec.world_size,
        master_addr="127.0.0.1",
        master_port=spec.port,
    )
    become_worker({**spec.environ, **rank_variables(layout), **_torchrun_extras(spec)}, spec.umask)
    threads, _ = session.thread_budget(spec.world_size)
    if threads is not None:  # torchrun exports 1; qaccel's budget, for what the rank starts and reads it
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    threading.Thread(target=_watch_caller, args=(caller,), name="qaccel-lifeline", daemon=True).start()
    loopback = session.loopback_interface()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback)
    ctx = session.rank_context(
        spec.rank, spec.rank, 0, spec.world_size, spec.world_size, config.device_type, config.backend
    )

    def store(session_number: int) -> dist.Store:
        timeout = datetime.timedelta(seconds=config.timeout)
        if not spec.store:
            return dist.TCPStore("127.0.0.1", spec.port, None, False, timeout=timeout)
        opened = dist.FileStore(spec.store, -1)  # in the run directory (0700): no other user can open it
        opened.set_timeout(timeout)
        return opened

    def body() -> None:
        caller_state.forget_inherited()
        settings, fn, args, kwargs = pickle.loads(Path(spec.run_dir, "payload").read_bytes())
        if settings is not None:
            inherit.apply(settings)
        inherit.adopt_script(settings, fn, args, kwargs)
        result = fn(*args, **kwargs)
        if spec.keep_result:
            storage.write_bytes(
                _dumps_result(result, spec.rank, spec.plain), Path(spec.run_dir, f"result-{spec.rank}"), durable=False
            )

    try:
        run_as_rank(ctx, config, body, _CallerReport(spec, caller), store, key=spec.key, process_ends=True)
    except BaseException:  # noqa: BLE001 - run_as_rank has reported it to the caller already
        raise SystemExit(1) from None


class _ResultPickler(cloudpickle.Pickler):
    """cloudpickle, with prepared objects given back as the user's own (a DDP model as its module): the caller
    has no process group to rebuild them in."""

    def __init__(self, file: io.BytesIO, plain: Callable[[Any], Any]) -> None:
        super().__init__(file)
        self.plain = plain

    def reducer_override(self, obj: Any) -> Any:
        plain = self.plain(obj)
        if plain is not obj:
            return _same, (plain,)
        return super().reducer_override(obj)


def _same(obj: Any) -> Any:
    return obj


def _dumps_result(result: Any, rank: int, plain: Callable[[Any], Any]) -> bytes:
    buffer = io.BytesIO()
    try:
        _ResultPickler(buffer, plain).dump(result)
    except Exception as exc:
        raise TypeError(f"rank {rank}'s return value ({type(result).__name__}) cannot be pickled: {exc}") from exc
    return buffer.getvalue()


class _CallerReport:
    """A failure, written to the run directory for the caller and announced on the lifeline at once (teardown may
    still take a while). The rank's output is flushed first: the caller stops it as soon as it hears."""

    def __init__(self, spec: RankSpec, caller: multiprocessing.connection.Connection) -> None:
        self.spec, self.caller = spec, caller

    def early(self, exc: BaseException) -> None:
        output.flush_std_streams()
        report = pickle.dumps(ErrorReport.of(self.spec.rank, exc))
        storage.write_bytes(report, Path(self.spec.run_dir, f"error-{self.spec.rank}"), durable=False)
        try:
            self.caller.send(self.spec.rank)
        except OSError:
            pass

    def late(self, exc: BaseException, reported_early: bool) -> None:
        if not reported_early:
            self.early(exc)
