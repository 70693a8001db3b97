"""perceptrain's Trainer (``perceptrain.trainer.Trainer``): qaccel's, calling ``loss_fn(batch, model)``."""

from __future__ import annotations

from qaccel.perceptrain.optimize_step import optimize_step
from qaccel.trainer import trainer
from qaccel.trainer.losses import LossOrder


class Trainer(trainer.Trainer):
    """qaccel's Trainer (``qaccel.Trainer``, the same arguments and behaviour) in perceptrain's loss order: training,
    validation, test and gradient-free steps call ``loss_fn(batch, model)``, and ``"mse"`` and ``"cross_entropy"``
    are written so. A function whose parameters are named ``(model, batch)`` is refused, as written for qadence's
    order. ``optimize_step`` from ``qaccel.perceptrain.optimize_step`` (perceptrain's default) selects the
    Trainer's own step; a step of your own is handed ``loss_fn`` as you wrote it."""

    _loss_order = LossOrder.BATCH_MODEL
    _default_steps = (optimize_step,)


__all__ = ["Trainer"]
