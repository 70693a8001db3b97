"""qadence's training steps (``qadence.ml_tools.optimize_step``): ``from qaccel.optimize_step import optimize_step``."""

from qaccel.trainer.steps import default_optimize_step, optimize_step, update_ng_parameters

__all__ = ["default_optimize_step", "optimize_step", "update_ng_parameters"]
