"""perceptrain's training steps (``perceptrain.optimize_step``): qadence's, calling ``loss_fn(batch, model)``.

``optimize_step`` passed to ``qaccel.perceptrain.Trainer`` (perceptrain's default) selects the Trainer's own step,
which adds gradient accumulation and fp16 loss scaling; called by hand it is perceptrain's step as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from qaccel.trainer import steps
from qaccel.trainer.losses import LossOrder


def optimize_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[..., Any],
    xs: Any,
    device: Any = None,
    dtype: Any = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """One update: ``optimizer.step(closure)``, the closure zeroing the gradients and back-propagating
    ``loss_fn(xs, model)``; returns the loss and metrics (perceptrain's default step)."""
    return steps.optimize_step(model, optimizer, loss_fn, xs, device, dtype, order=LossOrder.BATCH_MODEL)


def update_ng_parameters(
    model: torch.nn.Module, optimizer: Any, loss_fn: Callable[..., Any], data: Any, ng_params: Any
) -> tuple[Any, dict[str, Any], Any]:
    """One gradient-free update with a nevergrad optimizer at ``loss_fn(data, model)``; returns the loss, metrics
    and the optimizer's next candidate, now the model's parameters."""
    return steps.update_ng_parameters(model, optimizer, loss_fn, data, ng_params, order=LossOrder.BATCH_MODEL)


__all__ = ["optimize_step", "update_ng_parameters"]
