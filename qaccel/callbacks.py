"""The Trainer's callbacks (qadence's names): ``from qaccel.callbacks import EarlyStopping``."""

from qaccel.trainer.callbacks import (
    Callback,
    EarlyStopping,
    GradientMonitoring,
    LogHyperparameters,
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
    "Callback", "EarlyStopping", "GradientMonitoring", "LogHyperparameters", "LRSchedulerCosineAnnealing",
    "LRSchedulerCyclic", "LRSchedulerStepDecay", "OptimizeResult", "PlotMetrics", "PrintMetrics",
    "SaveBestCheckpoint", "SaveCheckpoint", "Stage", "WriteMetrics",
]
