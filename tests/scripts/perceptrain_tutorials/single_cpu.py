"""perceptrain's tutorial page docs/tutorials/distributed/single_cpu.md ("Single-Process CPU Training Example"),
perceptrain 0.1.0 at commit 2ef328a, run as a reader pastes its Python block, on perceptrain's Trainer or on
qaccel.perceptrain's.

Usage: ``python single_cpu.py perceptrain|qaccel``. Prints one line ``RESULT <json>`` at the end (also after an
error, with what was recorded up to it): the epochs trained, the model's loss on the whole dataset before and after
training and, where the Trainer keeps them (qaccel's ``trainer.history``), each epoch's training loss.

Changes from the page:

- imports: ``perceptrain`` -> ``qaccel.perceptrain``, ``perceptrain.optimize_step`` ->
  ``qaccel.perceptrain.optimize_step``, in a second import block next to perceptrain's;
- lines marked ``# test:`` only record values for the RESULT line.
"""

import atexit
import json
import sys

PERCEPTRAIN = {"perceptrain": True, "qaccel": False}[sys.argv[1]]  # test: whose Trainer
RESULT: dict = {"library": sys.argv[1]}  # test
atexit.register(lambda: print("RESULT " + json.dumps(RESULT), flush=True))  # test: printed last, even after an error


def loss_on(model, x, y):  # test: the model's loss on the whole dataset
    return torch.nn.functional.mse_loss(model(x), y).item()


# ---- Single-Process CPU Training Example ----

import torch
from torch import nn, optim
from torch.utils.data import DataLoader, TensorDataset
if PERCEPTRAIN:
    from perceptrain import TrainConfig, Trainer
    from perceptrain.optimize_step import optimize_step
else:
    from qaccel.perceptrain import TrainConfig, Trainer
    from qaccel.perceptrain.optimize_step import optimize_step
Trainer.set_use_grad(True)

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

history = getattr(trainer, "history", None)  # test
RESULT.update(current_epoch=trainer.current_epoch, max_iter=trainer.config.max_iter,  # test
              initial_loss=initial_loss, loss=loss_on(model, x, y),  # test
              train_loss=[epoch["train_loss"] for epoch in history] if history else None)  # test
