"""The Trainer: qadence's training loop (fit, validation, test, callbacks, tracked metrics), distributed by
``TrainConfig(nprocs=...)`` through the Accelerator, with qaccel's checkpoints and resume.

``fit()`` runs on every rank through ``Accelerator.distribute``: from ``python train.py`` it starts the ranks and the
caller's model and optimizer end up holding what the ranks trained; under torchrun or srun each rank runs it in
place on its own objects. Every decision that changes what ranks do next (stop, keep a best checkpoint) is taken
once and agreed, so the ranks never part ways.
"""

from __future__ import annotations

import datetime
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from qaccel.accelerator import Accelerator
from qaccel.environment import detect
from qaccel.nested import map_leaves
from qaccel.options import Strategy
from qaccel.train import sharding
from qaccel.trainer import plots
from qaccel.trainer.callbacks import (
    Callback,
    LogHyperparameters,
    OptimizeResult,
    PlotMetrics,
    PrintMetrics,
    SaveBestCheckpoint,
    Stage,
    WriteMetrics,
)
from qaccel.trainer.config import SchedulerStep, TrainConfig
from qaccel.trainer.tracking import Axis, Tracker, make_tracker

LossFunction = Callable[[torch.nn.Module, Any], tuple[torch.Tensor, dict[str, Any]]]
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


class _State:
    """What the Trainer adds to a checkpoint: the epochs and batches done, their metrics, the best validation, the
    running sums of an epoch in progress, the tracker's run and the callbacks' own state. Registered for
    checkpointing, so a resumed fit (mid-epoch included, after a stop on a signal too) continues exactly."""

    def __init__(self, callbacks: list[Callback]) -> None:
        self.epochs_done = 0
        self.global_step = 0  # training batches done, over every epoch
        self.history: list[dict[str, float]] = []
        self.best_val = math.inf
        self.sums: dict[str, Any] = {}  # name -> a number or a 0-dim tensor on the device (summed without a sync)
        self.batches = 0
        self.tracker: dict[str, Any] | None = None
        self._callbacks = callbacks  # whose state_dict() goes into the checkpoint with this

    def state_dict(self) -> dict[str, Any]:
        state = {name: value for name, value in vars(self).items() if not name.startswith("_")}
        state["sums"] = {name: float(total) for name, total in self.sums.items()}
        return {**state, "callbacks": [_state_of(c) for c in self._callbacks]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        for callback, saved in zip(self._callbacks, state.pop("callbacks")):
            if saved is not None:
                callback.load_state_dict(saved)
        vars(self).update(state)


class Trainer:
    """Train ``model`` with ``optimizer`` as ``config`` says, on ``config.nprocs`` ranks.

    Args:
        model: the model (a plain ``torch.nn.Module``).
        optimizer: its optimizer.
        config: a TrainConfig.
        loss_fn: ``"mse"``, ``"cross_entropy"`` or ``fn(model, batch) -> (loss, metrics)``; metrics are a dict of
            numbers or scalar tensors, logged as ``train_<name>``, ``val_<name>`` or ``test_<name>``.
        train_dataloader: the training DataLoader (or pass it to fit()).
        val_dataloader: the validation DataLoader (or pass it to fit()).
        test_dataloader: the test DataLoader (or pass it to test()).
        lr_scheduler: an LR scheduler of ``optimizer``, stepped per epoch or per optimizer update
            (``config.lr_scheduler_step``).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: TrainConfig,
                 loss_fn: str | LossFunction = "mse", train_dataloader: Any = None, val_dataloader: Any = None,
                 test_dataloader: Any = None, *, lr_scheduler: Any = None) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"Trainer(model=...) takes a torch.nn.Module; got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"Trainer(optimizer=...) takes a torch.optim.Optimizer; got {type(optimizer).__name__}")
        if not isinstance(config, TrainConfig):
            raise TypeError(f"Trainer(config=...) takes a qaccel.TrainConfig; got {type(config).__name__}")
        if isinstance(loss_fn, str):
            if loss_fn not in LOSSES:
                raise ValueError(f"loss_fn must be one of {', '.join(map(repr, LOSSES))} or a function "
                                 f"fn(model, batch) -> (loss, metrics); got {loss_fn!r}")
            loss_fn = LOSSES[loss_fn]
        elif not callable(loss_fn):
            raise TypeError(f"loss_fn must be a name or a function fn(model, batch) -> (loss, metrics); got {loss_fn!r}")
        if lr_scheduler is not None and not hasattr(lr_scheduler, "step"):
            raise TypeError(f"lr_scheduler must be an LR scheduler of the optimizer; got {lr_scheduler!r}")
        self.model, self.optimizer, self.config, self.loss_fn = model, optimizer, config, loss_fn
        self.train_dataloader, self.val_dataloader, self.test_dataloader = train_dataloader, val_dataloader, test_dataloader
        self.lr_scheduler = lr_scheduler
        self.accelerator = Accelerator(**config.accelerator_options())
        self.opt_result = OptimizeResult(0, model, optimizer)
        self.log_folder: Path | None = None  # the run's folder, once fit() chose it
        self.history: list[dict[str, float]] = []  # every epoch's metrics, with its "step"
        self.validation_improved = False
        self.tracker: Tracker | None = None
        self._callbacks: list[Callback] = []
        self._state = _State(self._callbacks)
        self._stop_reason: str | None = None
        self._at: Stage | None = None  # the stage whose callbacks run
        self._per_batch: set[str] = set()  # phases ("train", "val", "test") with a callback at a batch stage

    @property
    def global_step(self) -> int:
        """Training batches done, over every epoch of the fit (a resumed fit continues the count)."""
        return self._state.global_step

    # ---- what users call ----

    def fit(self, train_dataloader: Any = None, val_dataloader: Any = None) -> tuple[torch.nn.Module,
                                                                                     torch.optim.Optimizer]:
        """Train; return the model and optimizer, holding what the ranks trained."""
        self.train_dataloader = train_dataloader if train_dataloader is not None else self.train_dataloader
        self.val_dataloader = val_dataloader if val_dataloader is not None else self.val_dataloader
        if self.train_dataloader is None:
            raise ValueError("fit() needs a train_dataloader (here or in Trainer(...))")
        if self.config.val_every and self.val_dataloader is None:
            raise ValueError("TrainConfig.val_every > 0 needs a val_dataloader (in fit() or Trainer(...))")
        launching = detect().kind.creates_processes and self.config.nprocs > 1
        folder = self._choose_folder() if launching else None  # in place: rank 0 chooses, inside the session
        trained = self.accelerator.distribute(_fit_on_rank)(self, folder)
        if launching:  # the ranks trained copies: give their results to the caller's own objects
            self.model.load_state_dict(trained["model"])
            optimizer_state = trained["optimizer"]
            if self.accelerator.strategy is Strategy.FSDP:  # keyed by parameter name: key it by position
                optimizer_state = sharding.by_index(optimizer_state, self.model, self.optimizer)
            self.optimizer.load_state_dict(optimizer_state)
            if self.lr_scheduler is not None:
                self.lr_scheduler.load_state_dict(trained["lr_scheduler"])
        self.history, self.log_folder = trained["history"], trained["log_folder"]
        return self.model, self.optimizer

    def test(self, test_dataloader: Any = None) -> dict[str, float]:
        """The mean loss and metrics over ``test_dataloader`` (``test_loss``, ``test_<name>``), over every rank."""
        self.test_dataloader = test_dataloader if test_dataloader is not None else self.test_dataloader
        if self.test_dataloader is None:
            raise ValueError("test() needs a test_dataloader (here or in Trainer(...))")
        return self.accelerator.distribute(_test_on_rank)(self)

    def request_stop(self, reason: str) -> None:
        """Stop training after this epoch, on every rank (a callback on any rank may ask)."""
        self._stop_reason = reason

    def write_metrics(self, metrics: dict[str, float]) -> None:
        """Write metrics to the tracker (rank 0; nothing elsewhere): from a callback at a training batch stage at
        the batch's number on the tracker's batch axis, otherwise at the current epoch."""
        if self.tracker is None:
            return
        values = {k: float(v) for k, v in metrics.items()}
        if self._at in (Stage.TRAIN_BATCH_START, Stage.TRAIN_BATCH_END):
            self.tracker.log_metrics(values, self.opt_result.batch, Axis.BATCH)
        else:
            self.tracker.log_metrics(values, self.opt_result.iteration)

    def save_checkpoint(self, best: bool = False) -> str:
        """Save a checkpoint in the run's folder (every rank): numbered, or the ``best`` one."""
        assert self.log_folder is not None
        if best:
            return self.accelerator.save_state(self.log_folder / BEST)
        return self.accelerator.save_state()

    # ---- inside a rank ----

    def _fit(self, folder: Path | None) -> dict[str, Any]:
        acc, config = self.accelerator, self.config
        if folder is None:
            folder = acc.broadcast(self._choose_folder() if acc.is_main_process else None)
        self.log_folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        if config.seed is not None:
            acc.set_seed(config.seed)
        user_model, user_optimizer = self.model, self.optimizer
        prepared = acc.prepare(self.model, self.optimizer, self.train_dataloader,
                               *([self.val_dataloader] if self.val_dataloader is not None else []),
                               *([self.lr_scheduler] if self.lr_scheduler is not None else []))
        self.model, self.optimizer, train_loader = prepared[:3]
        val_loader = prepared[3] if self.val_dataloader is not None else None
        self._callbacks[:] = self._make_callbacks()
        self._per_batch = {c.on.value.split("_")[0] for c in self._callbacks if c.on.per_batch}
        self._stop_reason = None
        self._state = _State(self._callbacks)  # a fit starts from its folder's checkpoint, or from nothing
        acc.register_for_checkpointing(self._state)
        resumed = acc.resume(folder / CHECKPOINTS, keep=config.keep_checkpoints)
        state = self._state
        if resumed is not None and acc.is_main_process:
            print(f"qaccel: resumed {resumed} after epoch {state.epochs_done} of {config.max_iter}"
                  + (f" (and {state.batches} batches of the next)" if state.batches else ""), file=sys.stderr,
                  flush=True)
        self._open_tracker(resumed)
        try:
            self._train(train_loader, val_loader)
        finally:
            if self.tracker is not None:
                self.tracker.close()
        self.history = state.history
        if acc.is_main_process:
            self._write_curves()
        if config.log_model:
            acc.save_model(self.model, folder)
        result = {
            "model": acc.get_state_dict(self.model),
            "optimizer": self.optimizer.state_dict() if acc.strategy is Strategy.DDP
            else sharding.full_optimizer_state_dict(self.model, self.optimizer.optimizer),
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "history": state.history,
            "log_folder": folder,
        }
        self.model, self.optimizer = user_model, user_optimizer  # in place, the user's own objects, trained
        return result

    def _train(self, train_loader: Any, val_loader: Any) -> None:
        acc, config, state = self.accelerator, self.config, self._state
        self._stage(Stage.TRAIN_START)
        if config.val_every and state.epochs_done == 0 and state.batches == 0 and not state.history:
            self._validate(val_loader, 0)  # where training starts from
        epochs = range(train_loader.epoch, config.max_iter)
        for epoch in acc.progress(epochs, desc="epochs") if config.verbose else epochs:
            iteration = epoch + 1
            self.opt_result = OptimizeResult(iteration, self.model, self.optimizer, rank=acc.rank,
                                             device=str(acc.device))
            self._stage(Stage.TRAIN_EPOCH_START)
            for batch in train_loader:
                self._train_batch(batch)
            metrics = self._epoch_means()
            if self.lr_scheduler is not None and config.lr_scheduler_step is SchedulerStep.EPOCH:
                self.lr_scheduler.step()
            self._end_epoch(iteration, metrics)
            self._stage(Stage.TRAIN_EPOCH_END)
            if config.val_every and iteration % config.val_every == 0:
                self._validate(val_loader, iteration)
            if config.trainstop_criterion is not None and acc.is_main_process and config.trainstop_criterion(self):
                self.request_stop("trainstop_criterion returned True")
            stop = self._agreed_stop()
            state.epochs_done = iteration
            if config.checkpoint_every and not config.checkpoint_best_only and (
                    iteration % config.checkpoint_every == 0 or stop or iteration == config.max_iter):
                self.save_checkpoint()
            if stop:
                acc.print(f"qaccel: training stopped after epoch {iteration}: {stop}")
                break
        self._stage(Stage.TRAIN_END)

    def _train_batch(self, batch: Any) -> None:
        acc, state = self.accelerator, self._state
        self.opt_result.batch = state.global_step + 1
        self._stage(Stage.TRAIN_BATCH_START)
        with acc.accumulate(self.model):
            loss, metrics = self.loss_fn(self.model, acc.prepare_batch(batch))
            acc.backward(loss)
            self.optimizer.step()
        if (self.lr_scheduler is not None and self.config.lr_scheduler_step is SchedulerStep.BATCH
                and acc.sync_gradients and not acc.optimizer_step_was_skipped):
            self.lr_scheduler.step()
        values = _detached("train", loss, metrics)
        for name, value in values.items():
            state.sums[name] = state.sums.get(name, 0.0) + value
        state.batches += 1
        state.global_step += 1
        if "train" in self._per_batch:  # floats wait for the device: only when a callback reads them
            self._show_batch("train", values)
        self._stage(Stage.TRAIN_BATCH_END)  # before zero_grad: batch-end callbacks see the step's gradients
        self.optimizer.zero_grad()  # a no-op on accumulation steps, as the prepared optimizer's step

    def _validate(self, loader: Any, iteration: int) -> None:
        acc, state = self.accelerator, self._state
        self.opt_result = OptimizeResult(iteration, self.model, self.optimizer, rank=acc.rank, device=str(acc.device))
        self._stage(Stage.VAL_EPOCH_START)
        sums, samples = self._evaluate(self.model, loader, "val")
        if self.config.all_reduce_metrics:
            sums, samples = self._summed(sums, samples)
        means = {name: float(total) / max(samples, 1.0) for name, total in sums.items()}
        improved = False
        if acc.is_main_process:
            criterion = self.config.validation_criterion or _lower
            improved = bool(criterion(means["val_loss"], state.best_val, self.config.val_epsilon))
        self.validation_improved = bool(acc.broadcast(improved))
        if self.validation_improved:
            state.best_val = acc.broadcast(means["val_loss"])
        self.opt_result.loss, self.opt_result.metrics = means["val_loss"], means
        self._record(iteration, means)
        self.write_metrics(means)  # validation metrics are always written
        self._stage(Stage.VAL_EPOCH_END)

    def _test(self) -> dict[str, float]:
        acc = self.accelerator
        model, loader = acc.prepare(self.model, self.test_dataloader)
        self.opt_result = OptimizeResult(0, model, self.optimizer, rank=acc.rank, device=str(acc.device))
        sums, samples = self._summed(*self._evaluate(model, loader, "test"))
        return {name: float(total) / max(samples, 1.0) for name, total in sums.items()}

    def _evaluate(self, model: torch.nn.Module, loader: Any, phase: str) -> tuple[dict[str, Any], float]:
        """This rank's sums of the loss and metrics over ``loader``'s samples (batch means times batch sizes), and
        its sample count. Padding batches (repeats that even out the last step) run, as a sharded model needs every
        rank's forward, but count for nothing."""
        acc = self.accelerator
        start, end = Stage(f"{phase}_batch_start"), Stage(f"{phase}_batch_end")
        sums: dict[str, Any] = {}
        samples = 0
        model.eval()
        try:
            with torch.no_grad():
                for number, batch in enumerate(loader, 1):
                    self.opt_result.batch = number
                    self._stage(start)
                    batch = acc.prepare_batch(batch)
                    size, padding = _batch_size(batch), acc.padding_in_batch
                    if 0 < padding < size:  # the real samples only (all padding: run it, as a sharded model needs)
                        batch, size = map_leaves(batch, lambda t: t[:size - padding]), size - padding
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
        """The callbacks the config's fields ask for, then the user's own (as qadence orders them)."""
        config = self.config
        made: list[Callback] = []
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
        return made + list(config.callbacks)

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
        acc, state = self.accelerator, self._state
        if not acc.is_main_process:
            return
        self.tracker = make_tracker(self.config.tracking_tool)
        assert self.log_folder is not None
        self.tracker.open(self.log_folder / "tracking", self.log_folder.name, state.tracker,
                          start_step=state.epochs_done + 1 if resumed else 0,
                          start_batch=state.global_step + 1 if resumed else 0)
        state.tracker = self.tracker.state()

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
        raise ValueError(f"the loss function's {name!r} is a tensor of shape {tuple(value.shape)}; metrics are "
                         "numbers or one-element tensors")
    return value.detach().to(torch.float32 if value.device.type == "mps" else torch.float64)  # MPS has no float64


def _batch_size(batch: Any) -> int:
    first = batch[0] if isinstance(batch, (list, tuple)) else next(iter(batch.values())) if isinstance(batch, dict) \
        else batch
    return len(first) if hasattr(first, "__len__") else 1


def _lower(val_loss: float, best: float, epsilon: float) -> bool:
    return val_loss < best - epsilon


def _state_of(callback: Callback) -> dict[str, Any] | None:
    return callback.state_dict() if hasattr(callback, "state_dict") else None
