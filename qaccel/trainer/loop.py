"""The Trainer's training loop: a fit's epochs, each batch's step (qaccel's gradient step, the user's own
``optimize_step``, or a nevergrad step), and what ends an epoch (its means, the LR scheduler, validation, the agreed
stop, the checkpoint).

Apart from trainer.py so the loop reads top to bottom in one place. It calls the hooks, the callbacks and the steps
through the Trainer (``trainer._train_batch``, ``trainer.on_train_epoch_end``, ...), so a subclass's overrides apply.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import pickle
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from qaccel.accelerator import Accelerator
from qaccel.train import loaders
from qaccel.train.batch import real_dtype
from qaccel.trainer import steps
from qaccel.trainer.config import SchedulerStep
from qaccel.trainer.hooks import OptimizeResult, Stage
from qaccel.trainer.internals import BatchResult, TrainerInternals
from qaccel.trainer.losses import LossOrder


def train(trainer: TrainerInternals, train_loader: Any, val_loader: Any) -> None:
    """Train the epochs from the loader's up to the fit's end, validating, stopping and checkpointing as the config
    says; then qadence's last writes and plots, and the train_end hooks."""
    acc, config, state = trainer.accelerator, trainer.config, trainer._state
    if config.val_every and state.epochs_done == 0 and state.batches == 0 and not state.history:
        trainer._validate(val_loader, 0, hooks=False)  # where training starts from (qadence calls no epoch hook)
    trainer._stage(Stage.TRAIN_START)
    trainer.on_train_start()
    train_losses: list[list[BatchResult]] = []  # kept for qadence's hooks only
    val_losses: list[list[BatchResult]] = []
    epochs = range(train_loader.epoch, state.end)
    iteration, metrics = state.epochs_done - 1, {}
    for iteration in acc.progress(epochs, desc="epochs") if config.verbose else epochs:
        trainer.current_epoch = iteration
        trainer.opt_result = OptimizeResult(
            iteration, trainer.model, trainer._optimizer, rank=acc.rank, device=str(acc.device)
        )
        trainer.on_train_epoch_start()
        trainer._stage(Stage.TRAIN_EPOCH_START)
        epoch_results: list[BatchResult] = []
        for batch in epoch_of(train_loader, trainer.max_batches, state.batches):
            result = trainer._train_batch(batch)
            if trainer._hooked:
                epoch_results.append(result)
        metrics = epoch_means(trainer)
        if trainer.lr_scheduler is not None and config.lr_scheduler_step is SchedulerStep.EPOCH:
            trainer.lr_scheduler.step()
        end_epoch(trainer, iteration, metrics)
        trainer._stage(Stage.TRAIN_EPOCH_END)
        trainer.on_train_epoch_end(epoch_results)
        train_losses.append(epoch_results)
        if config.val_every and iteration % config.val_every == 0:
            # after epoch 0 too, as qadence: callbacks skip epoch 0, and its metrics are neither recorded nor
            # written (step 0 holds the validation before training)
            val_losses.append(trainer._validate(val_loader, iteration, record=iteration > 0))
        if config.trainstop_criterion is not None and acc.is_main_process and config.trainstop_criterion(trainer):
            trainer.request_stop("trainstop_criterion returned True")
        stop = agreed_stop(trainer)
        state.epochs_done = iteration + 1
        last = state.epochs_done == state.end
        if not trainer.use_grad:
            state.nevergrad = pickle.dumps((trainer._optimizer, trainer._ng_params))
        if (
            config.checkpoint_every
            and not config.checkpoint_best_only
            and (iteration % config.checkpoint_every == 0 or stop or last)
        ):
            trainer.save_checkpoint()
        if stop:
            acc.print(f"qaccel: training stopped after epoch {iteration}: {stop}")
            break
    # qadence writes and plots the last epoch's results at the end, where the frequencies left it out
    trainer.opt_result = OptimizeResult(
        iteration,
        trainer.model,
        trainer._optimizer,
        metrics.get("train_loss"),
        metrics,
        rank=acc.rank,
        device=str(acc.device),
    )
    if metrics and config.write_every and iteration % config.write_every:
        trainer.write_metrics(metrics)
    if config.plot_every and config.plotting_functions and iteration % config.plot_every:
        trainer.plot()
    trainer.on_train_end(train_losses, val_losses)
    trainer._stage(Stage.TRAIN_END)


def train_batch(trainer: TrainerInternals, batch: Any) -> BatchResult:
    """One training batch: its hooks and callbacks around the step, the LR scheduler (per update), the sums."""
    acc, state = trainer.accelerator, trainer._state
    trainer.opt_result.batch = state.global_step + 1
    batch = acc.prepare_batch(batch)
    trainer.on_train_batch_start(batch)
    trainer._stage(Stage.TRAIN_BATCH_START)
    if trainer.use_grad:
        # Gradients are zeroed before a step, not after, so the last update's stay for the callbacks at the
        # batch's and the epoch's end (GradientMonitoring); between the micro-steps of an accumulation the
        # prepared optimizer's zero_grad does nothing.
        trainer._optimizer.zero_grad()
        with acc.accumulate(trainer.model):
            step = trainer.optimize_step or trainer._optimize_step
            loss, metrics = step(
                model=trainer.model,
                optimizer=trainer._optimizer,
                loss_fn=trainer.loss_fn,
                xs=batch,
                device=acc.device,
                dtype=None if acc.dtype is None else real_dtype(acc.dtype),  # qadence's data_dtype
            )
    else:
        loss, metrics = trainer._gradient_free_step(batch)
    if (
        trainer.lr_scheduler is not None
        and trainer.config.lr_scheduler_step is SchedulerStep.BATCH
        and acc.sync_gradients
        and not acc.optimizer_step_was_skipped
    ):
        trainer.lr_scheduler.step()
    values = detached("train", loss, metrics)
    for name, value in values.items():
        state.sums[name] = state.sums.get(name, 0.0) + value
    state.batches += 1
    state.global_step += 1
    if "train" in trainer._per_batch:  # floats wait for the device: only when a callback reads them
        show_batch(trainer, "train", values)
    trainer._stage(Stage.TRAIN_BATCH_END)
    result = (loss.detach(), values)
    trainer.on_train_batch_end(result)
    return result


def optimize_step(
    accelerator: Accelerator,
    model: torch.nn.Module,
    optimizer: Any,
    loss_fn: Callable[..., BatchResult],
    xs: Any,
    order: LossOrder = LossOrder.MODEL_BATCH,
) -> BatchResult:
    """qaccel's training step: the loss (``loss_fn`` called in ``order``), its backward (scaled, divided over
    accumulation steps), the update. An optimizer whose step takes a closure gets one, as qadence's and perceptrain's
    steps give it, evaluated as often as it asks (LBFGS, perceptrain's AdamLBFGS); torch's others evaluate it once.
    Under fp16's GradScaler, which steps without a closure, and on the micro-steps of an accumulation, which do not
    step, the loss is evaluated first and ``step()`` is called without one."""
    out: list[Any] = []

    def closure() -> torch.Tensor:
        if out:  # evaluated again (LBFGS): gradients of this evaluation only
            optimizer.zero_grad()
        loss, metrics = order.call(loss_fn, model, xs)
        accelerator.backward(loss)
        out[:] = [loss, metrics]
        return loss

    if accelerator.sync_gradients and accelerator.scaler is None and takes_closure(optimizer):
        optimizer.step(closure)
        if not out:
            raise RuntimeError(
                f"{_name(optimizer)}.step(closure) returned without calling its closure, so no loss was computed: "
                "an optimizer that takes a closure must evaluate it"
            )
    else:
        closure()
        optimizer.step()
    return out[0], out[1]


def gradient_free_step(trainer: TrainerInternals, batch: Any) -> BatchResult:
    """One nevergrad step (qadence's update_ng_parameters), telling the loss's mean over the ranks, so that every
    rank's optimizer takes the same path. Autograd stays on, as in qadence and perceptrain: a loss may take
    gradients of its own (a physics-informed loss's derivatives of the model's output)."""
    acc = trainer.accelerator

    def mean(loss: torch.Tensor) -> float:
        return float(acc.reduce(loss.detach().reshape(()), reduction="mean")) if acc.world_size > 1 else float(loss)

    loss, metrics, trainer._ng_params = steps.update_ng_parameters(
        acc.unwrap_model(trainer.model),
        trainer._optimizer,
        trainer.loss_fn,
        batch,
        trainer._ng_params,
        told=mean,
        order=trainer._loss_order,
    )
    return loss, metrics


def check_closure(optimizer: Any, scaled: bool) -> None:
    """Refuse an optimizer whose step requires a closure where fp16's GradScaler steps it (``scaled``): torch's
    GradScaler steps without one."""
    if scaled and requires_closure(optimizer):
        raise ValueError(
            f"{_name(optimizer)}.step() requires a closure, which torch's GradScaler cannot pass: "
            "mixed_precision='fp16' steps every optimizer through it. Train with mixed_precision='bf16' or 'no', "
            "or with an optimizer that steps without a closure"
        )


# ---- an epoch's metrics and its end ----


def epoch_means(trainer: TrainerInternals) -> dict[str, float]:
    """The epoch's mean loss and metrics (over the ranks with ``all_reduce_metrics``); its sums start again."""
    state = trainer._state
    means = {name: float(total) / max(state.batches, 1) for name, total in state.sums.items()}
    state.sums, state.batches = {}, 0
    if trainer.config.all_reduce_metrics and means:
        return {k: float(v) for k, v in trainer.accelerator.all_reduce_dict(means).items()}
    return means


def end_epoch(trainer: TrainerInternals, iteration: int, metrics: dict[str, float]) -> None:
    trainer.opt_result.loss, trainer.opt_result.metrics = metrics.get("train_loss"), metrics
    record(trainer, iteration, metrics)


def record(trainer: TrainerInternals, iteration: int, metrics: dict[str, float]) -> None:
    """Add ``metrics`` to the history's entry for ``iteration`` (a new one, unless it is the last)."""
    history = trainer._state.history
    if history and history[-1]["step"] == iteration:
        history[-1].update(metrics)
    else:
        history.append({"step": iteration, **metrics})


def show_batch(trainer: TrainerInternals, phase: str, values: dict[str, Any]) -> None:
    """A batch's loss and metrics, as floats, in ``opt_result`` for the callbacks at a batch stage."""
    floats = {name: float(value) for name, value in values.items()}
    trainer.opt_result.loss, trainer.opt_result.metrics = floats[f"{phase}_loss"], floats


def agreed_stop(trainer: TrainerInternals) -> str | None:
    """Whether any rank asked to stop; every rank gets the same answer (one small all-reduce per epoch)."""
    asked = trainer.accelerator.all_reduce_dict({"stop": float(trainer._stop_reason is not None)}, op="max")
    if asked["stop"] <= 0:
        return None
    return trainer._stop_reason or "another rank asked to stop"


# ---- batches ----


def detached(phase: str, loss: torch.Tensor, metrics: dict[str, Any]) -> dict[str, Any]:
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


def epoch_of(loader: Any, max_batches: int | None, done: int = 0) -> Iterable[Any]:
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


def takes_closure(optimizer: Any) -> bool:
    """Whether the optimizer's step() takes a closure (torch's optimizers do: LBFGS's requires one)."""
    return _closure_parameter(_user_class(optimizer)) is not None


def requires_closure(optimizer: Any) -> bool:
    """Whether the optimizer's step() requires a closure (LBFGS's does; Adam's takes an optional one)."""
    parameter = _closure_parameter(_user_class(optimizer))
    return parameter is not None and parameter.default is inspect.Parameter.empty


@functools.cache
def _closure_parameter(optimizer_class: type) -> inspect.Parameter | None:
    """The ``closure`` parameter of the class's step() (the class's: an LR scheduler wraps the instance's step)."""
    try:
        return inspect.signature(optimizer_class.step).parameters.get("closure")
    except (AttributeError, TypeError, ValueError):
        return None


def _user_class(optimizer: Any) -> type:
    """The class of the user's optimizer, prepared (which holds it as ``.optimizer``) or not."""
    return type(getattr(optimizer, "optimizer", optimizer))


def _name(optimizer: Any) -> str:
    return _user_class(optimizer).__name__
