"""prepare(): each object to its preparer (model, optimizer, DataLoader); anything else passes through."""

from __future__ import annotations

import warnings
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from qaccel import handlers
from qaccel.comm import collectives, session
from qaccel.comm.session import RankContext
from qaccel.options import Config, MixedPrecision, Strategy
from qaccel.train import batch, data, loaders, precision, schedulers, sharding, stopping
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
    """Place the model on this rank's device (unless ``place`` is False) and dtype; wrap it in DDP when there is
    more than one rank, or shard it with FSDP2 (strategy="fsdp", also with one rank).

    A model already wrapped or sharded, or with nothing to train, is not wrapped (again).
    """
    if is_wrapped(model):
        return model
    trainable = any(p.requires_grad for p in model.parameters())
    if config.strategy is Strategy.FSDP and trainable and dist.is_initialized():
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
    cast_model(model, ctx.device if place else None, config.dtype)
    if ctx.world_size > 1 and dist.is_initialized() and trainable:
        on = next(model.parameters()).device
        device_ids = [on.index] if on.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=device_ids, **config.handlers.ddp)
        handlers.register_comm_hook(
            wrapped, config.handlers.comm_hook, config.handlers.comm_wrapper, config.handlers.comm_state_option
        )
        return wrapped
    return model


def cast_model(model: torch.nn.Module, device: torch.device | None, dtype: torch.dtype | None) -> None:
    """Move ``model`` to ``device`` (None: leave it) and cast it to ``dtype`` without discarding imaginary parts.

    Why not ``model.to(device, dtype)``: Module.to(dtype=torch.float64) casts complex tensors to float64, keeping
    only their real part (torch warns once; qadence's QNN then fails much later inside pyqtorch), and
    Module.to(dtype=torch.complex128) makes real parameters complex. Here real floating-point parameters and
    buffers get the real dtype (``dtype``, or a complex ``dtype``'s real counterpart, complex128 -> float64, as
    qadence casts data), complex ones the complex dtype of the same precision (``dtype``, or float64 ->
    complex128, float32 -> complex64, float16 -> complex32; bfloat16 has none: ValueError naming the tensor);
    integer and bool ones keep theirs, as with Module.to.

    A model without complex tensors is cast by its own ``to()`` with the real dtype (nothing to lose). One with complex
    tensors and its own ``to()`` is cast by it with the complex dtype first: qadence's QuantumModel.to then casts
    its circuit and its observables (outside its submodules, out of reach of anything else) to it and its
    parameters to the real counterpart, qadence's own convention. Then Module._apply, the tool Module.to uses,
    casts every parameter and buffer by the rule above, keeping the Parameter objects the optimizers point at.
    """
    # no device=None: some to()s would store it
    placement: dict[str, Any] = {} if device is None else {"device": device}
    if dtype is None:
        if placement:
            model.to(**placement)
        return
    real = batch.real_dtype(dtype)
    complex_ = dtype if dtype.is_complex else _complex_of(dtype)
    named = [*model.named_parameters(), *model.named_buffers()]
    complex_names = [(name, tensor.dtype) for name, tensor in named if tensor.is_complex()]
    if not complex_names:
        model.to(**placement, dtype=real)
        return
    if complex_ is None:
        name, current = complex_names[0]
        raise ValueError(
            f"dtype={dtype} would discard the imaginary part of {type(model).__name__}.{name} ({current}): torch "
            f"has no complex dtype of {dtype}'s precision; use dtype=torch.float32 (complex tensors become "
            "complex64) or dtype=None"
        )
    if type(model).to is not torch.nn.Module.to:
        with warnings.catch_warnings():  # the model's tensors were complex already: nothing new to warn about
            warnings.filterwarnings("ignore", "Complex modules are a new feature", UserWarning)
            model.to(**placement, dtype=complex_)
    model._apply(lambda t: t.to(device, real if t.is_floating_point() else complex_ if t.is_complex() else None))


def _complex_of(dtype: torch.dtype) -> torch.dtype | None:
    """The complex dtype with ``dtype``'s precision, None where torch has none (bfloat16: to_complex() gives
    complex64, a wider type, so it is not offered as a match)."""
    matching = {torch.float64: torch.complex128, torch.float32: torch.complex64, torch.float16: torch.complex32}
    return matching.get(dtype)


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
