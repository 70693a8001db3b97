"""even_batches=False: epochs in which ranks take different numbers of steps, made safe for DDP.

The short last round goes to the lowest ranks, so rank 0 always takes the most steps. In the steps only some ranks
take ("lone" steps), the ranks that have run out shadow DDP's gradient all-reduce through torch's Join: they add
zeros, and the average is over the ranks that still have a batch, so a lone step of full batches takes the
per-sample mean one process would. When the epoch ends, DDP gives every rank the parameters of a rank that took
every step, and every rank takes rank 0's optimizer, LR scheduler, gradient scaler and step count, which the ranks
that ran out did not advance.

Any other collective in a lone step would wait forever for the ranks that ran out: qaccel's raise instead
(``Run.alone``), naming the step.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

import torch
from torch.distributed.algorithms.join import Join, Joinable, _JoinConfig
from torch.nn.parallel import DistributedDataParallel

from qaccel.comm import collectives, session
from qaccel.comm.session import RankContext
from qaccel.options import Config, check_uneven

if TYPE_CHECKING:
    from qaccel.train.registry import Registry
    from qaccel.train.shards import BatchShard


@contextlib.contextmanager
def overridden(registry: Registry, config: Config, even: bool) -> Iterator[None]:
    """Inside the block, the session's prepared DataLoaders pad the last round or not as ``even`` says (Accelerate's
    ``join_uneven_inputs``)."""
    if not isinstance(even, bool):
        raise TypeError(f"even_batches must be True, False or None; got {even!r}")
    if not even:
        check_uneven(config.strategy, config.gradient_accumulation_steps, config.sync_each_batch)
    shards = [loader.shard for loader in registry.loaders if loader.shard is not None]
    if len(shards) < len(registry.loaders) and not even:
        warnings.warn(
            "join_uneven_inputs(even_batches=False) is only supported for map-style datasets: prepared "
            "DataLoaders of a stream (or with a DistributedSampler of yours) keep their own ending",
            stacklevel=3,
        )
    before = [shard.even for shard in shards]
    for shard in shards:
        shard.even = even
    try:
        yield
    finally:
        for shard, value in zip(shards, before):
            shard.even = value


class Epoch:
    """One epoch of a loader whose ranks take different numbers of steps."""

    def __init__(self, shard: BatchShard, registry: Registry, ctx: RankContext, start: int = 0) -> None:
        self.steps = [shard.steps(rank, start) for rank in range(ctx.world_size)]
        self.first_lone = min(self.steps)  # the first step (from ``start``) some ranks do not take
        self.registry = registry
        self.ctx = ctx
        self.updates_before = registry.updates  # rank 0's step count as the lone steps begin
        self.run = session.current_run()

    @staticmethod
    def of(shard: BatchShard | None, registry: Registry, ctx: RankContext, start: int = 0) -> Epoch | None:
        """The epoch's bookkeeping (from the user's batch ``start`` on) when its ranks take different numbers of
        steps, else None."""
        if shard is None or shard.even or ctx.world_size == 1:
            return None
        epoch = Epoch(shard, registry, ctx, start)
        return epoch if epoch.first_lone < max(epoch.steps) else None

    def mark(self, step: int) -> bool:
        """Enter step ``step`` (counted as ``steps``): True when only some ranks take it."""
        lone = step >= self.first_lone
        if lone and self.run is not None and self.run.alone is None:
            self.updates_before = self.registry.updates
            takers = [rank for rank, steps in enumerate(self.steps) if steps > step]
            self.run.alone = (
                f"step {step + 1} of this epoch is taken by rank(s) {takers} only (even_batches=False: "
                f"the ranks take {self.steps} steps); a collective in it would wait forever for the "
                "others: gather after the loop, or keep even_batches=True"
            )
        return lone

    @contextlib.contextmanager
    def joined(self) -> Iterator[None]:
        """The epoch's loop: the DDP models it trains under Join; when it ends, every rank with rank 0's training
        state. Join expects a backward pass after each forward, so a loop that starts under ``torch.no_grad()``,
        and models in eval mode, are left out of it (their forward passes do not communicate)."""
        models = (
            [m for m in self.registry.models if isinstance(m, DistributedDataParallel) and m.training]
            if torch.is_grad_enabled()
            else []
        )
        try:
            joined = cast("list[Joinable]", models)  # DDP models are Joinables (list is invariant)
            with Join(joined, divide_by_initial_world_size=False) if models else contextlib.nullcontext():
                yield
        finally:
            if self.run is not None:
                self.run.alone = None
            for model in models:  # Join leaves them notifying it at every forward, which would pair with nothing
                model._join_config = _JoinConfig.construct_disabled_join_config()
        self._adopt_rank0()

    def _adopt_rank0(self) -> None:
        """Give every rank rank 0's optimizer, scheduler and scaler states and step count, if rank 0 stepped in the
        lone steps (one broadcast; nothing else is sent when it did not)."""
        registry = self.registry
        state = None
        if self.ctx.rank == 0 and registry.updates != self.updates_before:
            state = {
                "optimizers": [o.state_dict() for o in registry.optimizers],
                "schedulers": [s.state_dict() for s in registry.schedulers],
                "scaler": registry.scaler.state_dict() if registry.scaler is not None else None,
                "updates": registry.updates,
            }
        state = collectives.broadcast(state, 0, self.ctx)
        if state is None or self.ctx.rank == 0:
            return
        for optimizer, saved in zip(registry.optimizers, state["optimizers"]):
            optimizer.load_state_dict(saved)
        for scheduler, saved in zip(registry.schedulers, state["schedulers"]):
            scheduler.load_state_dict(saved)
        if registry.scaler is not None:
            registry.scaler.load_state_dict(state["scaler"])
        registry.updates = state["updates"]
