"""qadence's tutorial page docs/tutorials/qml/ml_tools/data_and_config.md (dataloaders and TrainConfig), qadence
1.11.5 at commit 5b6c7d2, run as a reader pastes its Python blocks, on qadence's helpers or on qaccel's.

Usage: ``python data_and_config.py qadence|qaccel``. Prints one line ``RESULT <json>`` at the end (also after an
error, with what was recorded up to it): the batches the loaders gave, and the configs' fields.

Changes from the page:

- imports: ``qadence.ml_tools`` -> ``qaccel``, ``qadence.ml_tools.callbacks`` -> ``qaccel.callbacks``, in a
  second import block next to qadence's; ``ExperimentTrackingTool``, which the page uses without importing it,
  imported from ``qadence.types`` (as trainer.md does);
- left out: the custom-callback example ``Callback(..., callback_function=callback_fn)``, which raises
  TypeError on qadence too (the argument is ``callback``); the plotting example (``plot_loss_function`` is not
  defined on the page); the GPU example ``TrainConfig(compute_setup="gpu", nprocs=2, backend="nccl")``, which
  qaccel checks against the machine when the config is made (without CUDA: RuntimeError), where qadence makes
  the config and leaves the GPUs to fit(); the mlflow environment variables (bash);
- lines marked ``# test:`` only record values for the RESULT line.
"""

import atexit
import json
import sys

QADENCE = {"qadence": True, "qaccel": False}[sys.argv[1]]  # test: whose helpers
RESULT: dict = {"library": sys.argv[1]}  # test
atexit.register(lambda: print("RESULT " + json.dumps(RESULT), flush=True))  # test: printed last, even after an error


def fields(config):  # test: what the RESULT line says of a config
    names = ("max_iter", "batch_size", "print_every", "write_every", "checkpoint_every", "val_every", "nprocs",
             "compute_setup", "backend", "checkpoint_best_only")
    return {name: getattr(config, name) for name in names}


# ---- 1. Dataloaders ----

import torch
from torch.utils.data import DataLoader, TensorDataset
if QADENCE:
    from qadence.ml_tools import DictDataLoader, to_dataloader
else:
    from qaccel import DictDataLoader, to_dataloader


def dataloader(data_size: int = 25, batch_size: int = 5, infinite: bool = False) -> DataLoader:
    x = torch.linspace(0, 1, data_size).reshape(-1, 1)
    y = torch.sin(x)
    return to_dataloader(x, y, batch_size=batch_size, infinite=infinite)


def dictdataloader(data_size: int = 25, batch_size: int = 5) -> DictDataLoader:
    dls = {}
    for k in ["y1", "y2"]:
        x = torch.rand(data_size, 1)
        y = torch.sin(x)
        dls[k] = to_dataloader(x, y, batch_size=batch_size, infinite=True)
    return DictDataLoader(dls)


RESULT["standard"], RESULT["infinite"] = [], []  # test
# iterate over standard DataLoader
for (x,y) in dataloader(data_size=6, batch_size=2):
    print(f"Standard {x = }")
    RESULT["standard"].append([x.flatten().tolist(), y.flatten().tolist()])  # test

# construct an infinite dataset which will keep sampling indefinitely
n_epochs = 5
dl = iter(dataloader(data_size=6, batch_size=2, infinite=True))
for _ in range(n_epochs):
    (x, y) = next(dl)
    print(f"Infinite {x = }")
    RESULT["infinite"].append([x.flatten().tolist(), y.flatten().tolist()])  # test

# iterate over DictDataLoader
ddl = dictdataloader()
data = next(iter(ddl))
print(f"{data = }")
RESULT["dict"] = {k: [[t.flatten().tolist() for t in batch], list(batch[0].shape)]  # test
                  for k, batch in data.items()}  # test

# ---- 2.1. TrainConfig attributes: a config with a custom callback ----

if QADENCE:
    from qadence.ml_tools import OptimizeResult, TrainConfig
    from qadence.ml_tools.callbacks import Callback
else:
    from qaccel import OptimizeResult, TrainConfig
    from qaccel.callbacks import Callback

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
RESULT["configs"] = [fields(config)]  # test
RESULT["callback"] = [str(getattr(custom_callback.on, "value", custom_callback.on)),  # test
                      custom_callback.called_every, len(config.callbacks)]  # test

# ---- 2.2. Key configuration options ----

config = TrainConfig(max_iter=2000, batch_size=32)
RESULT["configs"].append(fields(config))  # test

config = TrainConfig(print_every=100, write_every=50, checkpoint_every=50)
RESULT["configs"].append(fields(config))  # test

from qadence.types import ExperimentTrackingTool  # not imported on the page

config = TrainConfig(root_folder="path/to/checkpoints", tracking_tool=ExperimentTrackingTool.MLFLOW, checkpoint_best_only=True)
RESULT["configs"].append(fields(config))  # test

config = TrainConfig(val_every=200, checkpoint_best_only = True, validation_criterion=lambda current, best: current < best - 0.001)
RESULT["configs"].append(fields(config))  # test

def validation_criterion(val_loss: float, best_val_loss: float, val_epsilon: float) -> bool:
    return val_loss < (best_val_loss - val_epsilon)

RESULT["criterion"] = [validation_criterion(0.5, 1.0, 1e-5), validation_criterion(1.0, 1.0, 1e-5)]  # test

config = TrainConfig(
    compute_setup="cpu",
    nprocs=5,
    backend="gloo"
)
RESULT["configs"].append(fields(config))  # test
