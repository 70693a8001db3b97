"""The Trainer's callbacks (qadence's names): ``from qaccel.callbacks import EarlyStopping``."""

from qaccel.train.tracking import make_tracker as get_writer  # qadence's name: the tracker for a tracking tool
from qaccel.trainer.callbacks import (
    Callback,
    EarlyStopping,
    GradientMonitoring,
    LoadCheckpoint,
    LogHyperparameters,
    LogModelTracker,
    LRSchedulerCosineAnnealing,
    LRSchedulerCyclic,
    LRSchedulerStepDecay,
    OptimizeResult,
    PlotMetrics,
    PrintMetrics,
    SaveBestCheckpoint,
    SaveCheckpoint,
    Stage,
    WriteMetrics,
)

__all__ = [
    "Callback",
    "EarlyStopping",
    "GradientMonitoring",
    "LRSchedulerCosineAnnealing",
    "LRSchedulerCyclic",
    "LRSchedulerStepDecay",
    "LoadCheckpoint",
    "LogHyperparameters",
    "LogModelTracker",
    "OptimizeResult",
    "PlotMetrics",
    "PrintMetrics",
    "SaveBestCheckpoint",
    "SaveCheckpoint",
    "Stage",
    "WriteMetrics",
    "get_writer",
]
