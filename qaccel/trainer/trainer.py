"""The Trainer: qadence's training loop (fit, validation, test, callbacks, tracked metrics), distributed by
``TrainConfig(nprocs=...)`` through the Accelerator, with qaccel's checkpoints and resume.

``fit()`` runs on every rank through ``Accelerator.distribute``: from ``python train.py`` it starts the ranks and the
caller's model and optimizer end up holding what the ranks trained; under torchrun or srun each rank runs it in
place on its own objects. Every decision that changes what ranks do next (stop, keep a best checkpoint) is taken
once and agreed, so the ranks never part ways.

This module holds the Trainer's API, its hooks and the fit's set-up; the parts of a fit are in modules of their own,
which the Trainer's methods call: the training loop in loop.py, validation and test in evaluation.py, the run's
folder and tracker in runs.py (plots in plots.py, callbacks in callbacks.py).
"""

from __future__ import annotations

import contextlib
import functools
import pickle
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
from torch.utils.data import DataLoader, Dataset

from qaccel.accelerator import Accelerator
from qaccel.options import count
from qaccel.tracking.tools import Axis, Tracker
from qaccel.train import loaders, strategies
from qaccel.trainer import evaluation, loop, runs, steps
from qaccel.trainer.callbacks import (
    LivePlotMetrics,
    LogHyperparameters,
    LogModelTracker,
    PlotMetrics,
    PrintMetrics,
    SaveBestCheckpoint,
    WriteMetrics,
)
from qaccel.trainer.config import TrainConfig
from qaccel.trainer.hooks import Callback, OptimizeResult, Stage
from qaccel.trainer.internals import BatchResult, FitState, OptimizeStep
from qaccel.trainer.losses import BatchFirstLossFunction, LossFunction, LossOrder

CHECKPOINTS = "checkpoints"
BEST = "best"


class Trainer:
    """Train ``model`` with ``optimizer`` as ``config`` says, on ``config.nprocs`` ranks (qadence's Trainer).

    Args:
        model: the model (a plain ``torch.nn.Module``).
        optimizer: its torch optimizer, or a nevergrad optimizer for gradient-free training
            (``Trainer.set_use_grad(False)`` first), or None: then fit inside
            ``with trainer.disable_grad_opt(ng_optimizer):`` (or ``enable_grad_opt(torch_optimizer)``).
        config: a TrainConfig.
        loss_fn: ``"mse"``, ``"cross_entropy"`` or ``fn(model, batch) -> (loss, metrics)`` (qadence's order;
            ``qaccel.perceptrain.Trainer`` calls ``fn(batch, model)``); metrics are a dict of numbers or scalar
            tensors, logged as ``train_<name>``, ``val_<name>`` or ``test_<name>``. Without a training loader,
            ``batch`` is None: the function makes its own points. A function whose parameters are named
            ``(batch, model)`` is refused: it is written for perceptrain's order.
        train_dataloader: the training DataLoader, a ``DictDataLoader``, or None (then ``loss_fn(model, None)`` once
            per epoch); or pass it to fit().
        val_dataloader: the validation DataLoader (or pass it to fit()).
        test_dataloader: the test DataLoader (or pass it to test()).
        optimize_step: ``fn(model, optimizer, loss_fn, xs, device, dtype) -> (loss, metrics)``, one training step
            of your own (qadence's argument), handed ``loss_fn`` as you wrote it; by default qaccel's, which
            accumulates gradients, scales fp16 losses and passes a closure to an optimizer whose step takes one.
        max_batches: at most this many batches per epoch; from a loader with no length (an infinite one) an epoch
            takes ``max_batches`` batches, by default one (qadence's rule).
        lr_scheduler: an LR scheduler of ``optimizer``, stepped per epoch or per optimizer update
            (``config.lr_scheduler_step``).
    """

    _use_grad: bool = True  # gradient-based training; set_use_grad() changes it for every Trainer, as in qadence
    _optimizer: Any  # torch's, nevergrad's or None; inside a rank, prepared (the torch one wrapped: .optimizer)
    _loss_order: ClassVar[LossOrder] = LossOrder.MODEL_BATCH  # how every part of a fit calls loss_fn
    _default_steps: ClassVar[tuple[OptimizeStep, ...]] = (steps.optimize_step,)  # passed, they select the own step

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        config: TrainConfig,
        loss_fn: str | LossFunction | BatchFirstLossFunction = "mse",
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
        order = self._loss_order
        if isinstance(loss_fn, str):
            if loss_fn not in order.losses:
                raise ValueError(
                    f"loss_fn must be one of {', '.join(map(repr, order.losses))} or a function "
                    f"fn{order.arguments} -> (loss, metrics); got {loss_fn!r}"
                )
            loss_fn = order.losses[loss_fn]
        elif not callable(loss_fn):
            raise TypeError(
                f"loss_fn must be a name or a function fn{order.arguments} -> (loss, metrics); got {loss_fn!r}"
            )
        else:
            order.check(loss_fn)
        if optimize_step is not None and not callable(optimize_step):
            raise TypeError(
                "optimize_step must be a function fn(model, optimizer, loss_fn, xs, device, dtype) -> "
                f"(loss, metrics); got {optimize_step!r}"
            )
        if max_batches is not None:
            count("max_batches", max_batches, 1, "or None")
        if lr_scheduler is not None and not hasattr(lr_scheduler, "step"):
            raise TypeError(f"lr_scheduler must be an LR scheduler of the optimizer; got {lr_scheduler!r}")
        self.model, self.config = model, config
        # the user's function as written: every part of a fit calls it through _loss_order, and a step of the user's
        # own is handed it to call in its own order
        self.loss_fn: Callable[..., BatchResult] = loss_fn
        self._ng_params: Any = None  # gradient-free: nevergrad's current candidate (set with the optimizer)
        self.optimizer = optimizer
        self.train_dataloader, self.val_dataloader, self.test_dataloader = (
            train_dataloader,
            val_dataloader,
            test_dataloader,
        )
        # qadence's (or perceptrain's) default step, passed as its tutorials do: the Trainer's own, which extends it
        self.optimize_step = None if optimize_step in self._default_steps else optimize_step
        self.max_batches, self.lr_scheduler = max_batches, lr_scheduler
        self.accelerator = Accelerator(**config.accelerator_options())
        self.opt_result = OptimizeResult(0, model, optimizer)
        self.current_epoch = 0  # the epoch being trained, or the last one trained
        self.log_folder: Path | None = None  # the run's folder, once fit() chose it
        self.history: list[dict[str, float]] = []  # every epoch's metrics, with its "step"
        self.validation_improved = False
        self.tracker: Tracker | None = None
        self._callbacks: list[Callback] = []
        self._state = FitState(self._callbacks)
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
        if optimizer is None:  # one comes with enable_grad_opt() or disable_grad_opt(), before fit()
            pass
        elif self.use_grad:
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
            raise ValueError(  # qadence's and perceptrain's words first (missing space included): scripts match them
                "If `config.val_every` is provided as an integer > 0, validation_dataloadermust be an instance of "
                "`DataLoader` or `DictDataLoader`. TrainConfig.val_every > 0 needs a val_dataloader (in fit() or "
                "Trainer(...))"
            )
        if self._optimizer is None:
            kind = "torch" if self.use_grad else "nevergrad"
            raise ValueError(
                f"fit() needs a {kind} optimizer, and this Trainer has none (Trainer(optimizer=None)): fit inside "
                "`with trainer.disable_grad_opt(ng_optimizer):` to train without gradients, or inside "
                "`with trainer.enable_grad_opt(torch_optimizer):` to train with them"
            )
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
                strategy = strategies.of(self.accelerator.strategy)
                self._optimizer.load_state_dict(
                    strategy.plain_optimizer_state(optimizer_state, self.model, self._optimizer)
                )
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
        loss_fn = functools.partial(self._loss_order.call, self.loss_fn)  # InformationContent calls (model, batch)
        content = InformationContent(self.model, loss_fn, batch, epsilons)
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
        if self.use_grad:
            loop.check_closure(self._optimizer, acc.scaler is not None)
        self._hooked = self._overrides_a_results_hook()
        self._callbacks[:] = self._make_callbacks()
        self._per_batch = {c.on.value.split("_")[0] for c in self._callbacks if c.on.per_batch}
        self._stop_reason = None
        self._state = FitState(self._callbacks)  # a fit starts from its folder's checkpoint, or from nothing
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
            strategy = strategies.of(acc.strategy)
            optimizer_state = strategy.optimizer_state(self.model, self._optimizer.optimizer)
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

    # ---- the parts of a fit, in their own modules: the Trainer's methods call them, and they call back through the
    # Trainer (hooks, callbacks, steps), so a subclass's overrides apply ----

    def _train(self, train_loader: Any, val_loader: Any) -> None:
        loop.train(self, train_loader, val_loader)

    def _train_batch(self, batch: Any) -> BatchResult:
        return loop.train_batch(self, batch)

    def _optimize_step(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        loss_fn: Callable[..., BatchResult],
        xs: Any,
        device: Any = None,
        dtype: Any = None,
    ) -> BatchResult:
        """qaccel's training step (loop.optimize_step), called as an ``optimize_step`` is; it calls ``loss_fn`` in
        the Trainer's order."""
        return loop.optimize_step(self.accelerator, model, optimizer, loss_fn, xs, self._loss_order)

    def _gradient_free_step(self, batch: Any) -> BatchResult:
        return loop.gradient_free_step(self, batch)

    def _validate(self, loader: Any, iteration: int, record: bool = True, hooks: bool = True) -> list[BatchResult]:
        return evaluation.validate(self, loader, iteration, record, hooks)

    def _test(self) -> dict[str, float]:
        return evaluation.test(self)

    def _evaluate(
        self, model: torch.nn.Module, loader: Any, phase: str, results: list[BatchResult] | None = None
    ) -> tuple[dict[str, Any], float]:
        return evaluation.evaluate(self, model, loader, phase, results)

    def _choose_folder(self) -> Path:
        return runs.choose_folder(self.config)

    def _continue_qadence(self, folder: Path, train_loader: Any) -> str | None:
        return runs.continue_qadence(self, folder, train_loader)

    def _open_tracker(self, resumed: str | None) -> None:
        runs.open_tracker(self, resumed)

    def _opened_tracker(self) -> Tracker:
        return runs.opened_tracker(self)

    def _write_curves(self) -> None:
        runs.write_curves(self)

    # ---- callbacks ----

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
        if config.live_plot_every:
            made.append(LivePlotMetrics(Stage.TRAIN_EPOCH_END, config.live_plot_every))
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


def _fit_on_rank(trainer: Trainer, folder: Path | None) -> dict[str, Any]:
    return trainer._fit(folder)


def _test_on_rank(trainer: Trainer) -> dict[str, float]:
    return trainer._test()


class _NoData(Dataset):
    """A Trainer's epoch without a training loader: one None per rank, so loss_fn(model, None) (in perceptrain's
    order, loss_fn(None, model)) runs once per epoch, and the epoch goes through a prepared loader like any other
    (resume, stop check points)."""

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


def _batches(loader: Any, max_batches: int | None) -> int:
    return 1 if loader is None else loaders.batches_per_epoch(loader, max_batches)


def _device_of(model: torch.nn.Module) -> torch.device | None:
    return next((p.device for p in model.parameters()), None)
