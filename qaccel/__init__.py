"""qaccel: turn a plain PyTorch training function into multi-process training, on CPUs or GPUs, on one node or many.

Layers, each importing only the ones below it:

- ``trainer``: qadence's Trainer (``Trainer``, ``TrainConfig``, ``qaccel.callbacks``, ``qaccel.data``, qadence's
  checkpoint files and parameter helpers), built on the facade;
- ``accelerator`` (the facade users hold) and ``cli`` (``qaccel env``, ``qaccel test``);
- ``launch``: starting ranks (a plain launch) or running in place (torchrun, srun), and bringing results back;
- ``train``: what runs inside a rank's training function: prepare, data, the step, precision, checkpoints;
- ``comm``: the session of one rank, its process group, collectives and hang reports;
- the vocabulary every layer uses: ``options``, ``errors``, ``environment``, ``storage``, ``nested``.
"""

__version__ = "0.1.0"

from qaccel.accelerator import Accelerator
from qaccel.checkpoints.state import consolidate
from qaccel.errors import (
    CheckpointError,
    CollectiveMismatchError,
    Preempted,
    QaccelError,
    RankError,
    RankKilledError,
    RendezvousError,
)
from qaccel.notebook import debug_launcher, notebook_launcher
from qaccel.options import (
    DataLoaderConfiguration,
    DistributedType,
    GradientAccumulationPlugin,
    ProjectConfiguration,
    SlurmCluster,
)
from qaccel.train.batch_size import should_reduce_batch_size
from qaccel.train.loaders import DictDataLoader, InfiniteTensorDataset, to_dataloader
from qaccel.trainer.callbacks import OptimizeResult
from qaccel.trainer.config import TrainConfig
from qaccel.trainer.parameters import get_parameters, num_parameters, set_parameters
from qaccel.trainer.saveload import load_checkpoint, load_model, write_checkpoint
from qaccel.trainer.steps import default_optimize_step
from qaccel.trainer.trainer import Trainer
from qaccel.utils import find_executable_batch_size

__all__ = [
    "Accelerator",
    "CheckpointError",
    "CollectiveMismatchError",
    "DataLoaderConfiguration",
    "DictDataLoader",
    "DistributedType",
    "GradientAccumulationPlugin",
    "InfiniteTensorDataset",
    "OptimizeResult",
    "Preempted",
    "ProjectConfiguration",
    "QaccelError",
    "RankError",
    "RankKilledError",
    "RendezvousError",
    "SlurmCluster",
    "TrainConfig",
    "Trainer",
    "__version__",
    "consolidate",
    "debug_launcher",
    "default_optimize_step",
    "find_executable_batch_size",
    "get_parameters",
    "load_checkpoint",
    "load_model",
    "notebook_launcher",
    "num_parameters",
    "set_parameters",
    "should_reduce_batch_size",
    "to_dataloader",
    "write_checkpoint",
]
