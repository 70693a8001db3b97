"""What the Trainer's parts share: the state a fit checkpoints (``FitState``), and ``TrainerInternals``, the Protocol
of what loop.py, evaluation.py and runs.py use of a Trainer.

Those modules take the Trainer as a ``TrainerInternals``: trainer.py imports them, so they cannot import it back,
and the Protocol also lists in one place how far each reaches into the Trainer.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, cast

import torch

from qaccel.trainer.hooks import Callback, Stage, TrainerView
from qaccel.trainer.losses import BatchResult, LossOrder

if TYPE_CHECKING:
    from qaccel.tracking.tools import Tracker
    from qaccel.trainer.config import TrainConfig

OptimizeStep = Callable[..., tuple[torch.Tensor, dict[str, Any]]]


class _Stateful(Protocol):
    """A callback with state of its own to checkpoint (not every Callback has it: see _state_of())."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class FitState:
    """What the Trainer adds to a checkpoint: the epochs and batches done, their metrics, the best validation, the
    running sums of an epoch in progress, the tracker's run and the callbacks' own state. Registered for
    checkpointing, so a resumed fit (mid-epoch included, after a stop on a signal too) continues exactly."""

    def __init__(self, callbacks: list[Callback]) -> None:
        self.epochs_done = 0  # epochs 0 .. epochs_done - 1 are trained
        self.end = 0  # the fit trains epochs up to end - 1
        self.global_step = 0  # training batches done, over every epoch
        self.history: list[dict[str, float]] = []
        self.best_val = math.inf
        self.sums: dict[str, Any] = {}  # name -> a number or a 0-dim tensor on the device (summed without a sync)
        self.batches = 0
        self.tracker: dict[str, Any] | None = None
        self.nevergrad: bytes | None = None  # gradient-free: the optimizer and its candidate, pickled
        self._callbacks = callbacks  # whose state_dict() goes into the checkpoint with this

    def state_dict(self) -> dict[str, Any]:
        state = {name: value for name, value in vars(self).items() if not name.startswith("_")}
        state["sums"] = {name: float(total) for name, total in self.sums.items()}
        # the nevergrad objects themselves, not their pickle's bytes: reading them back then needs full unpickling,
        # which the checkpoint's reader allows only where it may (qaccel/unpickling.py)
        state["nevergrad"] = None if self.nevergrad is None else pickle.loads(self.nevergrad)
        return {**state, "callbacks": [_state_of(c) for c in self._callbacks]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        for callback, saved in zip(self._callbacks, state.pop("callbacks")):
            if saved is not None:
                cast(_Stateful, callback).load_state_dict(saved)
        if state.get("nevergrad") is not None:
            state["nevergrad"] = pickle.dumps(state["nevergrad"])
        vars(self).update(state)


def _state_of(callback: Callback) -> dict[str, Any] | None:
    return cast(_Stateful, callback).state_dict() if hasattr(callback, "state_dict") else None


class TrainerInternals(TrainerView, Protocol):
    """What the Trainer's parts use of it, besides what callbacks do: its settings, the fit's state, and the methods
    and hooks they call back through the Trainer (so a subclass's overrides apply)."""

    current_epoch: int
    tracker: Tracker | None
    log_folder: Path | None
    history: list[dict[str, float]]
    _ng_params: Any
    _loss_order: ClassVar[LossOrder]  # how the parts call loss_fn

    @property
    def config(self) -> TrainConfig: ...

    @property
    def loss_fn(self) -> Callable[..., BatchResult]: ...

    @property
    def optimize_step(self) -> OptimizeStep | None: ...

    @property
    def max_batches(self) -> int | None: ...

    @property
    def lr_scheduler(self) -> Any: ...

    @property
    def use_grad(self) -> bool: ...

    @property
    def _optimizer(self) -> Any: ...

    @property
    def _state(self) -> FitState: ...

    @property
    def _stop_reason(self) -> str | None: ...

    @property
    def _hooked(self) -> bool: ...

    @property
    def _per_batch(self) -> set[str]: ...

    def _stage(self, when: Stage) -> None: ...

    def _train_batch(self, batch: Any) -> BatchResult: ...

    def _optimize_step(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        loss_fn: Callable[..., BatchResult],
        xs: Any,
        device: Any = None,
        dtype: Any = None,
    ) -> BatchResult: ...

    def _gradient_free_step(self, batch: Any) -> BatchResult: ...

    def _validate(self, loader: Any, iteration: int, record: bool = True, hooks: bool = True) -> list[BatchResult]: ...

    def _evaluate(
        self, model: torch.nn.Module, loader: Any, phase: str, results: list[BatchResult] | None = None
    ) -> tuple[dict[str, Any], float]: ...

    def on_train_start(self) -> None: ...

    def on_train_end(
        self, train_losses: list[list[BatchResult]], val_losses: list[list[BatchResult]] | None = None
    ) -> None: ...

    def on_train_epoch_start(self) -> None: ...

    def on_train_epoch_end(self, train_epoch_loss_metrics: list[BatchResult]) -> None: ...

    def on_val_epoch_start(self) -> None: ...

    def on_val_epoch_end(self, val_epoch_loss_metrics: list[BatchResult]) -> None: ...

    def on_train_batch_start(self, batch: Any) -> None: ...

    def on_train_batch_end(self, train_batch_loss_metrics: BatchResult) -> None: ...
