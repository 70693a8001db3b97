"""perceptrain's tutorial page docs/tutorials/distributed/CPU.md ("Training on CPU with Trainer"), perceptrain
0.1.0 at commit 2ef328a, run as a reader pastes its Python blocks, on perceptrain's TrainConfig or on
qaccel.perceptrain's.

Usage: ``python CPU.py perceptrain|qaccel``. Prints one line ``RESULT <json>`` at the end (also after an error,
with what was recorded up to it): the fields of the page's two configs.

Changes from the page:

- imports: the page uses ``TrainConfig`` without importing it: imported from ``perceptrain`` (one block) or
  ``qaccel.perceptrain`` (the other);
- lines marked ``# test:`` only record values for the RESULT line.
"""

import atexit
import json
import sys

PERCEPTRAIN = {"perceptrain": True, "qaccel": False}[sys.argv[1]]  # test: whose TrainConfig
RESULT: dict = {"library": sys.argv[1], "configs": []}  # test
atexit.register(lambda: print("RESULT " + json.dumps(RESULT), flush=True))  # test: printed last, even after an error


def fields(config):  # test: what the RESULT line says of a config
    names = ("compute_setup", "backend", "nprocs", "max_iter", "log_setup", "all_reduce_metrics")
    return {name: getattr(config, name) for name in names}


if PERCEPTRAIN:
    from perceptrain import TrainConfig  # not imported on the page
else:
    from qaccel.perceptrain import TrainConfig  # not imported on the page

# ---- Single-Process Training Configuration ----

train_config = TrainConfig(
    compute_setup="cpu",
)
RESULT["configs"].append(fields(train_config))  # test

# ---- Multi-Processing Configuration ----

train_config = TrainConfig(
    compute_setup="cpu",
    backend="gloo",
    nprocs=4,
)
RESULT["configs"].append(fields(train_config))  # test
