"""perceptrain's tutorial page docs/tutorials/dataconfig/config.md ("Training Configuration"), perceptrain 0.1.0 at
commit 2ef328a, run as a reader pastes its Python blocks, on perceptrain's TrainConfig or on qaccel.perceptrain's.

Usage: ``python config.py perceptrain|qaccel``. Prints one line ``RESULT <json>`` at the end (also after an error,
with what was recorded up to it): the configs' fields and the custom callback's.

Changes from the page:

- imports: ``perceptrain`` -> ``qaccel.perceptrain``, ``perceptrain.callbacks`` -> ``qaccel.perceptrain.callbacks``,
  in a second import block next to perceptrain's; ``ExperimentTrackingTool``, which the page uses without importing
  it, imported from ``perceptrain.types`` (qaccel's TrainConfig takes it);
- left out: the custom-callback example ``Callback(..., callback_function=callback_fn)``, which raises TypeError on
  perceptrain too (the argument is ``callback``); the plotting example (``plot_loss_function`` is not defined on the
  page); the GPU example ``TrainConfig(compute_setup="gpu", nprocs=2, backend="nccl")``, which qaccel checks against
  the machine when the config is made (without CUDA: RuntimeError), where perceptrain makes the config and leaves
  the GPUs to fit();
- lines marked ``# test:`` only record values for the RESULT line.
"""

import atexit
import json
import sys

PERCEPTRAIN = {"perceptrain": True, "qaccel": False}[sys.argv[1]]  # test: whose TrainConfig
RESULT: dict = {"library": sys.argv[1], "configs": []}  # test
atexit.register(lambda: print("RESULT " + json.dumps(RESULT), flush=True))  # test: printed last, even after an error


def fields(config):  # test: what the RESULT line says of a config
    names = ("max_iter", "batch_size", "print_every", "write_every", "plot_every", "checkpoint_every", "val_every",
             "val_epsilon", "checkpoint_best_only", "verbose", "nprocs", "compute_setup", "backend", "log_setup",
             "all_reduce_metrics", "log_model", "hyperparams")
    values = {name: getattr(config, name) for name in names}
    values["tracking_tool"] = str(getattr(config.tracking_tool, "value", config.tracking_tool))
    values["dtype"] = str(config.dtype)
    return values


# ---- 1. Explanation of TrainConfig Attributes ----

if PERCEPTRAIN:
    from perceptrain import OptimizeResult, TrainConfig
    from perceptrain.callbacks import Callback
else:
    from qaccel.perceptrain import OptimizeResult, TrainConfig
    from qaccel.perceptrain.callbacks import Callback

batch_size = 5
n_epochs = 100

print_parameters = lambda opt_res: print(opt_res.model.parameters())
condition_print = lambda opt_res: opt_res.loss < 1.0e-03
modify_extra_opt_res = {"n_epochs": n_epochs}
custom_callback = Callback(on="train_end", callback = print_parameters, callback_condition=condition_print, modify_optimize_result=modify_extra_opt_res, called_every=10,)

config = TrainConfig(
    root_folder="some_path/",
    max_iter=n_epochs,
    checkpoint_every=100,
    write_every=100,
    batch_size=batch_size,
    callbacks = [custom_callback]
)
RESULT["configs"].append(fields(config))  # test
RESULT["callback"] = [str(getattr(custom_callback.on, "value", custom_callback.on)),  # test
                      custom_callback.called_every, len(config.callbacks)]  # test

# ---- 2. Key Configuration Options: Iterations and Batch Size ----

config = TrainConfig(max_iter=2000, batch_size=32)
RESULT["configs"].append(fields(config))  # test

# ---- 2. Key Configuration Options: Training Parameters ----

config = TrainConfig(print_every=100, write_every=50, checkpoint_every=50)
RESULT["configs"].append(fields(config))  # test

from perceptrain.types import ExperimentTrackingTool  # not imported on the page

config = TrainConfig(root_folder="path/to/checkpoints", tracking_tool=ExperimentTrackingTool.MLFLOW, checkpoint_best_only=True)
RESULT["configs"].append(fields(config))  # test

# ---- 2. Key Configuration Options: Validation Parameters ----

config = TrainConfig(val_every=200, checkpoint_best_only = True, validation_criterion=lambda current, best: current < best - 0.001)
RESULT["configs"].append(fields(config))  # test

def validation_criterion(val_loss: float, best_val_loss: float, val_epsilon: float) -> bool:
    return val_loss < (best_val_loss - val_epsilon)

RESULT["criterion"] = [validation_criterion(0.5, 1.0, 1e-5), validation_criterion(1.0, 1.0, 1e-5)]  # test

# ---- 2. Key Configuration Options: Advanced Distributed Training ----

config = TrainConfig(
    compute_setup="cpu",
    nprocs=5,
    backend="gloo"
)
RESULT["configs"].append(fields(config))  # test
