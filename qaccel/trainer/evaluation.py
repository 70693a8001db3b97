"""The Trainer's evaluation: validation during a fit (its means recorded, written, and maybe the best so far) and
``test()``, both summing each batch's loss and metrics weighted by its real samples.

Apart from trainer.py and loop.py so what a validation or a test computes is read in one place. The hooks and
callbacks run through the Trainer, so a subclass's overrides apply.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from qaccel.accelerator import Accelerator
from qaccel.nested import map_leaves
from qaccel.trainer import loop
from qaccel.trainer.hooks import OptimizeResult, Stage
from qaccel.trainer.internals import BatchResult, TrainerInternals


def validate(
    trainer: TrainerInternals, loader: Any, iteration: int, record: bool = True, hooks: bool = True
) -> list[BatchResult]:
    """Validate; with ``record``, the means go to the history and the tracker and may be the best so far; with
    ``hooks``, the validation epoch's hooks run. Returns the batch results, for qadence's hooks."""
    acc, config, state = trainer.accelerator, trainer.config, trainer._state
    trainer.opt_result = OptimizeResult(
        iteration, trainer.model, trainer._optimizer, rank=acc.rank, device=str(acc.device)
    )
    if hooks:
        trainer.on_val_epoch_start()
    trainer._stage(Stage.VAL_EPOCH_START)
    results: list[BatchResult] = []
    sums, samples = trainer._evaluate(trainer.model, loader, "val", results)
    if config.all_reduce_metrics:
        sums, samples = summed(acc, sums, samples)
    means = {name: float(total) / max(samples, 1.0) for name, total in sums.items()}
    improved = False
    if acc.is_main_process and record:
        criterion = config.validation_criterion or _lower
        improved = bool(criterion(means["val_loss"], state.best_val, config.val_epsilon))
    trainer.validation_improved = bool(acc.broadcast(improved))
    if trainer.validation_improved:
        state.best_val = acc.broadcast(means["val_loss"])
    trainer.opt_result.loss, trainer.opt_result.metrics = means["val_loss"], means
    if record:
        loop.record(trainer, iteration, means)
        trainer.write_metrics(means)  # validation metrics are always written
    trainer._stage(Stage.VAL_EPOCH_END)
    if hooks:
        trainer.on_val_epoch_end(results)
    return results


def test(trainer: TrainerInternals) -> dict[str, float]:
    """The mean loss and metrics over the test loader, over every rank (inside a rank)."""
    acc = trainer.accelerator
    model, loader = acc.prepare(trainer.model, trainer.test_dataloader)
    trainer.opt_result = OptimizeResult(0, model, trainer._optimizer, rank=acc.rank, device=str(acc.device))
    sums, samples = summed(acc, *trainer._evaluate(model, loader, "test"))
    return {name: float(total) / max(samples, 1.0) for name, total in sums.items()}


def evaluate(
    trainer: TrainerInternals, model: torch.nn.Module, loader: Any, phase: str, results: list[BatchResult] | None = None
) -> tuple[dict[str, Any], float]:
    """This rank's sums of the loss and metrics over ``loader``'s samples (batch means times batch sizes), and
    its sample count; each batch's (loss, metrics) appended to ``results`` for qadence's hooks. Padding batches
    (repeats that even out the last step) run, as a sharded model needs every rank's forward, but count for
    nothing."""
    acc = trainer.accelerator
    start, end = Stage(f"{phase}_batch_start"), Stage(f"{phase}_batch_end")
    sums: dict[str, Any] = {}
    samples = 0
    padded = isinstance(loader, DataLoader)  # a DictDataLoader's batches are counted whole
    model.eval()
    try:
        with torch.no_grad():
            for number, batch in enumerate(loop.epoch_of(loader, trainer.max_batches), 1):
                trainer.opt_result.batch = number
                batch = acc.prepare_batch(batch)
                getattr(trainer, f"on_{phase}_batch_start")(batch)
                trainer._stage(start)
                size, padding = _batch_size(batch), acc.padding_in_batch if padded else 0
                if 0 < padding < size:  # the real samples only (all padding: run it, as a sharded model needs)
                    batch, size = map_leaves(batch, lambda t, real=size - padding: t[:real]), size - padding
                elif padding:
                    size = 0  # counts for nothing, but every rank keeps every name
                loss, metrics = trainer._loss_order.call(trainer.loss_fn, model, batch)
                values = loop.detached(phase, loss, metrics)
                for name, value in values.items():
                    sums[name] = sums.get(name, 0.0) + value * size
                samples += size
                if phase in trainer._per_batch:
                    loop.show_batch(trainer, phase, values)
                trainer._stage(end)
                result = (loss.detach(), values)
                getattr(trainer, f"on_{phase}_batch_end")(result)
                if results is not None and trainer._hooked:
                    results.append(result)
    finally:
        model.train()
    return sums, float(samples)


def summed(accelerator: Accelerator, sums: dict[str, Any], samples: float) -> tuple[dict[str, Any], float]:
    """Sums and sample count over every rank."""
    totals = accelerator.all_reduce_dict({**sums, "_samples": samples}, op="sum")
    return totals, float(totals.pop("_samples"))


def _batch_size(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (1 for a batch without tensors, e.g. None)."""
    if isinstance(batch, torch.Tensor):
        return len(batch) if batch.dim() else 1
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        if isinstance(item, (torch.Tensor, dict, list, tuple)):
            return _batch_size(item)
    return 1


def _lower(val_loss: float, best: float, epsilon: float) -> bool:
    return val_loss < best - epsilon
