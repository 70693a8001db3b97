"""Checkpoints written in the background: save_state(background=True) returns once the state is copied aside, and a
thread of each rank writes the files while training goes on; the checkpoint is complete, as any, once its marker is.

The copy puts every tensor into CPU memory, a CPU tensor's too (the next optimizer step changes those in place:
torch #144657): into the memory the save before used when the tensor still fits it (Staging), so a rank holds one
copy of its state from its first background save until free_memory() or the end of the session. The
thread runs at the lowest priority (NICE): it writes with what training leaves of the cores. The threads talk over a
gloo group of their own, made at the first background save of the session: their collectives must not interleave
with the training's on the default group. One save is in flight at a time: save_state(), load_state() and the
session's end wait for it.

A failed save is raised on every rank at the same step: while one is in flight, each prepared optimizer's step()
asks every rank (one small all-reduce) whether theirs ended, and once all have, raises the failure there. A save,
a load, wait_for_checkpoint() and the end of the distribute() call raise it too.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import datetime
import functools
import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from qaccel.comm import collectives, session
from qaccel.comm.session import RankContext
from qaccel.environment import usable_cores
from qaccel.nested import map_leaves

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

    from qaccel.train.registry import Registry

_CPU = torch.device("cpu")
NICE = 19  # the writing thread yields the cores to training: it writes in what training leaves idle
COPIERS = 8  # at most: threads copying a rank's CPU tensors into staging memory (no more than its cores)
PIECE = 32 * 2**20  # bytes: what one copier copies at a time


class Peers:
    """How the ranks of one save agree: through the session's collectives (a blocking save, in the training's own
    thread), or through ``group``, the background threads' own; a world of one has nobody to ask."""

    def __init__(self, ctx: RankContext, group: Any = None) -> None:
        self.ctx, self.group = ctx, group

    def gather(self, obj: Any) -> list[Any]:
        if self.group is None:
            return collectives.gather_object(obj, self.ctx)
        out: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        if self.group is None:
            return collectives.broadcast(obj, 0, self.ctx)
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


class Flight:
    """One background save: the checkpoint it writes, its thread, and what it raised."""

    def __init__(self, target: str, step: int) -> None:
        self.target, self.step = target, step
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def run(self, write: Callable[[Peers], None], peers: Peers) -> None:
        with contextlib.suppress(OSError, AttributeError):  # Linux: a thread's own nice value; elsewhere as it is
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        try:
            write(peers)
        except BaseException as exc:  # noqa: BLE001 - raised in the training's thread (outcome)
            self.error = exc

    def ended(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def outcome(self) -> str:
        """Wait for the save; its checkpoint's path, or its failure raised."""
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            self.error.add_note(
                f"[qaccel] raised by the background save of {self.target} (save_state at step "
                f"{self.step}); the checkpoint before it stands"
            )
            raise self.error
        return self.target


class Staging:
    """One rank's staging memory: a copy of each tensor of the state, kept from one background save to the next and
    copied into again while the tensor keeps its shape, dtype and layout, so that a later save copies into memory
    already touched (1.2 GB takes 0.4-2.3 s into new memory on a VM that hands free pages back to its host, 0.08 s
    into memory already touched). At most one copy of the state: a buffer the save does not use is dropped as it
    copies. CPU tensors are copied by up to COPIERS threads (no more than the rank's cores), in pieces of at most
    PIECE bytes: a rank's torch runs on its share of the cores (one each for two ranks on two), and a copy is bound
    by memory, not compute (0.18 s for 1.2 GB with two threads here, 0.30-0.41 s with torch's one). On CUDA:
    pinned memory, filled by copies queued on the current stream (work queued after the call waits for them in
    order) and waited for by the writing thread (``wait``), so the call does not wait for the transfer.

    Written here rather than with torch.distributed.checkpoint's DefaultStager, whose cache also keeps a copy per
    tensor, because its copy of an FSDP2 shard (a DTensor) raised ``KeyError: <class 'type'>`` on CUDA with torch
    2.11; a shard is staged by its own ``to("cpu", copy=True)`` here, which keeps its mesh and placements, and copied
    into through its local tensor later."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.staged: list[torch.Tensor | None] = []  # by the tensor's place in the state (each tensor once)
        self.copied: Any = None  # the CUDA event after the last save's copies, None on the CPU
        self._copiers: concurrent.futures.ThreadPoolExecutor | None = None
        self.threads = min(COPIERS, usable_cores())

    def copy(self, state: Any) -> Any:
        """``state`` with every tensor in staging memory (one tensor met twice is copied once), the rest deep
        copied."""
        memo: dict[int, Any] = {}
        used: list[torch.Tensor | None] = []
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (into, from)

        def stage(leaf: Any) -> Any:
            if isinstance(leaf, torch.Tensor) and id(leaf) not in memo:
                place = len(used)
                kept = self.staged[place] if place < len(self.staged) else None
                if kept is not None:
                    self.staged[place] = None  # dropped now if it does not fit: one copy at most
                memo[id(leaf)] = _staged(leaf.detach(), kept, self.pin, copies)
                used.append(memo[id(leaf)])
            return leaf

        with torch.no_grad():
            map_leaves(state, stage)
            self._copy(copies)
        self.staged = used
        return copy.deepcopy(state, memo)

    def _copy(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Make ``copies``: CUDA ones queued (an event marks their end), CPU ones by the copiers, in pieces."""
        self.copied = None
        pieces = []
        for into, source in copies:
            if source.is_cuda:
                into.copy_(source, non_blocking=self.pin)
                self.copied = self.copied or torch.cuda.Event()
            else:
                pieces += _pieces(into, source)
        if self.copied is not None:
            self.copied.record()
        if len(pieces) > 1 and self.threads > 1:
            if self._copiers is None:
                self._copiers = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="qaccel-stage")
            list(self._copiers.map(lambda piece: piece[0].copy_(piece[1]), pieces))
        else:
            for into, source in pieces:
                into.copy_(source)

    def wait(self) -> None:
        """Wait until the last copy is in staging memory (in the writing thread)."""
        if self.copied is not None:
            self.copied.synchronize()

    def close(self) -> None:
        """Let the copiers go (the memory goes with the last reference to this object)."""
        if self._copiers is not None:
            self._copiers.shutdown(wait=False)
            self._copiers = None


def _pieces(into: torch.Tensor, source: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``into.copy_(source)`` as copies of at most PIECE bytes each (one copy unless both are contiguous)."""
    count = into.numel()
    step = max(1, PIECE // max(1, into.element_size()))
    if count <= step or not (into.is_contiguous() and source.is_contiguous()):
        return [(into, source)]
    flat_into, flat_source = into.view(-1), source.view(-1)
    return [(flat_into[i : i + step], flat_source[i : i + step]) for i in range(0, count, step)]


def _staged(
    tensor: torch.Tensor, kept: torch.Tensor | None, pin: bool, copies: list[tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """Where ``tensor`` is staged: ``kept`` when it fits, else new CPU memory; the copy into it added to ``copies``
    (a DTensor's first copy made here)."""
    plain = type(tensor) is torch.Tensor and tensor.layout is torch.strided and not tensor.is_quantized
    if kept is not None and _fits(tensor, kept, plain):
        if plain:
            copies.append((kept, tensor))
        else:  # a DTensor: _fits takes no other kind
            copies.append((cast("DTensor", kept).to_local(), cast("DTensor", tensor).to_local()))
        return kept
    if not plain:  # a DTensor copies its shard and keeps its mesh and placements; sparse and quantized ones too
        return tensor.to("cpu", copy=True)
    into = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
    copies.append((into, tensor))
    return into


def _fits(tensor: torch.Tensor, kept: torch.Tensor, plain: bool) -> bool:
    """Whether ``kept`` can take a copy of ``tensor``: the same kind, shape and dtype (a DTensor's shard and layout
    too; other kinds are copied anew each time)."""
    if type(kept) is not type(tensor) or kept.shape != tensor.shape or kept.dtype != tensor.dtype:
        return False
    if plain:
        return True
    placements = getattr(tensor, "placements", None)
    if placements is None:
        return False
    dtensor, dkept = cast("DTensor", tensor), cast("DTensor", kept)  # with placements: DTensors (of one type)
    return (
        placements == dkept.placements
        and dtensor.device_mesh == dkept.device_mesh
        and dtensor.to_local().shape == dkept.to_local().shape
    )


class Saves:
    """One Accelerator's background saves in a session (its Registry's ``saves``): the save in flight, how their
    threads talk (from the session's first save), and the staging memory kept from one save to the next."""

    def __init__(self) -> None:
        self.flight: Flight | None = None
        self.peers: Peers | None = None
        self.staging: Staging | None = None

    def poll(self) -> None:
        """At a step, on every rank: raise the failure of a save in flight once it ended on every rank, or forget
        it. Nothing else is done without a save in flight: this runs at every optimizer step."""
        if self.flight is None:
            return
        ctx = session.current()
        ended = self.flight.ended()
        if ctx is not None and ctx.world_size > 1:
            run = session.current_run()
            if run is not None and run.alone is not None:  # a step only some ranks take: ask at the next one
                return
            ended = bool(collectives.all_reduce_dict({"ended": int(ended)}, "min", ctx, _CPU)["ended"])
        if ended:
            self.wait()

    def wait(self) -> str | None:
        """Wait for the save in flight, if any: its checkpoint's path (None without one), or its failure raised."""
        flight, self.flight = self.flight, None
        return None if flight is None else flight.outcome()

    def settle(self) -> None:
        """wait(), its failure said on stderr instead of raised."""
        flight = self.flight
        if flight is None:
            return
        try:
            self.wait()
        except Exception as exc:  # noqa: BLE001 - said, with the checkpoint it concerns
            sys.stderr.write(f"qaccel: the background save of {flight.target} failed: {type(exc).__name__}: {exc}\n")
            sys.stderr.flush()

    def close(self) -> None:
        """The session's objects go: the staging memory with them."""
        if self.staging is not None:
            self.staging.close()
        self.staging = None


def saves_of(registry: Registry) -> Saves:
    """The registry's background saves, made at its first."""
    if registry.saves is None:
        registry.saves = Saves()
    return cast(Saves, registry.saves)  # the only kind the registry is given


def staging_of(registry: Registry) -> Staging | None:
    """The staging memory an earlier background save left, if any."""
    return None if registry.saves is None else saves_of(registry).staging


def stage(registry: Registry, state: Any, device: torch.device) -> Any:
    """``state`` copied into this rank's staging memory, made at its first background save and kept until
    free_memory() or the end of the session."""
    saves = saves_of(registry)
    if saves.staging is None:
        saves.staging = Staging(pin=device.type == "cuda")
    return saves.staging.copy(state)


def start(registry: Registry, ctx: RankContext, target: str, write: Callable[[Peers], None]) -> None:
    """Run ``write`` in this rank's background thread (every rank calls this, after any save in flight ended)."""
    saves = saves_of(registry)
    if saves.peers is None:
        run, group = session.current_run(), None
        if collectives.is_distributed():  # a collective on the default group: every rank is here
            timeout = datetime.timedelta(seconds=run.timeout if run is not None else 1800.0)
            group = dist.new_group(backend="gloo", timeout=timeout)
        saves.peers = Peers(ctx, group)
        if run is not None:  # after the registry's own closer, so it runs first: the group is still there
            run.closers.append(functools.partial(_end, saves))
    flight = Flight(target, registry.updates)
    flight.thread = threading.Thread(target=flight.run, args=(write, saves.peers), name="qaccel-save")
    saves.flight = flight
    flight.thread.start()


def wait(registry: Registry) -> str | None:
    """Wait for the save in flight, if any: its checkpoint's path (None without one), or its failure raised."""
    return None if registry.saves is None else saves_of(registry).wait()


def settle(registry: Registry) -> None:
    """Wait for the save in flight; say its failure on stderr instead of raising it (what comes next matters more:
    a stop's own save, or the error that ends the call)."""
    if registry.saves is not None:
        saves_of(registry).settle()


def _end(saves: Saves, finished: bool) -> None:
    """The session ends: wait for the save in flight and raise its failure (said, when fn raised: fn's error is
    the one raised); the threads' group goes."""
    peers, saves.peers = saves.peers, None
    try:
        if finished:
            saves.wait()
        else:
            saves.settle()
    finally:
        if peers is not None and peers.group is not None and collectives.is_distributed():
            with contextlib.suppress(Exception):  # a group renewed after a rank left (session.renew_group) took it
                dist.destroy_process_group(peers.group)
