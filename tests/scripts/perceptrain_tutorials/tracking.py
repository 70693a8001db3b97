"""perceptrain's tutorial page docs/tutorials/training/tracking.md ("Experiment Tracking with TensorBoard and
MLflow"), perceptrain 0.1.0 at commit 2ef328a, run as a reader pastes its Python blocks, on perceptrain's TrainConfig
or on qaccel.perceptrain's.

Usage: ``python tracking.py perceptrain|qaccel``. Prints one line ``RESULT <json>`` at the end (also after an
error, with what was recorded up to it): each config's max_iter and tracking tool.

The page trains nothing: it makes a config for TensorBoard and one for MLflow.

Changes from the page:

- imports: ``perceptrain`` -> ``qaccel.perceptrain``, in a second import block next to perceptrain's;
  ``perceptrain.types.ExperimentTrackingTool`` stays imported from perceptrain (qaccel's TrainConfig takes it);
- lines marked ``# test:`` only record values for the RESULT line.
"""

import atexit
import json
import sys

PERCEPTRAIN = {"perceptrain": True, "qaccel": False}[sys.argv[1]]  # test: whose TrainConfig
RESULT: dict = {"library": sys.argv[1], "configs": []}  # test
atexit.register(lambda: print("RESULT " + json.dumps(RESULT), flush=True))  # test: printed last, even after an error


def record(config):  # test: what the RESULT line says of a config
    tool = config.tracking_tool
    RESULT["configs"].append([config.max_iter, str(getattr(tool, "value", tool))])


# ---- TensorBoard ----

if PERCEPTRAIN:
    from perceptrain import TrainConfig
else:
    from qaccel.perceptrain import TrainConfig
from perceptrain.types import ExperimentTrackingTool

# Set up tracking with TensorBoard
config = TrainConfig(max_iter=100, tracking_tool=ExperimentTrackingTool.TENSORBOARD)
record(config)  # test

# ---- MLflow ----

from perceptrain.types import ExperimentTrackingTool

# Set up tracking with MLflow
config = TrainConfig(max_iter=100, tracking_tool=ExperimentTrackingTool.MLFLOW)
record(config)  # test
