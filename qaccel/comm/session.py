"""One rank's runtime: which rank it is, its device, its CPU thread budget and its process group."""

from __future__ import annotations

import contextvars
import datetime
import functools
import gc
import itertools
import os
import socket
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# Imported before any group exists, on purpose: its functions take `group=group.WORLD` as a default argument, so an
# import with a live group (torch.distributed.checkpoint imports it) holds that group in ten defaults for good,
# and a group left with destroy_process_group() keeps its gloo connections open: peers waiting on this rank would
# wait until their timeout instead of failing at once (the batch-size search relies on that).
import torch.distributed.nn.functional

from qaccel.comm import hangs, sealed
from qaccel.environment import Environment, gpus, usable_cores
from qaccel.options import Backend, DeviceType


@dataclass(frozen=True)
class RankContext:
    """Where one rank runs; what the Accelerator's properties report."""

    rank: int
    local_rank: int
    node_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: Backend | None  # None only in a cluster job's caller: its nodes decide


@dataclass(eq=False)
class Run:
    """One session of this rank (one distribute() call): where it runs, and what its Accelerators keep for it.

    Prepared objects, accumulation counters and loop marks live here, so a second session in the same process
    (notebook, torchrun, srun, nprocs=1) starts clean instead of inheriting the first one's.
    """

    ctx: RankContext
    # this session's place among the process's sessions; every rank starts them in the same order, so the
    # number agrees across ranks and keeps each session's keys in a shared store apart
    number: int = 0
    _states: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    # Called once as the session ends, the last added first, with whether fn returned: e.g. a stop is agreed
    # and saved before the group goes, and signal handlers are given back.
    closers: list[Callable[[bool], None]] = field(default_factory=list)
    debug: bool = False  # check each qaccel collective's agreement across ranks first (collectives.tracked)
    timeout: float = 1800.0  # seconds a collective of the session's group waits
    # Why a collective now would wait forever (a loop step only some ranks take, even_batches=False); None: fine.
    alone: str | None = None
    # qaccel's keys in the group's rendezvous store, sealed with the launch's key; None in a world of one, or
    # for a group made without a store (MPI's)
    store: sealed.Sealed | None = None
    watch: hangs.Watch | None = None  # says where this rank is when asked; None in a world of one
    # What holds this session's process group (prepared DDP and FSDP models): see release().
    bound: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    _keys: Iterator[int] = field(default_factory=itertools.count)

    # One list per distribute() called inside fn (a Trainer's fit in a distributed function): what ends with it.
    calls: list[list[Callable[[bool], None]]] = field(default_factory=list)

    def close(self, finished: bool) -> None:
        closers, self.closers = self.closers, []
        try:
            _close_all(closers, finished)
        finally:
            self._states.clear()

    def at_call_end(self, close: Callable[[bool], None]) -> None:
        """Call ``close`` when the innermost distribute() running in this session returns (or raises): a stop on a
        signal ends with the call that armed it."""
        (self.calls[-1] if self.calls else self.closers).append(close)

    @contextmanager
    def call(self) -> Iterator[None]:
        """A distribute() inside fn: what it arms ends with it (see at_call_end)."""
        self.calls.append([])
        finished = False
        try:
            yield
            finished = True
        finally:
            _close_all(self.calls.pop(), finished)

    def key(self, kind: str) -> str:
        """A prefix of store keys for one ``kind`` of use in this session, the same on every rank (each asks for
        its keys in the same order)."""
        return f"{kind}/{self.number}/{next(self._keys)}/"

    def release(self) -> None:
        """Destroy what holds the session's group while the group still exists; mark what the user keeps.

        A DDP model is a reference cycle, so it is freed by the cyclic garbage collector, not when its last name
        goes. Left to run later, the collector may run in a DataLoader worker forked by a later session: the worker
        then destroys the old group's copy and crashes or hangs on threads that do not exist in it. So the
        collector runs here when something bound to the group is still alive (about 0.1 s with torch loaded).
        What outlives it is held by the user (a global, a traceback); forked children never collect it (below).
        """
        if len(self.bound):
            gc.collect()
        _outliving.update(self.bound)

    def forget(self, owner: Any = None) -> None:
        """Release and drop ``owner``'s state (every owner's by default): it is made anew on next use."""
        owners = list(self._states) if owner is None else [id(owner)]
        for key in owners:
            entry = self._states.pop(key, None)
            if entry is not None and callable(getattr(entry[1], "release", None)):
                entry[1].release()

    def state_for(self, owner: Any, make: Callable[[], Any]) -> Any:
        """``owner``'s state in this run, made on first use (the owner is kept alive, so its id stays unique)."""
        entry = self._states.get(id(owner))
        if entry is None:
            entry = self._states[id(owner)] = (owner, make())
        return entry[1]


def _close_all(closers: list[Callable[[bool], None]], finished: bool) -> None:
    """Run ``closers``, the last added first (a stop saves what its Accelerator's registry holds, so it runs before
    the registry is released), every one even if one raises (a stop raises Preempted); then raise the first error."""
    failure: BaseException | None = None
    for close in reversed(closers):
        try:
            close(finished)
        except BaseException as exc:  # noqa: BLE001 - every closer runs; the first failure is raised after them
            failure = failure or exc
    if failure is not None:
        raise failure


GLOO_DRAIN_S = 0.02
FORK_SETTLE_S = 0.005
_RUN: contextvars.ContextVar[Run | None] = contextvars.ContextVar("qaccel_run", default=None)
# Per process, not per run: the sessions' numbering (see Run.number), and one connection to the launcher's store
# (see env_store).
_numbers = itertools.count(1)
_env_store: tuple[tuple, dist.Store] | None = None
# Objects of this process that hold a destroyed process group, because the user kept them past their session.
_outliving: weakref.WeakSet = weakref.WeakSet()


def _freeze_in_child() -> None:
    """In a forked child: never collect what the parent holds from an ended session (see Run.release).

    gc.freeze() moves every object the child inherited out of the collector's reach, at once; the child's own
    objects are collected as usual.
    """
    if len(_outliving):
        gc.freeze()


def _let_gloo_threads_settle() -> None:
    """Before this process forks (a DataLoader's workers), let gloo's threads finish what needs the interpreter.

    A gloo thread that completed a collective frees the work's tensors; when Python let go of one first, the thread
    makes itself a Python thread state to drop it. A fork in that instant gives a child whose runtime lock stays
    taken: the worker hangs before running any code (CPython gh-112275, fixed in 3.11.8). Releasing the GIL for a
    moment lets such a thread finish; no collective of this rank's main thread is in flight while it forks.
    """
    if (
        sys.version_info < (3, 11, 8)
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_backend() == Backend.GLOO.value
    ):
        time.sleep(FORK_SETTLE_S)


@functools.cache
def _fork_hooks() -> None:
    """Registered once, as the process's first session starts: importing qaccel registers nothing."""
    os.register_at_fork(before=_let_gloo_threads_settle, after_in_child=_freeze_in_child)


def current_run() -> Run | None:
    """The session running in this context, or None outside distribute()."""
    return _RUN.get()


def current() -> RankContext | None:
    """The context of the rank running in this process, or None outside any rank."""
    run = _RUN.get()
    return None if run is None else run.ctx


def explain_timeout(exc: BaseException) -> None:
    """If ``exc`` is a collective's timeout (one qaccel did not make: DDP's, the user's own), add where every rank
    of this session is (hangs.py); qaccel's own collectives did so already."""
    run = _RUN.get()
    if run is not None and run.watch is not None and hangs.is_timeout(exc):
        run.watch.explain(exc, hangs.traceback_frames(exc.__traceback__))


def plan(env: Environment, nprocs: int, device_type: DeviceType | None, backend: Backend | None) -> RankContext:
    """The rank this process is (or, in a plain caller, rank 0 of the world of ``nprocs`` it would launch), on a
    device of ``device_type`` talking over ``backend`` (the resolved options; None: decided on a cluster job's
    nodes)."""
    world, local_world = env.world(nprocs)
    return rank_context(env.rank, env.local_rank, env.node_rank, world, local_world, device_type, backend)


def rank_context(
    rank: int,
    local_rank: int,
    node_rank: int,
    world: int,
    local_world: int,
    device_type: DeviceType | None,
    backend: Backend | None,
) -> RankContext:
    """Rank ``rank`` (``local_rank`` of ``local_world`` on node ``node_rank``) and its device: the GPU it sees, or the
    one its local rank picks (environment/gpus.py)."""
    device = torch.device("cpu")
    if device_type is DeviceType.CUDA:
        choice = gpus.choose(local_rank, local_world, gpus.cuda_device_count(), gpus.node_gpus())
        device = torch.device("cuda", choice.index)
    return RankContext(rank, local_rank, node_rank, world, local_world, device, backend)


def env_store(ctx: RankContext, timeout: float, session_number: int) -> dist.Store:
    """The env:// rendezvous store (torchrun's agent store, or one rank 0 hosts at MASTER_ADDR:MASTER_PORT),
    under a prefix of its own for each in-place session.

    The store is opened once per process and kept: were rank 0 to host a new server for each session, a peer
    that finished the previous session first would reach the old server just before it closed (SLURM, seen
    in CI as "Failed to recv, got 0 bytes"). A second group would also reuse the first one's keys and read a
    peer's stale address, hence the prefix (the session's number).
    """
    global _env_store
    key = tuple(os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")) + (ctx.rank, ctx.world_size)
    if _env_store is None or _env_store[0] != key:
        rendezvous = dist.rendezvous("env://", ctx.rank, ctx.world_size, timeout=datetime.timedelta(seconds=timeout))
        _env_store = (key, next(rendezvous)[0])
    base = _env_store[1]
    base.set_timeout(datetime.timedelta(seconds=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"qaccel/attempt_{attempt}/{session_number}", base)


def loopback_interface() -> str:
    """Name of the loopback interface, so gloo/NCCL never pick an unreachable address for a one-node world."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n.startswith("lo")), "lo")


def thread_budget(local_world_size: int) -> tuple[int | None, str]:
    """CPU threads for each of this node's ranks and why: the user's OMP_NUM_THREADS, else the cores shared
    between the ranks; None with one rank (torch's own default stands)."""
    chosen = os.environ.get("OMP_NUM_THREADS", "")
    if chosen.isdigit() and int(chosen) > 0:
        return int(chosen), f"OMP_NUM_THREADS={chosen} (yours)"
    if local_world_size < 2:
        return None, "torch's default"
    cores = usable_cores()
    return max(1, cores // local_world_size), f"{cores} cores // {local_world_size} local ranks"


def apply_thread_budget(local_world_size: int) -> None:
    """Set this rank's thread budget. The user's value is applied too: a forkserver rank imported torch before it
    saw the variable."""
    threads, _ = thread_budget(local_world_size)
    if threads is not None:
        torch.set_num_threads(threads)


@contextmanager
def session(
    ctx: RankContext,
    timeout: float,
    store: Callable[[int], dist.Store | None] | None = None,
    group_of_one: bool = False,
    debug: bool = False,
    where_to_log: bool = False,
    process_ends: bool = False,
    key: bytes | None = None,
) -> Iterator[RankContext]:
    """Run a block as rank ``ctx``: device, threads and process group set up, always torn down afterwards.

    ``store(number)`` opens the rendezvous store for the session numbered ``number`` (None: a new group finds
    its own). A group the caller had already initialised is reused, and destroyed at the end only if fn destroyed
    it. ``group_of_one``: make a group even for a world of one (FSDP2 shards over a device mesh, which needs one).
    ``debug``: see Run.debug. ``key``: what seals qaccel's keys in the store (sealed.py), the same on every rank;
    None: rank 0 makes one and sends it.
    ``where_to_log``: a rank asked where it is also prints it to its own output (under torchrun and srun, where
    each rank has its log; a plain launch's caller gets the answers in its error instead). ``process_ends``: the
    process exits after the session (a rank qaccel started), so no later session can meet what this one leaves.
    """
    owns_group = False
    asked = _Asked()
    _fork_hooks()
    run = Run(ctx, next(_numbers), debug=debug, timeout=timeout)
    token = _RUN.set(run)
    try:
        opened = store(run.number) if store is not None else None
        if ctx.device.type == "cuda":
            torch.cuda.set_device(ctx.device)
        if (ctx.world_size > 1 or group_of_one) and not dist.is_initialized():
            apply_thread_budget(ctx.local_world_size)
            hook = sys.excepthook
            _init_group(
                ctx.backend,
                store=opened if opened is not None or ctx.world_size > 1 else dist.HashStore(),
                rank=ctx.rank,
                world_size=ctx.world_size,
                timeout=datetime.timedelta(seconds=timeout),
            )
            owns_group = True
            if getattr(hook, "__name__", "") == "_distributed_excepthook":
                sys.excepthook = hook  # torch wraps it at each init: one "[rankN]: " prefix, not one per session
        if ctx.world_size > 1 and dist.is_initialized():
            run.store = _sealed_store(ctx, key)
            run.watch = hangs.Watch(ctx.rank, ctx.world_size, timeout, run.store, where_to_log, run.number)
        with _users_group_calls(ctx, asked) if dist.is_initialized() else nullcontext():
            yield ctx
        run.close(finished=True)
        if owns_group or asked.destroy:
            _quiesce(run)
    finally:
        run.close(finished=False)
        if run.watch is not None:
            run.watch.close()
        _RUN.reset(token)
        if (owns_group or asked.destroy) and dist.is_initialized():
            if not process_ends:
                run.release()
            _destroy_group()


# torch's own, for the session's group: during a session the names in torch.distributed answer the user's calls
_init_group, _destroy_group = dist.init_process_group, dist.destroy_process_group


@dataclass
class _Asked:
    """What fn asked of the session's group: ``destroy``, the default group's end."""

    destroy: bool = False


@contextmanager
def _users_group_calls(ctx: RankContext, asked: _Asked) -> Iterator[None]:
    """A training body written for torchrun makes the default group itself and destroys it at its end; in a session
    the group already exists (qaccel made it, or the caller did before distribute()), so, while fn runs,
    ``dist.init_process_group`` answers with it (after checking that the call asks for this world) and
    ``dist.destroy_process_group()`` leaves it to the session's end, where qaccel's own closing work still needs it
    (gathering every rank's result, freeing what holds the group on every rank before it goes): a group the caller
    made is destroyed there if fn asked. Calls through names bound before the session (``from torch.distributed
    import init_process_group`` at a module's top) reach torch itself, which refuses a second default group."""

    def init_process_group(
        backend: Any = None,
        init_method: Any = None,
        timeout: Any = None,
        world_size: int = -1,
        rank: int = -1,
        store: Any = None,
        group_name: str = "",
        pg_options: Any = None,
        device_id: Any = None,
    ) -> None:
        if not dist.is_initialized():  # the session's group is gone: the call is the user's own
            return _init_group(
                backend, init_method, timeout, world_size, rank, store, group_name, pg_options, device_id
            )
        made = str(dist.get_backend())
        if backend is not None and not _backends(backend) <= _backends(made):
            raise ValueError(
                f"init_process_group(backend={str(backend)!r}) inside distribute(): qaccel already made "
                f"this rank's group with backend {made!r} (choose it with Accelerator(backend=...)); leave "
                "init_process_group out, or let it ask for the same backend"
            )
        for name, value, actual in (("world_size", world_size, ctx.world_size), ("rank", rank, ctx.rank)):
            if value not in (-1, None) and value != actual:
                raise ValueError(
                    f"init_process_group({name}={value}) inside distribute(), whose rank is {ctx.rank} of "
                    f"{ctx.world_size}: the group qaccel made is that world"
                )

    def destroy_process_group(group: Any = None) -> None:
        if group is None or group is dist.GroupMember.WORLD:
            asked.destroy = True  # the session's group: destroyed when the session ends
            return
        _destroy_group(group)

    dist.init_process_group, dist.destroy_process_group = init_process_group, destroy_process_group
    try:
        yield
    finally:
        dist.init_process_group, dist.destroy_process_group = _init_group, _destroy_group


def _backends(name: Any) -> set[str]:
    """The backends a backend string names: "gloo", or "cpu:gloo,cuda:nccl" (each device's)."""
    return {part.split(":")[-1].strip() for part in str(name).lower().split(",")}


def leave_group(ctx: RankContext) -> None:
    """Leave the default group at once, so that the peers' collectives fail instead of waiting for this rank:
    gloo closes its connections; NCCL's communicators are aborted (a destroyed one would leave them waiting)."""
    if not dist.is_initialized():
        return
    if ctx.backend is Backend.NCCL:
        dist.distributed_c10d._abort_process_group()
    else:
        _destroy_group()


def drop_group(run: Run) -> None:
    """Drop what the session prepared (bound to its group), then leave the group: its connections close only once
    nothing holds it."""
    run.forget()
    run.release()
    leave_group(run.ctx)


def renew_group(run: Run, store: dist.Store) -> None:
    """Replace the default group by a new one of the same ranks over ``store`` (after a rank left it).

    What the session prepared is bound to the old group: it is dropped (Run.forget), so that a retried training
    function prepares anew.
    """
    drop_group(run)
    if run.ctx.backend is Backend.GLOO:  # the old group's failed works go before anything forks (see _quiesce)
        gc.collect()
        time.sleep(GLOO_DRAIN_S)
    _init_group(
        run.ctx.backend,
        store=store,
        rank=run.ctx.rank,
        world_size=run.ctx.world_size,
        timeout=datetime.timedelta(seconds=run.timeout),
    )


def _sealed_store(ctx: RankContext, key: bytes | None) -> sealed.Sealed | None:
    """qaccel's keys in the default group's store, sealed with ``key`` or rank 0's (one broadcast as the session
    starts); None for a group made without a store."""
    store = default_store()
    if store is None:
        return None
    return sealed.Sealed(store, key if key is not None else sealed.from_rank_0(ctx.rank, comm_device(ctx)), ctx.rank)


def comm_device(ctx: RankContext) -> torch.device:
    """Where the tensors of a collective live: the rank's GPU under NCCL, else the CPU."""
    return ctx.device if ctx.backend is Backend.NCCL else torch.device("cpu")


def default_store() -> dist.Store | None:
    """The default group's rendezvous store; None for a group made without one (MPI)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def _quiesce(run: Run) -> None:
    """Let every collective finish, everywhere, before the group is torn down.

    torch 2.13's gloo worker threads destroy a finished work object (and the tensors it holds) just after
    marking it complete; if the interpreter is finalising by then, that destructor needs the GIL and the
    process aborts ("terminate called without an active exception", SIGABRT; seen under torchrun in 2 of
    40 plain-torch runs). The barrier completes only after all earlier work has; the short pause lets the
    workers drop it.
    """
    if run.watch is None:
        group_barrier(run.ctx)
    else:  # a rank still busy in fn makes this barrier time out: say where each rank is
        run.watch.run("the barrier that ends distribute() (fn returned)", group_barrier, run.ctx)
    if run.ctx.backend is Backend.GLOO:
        time.sleep(GLOO_DRAIN_S)


def group_barrier(ctx: RankContext) -> None:
    """Block until every rank of the default group gets here (untracked: the session's own, at its end)."""
    if ctx.backend is Backend.NCCL:
        dist.barrier(device_ids=[ctx.device.index])
    else:
        dist.barrier()
