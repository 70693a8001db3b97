"""perceptrain's callbacks (``perceptrain.callbacks``): qaccel's, ``from qaccel.perceptrain.callbacks import ...``;
its checkpoint files in ``.saveload``."""

from qaccel import callbacks as _callbacks
from qaccel.callbacks import *  # every name of its __all__

__all__: list[str] = []
__all__ += _callbacks.__all__
