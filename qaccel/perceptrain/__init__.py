"""perceptrain's training API on qaccel: ``from qaccel.perceptrain import TrainConfig, Trainer`` where a script has
``from perceptrain import TrainConfig, Trainer``, and each of perceptrain's training modules under the same name
(``qaccel.perceptrain.callbacks``, ``.config``, ``.data``, ``.optimize_step``, ``.parameters``, ``.trainer``,
``.train_utils``).

Everything is qaccel's own, re-exported, except what perceptrain changed from qadence: the order its Trainer and
steps call the loss function in, ``loss_fn(batch, model)``.
"""

from qaccel.perceptrain.config import TrainConfig
from qaccel.perceptrain.data import DictDataLoader, InfiniteTensorDataset, OptimizeResult, to_dataloader
from qaccel.perceptrain.optimize_step import optimize_step as default_optimize_step
from qaccel.perceptrain.parameters import get_parameters, num_parameters, set_parameters
from qaccel.perceptrain.trainer import Trainer
from qaccel.trainer.saveload import load_checkpoint, load_model, write_checkpoint

__all__ = [
    "DictDataLoader",
    "InfiniteTensorDataset",
    "OptimizeResult",
    "TrainConfig",
    "Trainer",
    "default_optimize_step",
    "get_parameters",
    "load_checkpoint",
    "load_model",
    "num_parameters",
    "set_parameters",
    "to_dataloader",
    "write_checkpoint",
]
