"""How a model trains on several ranks: one class per strategy behind one interface, as Lightning Fabric's
strategies are. DDP keeps a whole replica on every rank and all-reduces the gradients; FSDP2 shards parameters,
gradients and optimizer state across the ranks. Preparing, the Accelerator's ``distributed_type`` and the
Trainer's hand-back ask the strategy instead of testing which one is set. A new strategy is a class here, an entry
in ``STRATEGIES`` and its value in ``options.Strategy``.

What a strategy does not decide: whether a given model is wrapped or sharded (``qaccel.wrapping`` asks the model
itself, for a model prepared by another Accelerator or by the user), and whether the session needs a process group
with one rank (``options.Strategy.needs_a_group_alone``, asked before this layer is reached)."""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from qaccel import handlers
from qaccel.comm.session import RankContext
from qaccel.options import Config, DistributedType, Strategy
from qaccel.train import sharding
from qaccel.train.placement import cast_model
from qaccel.train.registry import Registry


class ParallelStrategy(abc.ABC):
    """What every strategy answers."""

    kind: ClassVar[Strategy]

    @abc.abstractmethod
    def wrap(
        self, model: torch.nn.Module, ctx: RankContext, config: Config, registry: Registry, place: bool
    ) -> torch.nn.Module:
        """``model`` cast to the run's dtype, on this rank's device unless ``place`` is False, and made ready to
        train across the session's ranks. A model with nothing to train, or outside a process group, is only
        placed."""

    @abc.abstractmethod
    def distributed_type(self, device: torch.device | None) -> DistributedType | None:
        """Accelerate's name for how a rank on ``device`` trains with others (a world of one is ``NO`` before
        this is asked); None where it depends on a device not known yet (a cluster job's caller)."""

    @abc.abstractmethod
    def optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The whole state of ``optimizer`` (the user's, stepping the prepared ``model``'s parameters), as rank 0
        sends it out of the ranks; called on every rank (it may be a collective)."""

    @abc.abstractmethod
    def plain_optimizer_state(
        self, state: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """``state`` (optimizer_state's) keyed as the caller's own ``optimizer`` of its plain ``model`` loads it."""


class DDPStrategy(ParallelStrategy):
    """A whole replica per rank in torch's DistributedDataParallel, with the DDP options and communication hook of
    ``kwargs_handlers``."""

    kind = Strategy.DDP

    def wrap(
        self, model: torch.nn.Module, ctx: RankContext, config: Config, registry: Registry, place: bool
    ) -> torch.nn.Module:
        cast_model(model, ctx.device if place else None, config.dtype)
        if ctx.world_size == 1 or not dist.is_initialized() or not _trainable(model):
            return model
        on = next(model.parameters()).device
        device_ids = [on.index] if on.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=device_ids, **config.handlers.ddp)
        handlers.register_comm_hook(
            wrapped, config.handlers.comm_hook, config.handlers.comm_wrapper, config.handlers.comm_state_option
        )
        return wrapped

    def distributed_type(self, device: torch.device | None) -> DistributedType | None:
        if device is None:
            return None
        return DistributedType.MULTI_GPU if device.type == "cuda" else DistributedType.MULTI_CPU

    def optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def plain_optimizer_state(
        self, state: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        return state  # every rank's optimizer is a whole one, keyed as the caller's


class FSDPStrategy(ParallelStrategy):
    """FSDP2 (``fully_shard``) on a one-dimensional mesh of every rank, also with one rank; the units are
    ``fsdp_modules`` or the auto-wrap policy's (``fsdp_min_params``), then the root."""

    kind = Strategy.FSDP

    def wrap(
        self, model: torch.nn.Module, ctx: RankContext, config: Config, registry: Registry, place: bool
    ) -> torch.nn.Module:
        if not dist.is_initialized() or not _trainable(model):
            cast_model(model, ctx.device if place else None, config.dtype)  # placed, not sharded
            return model
        cast_model(model, None, config.dtype)  # fully_shard moves each shard to the mesh's device: no full copy
        if registry.mesh is None:
            registry.mesh = sharding.mesh_for(ctx)
        replaced = sharding.shard(
            model, config.fsdp_modules, config.fsdp_min_params, config.mixed_precision, registry.mesh
        )
        registry.replaced.update(replaced)
        for prepared in registry.optimizers:  # prepared before this model
            sharding.point_at_shards(prepared.optimizer, replaced)
        return model

    def distributed_type(self, device: torch.device | None) -> DistributedType | None:
        return DistributedType.FSDP

    def optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return sharding.full_optimizer_state_dict(model, optimizer)

    def plain_optimizer_state(
        self, state: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        return sharding.by_index(state, model, optimizer)  # keyed by parameter name: key it by position


STRATEGIES: dict[Strategy, ParallelStrategy] = {Strategy.DDP: DDPStrategy(), Strategy.FSDP: FSDPStrategy()}


def of(kind: Strategy) -> ParallelStrategy:
    """The strategy the option ``strategy`` names."""
    return STRATEGIES[kind]


def _trainable(model: torch.nn.Module) -> bool:
    return any(p.requires_grad for p in model.parameters())
