"""perceptrain's ``perceptrain.train_utils.Accelerator``: qaccel's Accelerator, which takes its arguments in its
order (``nprocs, compute_setup, log_setup, backend, dtype``)."""

from qaccel.accelerator import Accelerator

__all__ = ["Accelerator"]
