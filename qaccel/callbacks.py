"""The Trainer's callbacks (qadence's names): ``from qaccel.callbacks import EarlyStopping``."""

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
    "Callback", "EarlyStopping", "GradientMonitoring", "LoadCheckpoint", "LogHyperparameters", "LogModelTracker",
    "LRSchedulerCosineAnnealing",
    "LRSchedulerCyclic", "LRSchedulerStepDecay", "OptimizeResult", "PlotMetrics", "PrintMetrics",
    "SaveBestCheckpoint", "SaveCheckpoint", "Stage", "WriteMetrics",
]
