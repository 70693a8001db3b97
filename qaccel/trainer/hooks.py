"""What a callback and the Trainer share: the stages, the OptimizeResult, the ``Callback`` base class, and the
Protocols of what a callback uses of the Trainer and of its config.

The Trainer runs callbacks and its config holds them, while a callback is handed the Trainer and the config: this
module, which imports neither, is where those types meet, so that callbacks.py, config.py and trainer.py each import
it and none imports the others back.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from qaccel.options import count

if TYPE_CHECKING:
    from qaccel.accelerator import Accelerator
    from qaccel.tracking.tools import Tracker


class Stage(enum.StrEnum):
    """The points of training a callback can run at (qadence's names)."""

    TRAIN_START = "train_start"
    TRAIN_END = "train_end"
    TRAIN_EPOCH_START = "train_epoch_start"
    TRAIN_EPOCH_END = "train_epoch_end"
    TRAIN_BATCH_START = "train_batch_start"
    TRAIN_BATCH_END = "train_batch_end"
    VAL_EPOCH_START = "val_epoch_start"
    VAL_EPOCH_END = "val_epoch_end"
    VAL_BATCH_START = "val_batch_start"
    VAL_BATCH_END = "val_batch_end"
    TEST_BATCH_START = "test_batch_start"
    TEST_BATCH_END = "test_batch_end"

    @property
    def per_batch(self) -> bool:
        """Whether the stage comes once per batch: its ``called_every`` counts batches."""
        return "_batch_" in self.value


@dataclass
class OptimizeResult:
    """Where training is, for callbacks: the epoch (``iteration``), the model and optimizer, the latest loss and
    metrics (``train_*``, ``val_*`` or ``test_*``, as plain floats), ``extra`` for callbacks' own use, the rank and
    its device (qadence's fields, in its order), and ``batch``.

    At batch stages, ``batch`` is the batch's number (from 1): counted over the whole fit in training (resumed fits
    included), within the pass in validation and test; the loss and metrics are the batch's. At other stages they
    are the epoch's means.
    """

    iteration: int
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    rank: int = 0
    device: str = "cpu"
    batch: int = 0


class ConfigView(Protocol):
    """What the built-in callbacks read of the TrainConfig they are given (a TrainConfig is one)."""

    @property
    def log_folder(self) -> Path: ...

    @property
    def allow_pickle(self) -> bool | None: ...

    @property
    def hyperparams(self) -> dict[str, Any]: ...

    @property
    def plotting_functions(self) -> tuple[Callable[[torch.nn.Module, int], tuple[str, Any]], ...]: ...


class TrainerView(Protocol):
    """What the built-in callbacks use of the Trainer they are given (the Trainer is one): its model, optimizer,
    loaders and config, the latest ``opt_result`` (which a callback may replace), and what it asks the Trainer to do."""

    opt_result: OptimizeResult
    validation_improved: bool  # whether the latest validation was the best so far (validation sets it)

    @property
    def config(self) -> ConfigView: ...

    @property
    def accelerator(self) -> Accelerator: ...

    @property
    def model(self) -> torch.nn.Module: ...

    @property
    def optimizer(self) -> Any: ...

    @property
    def train_dataloader(self) -> Any: ...

    @property
    def val_dataloader(self) -> Any: ...

    @property
    def test_dataloader(self) -> Any: ...

    def request_stop(self, reason: str) -> None: ...

    def write_metrics(self, metrics: dict[str, float]) -> None: ...

    def plot(self) -> None: ...

    def save_checkpoint(self, best: bool = False) -> str: ...


# The user's callbacks are handed the Trainer and its TrainConfig; typed Any here so that a user's function or
# override annotated with those concrete classes type-checks (the built-in callbacks ask only for the views above).
CallbackFunction = Callable[[Any, Any, "Tracker | None"], Any]


class Callback:
    """Run ``callback(trainer, config, tracker)`` (or a subclass's ``run_callback``) at stage ``on``.

    Args:
        on: the stage (a ``Stage`` or its name, e.g. ``"train_epoch_end"``).
        called_every: every this many epochs, or batches at a batch stage (at ``train_start`` and ``train_end``:
            always); 0: never.
        callback: the function to run, for a callback that is not a subclass.
        callback_condition: ``condition(optimize_result) -> bool``, checked first.
        modify_optimize_result: a function of the OptimizeResult returning it changed, or a dict merged into its
            ``extra``, applied before the callback runs.
    """

    def __init__(
        self,
        on: Stage | str = Stage.TRAIN_EPOCH_END,
        called_every: int = 1,
        callback: CallbackFunction | None = None,
        callback_condition: Callable[[OptimizeResult], bool] | None = None,
        modify_optimize_result: Callable[[OptimizeResult], OptimizeResult] | dict[str, Any] | None = None,
    ) -> None:
        self.on = on
        count("called_every", called_every, 0)
        if callback is not None and not callable(callback):
            raise TypeError(f"callback must be a function (trainer, config, tracker); got {callback!r}")
        self.called_every = called_every
        self.callback = callback
        self.callback_condition = callback_condition
        self.modify_optimize_result = modify_optimize_result

    @property
    def on(self) -> Stage:
        return self._on

    @on.setter
    def on(self, on: Stage | str) -> None:
        try:
            self._on = Stage(on)
        except ValueError:
            allowed = ", ".join(repr(s.value) for s in Stage)
            raise ValueError(f"on must be one of {allowed}; got {on!r}") from None

    def should_call(self, when: Stage, result: OptimizeResult) -> bool:
        if when in (Stage.TRAIN_START, Stage.TRAIN_END):
            return True
        count = result.batch if when.per_batch else result.iteration
        if self.called_every == 0 or count == 0 or count % self.called_every:
            return False
        return self.callback_condition is None or bool(self.callback_condition(result))

    def __call__(self, when: Stage, trainer: TrainerView, config: ConfigView, tracker: Tracker | None) -> Any:
        if when != self.on:
            return None
        if isinstance(self.modify_optimize_result, dict):
            trainer.opt_result.extra.update(self.modify_optimize_result)
        elif self.modify_optimize_result is not None:
            trainer.opt_result = self.modify_optimize_result(trainer.opt_result)
        if self.should_call(when, trainer.opt_result):
            return self.run_callback(trainer, config, tracker)
        return None

    def run_callback(self, trainer: Any, config: Any, writer: Tracker | None) -> Any:
        """What the callback does: ``callback(trainer, config, writer)``, the Trainer and its TrainConfig."""
        if self.callback is None:
            raise NotImplementedError(f"{type(self).__name__}: pass callback=... or override run_callback")
        return self.callback(trainer, config, writer)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(on={self.on.value!r}, called_every={self.called_every})"
