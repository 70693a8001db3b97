"""perceptrain's tutorial page docs/tutorials/training/examples.md ("Examples"), perceptrain 0.1.0 at commit
2ef328a, run as a reader pastes its Python blocks, on perceptrain's Trainer or on qaccel.perceptrain's.

Usage: ``python examples.py perceptrain|qaccel``. Prints one line ``RESULT <json>`` at the end (also after an
error, with what was recorded up to it): for example 2, the epochs trained, the loss on the data before and after,
the loss function's calls and the run folder's entries; for example 4, that its imports ran.

Changes from the page:

- imports: ``perceptrain`` -> ``qaccel.perceptrain``, ``perceptrain.config`` -> ``qaccel.perceptrain.config``,
  ``perceptrain.data`` -> ``qaccel.perceptrain.data``, ``perceptrain.optimize_step`` ->
  ``qaccel.perceptrain.optimize_step``, ``perceptrain.callbacks`` -> ``qaccel.perceptrain.callbacks``,
  ``perceptrain.callbacks.saveload`` -> ``qaccel.perceptrain.callbacks.saveload``, in a second import block next to
  perceptrain's; qadence's QNN and blocks stay imported from qadence;
- left out: example 1 and example 3, which import names perceptrain 0.1.0 does not have (``from perceptrain import
  hea, QuantumCircuit, Z``, ``perceptrain.constructors``, ``perceptrain.utils``, ``perceptrain.config.AnsatzConfig``,
  ``perceptrain.operations``: ImportError on perceptrain too); example 4's ``def train(...)``, which raises
  NameError on perceptrain too (its default ``write_tensorboard`` is not defined anywhere): its import lines are
  kept; the markdown-exec lines that turn the figure into HTML (``from docs import docsutils``);
- example 2's ``loss_fn(model, data)`` takes its parameters in qadence's order, which perceptrain's Trainer does not
  call it in (``loss_fn(batch, model)``: on perceptrain the page raises TypeError, 'QNN' object is not
  subscriptable; qaccel.perceptrain refuses the function when the Trainer is made): swapped to ``(data, model)``;
- sizes: example 2's ``n_epochs = 30`` (tutorial: 300);
- plotting: matplotlib's Agg backend; example 2's final figure saved to ``fit.png``;
- lines marked ``# test:`` only record values for the RESULT line.
"""

import atexit
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # test: figures go to files, no window

PERCEPTRAIN = {"perceptrain": True, "qaccel": False}[sys.argv[1]]  # test: whose Trainer
RESULT: dict = {"library": sys.argv[1]}  # test
atexit.register(lambda: print("RESULT " + json.dumps(RESULT), flush=True))  # test: printed last, even after an error

# ---- 2. Fitting a function with a QNN using Trainer ----

from pathlib import Path
import torch
from functools import reduce
from operator import add
from itertools import count
import matplotlib.pyplot as plt

from qadence import Parameter, QuantumCircuit, Z
from qadence import hamiltonian_factory, hea, feature_map, chain
from qadence import QNN

if PERCEPTRAIN:
    from perceptrain import  TrainConfig, Trainer, to_dataloader
else:
    from qaccel.perceptrain import  TrainConfig, Trainer, to_dataloader

Trainer.set_use_grad(True)

n_qubits = 4
fm = feature_map(n_qubits)
ansatz = hea(n_qubits=n_qubits, depth=3)
observable = hamiltonian_factory(n_qubits, detuning=Z)
circuit = QuantumCircuit(n_qubits, fm, ansatz)

model = QNN(circuit, observable, backend="pyqtorch", diff_mode="ad")
batch_size = 100
input_values = {"phi": torch.rand(batch_size, requires_grad=True)}
pred = model(input_values)

cnt = count()
criterion = torch.nn.MSELoss()
optimizer = torch.optim.Adam(model.parameters(), lr=0.1)

def loss_fn(data: torch.Tensor, model: torch.nn.Module) -> tuple[torch.Tensor, dict]:  # tutorial: (model, data)
    next(cnt)
    x, y = data[0], data[1]
    out = model(x)
    loss = criterion(out, y)
    return loss, {}

def validation_criterion(
    current_validation_loss: float, current_best_validation_loss: float, val_epsilon: float
) -> bool:
    return current_validation_loss <= current_best_validation_loss - val_epsilon

n_epochs = 30  # tutorial: 300

config = TrainConfig(
    max_iter=n_epochs,
    batch_size=batch_size,
    checkpoint_best_only=True,
    val_every=10,  # The model will be run on the validation data after every `val_every` epochs.
    validation_criterion=validation_criterion
)

fn = lambda x, degree: .05 * reduce(add, (torch.cos(i*x) + torch.sin(i*x) for i in range(degree)), 0.)
x = torch.linspace(0, 10, batch_size).reshape(-1, 1)
y = fn(x, 5)

train_dataloader = to_dataloader(x, y, batch_size=batch_size, infinite=True)
val_dataloader =  to_dataloader(x, y, batch_size=batch_size, infinite=True)

initial_loss = criterion(model(x), y).item()  # test
trainer = Trainer(model, optimizer, config, loss_fn=loss_fn,
                    train_dataloader=train_dataloader, val_dataloader=val_dataloader)
trainer.fit()

plt.clf()
plt.plot(x.numpy(), y.numpy(), label='truth')
plt.plot(x.numpy(), model(x).detach().numpy(), "--", label="final", linewidth=3)
plt.legend()
plt.savefig("fit.png")  # tutorial: print(docsutils.fig_to_html(plt.gcf()))

RESULT["2"] = {"current_epoch": trainer.current_epoch, "max_iter": config.max_iter,  # test
               "initial_loss": initial_loss, "final_loss": criterion(model(x), y).item(),  # test
               "loss_fn_calls": next(cnt), "log_folder": str(config.log_folder),  # test
               "entries": sorted(os.listdir(config.log_folder))}  # test

# ---- 4. Custom train loop: its imports ----

from typing import Callable, Union

from torch.nn import Module
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter

if PERCEPTRAIN:
    from perceptrain.config import TrainConfig
    from perceptrain.data import DictDataLoader, data_to_device
    from perceptrain.optimize_step import optimize_step
    from perceptrain.callbacks import get_writer
    from perceptrain.callbacks.saveload import load_checkpoint, write_checkpoint
else:
    from qaccel.perceptrain.config import TrainConfig
    from qaccel.perceptrain.data import DictDataLoader, data_to_device
    from qaccel.perceptrain.optimize_step import optimize_step
    from qaccel.perceptrain.callbacks import get_writer
    from qaccel.perceptrain.callbacks.saveload import load_checkpoint, write_checkpoint
RESULT["4"] = "imported"  # test
