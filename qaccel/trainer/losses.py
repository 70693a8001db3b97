"""The loss function's argument order and the built-in losses.

qadence's Trainer calls ``loss_fn(model, batch)``, perceptrain's ``loss_fn(batch, model)``. ``qaccel.Trainer`` and
``qaccel.perceptrain.Trainer`` each hold the user's function as written and call it through their ``LossOrder``, the
one place the order is applied, so a step of the user's own is handed the function the user wrote.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable
from typing import Any

import torch

BatchResult = tuple[torch.Tensor, dict[str, Any]]  # a batch's (loss, metrics), as qadence's hooks get them
LossFunction = Callable[[torch.nn.Module, Any], BatchResult]  # fn(model, batch): qadence's order
BatchFirstLossFunction = Callable[[Any, torch.nn.Module], BatchResult]  # fn(batch, model): perceptrain's order

BATCH_NAMES = ("batch", "data", "xs", "x", "inputs")  # a parameter named so takes the batch


class LossOrder(enum.Enum):
    """The order a Trainer calls its loss function in; the value is the Trainer that calls it so."""

    MODEL_BATCH = "qaccel.Trainer"
    BATCH_MODEL = "qaccel.perceptrain.Trainer"

    @property
    def arguments(self) -> str:
        """The arguments in this order, for messages: ``(model, batch)`` or ``(batch, model)``."""
        return "(model, batch)" if self is LossOrder.MODEL_BATCH else "(batch, model)"

    @property
    def losses(self) -> dict[str, Callable[..., BatchResult]]:
        """The losses a Trainer takes by name, written in this order."""
        return _LOSSES[self]

    def call(self, loss_fn: Callable[..., BatchResult], model: torch.nn.Module, batch: Any) -> BatchResult:
        """``loss_fn``'s (loss, metrics) on ``batch``, called in this order."""
        return loss_fn(model, batch) if self is LossOrder.MODEL_BATCH else loss_fn(batch, model)

    def check(self, loss_fn: Callable[..., Any]) -> None:
        """Refuse a function whose parameter names say the other order; names that say nothing pass."""
        said = said_by(loss_fn)
        if said is None or said is self:
            return
        name = getattr(loss_fn, "__qualname__", None) or repr(loss_fn)
        first = "batch" if said is LossOrder.BATCH_MODEL else "model"
        raise TypeError(
            f"loss_fn {name}{inspect.signature(loss_fn)} takes the {first} first, but {self.value} calls "
            f"loss_fn{self.arguments}: use {said.value}, which calls loss_fn{said.arguments}, or swap the "
            "function's parameters"
        )


def said_by(loss_fn: Callable[..., Any]) -> LossOrder | None:
    """The order the names of ``loss_fn``'s first two parameters say (``model`` and one of BATCH_NAMES), if any."""
    try:
        parameters = inspect.signature(loss_fn).parameters.values()
    except (TypeError, ValueError):  # a callable without a signature says nothing
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in parameters if p.kind in positional][:2]
    if len(names) < 2:
        return None
    if names[0] == "model" and names[1] in BATCH_NAMES:
        return LossOrder.MODEL_BATCH
    if names[0] in BATCH_NAMES and names[1] == "model":
        return LossOrder.BATCH_MODEL
    return None


def mse_loss(model: torch.nn.Module, batch: Any) -> BatchResult:
    """Mean squared error of ``model(inputs)`` against ``targets`` for a batch ``(inputs, targets)``."""
    inputs, targets = batch
    loss = torch.nn.functional.mse_loss(model(inputs), targets)
    return loss, {"mse": loss}


def cross_entropy_loss(model: torch.nn.Module, batch: Any) -> BatchResult:
    """Cross entropy of ``model(inputs)`` (logits) against class ``targets``, and the batch's accuracy."""
    inputs, targets = batch
    logits = model(inputs)
    loss = torch.nn.functional.cross_entropy(logits, targets)
    return loss, {"cross_entropy": loss, "accuracy": (logits.argmax(-1) == targets).float().mean()}


def batch_first_mse_loss(batch: Any, model: torch.nn.Module) -> BatchResult:
    """``mse_loss`` in perceptrain's order."""
    return mse_loss(model, batch)


def batch_first_cross_entropy_loss(batch: Any, model: torch.nn.Module) -> BatchResult:
    """``cross_entropy_loss`` in perceptrain's order."""
    return cross_entropy_loss(model, batch)


_LOSSES: dict[LossOrder, dict[str, Callable[..., BatchResult]]] = {
    LossOrder.MODEL_BATCH: {"mse": mse_loss, "cross_entropy": cross_entropy_loss},
    LossOrder.BATCH_MODEL: {"mse": batch_first_mse_loss, "cross_entropy": batch_first_cross_entropy_loss},
}
