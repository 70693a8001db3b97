"""TrainConfig: qadence's training configuration, field for field, plus the Accelerator's options.

A script written for qadence's ``TrainConfig`` keeps its field names and meanings. Every Accelerator option
(``qaccel.options.Options``, inherited) is a field too, with the Accelerator's own default, so strategy, mixed precision,
accumulation, restarts and timeouts are set in one place. Every field is checked when the config is made: a bad
value raises naming the field and what is allowed, before any rank starts.
"""

# pyright: reportUnnecessaryIsInstance=false
# (what users pass is checked at run time, whatever the annotations say)

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qaccel import options
from qaccel.environment import detect
from qaccel.options import TrackingTool
from qaccel.trainer.hooks import Callback


class SchedulerStep(enum.StrEnum):
    """When a Trainer steps the LR scheduler it was given."""

    EPOCH = "epoch"
    """After every training epoch."""
    BATCH = "batch"
    """After every optimizer update (every ``gradient_accumulation_steps`` batches)."""


@dataclass
class TrainConfig(options.Options):
    """How a Trainer trains: qadence's TrainConfig fields (same names, same meanings), and the Accelerator's options
    (inherited from their declaration, keyword-only; ``keep_checkpoints`` also sets how many numbered checkpoints
    stay in the run's ``checkpoints`` folder).

    Frequencies (``*_every``) count epochs; 0 turns the action off. Where qaccel differs from qadence: the
    Accelerator's options default as the Accelerator's do (``compute_setup="auto"``, ``backend=None``), checkpoints
    are qaccel's (every rank, sharded under FSDP, resumable mid-epoch), and a run continues its folder's newest
    checkpoint whenever one is there (see the Trainer guide).
    """

    max_iter: int = 10000
    """The last epoch: epochs 0 .. max_iter are trained (max_iter + 1 passes, as in qadence; the metrics of epoch
    0, trained from the untouched model, are recorded but neither printed nor written, as qadence does)."""
    print_every: int = 0
    """Print the epoch's metrics every this many epochs (with ``verbose``)."""
    write_every: int = 0
    """Write the epoch's metrics to the tracker every this many epochs (validation metrics are always written)."""
    checkpoint_every: int = 0
    """Save a checkpoint every this many epochs (ignored with ``checkpoint_best_only``)."""
    checkpoint_in_background: bool = False
    """Write the checkpoints (``checkpoint_every``'s and the best one) while training goes on: each save returns once
    the state is copied aside (``save_state(background=True)``)."""
    allow_pickle: bool | None = None
    """Whether a fit that continues a checkpoint may unpickle in full what needs it (callbacks' or a nevergrad
    optimizer's state, qadence's files), which can run code: None (default) only from a folder no one but you can
    write, True always, False never."""
    plot_every: int = 0
    """Call ``plotting_functions`` and log their figures every this many epochs."""
    live_plot_every: int = 0
    """Draw the training metrics on screen every this many epochs, as they come (``LivePlotMetrics``, perceptrain's:
    livelossplot on rank 0, the ``plots`` extra); 0: never."""
    callbacks: list[Callback] = field(default_factory=list[Callback])
    """Callbacks of your own (see ``qaccel.callbacks``), run before the ones the fields above make (qadence's order)."""
    log_model: bool = False
    """Write the trained model's state dict to the run's folder at the end (``model.pt``)."""
    root_folder: Path = Path("./qml_logs")
    """The folder that holds the runs' folders."""
    create_subfolder_per_run: bool = False
    """A new folder per run in ``root_folder`` (a restarted or requeued job keeps its own)."""
    log_folder: Path = Path("./")
    """The run's folder; the default ``./`` means a new subfolder of ``root_folder`` per run, as in qadence."""
    checkpoint_best_only: bool = False
    """Keep one checkpoint, ``best``, saved when validation improves (needs ``val_every``)."""
    val_every: int = 0
    """Validate every this many epochs (and once before training)."""
    val_epsilon: float = 1e-5
    """How much the validation loss must improve to count as better."""
    validation_criterion: Callable[[float, float, float], bool] | None = None
    """``criterion(val_loss, best_val_loss, val_epsilon) -> bool``: is this validation better? None: lower by
    more than ``val_epsilon``."""
    trainstop_criterion: Callable[..., bool] | None = None
    """``criterion(trainer) -> bool``, called after each epoch on rank 0: stop training when it returns True."""
    batch_size: int = 1
    """Kept for qadence scripts; qaccel reads the batch size from your DataLoader."""
    verbose: bool = True
    """Print metrics (``print_every``) and the progress bar."""
    tracking_tool: TrackingTool | str = TrackingTool.TENSORBOARD
    """``tensorboard`` (``pip install tensorboard``), ``mlflow`` (``pip install mlflow-skinny``) or ``csv``."""
    hyperparams: dict[str, Any] = field(default_factory=dict[str, Any])
    """Hyperparameters logged once to the tracker."""
    plotting_functions: tuple[Callable[[torch.nn.Module, int], tuple[str, Any]], ...] = ()
    """``fn(model, epoch) -> (name, matplotlib figure)``, logged every ``plot_every`` epochs."""
    all_reduce_metrics: bool = False
    """Average the metrics over the ranks before they are printed and written (one all-reduce per epoch)."""
    lr_scheduler_step: SchedulerStep | str = SchedulerStep.EPOCH
    """When the Trainer's ``lr_scheduler`` steps: ``epoch`` or ``batch`` (each optimizer update)."""
    seed: int | None = None
    """Seed every rank's RNGs (``Accelerator.set_seed``) before training; None leaves them."""

    def __post_init__(self) -> None:
        options.count("TrainConfig.max_iter", self.max_iter, 0)
        options.count("TrainConfig.batch_size", self.batch_size, 1)
        for name in ("print_every", "write_every", "checkpoint_every", "plot_every", "live_plot_every", "val_every"):
            options.count(f"TrainConfig.{name}", getattr(self, name), 0)
        for name in (
            "log_model",
            "create_subfolder_per_run",
            "checkpoint_best_only",
            "checkpoint_in_background",
            "verbose",
            "all_reduce_metrics",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"TrainConfig.{name} must be True or False; got {getattr(self, name)!r}")
        if isinstance(self.val_epsilon, bool) or not isinstance(self.val_epsilon, (int, float)) or self.val_epsilon < 0:
            raise ValueError(f"TrainConfig.val_epsilon must be a number >= 0; got {self.val_epsilon!r}")
        for name in ("validation_criterion", "trainstop_criterion"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise TypeError(f"TrainConfig.{name} must be a function or None; got {getattr(self, name)!r}")
        if (
            self.checkpoint_best_only and not self.val_every
        ):  # qadence accepts it, and saves nothing: so do we, saying so
            warnings.warn(
                "TrainConfig.checkpoint_best_only keeps the best validation, and val_every=0 validates "
                "never: no checkpoint will be saved (set val_every > 0)",
                UserWarning,
                stacklevel=3,
            )
        self.root_folder, self.log_folder = Path(self.root_folder), Path(self.log_folder)
        self.tracking_tool = _member("tracking_tool", self.tracking_tool, TrackingTool)
        self.lr_scheduler_step = _member("lr_scheduler_step", self.lr_scheduler_step, SchedulerStep)
        if not isinstance(self.callbacks, (list, tuple)) or not all(isinstance(c, Callback) for c in self.callbacks):
            raise TypeError(
                f"TrainConfig.callbacks must be a list of qaccel.callbacks.Callback; got {self.callbacks!r}"
            )
        self.callbacks = list(self.callbacks)
        if not isinstance(self.hyperparams, dict):
            raise TypeError(f"TrainConfig.hyperparams must be a dict; got {self.hyperparams!r}")
        if not all(callable(f) for f in self.plotting_functions):
            raise TypeError("TrainConfig.plotting_functions must be functions fn(model, epoch) -> (name, figure)")
        self.plotting_functions = tuple(self.plotting_functions)
        if self.seed is not None:
            options.count("TrainConfig.seed", self.seed, 0)
        if self.allow_pickle not in (None, True, False):
            raise TypeError(f"TrainConfig.allow_pickle must be None, True or False; got {self.allow_pickle!r}")
        if self.keep_checkpoints is not None:
            options.count("TrainConfig.keep_checkpoints", self.keep_checkpoints, 1)
        try:
            options.make_config(detect(), **self.accelerator_options())
        except (ValueError, TypeError, RuntimeError) as exc:
            raise type(exc)(f"TrainConfig.{exc}") from None

    def accelerator_options(self) -> dict[str, Any]:
        """The fields that are the Accelerator's options, by name."""
        return {name: getattr(self, name) for name in options.NAMES}


def _member(name: str, value: object, kind: type[enum.StrEnum]) -> Any:
    """``value`` (a member, its string, or another library's enum member with the same value) as a ``kind``."""
    raw = value.value if isinstance(value, enum.Enum) else value
    try:
        return kind(raw)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in kind)
        raise ValueError(f"TrainConfig.{name} must be one of {allowed}; got {value!r}") from None
