"""Checkpoints written in the background: save_state(background=True) returns once the state is copied aside, and a
thread of each rank writes the files while training goes on; the checkpoint is complete, as any, once its marker is.

The copy puts every tensor into new CPU memory, a CPU tensor's too (the next optimizer step changes those in place:
torch #144657); an FSDP2 shard (a DTensor) is copied by its own to(), which keeps its mesh and placements. It is
dropped when the save ends, so a rank holds at most one copy of its state, and only while a save is in flight. The
thread runs at the lowest priority (NICE): it writes with what training leaves of the cores. The threads talk over a
gloo group of their own, made at the first background save of the session: their collectives must not interleave
with the training's on the default group. One save is in flight at a time: save_state(), load_state() and the
session's end wait for it.

A failed save is raised on every rank at the same step: while one is in flight, each prepared optimizer's step()
asks every rank (one small all-reduce) whether theirs ended, and once all have, raises the failure there. A save,
a load, wait_for_checkpoint() and the end of the distribute() call raise it too.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import functools
import os
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from qaccel.comm import collectives, session
from qaccel.comm.session import RankContext
from qaccel.nested import map_leaves

if TYPE_CHECKING:
    from qaccel.train.registry import Registry

_CPU = torch.device("cpu")
NICE = 19  # the writing thread yields the cores to training: it writes in what training leaves idle


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
            self.error.add_note(f"[qaccel] raised by the background save of {self.target} (save_state at step "
                                f"{self.step}); the checkpoint before it stands")
            raise self.error
        return self.target


def copy_aside(state: Any) -> Any:
    """``state`` with every tensor copied into new CPU memory (one tensor met twice is copied once), the rest deep
    copied."""
    if not state:
        return state
    memo: dict[int, Any] = {}

    def copy_tensor(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and id(leaf) not in memo:
            memo[id(leaf)] = _copied(leaf)
        return leaf

    map_leaves(state, copy_tensor)
    return copy.deepcopy(state, memo)


def _copied(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` in new CPU memory. New memory, not memory kept from the last save: the copy is given
    back as the save ends, at the price of the kernel's page faults as it is filled (1.2 GB takes 0.43 s into new
    memory here, 0.08 s into memory already touched; 2 MiB pages made it slower once written checkpoints filled
    the page cache)."""
    tensor = tensor.detach()
    if type(tensor) is not torch.Tensor or tensor.layout is not torch.strided or tensor.is_quantized:
        return tensor.to("cpu", copy=True)  # a DTensor copies its shard and keeps its mesh and placements
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu").copy_(tensor)


def start(registry: Registry, ctx: RankContext, target: str, write: Callable[[Peers], None]) -> None:
    """Run ``write`` in this rank's background thread (every rank calls this, after any save in flight ended)."""
    if registry.save_peers is None:
        run, group = session.current_run(), None
        if collectives.is_distributed():  # a collective on the default group: every rank is here
            timeout = datetime.timedelta(seconds=run.timeout if run is not None else 1800.0)
            group = dist.new_group(backend="gloo", timeout=timeout)
        registry.save_peers = Peers(ctx, group)
        if run is not None:  # after the registry's own closer, so it runs first: the group is still there
            run.closers.append(functools.partial(_end, registry))
    flight = Flight(target, registry.updates)
    flight.thread = threading.Thread(target=flight.run, args=(write, registry.save_peers), name="qaccel-save")
    registry.saving = flight
    flight.thread.start()


def wait(registry: Registry) -> str | None:
    """Wait for the save in flight, if any: its checkpoint's path (None without one), or its failure raised."""
    flight, registry.saving = registry.saving, None
    return None if flight is None else flight.outcome()


def poll(registry: Registry, ctx: RankContext | None) -> None:
    """At a step, on every rank: raise the failure of a save in flight once it ended on every rank, or forget it."""
    flight = registry.saving
    if flight is None:
        return
    ended = flight.ended()
    if ctx is not None and ctx.world_size > 1:
        run = session.current_run()
        if run is not None and run.alone is not None:  # a step only some ranks take: ask at the next one
            return
        ended = bool(collectives.all_reduce_dict({"ended": int(ended)}, "min", ctx, _CPU)["ended"])
    if ended:
        wait(registry)


def settle(registry: Registry) -> None:
    """Wait for the save in flight; say its failure on stderr instead of raising it (what comes next matters more:
    a stop's own save, or the error that ends the call)."""
    flight = registry.saving
    try:
        wait(registry)
    except Exception as exc:  # noqa: BLE001 - said, with the checkpoint it concerns
        sys.stderr.write(f"qaccel: the background save of {flight.target} failed: {type(exc).__name__}: {exc}\n")
        sys.stderr.flush()


def _end(registry: Registry, finished: bool) -> None:
    """The session ends: wait for the save in flight and raise its failure (said, when fn raised: fn's error is
    the one raised); the threads' group goes."""
    peers, registry.save_peers = registry.save_peers, None
    try:
        if finished:
            wait(registry)
        else:
            settle(registry)
    finally:
        if peers is not None and peers.group is not None and collectives.is_distributed():
            with contextlib.suppress(Exception):  # a group renewed after a rank left (session.renew_group) took it
                dist.destroy_process_group(peers.group)
