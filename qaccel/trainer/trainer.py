"""The Trainer: qadence's training loop (fit, validation, test, callbacks, tracked metrics), distributed by
``TrainConfig(nprocs=...)`` through the Accelerator, with qaccel's checkpoints and resume.

``fit()`` runs on every rank through ``Accelerator.distribute``: from ``python train.py`` it starts the ranks and the
caller's model and optimizer end up holding what the ranks trained; under torchrun or srun each rank runs it in
place on its own objects. Every decision that changes what ranks do next (stop, keep a best checkpoint) is taken
once and agreed, so the ranks never part ways.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import itertools
import math
import os
import pickle
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol, cast

import torch
from torch.utils.data import DataLoader, Dataset

from qaccel.accelerator import Accelerator
from qaccel.nested import map_leaves
from qaccel.options import Strategy, count
from qaccel.tracking.tools import Axis, NullTracker, Tracker, make_tracker
from qaccel.train import loaders, sharding
from qaccel.train.batch import real_dtype
from qaccel.trainer import plots, steps
from qaccel.trainer.callbacks import (
    Callback,
    LogHyperparameters,
    LogModelTracker,
    OptimizeResult,
    PlotMetrics,
    PrintMetrics,
    SaveBestCheckpoint,
    Stage,
    WriteMetrics,
)
from qaccel.trainer.config import SchedulerStep, TrainConfig

LossFunction = Callable[[torch.nn.Module, Any], tuple[torch.Tensor, dict[str, Any]]]
OptimizeStep = Callable[..., tuple[torch.Tensor, dict[str, Any]]]
CHECKPOINTS = "checkpoints"
BEST = "best"


def mse_loss(model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """Mean squared error of ``model(inputs)`` against ``targets`` for a batch ``(inputs, targets)``."""
    inputs, targets = batch
    loss = torch.nn.functional.mse_loss(model(inputs), targets)
    return loss, {"mse": loss}


def cross_entropy_loss(model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """Cross entropy of ``model(inputs)`` (logits) against class ``targets``, and the batch's accuracy."""
    inputs, targets = batch
    logits = model(inputs)
    loss = torch.nn.functional.cross_entropy(logits, targets)
    return loss, {"cross_entropy": loss, "accuracy": (logits.argmax(-1) == targets).float().mean()}


LOSSES: dict[str, LossFunction] = {"mse": mse_loss, "cross_entropy": cross_entropy_loss}


class _Stateful(Protocol):
    """A callback with state of its own to checkpoint (not every Callback has it: see _state_of())."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class _State:
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


class Trainer:
    """Train ``model`` with ``optimizer`` as ``config`` says, on ``config.nprocs`` ranks (qadence's Trainer).

    Args:
        model: the model (a plain ``torch.nn.Module``).
        optimizer: its torch optimizer, or a nevergrad optimizer for gradient-free training
            (``Trainer.set_use_grad(False)`` first, or ``with trainer.disable_grad_opt(ng_optimizer):``).
        config: a TrainConfig.
        loss_fn: ``"mse"``, ``"cross_entropy"`` or ``fn(model, batch) -> (loss, metrics)``; metrics are a dict of
            numbers or scalar tensors, logged as ``train_<name>``, ``val_<name>`` or ``test_<name>``. Without a
            training loader, ``batch`` is None: the function makes its own points.
        train_dataloader: the training DataLoader, a ``DictDataLoader``, or None (then ``loss_fn(model, None)`` once
            per epoch); or pass it to fit().
        val_dataloader: the validation DataLoader (or pass it to fit()).
        test_dataloader: the test DataLoader (or pass it to test()).
        optimize_step: ``fn(model, optimizer, loss_fn, xs, device, dtype) -> (loss, metrics)``, one training step
            of your own (qadence's argument); by default qaccel's, which accumulates gradients, scales fp16 losses
            and passes a closure to optimizers that need one (LBFGS).
        max_batches: at most this many batches per epoch; from a loader with no length (an infinite one) an epoch
            takes ``max_batches`` batches, by default one (qadence's rule).
        lr_scheduler: an LR scheduler of ``optimizer``, stepped per epoch or per optimizer update
            (``config.lr_scheduler_step``).
    """

    _use_grad: bool = True  # gradient-based training; set_use_grad() changes it for every Trainer, as in qadence
    _optimizer: Any  # torch's or nevergrad's; inside a rank, prepared (the torch one wrapped: .optimizer)

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        config: TrainConfig,
        loss_fn: str | LossFunction = "mse",
        train_dataloader: Any = None,
        val_dataloader: Any = None,
        test_dataloader: Any = None,
        optimize_step: OptimizeStep | None = None,
        max_batches: int | None = None,
        *,
        lr_scheduler: Any = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"Trainer(model=...) takes a torch.nn.Module; got {type(model).__name__}")
        if not isinstance(config, TrainConfig):
            raise TypeError(f"Trainer(config=...) takes a qaccel.TrainConfig; got {type(config).__name__}")
        if isinstance(loss_fn, str):
            if loss_fn not in LOSSES:
                raise ValueError(
                    f"loss_fn must be one of {', '.join(map(repr, LOSSES))} or a function "
                    f"fn(model, batch) -> (loss, metrics); got {loss_fn!r}"
                )
            loss_fn = LOSSES[loss_fn]
        elif not callable(loss_fn):
            raise TypeError(
                f"loss_fn must be a name or a function fn(model, batch) -> (loss, metrics); got {loss_fn!r}"
            )
        if optimize_step is not None and not callable(optimize_step):
            raise TypeError(
                "optimize_step must be a function fn(model, optimizer, loss_fn, xs, device, dtype) -> "
                f"(loss, metrics); got {optimize_step!r}"
            )
        if max_batches is not None:
            count("max_batches", max_batches, 1, "or None")
        if lr_scheduler is not None and not hasattr(lr_scheduler, "step"):
            raise TypeError(f"lr_scheduler must be an LR scheduler of the optimizer; got {lr_scheduler!r}")
        self.model, self.config, self.loss_fn = model, config, loss_fn
        self._ng_params: Any = None  # gradient-free: nevergrad's current candidate (set with the optimizer)
        self.optimizer = optimizer
        self.train_dataloader, self.val_dataloader, self.test_dataloader = (
            train_dataloader,
            val_dataloader,
            test_dataloader,
        )
        # qadence's default step, passed as its tutorials do: the Trainer's own, which extends it
        self.optimize_step = None if optimize_step is steps.optimize_step else optimize_step
        self.max_batches, self.lr_scheduler = max_batches, lr_scheduler
        self.accelerator = Accelerator(**config.accelerator_options())
        self.opt_result = OptimizeResult(0, model, optimizer)
        self.current_epoch = 0  # the epoch being trained, or the last one trained
        self.log_folder: Path | None = None  # the run's folder, once fit() chose it
        self.history: list[dict[str, float]] = []  # every epoch's metrics, with its "step"
        self.validation_improved = False
        self.tracker: Tracker | None = None
        self._callbacks: list[Callback] = []
        self._state = _State(self._callbacks)
        self._stop_reason: str | None = None
        self._at: Stage | None = None  # the stage whose callbacks run
        self._per_batch: set[str] = set()  # phases ("train", "val", "test") with a callback at a batch stage
        self._fitted = False  # a fit of this Trainer ended: the next one trains max_iter + 1 more epochs
        self._hooked = False  # a subclass's hook takes the batch results of an epoch: keep them

    # ---- qadence's switches between gradient-based and gradient-free training ----

    @property
    def use_grad(self) -> bool:
        """Whether training follows gradients (a torch optimizer) or not (a nevergrad optimizer)."""
        return self._use_grad

    @use_grad.setter
    def use_grad(self, use_grad: bool) -> None:
        if not isinstance(use_grad, bool):
            raise TypeError(f"use_grad must be True or False; got {use_grad!r}")
        self._use_grad = use_grad

    @classmethod
    def set_use_grad(cls, value: bool) -> None:
        """Gradient-based (True) or gradient-free (False) training for every Trainer made from now on."""
        if not isinstance(value, bool):
            raise TypeError(f"use_grad must be True or False; got {value!r}")
        cls._use_grad = value

    @property
    def optimizer(self) -> Any:
        return self._optimizer

    @optimizer.setter
    def optimizer(self, optimizer: Any) -> None:
        if self.use_grad:
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(
                    f"Trainer(optimizer=...) takes a torch.optim.Optimizer (gradient-free training takes a "
                    f"nevergrad optimizer: set_use_grad(False) first); got {type(optimizer).__name__}"
                )
        else:
            if not (hasattr(optimizer, "ask") and hasattr(optimizer, "tell")):
                raise TypeError(
                    f"gradient-free training (use_grad=False) takes a nevergrad optimizer; got "
                    f"{type(optimizer).__name__}"
                )
            import nevergrad

            from qaccel.trainer.parameters import get_parameters

            optimizer.budget = self.config.max_iter  # as qadence sets it
            optimizer.enable_pickling()  # it travels to the ranks and into checkpoints
            self._ng_params = nevergrad.p.Array(init=get_parameters(self.model).detach().numpy())
        self._optimizer = optimizer

    @contextlib.contextmanager
    def enable_grad_opt(self, optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
        """Within the block, train with gradients, with ``optimizer`` (or the Trainer's own)."""
        with self._grad_mode(True, optimizer):
            yield

    @contextlib.contextmanager
    def disable_grad_opt(self, optimizer: Any = None) -> Iterator[None]:
        """Within the block, train without gradients, with the nevergrad ``optimizer`` (or the Trainer's own)."""
        with self._grad_mode(False, optimizer):
            yield

    @contextlib.contextmanager
    def _grad_mode(self, use_grad: bool, optimizer: Any) -> Iterator[None]:
        mode, previous = self.use_grad, self._optimizer
        try:
            self.use_grad = use_grad
            self.optimizer = optimizer if optimizer is not None else previous
            yield
        finally:
            self.use_grad = mode
            self._optimizer = previous

    @property
    def global_step(self) -> int:
        """Training batches done, over every epoch of the fit (a resumed fit continues the count)."""
        return self._state.global_step

    @property
    def num_training_batches(self) -> int:
        """Batches an epoch takes from the training loader (1 without one)."""
        return _batches(self.train_dataloader, self.max_batches)

    @property
    def num_validation_batches(self) -> int:
        return _batches(self.val_dataloader, self.max_batches)

    @property
    def num_test_batches(self) -> int:
        return _batches(self.test_dataloader, self.max_batches)

    # ---- qadence's hooks: a subclass overrides them (each batch's results are lists of (loss, metrics)) ----

    def on_train_start(self) -> None:
        """At the start of training, after the train_start callbacks."""

    def on_train_end(
        self,
        train_losses: list[list[tuple[torch.Tensor, Any]]],
        val_losses: list[list[tuple[torch.Tensor, Any]]] | None = None,
    ) -> None:
        """At the end of training, before the train_end callbacks: every epoch's batch results of this fit."""

    def on_train_epoch_start(self) -> None:
        """Before each training epoch (and its callbacks)."""

    def on_train_epoch_end(self, train_epoch_loss_metrics: list[tuple[torch.Tensor, Any]]) -> None:
        """After each training epoch (and its callbacks): the epoch's batch results."""

    def on_val_epoch_start(self) -> None:
        """Before each validation."""

    def on_val_epoch_end(self, val_epoch_loss_metrics: list[tuple[torch.Tensor, Any]]) -> None:
        """After each validation: its batch results."""

    def on_train_batch_start(self, batch: Any) -> None:
        """Before each training batch, given the batch on the rank's device."""

    def on_train_batch_end(self, train_batch_loss_metrics: tuple[torch.Tensor, Any]) -> None:
        """After each training batch: its (loss, metrics)."""

    def on_val_batch_start(self, batch: Any) -> None:
        """Before each validation batch."""

    def on_val_batch_end(self, val_batch_loss_metrics: tuple[torch.Tensor, Any]) -> None:
        """After each validation batch."""

    def on_test_batch_start(self, batch: Any) -> None:
        """Before each test batch."""

    def on_test_batch_end(self, test_batch_loss_metrics: tuple[torch.Tensor, Any]) -> None:
        """After each test batch."""

    def _overrides_a_results_hook(self) -> bool:
        """Whether a subclass overrides a hook that gets an epoch's batch results: only then are they kept."""
        return any(
            getattr(type(self), name) is not getattr(Trainer, name)
            for name in ("on_train_end", "on_train_epoch_end", "on_val_epoch_end")
        )

    # ---- what users call ----

    def fit(self, train_dataloader: Any = None, val_dataloader: Any = None) -> tuple[torch.nn.Module, Any]:
        """Train epochs 0 .. ``max_iter``; return the model and optimizer, holding what the ranks trained.

        A second fit of the same Trainer continues where the first ended (its folder, its checkpoint) and trains
        ``max_iter + 1`` more epochs, as in qadence."""
        self.train_dataloader = train_dataloader if train_dataloader is not None else self.train_dataloader
        self.val_dataloader = val_dataloader if val_dataloader is not None else self.val_dataloader
        for name in ("train_dataloader", "val_dataloader"):
            loader = getattr(self, name)
            if loader is not None and not isinstance(loader, (DataLoader, loaders.DictDataLoader)):
                raise TypeError(
                    f"{name} must be a torch DataLoader or a qaccel DictDataLoader; got {type(loader).__name__}"
                )
        if self.config.val_every and self.val_dataloader is None:
            raise ValueError("TrainConfig.val_every > 0 needs a val_dataloader (in fit() or Trainer(...))")
        if self.optimize_step is not None and self.config.gradient_accumulation_steps > 1:
            raise ValueError(
                "optimize_step=... is one whole step of your own; gradient accumulation "
                f"(gradient_accumulation_steps={self.config.gradient_accumulation_steps}) needs "
                "qaccel's: leave optimize_step out, or set gradient_accumulation_steps=1"
            )
        launching = self.accelerator.starts_ranks
        folder = self._choose_folder() if launching else None  # in place: rank 0 chooses, inside the session
        trained = self.accelerator.distribute(_fit_on_rank)(self, folder)
        if launching:  # the ranks trained copies: give their results to the caller's own objects
            self.model.load_state_dict(trained["model"])
            optimizer_state = trained["optimizer"]
            if self.use_grad:
                if self.accelerator.strategy is Strategy.FSDP:  # keyed by parameter name: key it by position
                    optimizer_state = sharding.by_index(optimizer_state, self.model, self._optimizer)
                self._optimizer.load_state_dict(optimizer_state)
            else:
                self._optimizer, self._ng_params = pickle.loads(optimizer_state)
            if self.lr_scheduler is not None:
                self.lr_scheduler.load_state_dict(trained["lr_scheduler"])
        log_folder: Path = trained["log_folder"]
        self.history, self.log_folder = trained["history"], log_folder
        self.current_epoch, self._fitted = trained["epoch"], True
        self._state.global_step = trained["global_step"]
        self.config.log_folder = self.log_folder  # as qadence: the run's folder, where a second fit continues
        return self.model, self.optimizer

    def test(self, test_dataloader: Any = None) -> dict[str, float]:
        """The mean loss and metrics over ``test_dataloader`` (``test_loss``, ``test_<name>``), over every rank."""
        self.test_dataloader = test_dataloader if test_dataloader is not None else self.test_dataloader
        if self.test_dataloader is None:
            raise ValueError("test() needs a test_dataloader (here or in Trainer(...))")
        return self.accelerator.distribute(_test_on_rank)(self)

    def get_ic_grad_bounds(
        self, eta: float, epsilons: torch.Tensor, variation_multiple: int = 20, dataloader: Any = None
    ) -> tuple[float, float, float]:
        """qadence's bounds on the gradient norm from the loss landscape's information content around the model's
        parameters, on the first batch of ``dataloader`` (or the training loader): (max-IC lower bound, max-IC upper
        bound, sensitivity-IC upper bound). Computed in this process by qadence's own ``InformationContent``, so it
        needs qadence (``variation_multiple`` is unused, as in qadence)."""
        try:
            from qadence.ml_tools.information import InformationContent
        except ImportError as exc:
            raise ImportError(
                "Trainer.get_ic_grad_bounds() computes with qadence's InformationContent: pip install qadence"
            ) from exc
        if not self.use_grad:
            warnings.warn(
                "gradient norm bounds matter for gradient-based training; this Trainer trains without "
                "gradients (use_grad=False)",
                stacklevel=2,
            )
        loader = dataloader if dataloader is not None else self.train_dataloader
        batch = None if loader is None else next(iter(loader))
        content = InformationContent(self.model, self.loss_fn, batch, epsilons)
        lower, upper = content.get_grad_norm_bounds_max_IC()
        return lower, upper, content.get_grad_norm_bounds_sensitivity_IC(eta)

    def request_stop(self, reason: str) -> None:
        """Stop training after this epoch, on every rank (a callback on any rank may ask)."""
        self._stop_reason = reason

    def write_metrics(self, metrics: dict[str, float]) -> None:
        """Write metrics to the tracker (rank 0; nothing elsewhere): from a callback at a training batch stage at
        the batch's number on the tracker's batch axis, otherwise at the current epoch."""
        if self.tracker is None or not self.accelerator.is_main_process:
            return
        values = {k: float(v) for k, v in metrics.items()}
        if self._at in (Stage.TRAIN_BATCH_START, Stage.TRAIN_BATCH_END):
            self.tracker.log_metrics(values, self.opt_result.batch, Axis.BATCH)
        else:
            self.tracker.log_metrics(values, self.opt_result.iteration)

    def plot(self) -> None:
        """Log the figures of ``config.plotting_functions`` for the current epoch to the tracker (rank 0; nothing
        elsewhere): what ``PlotMetrics`` and ``plot_every`` call."""
        if self.accelerator.is_main_process:
            model = self.accelerator.unwrap_model(self.model)
            self._opened_tracker().plot(model, self.opt_result.iteration, self.config.plotting_functions)

    def save_checkpoint(self, best: bool = False) -> str:
        """Save a checkpoint in the run's folder (every rank): numbered, or the ``best`` one."""
        if self.log_folder is None:
            raise RuntimeError("save_checkpoint() saves into the run's folder: call it during fit()")
        background = self.config.checkpoint_in_background
        if best:
            return self.accelerator.save_state(self.log_folder / BEST, background=background)
        return self.accelerator.save_state(background=background)

    # ---- inside a rank ----

    def _fit(self, folder: Path | None) -> dict[str, Any]:
        acc, config = self.accelerator, self.config
        if folder is None:
            folder = cast(Path, acc.broadcast(self._choose_folder() if acc.is_main_process else None))  # rank 0's
        self.log_folder = config.log_folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        if config.seed is not None:
            acc.set_seed(config.seed)
        user_model, user_optimizer = self.model, self._optimizer
        where = _device_of(user_model)
        train = self.train_dataloader if self.train_dataloader is not None else _no_data(acc.world_size)
        prepared = acc.prepare(
            self.model,
            self._optimizer,
            train,
            *([self.val_dataloader] if self.val_dataloader is not None else []),
            *([self.lr_scheduler] if self.lr_scheduler is not None else []),
        )
        self.model, self._optimizer, train_loader = prepared[:3]
        val_loader = prepared[3] if self.val_dataloader is not None else None
        self._hooked = self._overrides_a_results_hook()
        self._callbacks[:] = self._make_callbacks()
        self._per_batch = {c.on.value.split("_")[0] for c in self._callbacks if c.on.per_batch}
        self._stop_reason = None
        self._state = _State(self._callbacks)  # a fit starts from its folder's checkpoint, or from nothing
        if not self.use_grad:
            self._state.nevergrad = pickle.dumps((self._optimizer, self._ng_params))
        acc.register_for_checkpointing(self._state)
        resumed = acc.resume(folder / CHECKPOINTS, keep=config.keep_checkpoints, allow_pickle=config.allow_pickle)
        state = self._state
        if resumed is None:
            resumed = self._continue_qadence(folder, train_loader)
        if not self.use_grad and state.nevergrad is not None:
            self._optimizer, self._ng_params = pickle.loads(state.nevergrad)
        if resumed is None or (state.epochs_done >= state.end and not self._fitted):
            state.end = config.max_iter + 1
        elif state.epochs_done >= state.end:  # a later fit of this Trainer: max_iter + 1 more epochs
            state.end = state.epochs_done + config.max_iter + 1
        if resumed is not None and acc.is_main_process:
            print(
                f"qaccel: resumed {resumed} after epoch {state.epochs_done - 1} (training epochs "
                f"{state.epochs_done}-{state.end - 1} next)"
                + (f" and {state.batches} batches of the next" if state.batches else ""),
                file=sys.stderr,
                flush=True,
            )
        self._open_tracker(resumed)
        try:
            self._train(train_loader, val_loader)
        finally:
            self._opened_tracker().close()
        self.history = state.history
        if acc.is_main_process:
            self._write_curves()
        if config.log_model:
            acc.save_model(self.model, folder)
        if self.use_grad:
            optimizer_state = (
                self._optimizer.state_dict()
                if acc.strategy is Strategy.DDP
                else sharding.full_optimizer_state_dict(self.model, self._optimizer.optimizer)
            )
        else:
            optimizer_state = pickle.dumps((self._optimizer, self._ng_params))
        result = {
            "model": acc.get_state_dict(self.model),
            "optimizer": optimizer_state,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "history": state.history,
            "log_folder": folder,
            "epoch": self.current_epoch,
            "global_step": state.global_step,
        }
        self.model, self._optimizer = user_model, user_optimizer  # in place, the user's own objects, trained
        if where is not None and _device_of(user_model) != where:  # back where the user made it, as a launch gives it
            user_model.to(where)
            if self.use_grad:
                user_optimizer.load_state_dict(user_optimizer.state_dict())  # torch moves the state to the parameters
        self._fitted = True
        return result

    def _continue_qadence(self, folder: Path, train_loader: Any) -> str | None:
        """Continue a run qadence's Trainer checkpointed in ``folder`` (its ``model_*_ckpt_*.pt`` files): its model
        and optimizer, every rank, from the epoch after the checkpoint's. None when there is none."""
        from qaccel.trainer import saveload

        if not any(folder.glob("model_*_ckpt_*.pt")):
            return None
        device = self.accelerator.device
        model_file = saveload.get_latest_checkpoint_name(folder, "model", device)
        model = self.accelerator.unwrap_model(self.model)
        allow = self.config.allow_pickle
        _, iteration = saveload.load_model(folder, model, model_file, device, allow_pickle=allow)
        if self.use_grad:
            saveload.load_optimizer(folder, self._optimizer.optimizer, device=device, allow_pickle=allow)
        if isinstance(iteration, int):
            self._state.epochs_done = iteration + 1
            for loader in _prepared_loaders(train_loader):
                loader.set_epoch(iteration + 1)
        return str(folder / model_file)

    def _train(self, train_loader: Any, val_loader: Any) -> None:
        acc, config, state = self.accelerator, self.config, self._state
        if config.val_every and state.epochs_done == 0 and state.batches == 0 and not state.history:
            self._validate(val_loader, 0, hooks=False)  # where training starts from (qadence calls no epoch hook)
        self._stage(Stage.TRAIN_START)
        self.on_train_start()
        train_losses: list[list[tuple[torch.Tensor, dict[str, Any]]]] = []  # kept for qadence's hooks only
        val_losses: list[list[tuple[torch.Tensor, dict[str, Any]]]] = []
        epochs = range(train_loader.epoch, state.end)
        iteration, metrics = state.epochs_done - 1, {}
        for iteration in acc.progress(epochs, desc="epochs") if config.verbose else epochs:
            self.current_epoch = iteration
            self.opt_result = OptimizeResult(
                iteration, self.model, self._optimizer, rank=acc.rank, device=str(acc.device)
            )
            self.on_train_epoch_start()
            self._stage(Stage.TRAIN_EPOCH_START)
            epoch_results = []
            for batch in _epoch_of(train_loader, self.max_batches, state.batches):
                result = self._train_batch(batch)
                if self._hooked:
                    epoch_results.append(result)
            metrics = self._epoch_means()
            if self.lr_scheduler is not None and config.lr_scheduler_step is SchedulerStep.EPOCH:
                self.lr_scheduler.step()
            self._end_epoch(iteration, metrics)
            self._stage(Stage.TRAIN_EPOCH_END)
            self.on_train_epoch_end(epoch_results)
            train_losses.append(epoch_results)
            if config.val_every and iteration % config.val_every == 0:
                # after epoch 0 too, as qadence: callbacks skip epoch 0, and its metrics are neither recorded nor
                # written (step 0 holds the validation before training)
                val_losses.append(self._validate(val_loader, iteration, record=iteration > 0))
            if config.trainstop_criterion is not None and acc.is_main_process and config.trainstop_criterion(self):
                self.request_stop("trainstop_criterion returned True")
            stop = self._agreed_stop()
            state.epochs_done = iteration + 1
            last = state.epochs_done == state.end
            if not self.use_grad:
                state.nevergrad = pickle.dumps((self._optimizer, self._ng_params))
            if (
                config.checkpoint_every
                and not config.checkpoint_best_only
                and (iteration % config.checkpoint_every == 0 or stop or last)
            ):
                self.save_checkpoint()
            if stop:
                acc.print(f"qaccel: training stopped after epoch {iteration}: {stop}")
                break
        # qadence writes and plots the last epoch's results at the end, where the frequencies left it out
        self.opt_result = OptimizeResult(
            iteration,
            self.model,
            self._optimizer,
            metrics.get("train_loss"),
            metrics,
            rank=acc.rank,
            device=str(acc.device),
        )
        if metrics and config.write_every and iteration % config.write_every:
            self.write_metrics(metrics)
        if config.plot_every and config.plotting_functions and iteration % config.plot_every:
            self.plot()
        self.on_train_end(train_losses, val_losses)
        self._stage(Stage.TRAIN_END)

    def _train_batch(self, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        acc, state = self.accelerator, self._state
        self.opt_result.batch = state.global_step + 1
        batch = acc.prepare_batch(batch)
        self.on_train_batch_start(batch)
        self._stage(Stage.TRAIN_BATCH_START)
        if self.use_grad:
            # Gradients are zeroed before a step, not after, so the last update's stay for the callbacks at the
            # batch's and the epoch's end (GradientMonitoring); between the micro-steps of an accumulation the
            # prepared optimizer's zero_grad does nothing.
            self._optimizer.zero_grad()
            with acc.accumulate(self.model):
                step = self.optimize_step or self._optimize_step
                loss, metrics = step(
                    model=self.model,
                    optimizer=self._optimizer,
                    loss_fn=self.loss_fn,
                    xs=batch,
                    device=acc.device,
                    dtype=None if acc.dtype is None else real_dtype(acc.dtype),  # qadence's data_dtype
                )
        else:
            loss, metrics = self._gradient_free_step(batch)
        if (
            self.lr_scheduler is not None
            and self.config.lr_scheduler_step is SchedulerStep.BATCH
            and acc.sync_gradients
            and not acc.optimizer_step_was_skipped
        ):
            self.lr_scheduler.step()
        values = _detached("train", loss, metrics)
        for name, value in values.items():
            state.sums[name] = state.sums.get(name, 0.0) + value
        state.batches += 1
        state.global_step += 1
        if "train" in self._per_batch:  # floats wait for the device: only when a callback reads them
            self._show_batch("train", values)
        self._stage(Stage.TRAIN_BATCH_END)
        result = (loss.detach(), values)
        self.on_train_batch_end(result)
        return result

    def _optimize_step(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        loss_fn: LossFunction,
        xs: Any,
        device: Any = None,
        dtype: Any = None,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """qaccel's training step: the loss, its backward (scaled, divided over accumulation steps), the update.
        An optimizer that needs a closure (LBFGS) gets one, evaluated as often as it asks, as qadence does."""
        acc = self.accelerator
        out: list[Any] = []

        def closure() -> torch.Tensor:
            if out:  # evaluated again (LBFGS): gradients of this evaluation only
                optimizer.zero_grad()
            loss, metrics = loss_fn(model, xs)
            acc.backward(loss)
            out[:] = [loss, metrics]
            return loss

        if acc.sync_gradients and _needs_closure(optimizer):
            optimizer.step(closure)
        else:
            closure()
            optimizer.step()
        return out[0], out[1]

    def _gradient_free_step(self, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """One nevergrad step (qadence's update_ng_parameters), telling the loss's mean over the ranks, so that every
        rank's optimizer takes the same path."""
        acc = self.accelerator

        def mean(loss: torch.Tensor) -> float:
            return float(acc.reduce(loss.detach().reshape(()), reduction="mean")) if acc.world_size > 1 else float(loss)

        with torch.no_grad():
            loss, metrics, self._ng_params = steps.update_ng_parameters(
                acc.unwrap_model(self.model), self._optimizer, self.loss_fn, batch, self._ng_params, told=mean
            )
        return loss, metrics

    def _validate(
        self, loader: Any, iteration: int, record: bool = True, hooks: bool = True
    ) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        """Validate; with ``record``, the means go to the history and the tracker and may be the best so far; with
        ``hooks``, the validation epoch's hooks run."""
        acc, state = self.accelerator, self._state
        self.opt_result = OptimizeResult(iteration, self.model, self._optimizer, rank=acc.rank, device=str(acc.device))
        if hooks:
            self.on_val_epoch_start()
        self._stage(Stage.VAL_EPOCH_START)
        results: list[tuple[torch.Tensor, dict[str, Any]]] = []
        sums, samples = self._evaluate(self.model, loader, "val", results)
        if self.config.all_reduce_metrics:
            sums, samples = self._summed(sums, samples)
        means = {name: float(total) / max(samples, 1.0) for name, total in sums.items()}
        improved = False
        if acc.is_main_process and record:
            criterion = self.config.validation_criterion or _lower
            improved = bool(criterion(means["val_loss"], state.best_val, self.config.val_epsilon))
        self.validation_improved = bool(acc.broadcast(improved))
        if self.validation_improved:
            state.best_val = acc.broadcast(means["val_loss"])
        self.opt_result.loss, self.opt_result.metrics = means["val_loss"], means
        if record:
            self._record(iteration, means)
            self.write_metrics(means)  # validation metrics are always written
        self._stage(Stage.VAL_EPOCH_END)
        if hooks:
            self.on_val_epoch_end(results)
        return results

    def _test(self) -> dict[str, float]:
        acc = self.accelerator
        model, loader = acc.prepare(self.model, self.test_dataloader)
        self.opt_result = OptimizeResult(0, model, self._optimizer, rank=acc.rank, device=str(acc.device))
        sums, samples = self._summed(*self._evaluate(model, loader, "test"))
        return {name: float(total) / max(samples, 1.0) for name, total in sums.items()}

    def _evaluate(
        self,
        model: torch.nn.Module,
        loader: Any,
        phase: str,
        results: list[tuple[torch.Tensor, dict[str, Any]]] | None = None,
    ) -> tuple[dict[str, Any], float]:
        """This rank's sums of the loss and metrics over ``loader``'s samples (batch means times batch sizes), and
        its sample count; each batch's (loss, metrics) appended to ``results`` for qadence's hooks. Padding batches
        (repeats that even out the last step) run, as a sharded model needs every rank's forward, but count for
        nothing."""
        acc = self.accelerator
        start, end = Stage(f"{phase}_batch_start"), Stage(f"{phase}_batch_end")
        sums: dict[str, Any] = {}
        samples = 0
        padded = isinstance(loader, DataLoader)  # a DictDataLoader's batches are counted whole
        model.eval()
        try:
            with torch.no_grad():
                for number, batch in enumerate(_epoch_of(loader, self.max_batches), 1):
                    self.opt_result.batch = number
                    batch = acc.prepare_batch(batch)
                    getattr(self, f"on_{phase}_batch_start")(batch)
                    self._stage(start)
                    size, padding = _batch_size(batch), acc.padding_in_batch if padded else 0
                    if 0 < padding < size:  # the real samples only (all padding: run it, as a sharded model needs)
                        batch, size = map_leaves(batch, lambda t, real=size - padding: t[:real]), size - padding
                    elif padding:
                        size = 0  # counts for nothing, but every rank keeps every name
                    loss, metrics = self.loss_fn(model, batch)
                    values = _detached(phase, loss, metrics)
                    for name, value in values.items():
                        sums[name] = sums.get(name, 0.0) + value * size
                    samples += size
                    if phase in self._per_batch:
                        self._show_batch(phase, values)
                    self._stage(end)
                    result = (loss.detach(), values)
                    getattr(self, f"on_{phase}_batch_end")(result)
                    if results is not None and self._hooked:
                        results.append(result)
        finally:
            model.train()
        return sums, float(samples)

    def _summed(self, sums: dict[str, Any], samples: float) -> tuple[dict[str, Any], float]:
        """Sums and sample count over every rank."""
        totals = self.accelerator.all_reduce_dict({**sums, "_samples": samples}, op="sum")
        return totals, float(totals.pop("_samples"))

    def _show_batch(self, phase: str, values: dict[str, Any]) -> None:
        floats = {name: float(value) for name, value in values.items()}
        self.opt_result.loss, self.opt_result.metrics = floats[f"{phase}_loss"], floats

    # ---- helpers ----

    def _make_callbacks(self) -> list[Callback]:
        """The user's callbacks, then the ones the config's fields ask for (qadence's order)."""
        config = self.config
        made: list[Callback] = list(config.callbacks)
        if config.plotting_functions:
            made.append(PlotMetrics(Stage.TRAIN_START, 1))  # qadence plots where training starts
        if config.checkpoint_best_only:
            made.append(SaveBestCheckpoint(Stage.VAL_EPOCH_END, 1))
        if config.verbose and config.print_every:
            made.append(PrintMetrics(Stage.TRAIN_EPOCH_END, config.print_every))
            if config.val_every:
                made.append(PrintMetrics(Stage.VAL_EPOCH_END, 1))
        if config.write_every:
            made.append(WriteMetrics(Stage.TRAIN_EPOCH_END, config.write_every))
        if config.plot_every and config.plotting_functions:
            made.append(PlotMetrics(Stage.TRAIN_EPOCH_END, config.plot_every))
        if config.hyperparams:
            made.append(LogHyperparameters(Stage.TRAIN_END, 1))
        if config.log_model:
            made.append(LogModelTracker(Stage.TRAIN_END, 1))
        return made

    def _stage(self, when: Stage) -> None:
        self._at = when
        try:
            for callback in self._callbacks:
                callback(when, self, self.config, self.tracker)
        finally:
            self._at = None

    def _epoch_means(self) -> dict[str, float]:
        state = self._state
        means = {name: float(total) / max(state.batches, 1) for name, total in state.sums.items()}
        state.sums, state.batches = {}, 0
        return self._reduced(means)

    def _reduced(self, metrics: dict[str, float]) -> dict[str, float]:
        if self.config.all_reduce_metrics and metrics:
            return {k: float(v) for k, v in self.accelerator.all_reduce_dict(metrics).items()}
        return metrics

    def _end_epoch(self, iteration: int, metrics: dict[str, float]) -> None:
        self.opt_result.loss, self.opt_result.metrics = metrics.get("train_loss"), metrics
        self._record(iteration, metrics)

    def _record(self, iteration: int, metrics: dict[str, float]) -> None:
        history = self._state.history
        if history and history[-1]["step"] == iteration:
            history[-1].update(metrics)
        else:
            history.append({"step": iteration, **metrics})

    def _agreed_stop(self) -> str | None:
        """Whether any rank asked to stop; every rank gets the same answer (one small all-reduce per epoch)."""
        asked = self.accelerator.all_reduce_dict({"stop": float(self._stop_reason is not None)}, op="max")
        if asked["stop"] <= 0:
            return None
        return self._stop_reason or "another rank asked to stop"

    def _choose_folder(self) -> Path:
        """The run's folder, as qadence picks it: ``log_folder`` if given, else a new subfolder of ``root_folder``.
        A job that restarts or is requeued finds its own subfolder again (named after the SLURM job or the
        torchrun run)."""
        config = self.config
        if config.log_folder != Path("./") and not config.create_subfolder_per_run:
            return config.log_folder.resolve()
        root = config.root_folder.resolve()
        job = os.environ.get("SLURM_JOB_ID") or (os.environ.get("TORCHELASTIC_RUN_ID") or "").replace("none", "")
        if job:
            mine = sorted(root.glob(f"*_{job}")) if root.is_dir() else []
            if mine:
                return mine[-1]
        existing = len(list(root.iterdir())) if root.is_dir() else 0
        stamp = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
        return root / f"{existing + 1}_{stamp}_{job or format(os.getpid(), 'x')}"

    def _open_tracker(self, resumed: str | None) -> None:
        """Rank 0's tracker; the other ranks get one that writes nothing, so callbacks call it on every rank."""
        acc, state = self.accelerator, self._state
        if not acc.is_main_process:
            self.tracker = NullTracker()
            return
        self.tracker = make_tracker(self.config.tracking_tool)
        assert self.log_folder is not None
        self.tracker.open(
            self.log_folder / "tracking",
            self.log_folder.name,
            state.tracker,
            start_step=state.epochs_done if resumed else 0,
            start_batch=state.global_step + 1 if resumed else 0,
        )
        state.tracker = self.tracker.state()

    def _opened_tracker(self) -> Tracker:
        """The tracker _open_tracker() opened for the fit in progress."""
        if self.tracker is None:
            raise RuntimeError("the Trainer's tracker is opened by fit(), on every rank")
        return self.tracker

    def _write_curves(self) -> None:
        assert self.log_folder is not None
        if self.history and plots.curves(self.history, self.log_folder / "curves.png") is None:
            print("qaccel: no curves.png: install matplotlib (pip install matplotlib) to get one", flush=True)


def _fit_on_rank(trainer: Trainer, folder: Path | None) -> dict[str, Any]:
    return trainer._fit(folder)


def _test_on_rank(trainer: Trainer) -> dict[str, float]:
    return trainer._test()


def _detached(phase: str, loss: torch.Tensor, metrics: dict[str, Any]) -> dict[str, Any]:
    """The batch's loss and metrics named ``<phase>_<name>``: numbers, or tensors detached (no graph kept) in the
    precision sums need, left on the device (reading a number would wait for it)."""
    values = {f"{phase}_{name}": _number(f"{phase}_{name}", value) for name, value in metrics.items()}
    values[f"{phase}_loss"] = _number(f"{phase}_loss", loss)
    return values


def _number(name: str, value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return float(value)
    if value.numel() != 1:
        raise ValueError(
            f"the loss function's {name!r} is a tensor of shape {tuple(value.shape)}; metrics are "
            "numbers or one-element tensors"
        )
    return value.detach().to(torch.float32 if value.device.type == "mps" else torch.float64)  # MPS has no float64


def _batch_size(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (1 for a batch without tensors, e.g. None)."""
    if isinstance(batch, torch.Tensor):
        return len(batch) if batch.dim() else 1
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        if isinstance(item, (torch.Tensor, dict, list, tuple)):
            return _batch_size(item)
    return 1


class _NoData(Dataset):
    """A Trainer's epoch without a training loader: one None per rank, so loss_fn(model, None) runs once per
    epoch, and the epoch goes through a prepared loader like any other (resume, stop check points)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def __len__(self) -> int:
        return self.world_size

    def __getitem__(self, index: int) -> None:
        return None


def _none(batch: list[None]) -> None:
    return None


def _no_data(world_size: int) -> DataLoader:
    return DataLoader(_NoData(world_size), batch_size=1, collate_fn=_none)


def _epoch_of(loader: Any, max_batches: int | None, done: int = 0) -> Iterable[Any]:
    """The batches one epoch takes from ``loader`` (loaders.batches_per_epoch), ``done`` of them taken before a
    resume: the loader itself when that is all of it (a resumed prepared loader passes over what was done), else
    its next ones, the epoch then ended (so a prepared loader records it as done)."""
    count = loaders.batches_per_epoch(loader, max_batches)
    try:
        if len(loader) <= count:
            return loader
    except TypeError:
        pass
    return _first(loader, count - done)


def _first(loader: Any, count: int) -> Iterator[Any]:
    batches = iter(loader)
    try:
        yield from itertools.islice(batches, count)
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


def _batches(loader: Any, max_batches: int | None) -> int:
    return 1 if loader is None else loaders.batches_per_epoch(loader, max_batches)


def _prepared_loaders(loader: Any) -> list[Any]:
    """The prepared loaders in a training loader (a DictDataLoader's own)."""
    return list(loader.dataloaders.values()) if isinstance(loader, loaders.DictDataLoader) else [loader]


def _needs_closure(optimizer: Any) -> bool:
    """Whether the optimizer's step() requires a closure (LBFGS's does; Adam's takes an optional one)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    parameter = inspect.signature(type(inner).step).parameters.get("closure")
    return parameter is not None and parameter.default is inspect.Parameter.empty


def _device_of(model: torch.nn.Module) -> torch.device | None:
    return next((p.device for p in model.parameters()), None)


def _lower(val_loss: float, best: float, epsilon: float) -> bool:
    return val_loss < best - epsilon


def _state_of(callback: Callback) -> dict[str, Any] | None:
    return cast(_Stateful, callback).state_dict() if hasattr(callback, "state_dict") else None
