"""perceptrain's ``perceptrain.config.TrainConfig``: qaccel's."""

from qaccel.trainer.config import TrainConfig

__all__ = ["TrainConfig"]
