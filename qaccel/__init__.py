"""qaccel: turn a plain PyTorch training function into multi-process, multi-GPU, multi-node training."""

__version__ = "0.1.0"

from qaccel.accelerator import Accelerator
from qaccel.checkpoint import consolidate
from qaccel.errors import CheckpointError, CollectiveMismatchError, QaccelError, RankError, RankKilledError
from qaccel.stopping import Preempted

__all__ = ["Accelerator", "Preempted", "consolidate", "CheckpointError", "CollectiveMismatchError", "QaccelError", "RankError", "RankKilledError", "__version__"]
