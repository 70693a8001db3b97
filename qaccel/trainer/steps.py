"""qadence's training steps (``qadence.ml_tools.optimize_step``), for scripts that call or pass them; with
``order=LossOrder.BATCH_MODEL``, perceptrain's (``qaccel.perceptrain.optimize_step``).

``optimize_step`` passed to a qaccel Trainer (as qadence's tutorials pass it) selects the Trainer's own step, which
is this step with gradient accumulation and fp16 loss scaling added; called by hand it is qadence's step as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from qaccel.trainer.losses import LossOrder
from qaccel.trainer.parameters import set_parameters


def optimize_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[..., Any],
    xs: Any,
    device: Any = None,
    dtype: Any = None,
    *,
    order: LossOrder = LossOrder.MODEL_BATCH,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """One update: ``optimizer.step(closure)``, the closure zeroing the gradients and back-propagating
    ``loss_fn(model, xs)`` (``loss_fn(xs, model)`` in perceptrain's ``order``); returns the loss and metrics
    (qadence's default step, LBFGS included)."""
    loss: Any = None  # loss_fn's, set by the closure that optimizer.step() calls
    metrics: dict[str, Any] = {}

    def closure() -> float:
        nonlocal loss, metrics
        optimizer.zero_grad()
        loss, metrics = order.call(loss_fn, model, xs)
        loss.backward(retain_graph=True)
        return loss.item()

    optimizer.step(closure)
    return loss, metrics


def update_ng_parameters(
    model: torch.nn.Module,
    optimizer: Any,
    loss_fn: Callable[..., Any],
    data: Any,
    ng_params: Any,
    *,
    told: Callable[[Any], float] = float,
    order: LossOrder = LossOrder.MODEL_BATCH,
) -> tuple[Any, dict[str, Any], Any]:
    """One gradient-free update with a nevergrad optimizer: tell it the loss at ``ng_params`` (``told(loss)``: the
    Trainer tells the mean over its ranks), ask for the next candidate and set the model's parameters to it;
    returns the loss, metrics and the new candidate. The loss is computed with autograd on, as qadence does, so a
    loss that takes gradients itself (``torch.autograd.grad`` of the model's output) works."""
    loss, metrics = order.call(loss_fn, model, data)
    optimizer.tell(ng_params, told(loss.detach() if isinstance(loss, torch.Tensor) else loss))
    ng_params = optimizer.ask()
    set_parameters(model, torch.as_tensor(ng_params.value))
    return loss, metrics, ng_params


default_optimize_step = optimize_step

__all__ = ["default_optimize_step", "optimize_step", "update_ng_parameters"]
