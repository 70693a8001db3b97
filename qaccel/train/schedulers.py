"""step_scheduler_with_optimizer=True: prepared LR schedulers stepped as Accelerate steps them.

Accelerate sizes a schedule on the unprepared DataLoader's length, the batches of all ranks together, and makes up
for it in the scheduler: a prepared scheduler's ``step()`` does nothing on accumulation micro-steps or when fp16
skipped the update, and steps N times on an update of N ranks (once with split_batches, where the loader's batch
is already the batch of all ranks). Without the option, a prepared scheduler is returned as it is.
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from qaccel.train.registry import Registry


class PreparedScheduler:
    """A scheduler whose ``step()`` follows the prepared optimizers' updates; everything else is the scheduler's."""

    def __init__(
        self, scheduler: torch.optim.lr_scheduler.LRScheduler, registry: Registry, steps_per_update: int
    ) -> None:
        self.scheduler = scheduler
        self._registry = registry
        self._steps_per_update = steps_per_update

    def step(self, *args: Any, **kwargs: Any) -> None:
        registry = self._registry
        if not registry.sync_gradients or any(o.step_was_skipped for o in registry.optimizers):
            return
        total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR raises past its end
        for _ in range(self._steps_per_update):
            if total is not None and self.scheduler._step_count > total:
                return
            self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:  # get_last_lr, last_epoch, optimizer, ...
        return getattr(self.scheduler, name)


def track_optimizer_steps(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Mark the scheduler's optimizer's steps again, as the scheduler's constructor did: the mark (a wrapper on the
    optimizer's ``step``) does not survive pickling, so in a rank the scheduler warned on every ``step()`` that
    ``optimizer.step()`` had been overridden, and could no longer tell a step called before the optimizer's."""
    optimizer = scheduler.optimizer
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    owner = weakref.ref(optimizer)
    step = type(optimizer).step

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        optimizer = cast(torch.optim.Optimizer, owner())  # alive: this wrapper is its step
        # torch's LRScheduler sets this flag too, which Optimizer does not declare
        optimizer._opt_called = True  # pyright: ignore[reportAttributeAccessIssue]
        return step(optimizer, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper
