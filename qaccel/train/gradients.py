"""What a training step needs beyond the model: loss scaling, gradient accumulation, clipping.

The session's registry (registry.py) tells the prepared optimizers whether this step updates: on accumulation
steps gradients stay local (DDP ``no_sync``) and ``step``/``zero_grad`` do nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.nn.parallel import DistributedDataParallel

from qaccel.train import sharding
from qaccel.wrapping import is_sharded

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

    from qaccel.train.registry import Registry


class PreparedOptimizer(torch.optim.Optimizer):
    """The user's optimizer; it steps only when gradients are synchronised, through the fp16 scaler if any.

    Subclasses Optimizer (without its __init__) so LR schedulers accept it; param_groups and state are the
    user's optimizer's own objects, so a scheduler built on either drives the same learning rates.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, registry: Registry) -> None:
        self.optimizer = optimizer
        self._registry = registry
        self.step_was_skipped = False

    # param_groups and state: properties in place of Optimizer's attributes, the user's optimizer's own objects
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:  # pyright: ignore[reportIncompatibleVariableOverride]
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:  # pyright: ignore[reportIncompatibleVariableOverride]
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._registry.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        self.step_was_skipped = False
        registry = self._registry
        if registry.saves is not None:  # a background save's failure is raised here, at the same step on every rank
            registry.saves.poll()
        if registry.accumulation_steps > 1 and not registry.accumulating_loop:
            raise RuntimeError(_outside_accumulate(registry))
        if not registry.sync_gradients:
            return None
        if registry.optimizers and registry.optimizers[0] is self:
            registry.updates += 1
        scaler = registry.scaler
        if scaler is None:
            return self.optimizer.step(closure)
        scale = scaler.get_scale()
        result = scaler.step(self.optimizer, closure) if closure is not None else scaler.step(self.optimizer)
        scaler.update()
        self.step_was_skipped = scaler.get_scale() < scale  # the scaler backs off exactly when it skipped
        return result

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __getattr__(self, name: str) -> Any:
        """What the user's optimizer has beyond torch's Optimizer (schedule-free optimizers' ``train()`` and
        ``eval()``, ...), as on the optimizer itself."""
        if name == "optimizer" or name.startswith("__"):  # not set yet (unpickling), or a protocol lookup
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"


def _outside_accumulate(registry: Registry) -> str:
    why = f" ({registry.accumulation_set_by})" if registry.accumulation_set_by else ""
    return (
        f"gradient accumulation of {registry.accumulation_steps} micro-steps{why} needs each training step "
        "inside `with accelerator.accumulate(model):`; outside it every micro-batch would update the model with "
        f"its loss divided by {registry.accumulation_steps}"
    )


def backward(loss: torch.Tensor, registry: Registry, **kwargs: Any) -> None:
    """``loss.backward()``, divided over the accumulation steps and scaled for fp16."""
    if registry.accumulation_steps > 1:
        loss = loss / registry.accumulation_steps
    if registry.scaler is not None:
        loss = registry.scaler.scale(loss)
    loss.backward(**kwargs)


# What accumulate() returns when there is nothing to switch off: stateless, so one instance serves every step.
_NOTHING = contextlib.nullcontext()


def accumulate(models: tuple[torch.nn.Module, ...], registry: Registry) -> contextlib.AbstractContextManager[None]:
    """One micro-step: synchronise gradients every ``accumulation_steps`` and on an epoch's last batch.

    The micro-step is counted here, when called, and what comes back is DDP's own ``no_sync()`` (or a shared
    no-op when gradients sync): a generator context manager and an ExitStack around it cost more than no_sync().
    """
    registry.accumulating_loop = True
    if registry.marks.end_of_epoch:
        registry.micro_step, registry.sync_gradients = 0, True
    else:
        registry.micro_step += 1
        registry.sync_gradients = registry.micro_step % registry.accumulation_steps == 0
    if registry.sync_each_batch:  # gradients reduced every micro-step; only the optimizers wait
        return _NOTHING
    if registry.mesh is not None and registry.accumulating == registry.sync_gradients:  # FSDP2: a switch, not a context
        registry.accumulating = not registry.sync_gradients
        sharding.set_accumulating(registry.models, registry.accumulating)
    if registry.sync_gradients:
        return _NOTHING
    ddp = [model for model in models if isinstance(model, DistributedDataParallel)]
    if not ddp:
        return _NOTHING
    return ddp[0].no_sync() if len(ddp) == 1 else no_sync(ddp)


@contextlib.contextmanager
def no_sync(models: Iterable[torch.nn.Module]) -> Iterator[None]:
    """Keep the gradients of the block's backward passes local: DDP's ``no_sync()``; for an FSDP2 model, no
    reduce-scatter until the block ends; a no-op for other models."""
    with contextlib.ExitStack() as stack:
        for model in models:
            if isinstance(model, DistributedDataParallel):
                stack.enter_context(model.no_sync())
            elif is_sharded(model):
                sharded = cast("FSDPModule", model)
                sharded.set_requires_gradient_sync(False)
                stack.callback(sharded.set_requires_gradient_sync, True)
        yield


@contextlib.contextmanager
def sync_in_backward(model: torch.nn.Module) -> Iterator[None]:
    """Make the block's backward synchronise a DDP model's gradients even inside ``no_sync()`` (DDP's own flags,
    as Accelerate's ``trigger_sync_in_backward`` sets them); a no-op for other models."""
    if not isinstance(model, DistributedDataParallel):
        yield
        return
    before = model.require_backward_grad_sync, model.require_forward_param_sync
    model.require_backward_grad_sync = model.require_forward_param_sync = True
    model.reducer.prepare_for_backward([])
    try:
        yield
    finally:
        model.require_backward_grad_sync, model.require_forward_param_sync = before


def clip(
    clip_fn: Callable[..., Any], parameters: Iterable[torch.Tensor] | torch.Tensor, registry: Registry, *args: Any
) -> Any:
    """Clip with ``clip_fn`` after unscaling fp16 gradients; None on accumulation steps (nothing to clip yet)."""
    if not registry.sync_gradients:
        return None
    if registry.scaler is not None:
        for optimizer in registry.optimizers:
            registry.scaler.unscale_(optimizer.optimizer)
    return clip_fn(parameters, *args)
