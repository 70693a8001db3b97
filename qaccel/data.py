"""qadence's data helpers (``qadence.ml_tools.data``): ``from qaccel.data import to_dataloader``."""

from qaccel.train.loaders import DictDataLoader, InfiniteTensorDataset, data_to_device, to_dataloader
from qaccel.trainer.callbacks import OptimizeResult

__all__ = ["DictDataLoader", "InfiniteTensorDataset", "OptimizeResult", "data_to_device", "to_dataloader"]
