"""qadence's tutorial page docs/tutorials/qml/ml_tools/CPU.md ("Training on CPU with Trainer"), qadence 1.11.5 at
commit 5b6c7d2, run as a reader pastes its Python blocks, on qadence's Trainer or on qaccel's.

Usage: ``python CPU.py qadence|qaccel``. Prints one line ``RESULT <json>`` at the end (also after an error, with
what was recorded up to it): for each of the two examples, the epochs trained, the model's loss on the whole
dataset before and after training and, where the Trainer keeps them (qaccel's ``trainer.history``), each epoch's training loss.

Changes from the page:

- imports: ``qadence.ml_tools`` -> ``qaccel``, ``qadence.ml_tools.optimize_step`` -> ``qaccel.optimize_step``, in
  a second import block next to qadence's; the first two blocks use ``TrainConfig`` before the page imports it:
  imported there;
- sizes: the multi-process example's ``nprocs=2`` (tutorial: ``nprocs=4``): the test machine has 2 cores;
- ``if __name__ == "__main__":`` around the single-process example's training, which the page runs at module
  level: the multi-process example below it starts ranks, and ranks started by forkserver import this module
  again (the page's own multi-process example is guarded, "__main__ is recommended");
- lines marked ``# test:`` only record values for the RESULT line.
"""

import atexit
import json
import sys

QADENCE = {"qadence": True, "qaccel": False}[sys.argv[1]]  # test: whose Trainer
RESULT: dict = {"library": sys.argv[1]}  # test
if __name__ == "__main__":  # test: the caller only, not the ranks
    atexit.register(lambda: print("RESULT " + json.dumps(RESULT), flush=True))  # test: printed last, even after an error


def loss_on(model, x, y):  # test: the model's loss on the whole dataset
    return torch.nn.functional.mse_loss(model(x), y).item()


def trained(trainer, model, x, y, initial_loss):  # test: what the RESULT line says of a fit
    history = getattr(trainer, "history", None)
    return {"current_epoch": trainer.current_epoch, "max_iter": trainer.config.max_iter,
            "initial_loss": initial_loss, "loss": loss_on(model, x, y),
            "train_loss": [epoch["train_loss"] for epoch in history] if history else None}


# ---- Single-process training configuration ----

if QADENCE:
    from qadence.ml_tools import TrainConfig  # not imported on the page
else:
    from qaccel import TrainConfig  # not imported on the page

train_config = TrainConfig(
    compute_setup="cpu",
)

# ---- Multi-processing configuration ----

train_config = TrainConfig(
    compute_setup="cpu",
    backend="gloo",
    nprocs=4,
)

# ---- Single-process CPU training example ----

import torch
from torch import nn, optim
from torch.utils.data import DataLoader, TensorDataset
if QADENCE:
    from qadence.ml_tools import TrainConfig, Trainer
    from qadence.ml_tools.optimize_step import optimize_step
else:
    from qaccel import TrainConfig, Trainer
    from qaccel.optimize_step import optimize_step
Trainer.set_use_grad(True)

if __name__ == "__main__":  # not on the page: the next example starts ranks
    # Dataset, Model, and Optimizer
    x = torch.linspace(0, 1, 100).reshape(-1, 1)
    y = torch.sin(2 * torch.pi * x)
    dataloader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    model = nn.Sequential(nn.Linear(1, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = optim.SGD(model.parameters(), lr=0.01)

    # Single-Process Training Configuration
    train_config = TrainConfig(compute_setup="cpu", max_iter=5, print_every=1)

    # Training
    initial_loss = loss_on(model, x, y)  # test
    trainer = Trainer(model, optimizer, train_config, loss_fn="mse", optimize_step=optimize_step)
    trainer.fit(dataloader)

    RESULT["single"] = trained(trainer, model, x, y, initial_loss)  # test

# ---- Multi-processing CPU training example ----

import torch
from torch import nn, optim
from torch.utils.data import DataLoader, TensorDataset
if QADENCE:
    from qadence.ml_tools import TrainConfig, Trainer
    from qadence.ml_tools.optimize_step import optimize_step
else:
    from qaccel import TrainConfig, Trainer
    from qaccel.optimize_step import optimize_step
Trainer.set_use_grad(True)

# __main__ is recommended.
if __name__ == "__main__":
    x = torch.linspace(0, 1, 100).reshape(-1, 1)
    y = torch.sin(2 * torch.pi * x)
    dataloader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    model = nn.Sequential(nn.Linear(1, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = optim.SGD(model.parameters(), lr=0.01)

    # Multi-Process Training Configuration
    train_config = TrainConfig(
        compute_setup="cpu",
        backend="gloo",
        nprocs=2,  # tutorial: nprocs=4
        max_iter=5,
        print_every=1)

    initial_loss = loss_on(model, x, y)  # test
    trainer = Trainer(model, optimizer, train_config, loss_fn="mse", optimize_step=optimize_step)
    trainer.fit(dataloader)

    RESULT["multi"] = trained(trainer, model, x, y, initial_loss)  # test
