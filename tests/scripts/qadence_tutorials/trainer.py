"""qadence's tutorial page docs/tutorials/qml/ml_tools/trainer.md ("Qadence Trainer Guide"), qadence 1.11.5 at
commit 5b6c7d2, run as a reader pastes its Python blocks, on qadence's Trainer or on qaccel's.

Usage: ``python trainer.py qadence|qaccel``. Prints one line ``RESULT <json>`` at the end (also after an error,
with what was recorded up to it).

Changes from the page:

- imports: every ``qadence.ml_tools...`` import of the Trainer, TrainConfig, data helpers, optimize_step, callbacks
  and checkpoint helpers comes in two blocks, qadence's as on the page and qaccel's (``qadence.ml_tools`` ->
  ``qaccel``, ``qadence.ml_tools.data`` -> ``qaccel.data``, ``qadence.ml_tools.optimize_step`` ->
  ``qaccel.optimize_step``, ``qadence.ml_tools.callbacks`` -> ``qaccel.callbacks``,
  ``qadence.ml_tools.callbacks.saveload`` -> ``qaccel``; ``qadence.ml_tools.trainer`` / ``.config``'s
  TrainConfig -> ``qaccel``); qadence's models and types (QNN, AnsatzConfig, ExperimentTrackingTool, ...) stay
  imported from qadence;
- left out: the "Overview" and "Custom Loss Functions" blocks that use ``model = ...`` (a placeholder), the
  notes' ``train_with_grad`` blocks (an API qadence removed), the context-manager block (``trainer`` and
  ``ng_optimizer`` undefined there), and the block ``Trainer.set_use_grad(False)``: pasted before 6.1, it makes
  6.1's ``Trainer(model, Adam, ...)`` raise TypeError on qadence too (a gradient-free Trainer needs a nevergrad
  optimizer); 6.5's ``def train(...)``, which raises NameError on qadence too (its default ``write_tensorboard``
  is not defined anywhere): its import lines are kept;
- sizes: 6.2 ``n_epochs = 100`` (tutorial: 300); the rest as on the page;
- plotting: matplotlib's Agg backend; 6.2's final figure saved to ``fit.png`` (the page turns it into HTML);
- lines marked ``# test:`` only record values for the RESULT line.
"""

import atexit
import json
import sys

import matplotlib

matplotlib.use("Agg")  # test: figures go to files, no window

QADENCE = {"qadence": True, "qaccel": False}[sys.argv[1]]  # test: whose Trainer
RESULT: dict = {"library": sys.argv[1]}  # test
atexit.register(lambda: print("RESULT " + json.dumps(RESULT), flush=True))  # test: printed last, even after an error

# ---- 2. Gradient-Based and Gradient-Free Optimization ----

if QADENCE:
    from qadence.ml_tools import Trainer
else:
    from qaccel import Trainer

# set_use_grad(True) to enable gradient based training. This is the default behaviour of Trainer.
Trainer.set_use_grad(True)

# ---- 3. Custom Loss Functions ----

import torch
from itertools import count
cnt = count()
criterion = torch.nn.MSELoss()

def loss_fn(model: torch.nn.Module, data: torch.Tensor) -> tuple[torch.Tensor, dict]:
    next(cnt)
    x, y = data
    out = model(x)
    loss = criterion(out, y)
    return loss, {}

# ---- 4. Hooks for Custom Behavior ----

if QADENCE:
    from qadence.ml_tools import Trainer
else:
    from qaccel import Trainer

class CustomTrainer(Trainer):
    def on_train_epoch_end(self, train_epoch_loss_metrics):
        print(f"End of epoch - Loss and Metrics: {train_epoch_loss_metrics}")

# ---- 5. Experiment Tracking with TensorBoard and MLflow ----

if QADENCE:
    from qadence.ml_tools import TrainConfig
else:
    from qaccel import TrainConfig
from qadence.types import ExperimentTrackingTool

# Set up tracking with TensorBoard
config = TrainConfig(max_iter=100, tracking_tool=ExperimentTrackingTool.TENSORBOARD)

from qadence.types import ExperimentTrackingTool

# Set up tracking with MLflow
config = TrainConfig(max_iter=100, tracking_tool=ExperimentTrackingTool.MLFLOW)

# ---- 6.1. Training with Trainer and TrainConfig ----

import random
from itertools import count

import numpy as np
import torch
from matplotlib import pyplot as plt
from matplotlib.figure import Figure
from torch.nn import Module
from torch.utils.data import DataLoader

from qadence import hea, QuantumCircuit, Z
from qadence.constructors import feature_map, hamiltonian_factory
if QADENCE:
    from qadence.ml_tools import Trainer, TrainConfig
    from qadence.ml_tools.data import to_dataloader
else:
    from qaccel import Trainer, TrainConfig
    from qaccel.data import to_dataloader
from qadence.ml_tools.utils import rand_featureparameters
from qadence.ml_tools.models import QNN, QuantumModel
from qadence.types import ExperimentTrackingTool

hyperparams = {
    "seed": 42,
    "batch_size": 10,
    "n_qubits": 2,
    "ansatz_depth": 1,
    "observable": Z,
}

np.random.seed(hyperparams["seed"])
torch.manual_seed(hyperparams["seed"])
random.seed(hyperparams["seed"])


def dataloader(batch_size: int = 25) -> DataLoader:
    x = torch.linspace(0, 1, batch_size).reshape(-1, 1)
    y = torch.cos(x)
    return to_dataloader(x, y, batch_size=batch_size, infinite=True)

obs = hamiltonian_factory(register=hyperparams["n_qubits"], detuning=hyperparams["observable"])

data = dataloader(hyperparams["batch_size"])
fm = feature_map(hyperparams["n_qubits"], param="x")

model = QNN(
    QuantumCircuit(
        hyperparams["n_qubits"], fm, hea(hyperparams["n_qubits"], hyperparams["ansatz_depth"])
    ),
    observable=obs,
    inputs=["x"],
)

cnt = count()
criterion = torch.nn.MSELoss()
optimizer = torch.optim.Adam(model.parameters(), lr=0.1)

inputs = rand_featureparameters(model, 1)

def loss_fn(model: QuantumModel, data: torch.Tensor) -> tuple[torch.Tensor, dict]:
    next(cnt)
    out = model.expectation(inputs)
    loss = criterion(out, torch.rand(1))
    return loss, {}

def plot_fn(model: Module, iteration: int) -> tuple[str, Figure]:
    descr = f"ufa_prediction_epoch_{iteration}.png"
    fig, ax = plt.subplots()
    x = torch.linspace(0, 1, 100).reshape(-1, 1)
    out = model.expectation(x)
    ax.plot(x.detach().numpy(), out.detach().numpy())
    return descr, fig


config = TrainConfig(
    root_folder="mlflow_demonstration",
    max_iter=10,
    checkpoint_every=1,
    plot_every=2,
    write_every=1,
    log_model=True,
    tracking_tool=ExperimentTrackingTool.MLFLOW,
    hyperparams=hyperparams,
    plotting_functions=(plot_fn,),
)

trainer = Trainer(model, optimizer, config, loss_fn)
trainer.fit(train_dataloader=data)

RESULT["6.1"] = {"loss_fn_calls": next(cnt), "current_epoch": trainer.current_epoch,  # test
                 "max_iter": config.max_iter, "log_folder": str(config.log_folder),  # test
                 "params": [p.detach().flatten().tolist() for p in model.parameters()]}  # test

# ---- 6.2. Fitting a function with a QNN using ml_tools ----

from pathlib import Path
import torch
from functools import reduce
from operator import add
from itertools import count
import matplotlib.pyplot as plt

from qadence import Parameter, QuantumCircuit, Z
from qadence import hamiltonian_factory, hea, feature_map, chain
from qadence import QNN
if QADENCE:
    from qadence.ml_tools import  TrainConfig, Trainer, to_dataloader
else:
    from qaccel import TrainConfig, Trainer, to_dataloader

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

def loss_fn(model: torch.nn.Module, data: torch.Tensor) -> tuple[torch.Tensor, dict]:
    next(cnt)
    x, y = data[0], data[1]
    out = model(x)
    loss = criterion(out, y)
    return loss, {}

def validation_criterion(
    current_validation_loss: float, current_best_validation_loss: float, val_epsilon: float
) -> bool:
    return current_validation_loss <= current_best_validation_loss - val_epsilon

n_epochs = 100  # tutorial: n_epochs = 300

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

initial_loss = criterion(model(x), y).item()  # test: the untrained model's loss on the data
trainer = Trainer(model, optimizer, config, loss_fn=loss_fn,
                    train_dataloader=train_dataloader, val_dataloader=val_dataloader)
trainer.fit()

plt.clf()
plt.plot(x.numpy(), y.numpy(), label='truth')
plt.plot(x.numpy(), model(x).detach().numpy(), "--", label="final", linewidth=3)
plt.legend()
plt.savefig("fit.png")  # tutorial: print(docsutils.fig_to_html(plt.gcf()))

RESULT["6.2"] = {"initial_loss": initial_loss, "final_loss": criterion(model(x), y).item(),  # test
                 "loss_fn_calls": next(cnt), "current_epoch": trainer.current_epoch,  # test
                 "max_iter": config.max_iter, "log_folder": str(config.log_folder)}  # test

# ---- 6.3. Fitting a function - Low-level API ----

from pathlib import Path
import torch
from itertools import count
from qadence.constructors import hamiltonian_factory, hea, feature_map
from qadence import chain, Parameter, QuantumCircuit, Z
from qadence import QNN
if QADENCE:
    from qadence.ml_tools import TrainConfig
else:
    from qaccel import TrainConfig

n_qubits = 2
fm = feature_map(n_qubits)
ansatz = hea(n_qubits=n_qubits, depth=3)
observable = hamiltonian_factory(n_qubits, detuning=Z)
circuit = QuantumCircuit(n_qubits, fm, ansatz)

model = QNN(circuit, observable, backend="pyqtorch", diff_mode="ad")
batch_size = 1
input_values = {"phi": torch.rand(batch_size, requires_grad=True)}
pred = model(input_values)

criterion = torch.nn.MSELoss()
optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
n_epochs=50
cnt = count()

tmp_path = Path("/tmp")

config = TrainConfig(
    root_folder=tmp_path,
    max_iter=n_epochs,
    checkpoint_every=100,
    write_every=100,
    batch_size=batch_size,
)

x = torch.linspace(0, 1, batch_size).reshape(-1, 1)
y = torch.sin(x)

for i in range(n_epochs):
    out = model(x)
    loss = criterion(out, y)
    loss.backward()
    optimizer.step()

RESULT["6.3"] = {"loss": loss.item()}  # test

# ---- 6.4. Pre-training Exploratory Landscape Analysis (ELA) with Information Content (IC) ----

import torch
from torch.optim.adam import Adam

from qadence.constructors import ObservableConfig
from qadence.ml_tools.config import AnsatzConfig, FeatureMapConfig
if QADENCE:
    from qadence.ml_tools.config import TrainConfig
    from qadence.ml_tools.data import to_dataloader
else:
    from qaccel import TrainConfig
    from qaccel.data import to_dataloader
from qadence.ml_tools.models import QNN
if QADENCE:
    from qadence.ml_tools.optimize_step import optimize_step
    from qadence.ml_tools.trainer import Trainer
else:
    from qaccel.optimize_step import optimize_step
    from qaccel import Trainer
from qadence.operations.primitive import Z

fm_config = FeatureMapConfig(num_features=1)
ansatz_config = AnsatzConfig(depth=4)
obs_config = ObservableConfig(detuning=Z)

qnn = QNN.from_configs(
    register=4,
    obs_config=obs_config,
    fm_config=fm_config,
    ansatz_config=ansatz_config,
)

optimizer = Adam(qnn.parameters(), lr=0.001)

batch_size = 25
x = torch.linspace(0, 1, 32).reshape(-1, 1)
y = torch.sin(x)
train_loader = to_dataloader(x, y, batch_size=batch_size, infinite=True)

train_config = TrainConfig(max_iter=100)

trainer = Trainer(
    model=qnn,
    optimizer=optimizer,
    config=train_config,
    loss_fn="mse",
    train_dataloader=train_loader,
    optimize_step=optimize_step,
)

# Perform exploratory landscape analysis with Information Content
ic_sensitivity_threshold = 1e-4
epsilons = torch.logspace(-2, 2, 10)

max_ic_lower_bound, max_ic_upper_bound, sensitivity_ic_upper_bound = (
    trainer.get_ic_grad_bounds(
        eta=ic_sensitivity_threshold,
        epsilons=epsilons,
    )
)

print(
    f"Using maximum IC, the gradients are bound between {max_ic_lower_bound:.3f} and {max_ic_upper_bound:.3f}\n"
)
print(
    f"Using sensitivity IC, the gradients are bounded above by {sensitivity_ic_upper_bound:.3f}"
)

# Resume training as usual...

initial_loss = torch.nn.functional.mse_loss(qnn(x), y).item()  # test: the untrained model's loss on the data
trainer.fit(train_loader)

RESULT["6.4"] = {"bounds": [float(max_ic_lower_bound), float(max_ic_upper_bound),  # test
                            float(sensitivity_ic_upper_bound)],  # test
                 "initial_loss": initial_loss,  # test
                 "final_loss": torch.nn.functional.mse_loss(qnn(x), y).item(),  # test
                 "current_epoch": trainer.current_epoch, "max_iter": train_config.max_iter}  # test

# ---- 6.5. Custom train loop: the block's imports (its def train(...) raises NameError, see the docstring) ----

from typing import Callable, Union

from torch.nn import Module
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter

if QADENCE:
    from qadence.ml_tools.config import TrainConfig
    from qadence.ml_tools.data import DictDataLoader, data_to_device
    from qadence.ml_tools.optimize_step import optimize_step
    from qadence.ml_tools.callbacks import get_writer
    from qadence.ml_tools.callbacks.saveload import load_checkpoint, write_checkpoint
else:
    from qaccel import TrainConfig
    from qaccel.data import DictDataLoader, data_to_device
    from qaccel.optimize_step import optimize_step
    from qaccel.callbacks import get_writer
    from qaccel import load_checkpoint, write_checkpoint

RESULT["6.5"] = {"imported": True}  # test
