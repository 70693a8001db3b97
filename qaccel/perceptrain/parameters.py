"""perceptrain's parameter-vector helpers (``perceptrain.parameters``): qaccel's."""

from qaccel.trainer.parameters import get_parameters, num_parameters, set_parameters

__all__ = ["get_parameters", "num_parameters", "set_parameters"]
