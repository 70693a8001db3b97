"""qadence's data helpers (``qadence.ml_tools.data``): ``from qaccel.data import to_dataloader``."""

from qaccel.train.loaders import (
    DictDataLoader,
    GenerativeIterableDataset,
    InfiniteTensorDataset,
    R3Dataset,
    data_to_device,
    to_dataloader,
)
from qaccel.trainer.callbacks import OptimizeResult

__all__ = [
    "DictDataLoader",
    "GenerativeIterableDataset",
    "InfiniteTensorDataset",
    "OptimizeResult",
    "R3Dataset",
    "data_to_device",
    "to_dataloader",
]
