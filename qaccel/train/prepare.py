"""prepare(): each object to its preparer (model, optimizer, DataLoader); anything else passes through."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from qaccel.comm import collectives, session
from qaccel.comm.session import RankContext
from qaccel.options import Config, MixedPrecision, Strategy
from qaccel.train import data, precision, sharding, stopping
from qaccel.train.gradients import PreparedOptimizer
from qaccel.train.registry import Registry
from qaccel.train.schedulers import PreparedScheduler


def prepare_one(obj: Any, ctx: RankContext, config: Config, registry: Registry) -> Any:
    if isinstance(obj, torch.nn.Module):
        model = prepare_model(obj, ctx, config, registry)
        run = session.current_run()
        if run is not None and (isinstance(model, DistributedDataParallel) or sharding.is_sharded(model)):
            run.bound.add(model)  # destroyed before the session's group is (session.Run.release)
        if config.mixed_precision is not MixedPrecision.NO and not sharding.is_sharded(model) and not hasattr(model, "_qaccel_autocast"):
            model.forward = precision.autocast_forward(model.forward, config.mixed_precision, ctx.device)
            model._qaccel_autocast = True
        if not any(model is known for known in registry.models):
            registry.models.append(model)
        return model
    if isinstance(obj, PreparedOptimizer):
        return obj
    if isinstance(obj, torch.optim.Optimizer):
        sharding.point_at_shards(obj, registry.replaced)
        prepared = PreparedOptimizer(prepare_optimizer(obj), registry)
        registry.optimizers.append(prepared)
        return prepared
    if isinstance(obj, DataLoader) and not isinstance(obj, data.PreparedDataLoader):
        seed = collectives.broadcast(data.shared_seed(obj), 0, ctx)
        loader = data.PreparedDataLoader(obj, ctx, seed, registry, config.split_batches, config.even_batches,
                                         config.dispatch_batches)
        registry.loaders.append(loader)
        if registry.stopper is not None:  # prepared after resume()
            stopping.shield_workers(loader)
        return loader
    if isinstance(obj, PreparedScheduler):
        return obj
    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler) and not any(obj is s for s in registry.schedulers):
        registry.schedulers.append(obj)
        if config.step_scheduler_with_optimizer:
            return PreparedScheduler(obj, registry, 1 if config.split_batches else ctx.world_size)
    return obj


def prepare_model(model: torch.nn.Module, ctx: RankContext, config: Config, registry: Registry) -> torch.nn.Module:
    """Place the model on this rank's device (and dtype); wrap it in DDP when there is more than one rank, or
    shard it with FSDP2 (strategy="fsdp", also with one rank).

    A model already wrapped or sharded, or with nothing to train, is not wrapped (again).
    """
    if isinstance(model, DistributedDataParallel) or sharding.is_sharded(model):
        return model
    trainable = any(p.requires_grad for p in model.parameters())
    if config.strategy is Strategy.FSDP and trainable and dist.is_initialized():
        model.to(dtype=config.dtype)  # fully_shard moves each shard to the mesh's device: no full copy there
        if registry.mesh is None:
            registry.mesh = sharding.mesh_for(ctx)
        replaced = sharding.shard(model, config.fsdp_modules, config.fsdp_min_params, config.mixed_precision, registry.mesh)
        registry.replaced.update(replaced)
        for prepared in registry.optimizers:  # prepared before this model
            sharding.point_at_shards(prepared.optimizer, replaced)
        return model
    model.to(device=ctx.device, dtype=config.dtype)
    if ctx.world_size > 1 and dist.is_initialized() and trainable:
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)
    return model


def prepare_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Move existing optimizer state next to its (already moved) parameters, by torch's own casting rules.

    Module.to() keeps the Parameter objects, so the optimizer already points at the placed (and, under DDP,
    shared) parameters; only state created before placement (e.g. Adam moments) needs moving.
    """
    if optimizer.state:
        optimizer.load_state_dict(optimizer.state_dict())
        for param, state in optimizer.state.items():  # torch casts state only for floating-point params
            for key, value in state.items():
                if torch.is_tensor(value) and value.is_complex() and param.is_complex():
                    state[key] = value.to(param.dtype)
    return optimizer


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside a DDP wrapper (or the module itself)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def plain_object(obj: Any) -> Any:
    """What a prepared object is outside its rank: the user's module for a DDP model, the user's optimizer for
    a prepared one; anything else is itself. (DDP cannot be unpickled where there is no process group.)"""
    if isinstance(obj, DistributedDataParallel):
        return obj.module
    if sharding.is_sharded(obj):
        raise TypeError(
            f"a model sharded by strategy='fsdp' ({type(obj).__name__}) holds only this rank's shards and cannot "
            "leave its rank; return acc.get_state_dict(model) instead (called on every rank; rank 0 gets it)"
        )
    if isinstance(obj, PreparedOptimizer):
        return obj.optimizer
    return obj


def plain_result(obj: Any) -> Any:
    """fn's result as a run in place gives it back: a prepared DDP model or optimizer, also inside tuples, lists and
    dicts, becomes the user's own, as in a plain launch's result. The DDP wrapper holds the session's process
    group, which is gone once distribute() returns. Anything else is returned as it is (the same object)."""
    if isinstance(obj, (DistributedDataParallel, PreparedOptimizer)):
        return plain_object(obj)
    if type(obj) in (list, tuple) or (isinstance(obj, tuple) and hasattr(obj, "_fields")):
        items = [plain_result(item) for item in obj]
        if all(new is old for new, old in zip(items, obj)):
            return obj
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if type(obj) is dict:
        values = {key: plain_result(value) for key, value in obj.items()}
        return obj if all(values[key] is value for key, value in obj.items()) else values
    return obj
