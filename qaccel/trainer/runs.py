"""Where a fit's run lives and what it leaves: the run's folder (chosen as qadence does, found again by a requeued
job), its tracker, the curves it draws at the end, and the continuation of a folder qadence's Trainer checkpointed.

Apart from trainer.py so that the folder and tracker rules, which users meet when a job restarts, are read in one
place, away from the loop.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

from qaccel.tracking.tools import NullTracker, Tracker, make_tracker
from qaccel.train import loaders
from qaccel.trainer import plots
from qaccel.trainer.config import TrainConfig
from qaccel.trainer.internals import TrainerInternals


def choose_folder(config: TrainConfig) -> Path:
    """The run's folder, as qadence picks it: ``log_folder`` if given, else a new subfolder of ``root_folder``.
    A job that restarts or is requeued finds its own subfolder again (named after the SLURM job or the torchrun
    run)."""
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


def open_tracker(trainer: TrainerInternals, resumed: str | None) -> None:
    """Rank 0's tracker, opened in the run's folder (continuing the checkpointed run when ``resumed``); the other
    ranks get one that writes nothing, so callbacks call it on every rank."""
    acc, state = trainer.accelerator, trainer._state
    if not acc.is_main_process:
        trainer.tracker = NullTracker()
        return
    trainer.tracker = tracker = make_tracker(trainer.config.tracking_tool)
    assert trainer.log_folder is not None
    tracker.open(
        trainer.log_folder / "tracking",
        trainer.log_folder.name,
        state.tracker,
        start_step=state.epochs_done if resumed else 0,
        start_batch=state.global_step + 1 if resumed else 0,
    )
    state.tracker = tracker.state()


def opened_tracker(trainer: TrainerInternals) -> Tracker:
    """The tracker open_tracker() opened for the fit in progress."""
    if trainer.tracker is None:
        raise RuntimeError("the Trainer's tracker is opened by fit(), on every rank")
    return trainer.tracker


def write_curves(trainer: TrainerInternals) -> None:
    """The run's ``curves.png``, from the fit's history (rank 0)."""
    assert trainer.log_folder is not None
    if trainer.history and plots.curves(trainer.history, trainer.log_folder / "curves.png") is None:
        print("qaccel: no curves.png: install matplotlib (pip install matplotlib) to get one", flush=True)


def continue_qadence(trainer: TrainerInternals, folder: Path, train_loader: Any) -> str | None:
    """Continue a run qadence's Trainer checkpointed in ``folder`` (its ``model_*_ckpt_*.pt`` files): its model
    and optimizer, every rank, from the epoch after the checkpoint's. None when there is none."""
    from qaccel.trainer import saveload

    if not any(folder.glob("model_*_ckpt_*.pt")):
        return None
    device = trainer.accelerator.device
    model_file = saveload.get_latest_checkpoint_name(folder, "model", device)
    model = trainer.accelerator.unwrap_model(trainer.model)
    allow = trainer.config.allow_pickle
    _, iteration = saveload.load_model(folder, model, model_file, device, allow_pickle=allow)
    if trainer.use_grad:
        saveload.load_optimizer(folder, trainer._optimizer.optimizer, device=device, allow_pickle=allow)
    if isinstance(iteration, int):
        trainer._state.epochs_done = iteration + 1
        for loader in _prepared_loaders(train_loader):
            loader.set_epoch(iteration + 1)
    return str(folder / model_file)


def _prepared_loaders(loader: Any) -> list[Any]:
    """The prepared loaders in a training loader (a DictDataLoader's own)."""
    return list(loader.dataloaders.values()) if isinstance(loader, loaders.DictDataLoader) else [loader]
