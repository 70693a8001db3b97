"""perceptrain's data helpers (``perceptrain.data``): qaccel's, ``from qaccel.perceptrain.data import to_dataloader``."""

from qaccel.data import (
    DictDataLoader,
    GenerativeIterableDataset,
    InfiniteTensorDataset,
    OptimizeResult,
    R3Dataset,
    data_to_device,
    to_dataloader,
)

__all__ = [
    "DictDataLoader",
    "GenerativeIterableDataset",
    "InfiniteTensorDataset",
    "OptimizeResult",
    "R3Dataset",
    "data_to_device",
    "to_dataloader",
]
