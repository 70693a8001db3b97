"""Callbacks: code the Trainer runs at named points of training, as qadence's callbacks do.

A callback runs on every rank, so one that saves a checkpoint (a collective) or changes the learning rate keeps the
ranks in step; the ones that print or write do so on rank 0 only. One that raises ends the fit on every rank with
that rank's traceback, as any error in a distributed function does. A callback with state (early stopping's
patience, a schedule's base rates) has ``state_dict``/``load_state_dict``: the Trainer keeps that state in its
checkpoints, so a resumed fit continues where it stopped.

The base class ``Callback``, ``Stage`` and ``OptimizeResult`` are defined in hooks.py, which the config and the
Trainer import too, and are importable from here as before.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from qaccel.options import count
from qaccel.tracking.tools import Axis
from qaccel.trainer.hooks import Callback, ConfigView, OptimizeResult, Stage, TrainerView

if TYPE_CHECKING:
    import torch
    from torch.distributed.tensor import DTensor

    from qaccel.tracking.tools import Tracker
    from qaccel.train.loaders import R3Dataset

logger = logging.getLogger(__name__)


class PrintMetrics(Callback):
    """Print the latest loss and metrics on rank 0."""

    def run_callback(self, trainer: TrainerView, config: ConfigView, writer: Tracker | None) -> None:
        if trainer.accelerator.is_main_process:
            result = trainer.opt_result
            values = "  ".join(f"{name} {value:.6g}" for name, value in sorted(result.metrics.items()))
            where = f"epoch {result.iteration}" + (f" batch {result.batch}" if self.on.per_batch else "")
            print(f"{where}: {values}", flush=True)


def _write(callback: Callback, trainer: TrainerView, writer: Tracker | None, metrics: dict[str, Any]) -> None:
    """``metrics`` through ``writer``, the tracker the callback is handed (rank 0's in a fit, a ``NullTracker``
    elsewhere, or one of yours when you call the callback): at a training batch stage on the batch axis at the
    batch's number, elsewhere as qadence's and perceptrain's ``writer.write(iteration, metrics)``."""
    if writer is None or not metrics:
        return
    if callback.on in (Stage.TRAIN_BATCH_START, Stage.TRAIN_BATCH_END):
        writer.log_metrics({k: float(v) for k, v in metrics.items()}, trainer.opt_result.batch, Axis.BATCH)
    else:
        writer.write(trainer.opt_result.iteration, metrics)


class WriteMetrics(Callback):
    """Write the latest metrics to the tracker (rank 0): at a training batch stage the batch's, on the batch axis;
    elsewhere at the epoch as step."""

    def run_callback(self, trainer: TrainerView, config: ConfigView, writer: Tracker | None) -> None:
        _write(self, trainer, writer, trainer.opt_result.metrics)


class PlotMetrics(Callback):
    """Log the figures of ``config.plotting_functions`` to the tracker it is handed (rank 0's; the other ranks'
    draw nothing)."""

    def run_callback(self, trainer: TrainerView, config: ConfigView, writer: Tracker | None) -> None:
        if writer is not None and trainer.accelerator.is_main_process:
            model = trainer.accelerator.unwrap_model(trainer.model)
            writer.plot(model, trainer.opt_result.iteration, config.plotting_functions)


WritePlots = PlotMetrics  # perceptrain's name


class LivePlotMetrics(Callback):
    """Follow the metrics on screen as training goes, as perceptrain's callback does: rank 0 hands each call's
    metrics to livelossplot's ``PlotLosses``, which draws them with matplotlib (in a notebook below the cell, from a
    script in a window, when matplotlib's backend can show one). ``arrange``: the subplots, as
    ``{title: [metric names]}``; by default one with every metric. Needs ``livelossplot`` (the ``plots`` extra)."""

    def __init__(self, on: Stage | str, called_every: int, arrange: dict[str, list[str]] | None = None) -> None:
        super().__init__(on, called_every)
        try:
            import livelossplot  # noqa: F401  (here, where the callback is made, not at the first epoch's end)
        except ImportError as exc:
            raise ImportError(
                "LivePlotMetrics needs livelossplot: pip install livelossplot (from qaccel's checkout: "
                "pip install -e '.[plots]')"
            ) from exc
        self.arrange = arrange
        self.plot: Any = None  # livelossplot's PlotLosses, made at the first call on rank 0

    def run_callback(self, trainer: TrainerView, config: ConfigView, writer: Tracker | None) -> None:
        if not trainer.accelerator.is_main_process:
            return
        if self.plot is None:
            import livelossplot
            from livelossplot.outputs import MatplotlibPlot

            groups = self.arrange or {"Training": list(trainer.opt_result.metrics)}
            outputs: Any = [MatplotlibPlot(after_plots=_show)]  # an instance: livelossplot's annotation says a class
            self.plot = livelossplot.PlotLosses(outputs=outputs, groups=groups)
        self.plot.update(trainer.opt_result.metrics, current_step=trainer.opt_result.iteration)
        self.plot.send()

    def __getstate__(self) -> dict[str, Any]:
        return {**vars(self), "plot": None}  # the figure stays in the process that draws it


def _show(figure: Any) -> None:
    """Show livelossplot's figure: in a notebook, below the cell; from a script, a moment in its window, as
    perceptrain does. A backend that cannot show (Agg, without a display) draws nothing, without a warning."""
    import matplotlib
    from livelossplot.plot_losses import get_mode
    from matplotlib import pyplot

    figure.tight_layout()
    if get_mode() == "notebook":
        pyplot.show()
    elif matplotlib.get_backend().lower() not in ("agg", "pdf", "ps", "svg", "cairo", "template"):
        pyplot.draw()
        pyplot.pause(0.1)
    pyplot.close(figure)


class LogHyperparameters(Callback):
    """Log ``config.hyperparams`` (with the latest metrics) to the tracker (rank 0)."""

    def run_callback(self, trainer: TrainerView, config: ConfigView, writer: Tracker | None) -> None:
        if writer is not None and config.hyperparams:
            writer.log_hyperparams(config.hyperparams, trainer.opt_result.metrics)


class SaveCheckpoint(Callback):
    """Save a numbered checkpoint in the run's ``checkpoints`` folder (every rank: a collective)."""

    def run_callback(self, trainer: TrainerView, config: ConfigView, writer: Tracker | None) -> None:
        trainer.save_checkpoint()


class SaveBestCheckpoint(Callback):
    """Save the ``best`` checkpoint when the latest validation is the best so far (every rank)."""

    def run_callback(self, trainer: TrainerView, config: ConfigView, writer: Tracker | None) -> None:
        if trainer.validation_improved:
            trainer.save_checkpoint(best=True)


class LoadCheckpoint(Callback):
    """Load the newest checkpoint qadence's way (``model_*_ckpt_*.pt`` and ``opt_*_ckpt_*.pt`` in
    ``config.log_folder``, as qadence's Trainer and ``write_checkpoint`` write them) into the model and optimizer,
    on every rank; returns ``(model, optimizer, iteration)``. A fit continues such a folder by itself."""

    def run_callback(self, trainer: TrainerView, config: ConfigView, writer: Tracker | None) -> Any:
        from qaccel.trainer import saveload

        model = trainer.accelerator.unwrap_model(trainer.model)
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        return saveload.load_checkpoint(
            config.log_folder, model, optimizer, device=trainer.accelerator.device, allow_pickle=config.allow_pickle
        )


class LogModelTracker(Callback):
    """Log the model to the tracker (rank 0): MLflow logs it with its signature, CSV writes ``model.pt``;
    TensorBoard has no place for it and says so."""

    def run_callback(self, trainer: TrainerView, config: ConfigView, writer: Tracker | None) -> None:
        if writer is not None and trainer.accelerator.is_main_process:
            writer.log_model(
                trainer.accelerator.unwrap_model(trainer.model),
                trainer.train_dataloader,
                trainer.val_dataloader,
                trainer.test_dataloader,
            )


class EarlyStopping(Callback):
    """Stop training when ``monitor`` (a metric name, e.g. ``"val_loss"``) has not improved for ``patience`` calls.

    Rank 0's value decides, and every rank stops after the same epoch.
    """

    def __init__(self, on: Stage | str, called_every: int, monitor: str, patience: int = 5, mode: str = "min") -> None:
        super().__init__(on, called_every)
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max'; got {mode!r}")
        count("patience", patience, 1)
        self.monitor, self.patience, self.mode = monitor, patience, mode
        self.best = math.inf if mode == "min" else -math.inf
        self.counter = 0

    def run_callback(self, trainer: TrainerView, config: ConfigView, writer: Tracker | None) -> None:
        metrics = trainer.opt_result.metrics
        if self.monitor not in metrics:
            raise KeyError(
                f"EarlyStopping monitors {self.monitor!r}, which is not among the metrics at "
                f"{self.on.value}: {sorted(metrics)}"
            )
        value = float(metrics[self.monitor])
        if (value < self.best) if self.mode == "min" else (value > self.best):
            self.best, self.counter = value, 0
            return
        self.counter += 1
        if self.counter >= self.patience:
            trainer.request_stop(f"early stopping: {self.monitor} has not improved for {self.patience} checks")

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "counter": self.counter}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.counter = state["best"], state["counter"]


class _Schedule(Callback):
    """A learning-rate schedule applied to the optimizer's groups, from each group's rate when it first ran."""

    def __init__(self, on: Stage | str, called_every: int) -> None:
        super().__init__(on, called_every)
        self.base: list[float] | None = None

    def run_callback(self, trainer: TrainerView, config: ConfigView, writer: Tracker | None) -> None:
        groups = trainer.optimizer.param_groups
        if self.base is None:
            self.base = [group["lr"] for group in groups]
        for group, base in zip(groups, self.base):
            group["lr"] = self.rate(base, trainer.opt_result.iteration, group["lr"])

    def rate(self, base: float, iteration: int, current: float) -> float:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"base": self.base}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.base = state["base"]


class LRSchedulerStepDecay(_Schedule):
    """Multiply the learning rate by ``gamma`` at each call."""

    def __init__(self, on: Stage | str, called_every: int, gamma: float = 0.5) -> None:
        super().__init__(on, called_every)
        self.gamma = gamma

    def rate(self, base: float, iteration: int, current: float) -> float:
        return current * self.gamma


class LRSchedulerCyclic(_Schedule):
    """A triangular cycle between ``base_lr`` and ``max_lr``, ``step_size`` epochs each way."""

    def __init__(self, on: Stage | str, called_every: int, base_lr: float, max_lr: float, step_size: int) -> None:
        super().__init__(on, called_every)
        self.base_lr, self.max_lr, self.step_size = base_lr, max_lr, step_size

    def rate(self, base: float, iteration: int, current: float) -> float:
        cycle = iteration // (2 * self.step_size)
        x = abs(iteration / self.step_size - 2 * cycle - 1)
        return self.base_lr + (self.max_lr - self.base_lr) * max(0.0, 1 - x)


class LRSchedulerCosineAnnealing(_Schedule):
    """Cosine annealing from each group's first rate to ``min_lr`` over ``t_max`` epochs."""

    def __init__(self, on: Stage | str, called_every: int, t_max: int, min_lr: float = 0.0) -> None:
        super().__init__(on, called_every)
        self.t_max, self.min_lr = t_max, min_lr

    def rate(self, base: float, iteration: int, current: float) -> float:
        return (
            self.min_lr + (base - self.min_lr) * (1 + math.cos(math.pi * min(iteration, self.t_max) / self.t_max)) / 2
        )


class LRSchedulerReduceOnPlateau(Callback):
    """Multiply every group's learning rate by ``gamma`` when ``monitor`` (e.g. ``"train_loss"``, ``"val_loss"``)
    has not improved by more than ``threshold`` for ``patience`` calls; a rate that would fall below ``min_lr`` is set
    to it, and the rates then stay. perceptrain's callback, with its messages (``verbose``: rank 0 logs them at
    INFO); every rank sees the same metrics, so the rates agree."""

    def __init__(
        self,
        on: Stage | str,
        called_every: int = 1,
        monitor: str = "train_loss",
        patience: int = 20,
        mode: str = "min",
        gamma: float = 0.5,
        threshold: float = 1e-4,
        min_lr: float = 1e-6,
        verbose: bool = True,
    ) -> None:
        super().__init__(on, called_every)
        if mode not in ("min", "max"):
            raise ValueError(f"LRSchedulerReduceOnPlateau: mode must be 'min' or 'max'; got {mode!r}")
        count("patience", patience, 1)
        for name, value in (("gamma", gamma), ("threshold", threshold), ("min_lr", min_lr)):
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                raise ValueError(f"LRSchedulerReduceOnPlateau: {name} must be a number >= 0; got {value!r}")
        self.monitor, self.patience, self.mode, self.gamma = monitor, patience, mode, gamma
        self.threshold, self.min_lr, self.verbose = threshold, min_lr, verbose
        self.best_value = math.inf if mode == "min" else -math.inf
        self.counter = 0
        self.reached_minimum_lr = False

    def run_callback(self, trainer: TrainerView, config: ConfigView, writer: Tracker | None) -> None:
        if self.reached_minimum_lr:
            return
        metrics = trainer.opt_result.metrics
        if self.monitor not in metrics:
            raise ValueError(
                f"LRSchedulerReduceOnPlateau monitors {self.monitor!r}, which is not among the metrics at "
                f"{self.on.value}: {sorted(metrics)}"
            )
        value = float(metrics[self.monitor])
        better = (
            value + self.threshold < self.best_value if self.mode == "min" else value - self.threshold > self.best_value
        )
        self.best_value, self.counter = (value, 0) if better else (self.best_value, self.counter + 1)
        if self.counter < self.patience:
            return
        self.counter = 0
        say = self.verbose and trainer.accelerator.is_main_process
        for group in trainer.optimizer.param_groups:
            lr = group["lr"] * self.gamma
            if lr < self.min_lr:
                group["lr"], self.reached_minimum_lr = self.min_lr, True
                if say:
                    logger.info("Learning rate has reached the minimum learning rate %s", self.min_lr)
            else:
                group["lr"] = lr
                if say:
                    logger.info("Loss has reached a plateau, reducing learning rate to %s", lr)

    def state_dict(self) -> dict[str, Any]:
        return {"best_value": self.best_value, "counter": self.counter, "reached_minimum_lr": self.reached_minimum_lr}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_value, self.counter = state["best_value"], state["counter"]
        self.reached_minimum_lr = state["reached_minimum_lr"]


class GradientMonitoring(Callback):
    """Write each parameter's gradient statistics, ``<name>_mean``, ``_std``, ``_max`` and ``_min`` (qadence's
    names), to the tracker (rank 0): per batch by default, on the batch axis; at an epoch stage, the epoch's last
    update's gradients, at the epoch."""

    def __init__(self, on: Stage | str = Stage.TRAIN_BATCH_END, called_every: int = 1) -> None:
        super().__init__(on, called_every)

    def run_callback(self, trainer: TrainerView, config: ConfigView, writer: Tracker | None) -> None:
        named = [
            (n, p.grad)
            for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()
            if p.grad is not None
        ]
        sharded = any(hasattr(grad, "full_tensor") for _, grad in named)  # gathering a shard is a collective
        if not trainer.accelerator.is_main_process and not sharded:
            return
        stats: dict[str, float] = {}
        for name, grad in named:
            grad = cast("DTensor", grad).full_tensor() if hasattr(grad, "full_tensor") else grad  # FSDP2's shard
            stats[f"{name}_mean"] = grad.mean().item()
            stats[f"{name}_std"] = grad.std().item() if grad.numel() > 1 else math.nan
            stats[f"{name}_max"] = grad.max().item()
            stats[f"{name}_min"] = grad.min().item()
        if trainer.accelerator.is_main_process:
            _write(self, trainer, writer, stats)


class R3Sampling(Callback):
    """R3 sampling (https://arxiv.org/abs/2207.02338), perceptrain's callback: at each training epoch's start,
    ``fitness_function(dataset.features, model)`` scores every sample with your model (unwrapped) and
    ``dataset.update`` releases the unfit ones and draws new ones. On several ranks every rank scores, rank 0 alone
    updates, and its dataset is broadcast, so every rank trains on the same samples, each sample on one rank
    (perceptrain's ranks each draw their own). ``verbose``: rank 0 prints the retained and released counts."""

    def __init__(
        self,
        initial_dataset: R3Dataset,
        fitness_function: Callable[[torch.Tensor, torch.nn.Module], torch.Tensor],
        verbose: bool = False,
        called_every: int = 1,
    ) -> None:
        self.dataset = initial_dataset
        self.fitness_function = fitness_function
        self.verbose = verbose
        super().__init__(on=Stage.TRAIN_EPOCH_START, called_every=called_every)

    def run_callback(self, trainer: TrainerView, config: ConfigView, writer: Tracker | None) -> None:
        acc, dataset = trainer.accelerator, self.dataset
        # every rank scores: a sharded model's forward is a collective
        fitnesses = self.fitness_function(dataset.features, acc.unwrap_model(trainer.model))
        if acc.is_main_process:
            dataset.update(fitnesses)
        if acc.num_processes > 1:  # in place: the training loader holds this same dataset object
            state = {name: getattr(dataset, name) for name in _R3_STATE} if acc.is_main_process else None
            for name, value in acc.broadcast(state).items():
                setattr(dataset, name, value)
        if self.verbose and acc.is_main_process:
            print(
                f"Epoch {trainer.opt_result.iteration};"
                f" num. retained: {dataset.n_samples - dataset.n_released:5d};"
                f" num. released: {dataset.n_released:5d}",
                flush=True,
            )


# what R3Dataset.update changes: rank 0's values reach the other ranks
_R3_STATE = ("features", "_released", "_released_indices", "_resampled", "n_released", "n_retained")


__all__ = [
    "Callback",
    "EarlyStopping",
    "GradientMonitoring",
    "LRSchedulerCosineAnnealing",
    "LRSchedulerCyclic",
    "LRSchedulerReduceOnPlateau",
    "LRSchedulerStepDecay",
    "LivePlotMetrics",
    "LoadCheckpoint",
    "LogHyperparameters",
    "LogModelTracker",
    "OptimizeResult",
    "PlotMetrics",
    "PrintMetrics",
    "R3Sampling",
    "SaveBestCheckpoint",
    "SaveCheckpoint",
    "Stage",
    "WriteMetrics",
    "WritePlots",
]
