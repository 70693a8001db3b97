"""perceptrain's checkpoint files (``perceptrain.callbacks.saveload``): qaccel's readers and writers of them."""

from qaccel.trainer.saveload import (
    get_latest_checkpoint_name,
    load_checkpoint,
    load_model,
    load_optimizer,
    write_checkpoint,
)

__all__ = ["get_latest_checkpoint_name", "load_checkpoint", "load_model", "load_optimizer", "write_checkpoint"]
