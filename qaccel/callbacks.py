"""The Trainer's callbacks (qadence's names): ``from qaccel.callbacks import EarlyStopping``."""

from qaccel.tracking.tools import make_tracker as get_writer  # qadence's name: the tracker for a tracking tool
from qaccel.trainer import callbacks as _callbacks
from qaccel.trainer.callbacks import *  # every name of its __all__

__all__ = ["get_writer"]
__all__ += _callbacks.__all__
