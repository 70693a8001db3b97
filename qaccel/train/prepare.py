"""prepare(): each object to its preparer (model, optimizer, DataLoader); anything else passes through."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from qaccel.comm import collectives, session
from qaccel.comm.session import RankContext
from qaccel.options import Config, MixedPrecision
from qaccel.train import data, loaders, precision, schedulers, sharding, stopping, strategies
from qaccel.train.gradients import PreparedOptimizer
from qaccel.train.registry import Registry
from qaccel.train.schedulers import PreparedScheduler
from qaccel.wrapping import inner_module, is_sharded, is_wrapped


def prepare_one(obj: Any, ctx: RankContext, config: Config, registry: Registry, place: bool | None = None) -> Any:
    """``obj`` prepared; ``place`` (None: the device_placement option) puts a model, an optimizer's state and a
    loader's batches on this rank's device."""
    place = config.device_placement if place is None else place
    if isinstance(obj, torch.nn.Module):
        model = prepare_model(obj, ctx, config, registry, place)
        run = session.current_run()
        if run is not None and (is_wrapped(model)):
            run.bound.add(model)  # destroyed before the session's group is (session.Run.release)
        inner = unwrap_model(model)
        if config.mixed_precision is not MixedPrecision.NO and not is_sharded(model):
            precision.wrap_forward(inner, "autocast", (config.mixed_precision, ctx.device, config.handlers.autocast))
        if config.compile is not None:  # torch 2.13 compiles no graph over the DDP wrapper (its forward is skipped)
            precision.wrap_forward(inner, "compile", config.compile)
        if not any(model is known for known in registry.models):
            registry.models.append(model)
        return model
    if isinstance(obj, PreparedOptimizer):
        return obj
    if isinstance(obj, torch.optim.Optimizer):
        sharding.point_at_shards(obj, registry.replaced)
        prepared = PreparedOptimizer(prepare_optimizer(obj) if place else obj, registry)
        registry.optimizers.append(prepared)
        return prepared
    if isinstance(obj, loaders.DictDataLoader):
        return loaders.DictDataLoader(
            {name: prepare_one(loader, ctx, config, registry, place) for name, loader in obj.dataloaders.items()}
        )
    if isinstance(obj, DataLoader) and not isinstance(obj, data.PreparedDataLoader):
        seed = collectives.broadcast(data.shared_seed(obj, config.use_seedable_sampler, config.data_seed), 0, ctx)
        loader = data.PreparedDataLoader(
            obj,
            ctx,
            seed,
            registry,
            config.split_batches,
            config.even_batches,
            config.dispatch_batches,
            config.use_seedable_sampler,
            config.rng_types,
            place,
        )
        registry.loaders.append(loader)
        if registry.stopper is not None:  # prepared after resume()
            stopping.shield_workers(loader)
        return loader
    if isinstance(obj, PreparedScheduler):
        return obj
    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler) and not any(obj is s for s in registry.schedulers):
        registry.schedulers.append(obj)
        schedulers.track_optimizer_steps(obj)
        if config.step_scheduler_with_optimizer:
            return PreparedScheduler(obj, registry, 1 if config.split_batches else ctx.world_size)
    return obj


def prepare_model(
    model: torch.nn.Module, ctx: RankContext, config: Config, registry: Registry, place: bool = True
) -> torch.nn.Module:
    """The model placed on this rank's device (unless ``place`` is False) and dtype, and made ready for several
    ranks by the strategy (strategies.py). A model already wrapped or sharded is left as it is."""
    if is_wrapped(model):
        return model
    return strategies.of(config.strategy).wrap(model, ctx, config, registry, place)


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


def unwrap_model(
    model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
) -> torch.nn.Module:
    """The user's module inside a DDP wrapper (or the module itself). ``keep_fp32_wrapper=False`` takes mixed
    precision's autocast off its forward, ``keep_torch_compile=False`` the compilation (in place, as Accelerate's:
    also through the prepared model); a module the user compiled (``torch.compile``) then gives the one inside."""
    inner = inner_module(model)
    if not keep_torch_compile:
        if isinstance(inner, torch._dynamo.eval_frame.OptimizedModule):  # compiled by the user
            inner = inner._orig_mod
        precision.unwrap_forward(inner, "compile")
    if not keep_fp32_wrapper:
        precision.unwrap_forward(inner, "autocast")
    return inner


def plain_object(obj: Any) -> Any:
    """What a prepared object is outside its rank: the user's module for a DDP model (without the autocast and
    compilation prepare() put around its forward), the user's optimizer for a prepared one; anything else is
    itself. (DDP cannot be unpickled where there is no process group, compiled code not at all.)"""
    if isinstance(obj, DistributedDataParallel):
        return plain_object(obj.module)
    if isinstance(obj, torch.nn.Module) and precision.LAYERS in vars(obj):
        for layer in list(vars(obj)[precision.LAYERS]):  # compiled code and closures stay in the rank
            precision.unwrap_forward(obj, layer)
        return obj
    if is_sharded(obj):
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
    if isinstance(obj, (DistributedDataParallel, PreparedOptimizer)) or (
        isinstance(obj, torch.nn.Module) and precision.LAYERS in vars(obj)
    ):
        return plain_object(obj)
    if type(obj) in (list, tuple) or (isinstance(obj, tuple) and hasattr(obj, "_fields")):
        sequence = cast("list[Any] | tuple[Any, ...]", obj)  # the checks above: a list or a tuple
        items = [plain_result(item) for item in sequence]
        if all(new is old for new, old in zip(items, sequence)):
            return obj
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if type(obj) is dict:
        values = {key: plain_result(value) for key, value in obj.items()}
        return obj if all(values[key] is value for key, value in obj.items()) else values
    return obj
