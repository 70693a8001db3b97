"""perceptrain's tutorial page docs/tutorials/callbacks/default.md ("Built-in Callbacks"), perceptrain 0.1.0 at
commit 2ef328a, run as a reader pastes its Python blocks, on perceptrain's callbacks or on qaccel.perceptrain's.

Usage: ``python default.py perceptrain|qaccel``. Prints one line ``RESULT <json>`` at the end (also after an error,
with what was recorded up to it): each config's max_iter and callbacks (class, stage, frequency).

The page trains nothing: each block makes one built-in callback and a TrainConfig holding it.

Changes from the page:

- imports: ``perceptrain`` -> ``qaccel.perceptrain``, ``perceptrain.callbacks`` -> ``qaccel.perceptrain.callbacks``,
  ``perceptrain.data`` -> ``qaccel.perceptrain.data``, in a second import block next to perceptrain's;
  ``perceptrain.models.PINN`` (a model) stays imported from perceptrain;
- lines marked ``# test:`` only record values for the RESULT line.
"""

import atexit
import json
import sys

PERCEPTRAIN = {"perceptrain": True, "qaccel": False}[sys.argv[1]]  # test: whose callbacks
RESULT: dict = {"library": sys.argv[1], "configs": []}  # test
atexit.register(lambda: print("RESULT " + json.dumps(RESULT), flush=True))  # test: printed last, even after an error


def described(callback):  # test: what the RESULT line says of a callback
    return [type(callback).__name__, str(getattr(callback.on, "value", callback.on)), callback.called_every]


def record(config):  # test
    RESULT["configs"].append({"max_iter": config.max_iter, "callbacks": [described(c) for c in config.callbacks]})

# ---- 1. PrintMetrics ----

if PERCEPTRAIN:
    from perceptrain import TrainConfig
    from perceptrain.callbacks import PrintMetrics
else:
    from qaccel.perceptrain import TrainConfig
    from qaccel.perceptrain.callbacks import PrintMetrics

print_metrics_callback = PrintMetrics(on="val_batch_end", called_every=100)

config = TrainConfig(
    max_iter=10000,
    callbacks=[print_metrics_callback]
)
record(config)  # test

# ---- 2. WriteMetrics ----

if PERCEPTRAIN:
    from perceptrain import TrainConfig
    from perceptrain.callbacks import WriteMetrics
else:
    from qaccel.perceptrain import TrainConfig
    from qaccel.perceptrain.callbacks import WriteMetrics

write_metrics_callback = WriteMetrics(on="train_epoch_end", called_every=50)

config = TrainConfig(
    max_iter=5000,
    callbacks=[write_metrics_callback]
)
record(config)  # test

# ---- 3. WritePlots ----

if PERCEPTRAIN:
    from perceptrain import TrainConfig
    from perceptrain.callbacks import WritePlots
else:
    from qaccel.perceptrain import TrainConfig
    from qaccel.perceptrain.callbacks import WritePlots

plot_metrics_callback = WritePlots(on="train_epoch_end", called_every=100)

config = TrainConfig(
    max_iter=5000,
    callbacks=[plot_metrics_callback]
)
record(config)  # test

# ---- 3. LivePlotMetrics ----

if PERCEPTRAIN:
    from perceptrain import TrainConfig
    from perceptrain.callbacks import LivePlotMetrics
else:
    from qaccel.perceptrain import TrainConfig
    from qaccel.perceptrain.callbacks import LivePlotMetrics

live_plot_callback = LivePlotMetrics(on="train_epoch_end",
    called_every=100,
    arrange={"training": ["train_loss", "train_metric_first"], "validation": ["val_loss", "val_metric_second"]},
)

config = TrainConfig(
    max_iter=5000,
    callbacks=[live_plot_callback]
)
record(config)  # test
RESULT["arrange"] = live_plot_callback.arrange  # test

# ---- 4. LogHyperparameters ----

if PERCEPTRAIN:
    from perceptrain import TrainConfig
    from perceptrain.callbacks import LogHyperparameters
else:
    from qaccel.perceptrain import TrainConfig
    from qaccel.perceptrain.callbacks import LogHyperparameters

log_hyper_callback = LogHyperparameters(on="train_start", called_every=1)

config = TrainConfig(
    max_iter=1000,
    callbacks=[log_hyper_callback]
)
record(config)  # test

# ---- 5. SaveCheckpoint ----

if PERCEPTRAIN:
    from perceptrain import TrainConfig
    from perceptrain.callbacks import SaveCheckpoint
else:
    from qaccel.perceptrain import TrainConfig
    from qaccel.perceptrain.callbacks import SaveCheckpoint

save_checkpoint_callback = SaveCheckpoint(on="train_epoch_end", called_every=100)

config = TrainConfig(
    max_iter=10000,
    callbacks=[save_checkpoint_callback]
)
record(config)  # test

# ---- 6. SaveBestCheckpoint ----

if PERCEPTRAIN:
    from perceptrain import TrainConfig
    from perceptrain.callbacks import SaveBestCheckpoint
else:
    from qaccel.perceptrain import TrainConfig
    from qaccel.perceptrain.callbacks import SaveBestCheckpoint

save_best_checkpoint_callback = SaveBestCheckpoint(on="val_epoch_end", called_every=10)

config = TrainConfig(
    max_iter=10000,
    callbacks=[save_best_checkpoint_callback]
)
record(config)  # test

# ---- 7. LoadCheckpoint ----

if PERCEPTRAIN:
    from perceptrain import TrainConfig
    from perceptrain.callbacks import LoadCheckpoint
else:
    from qaccel.perceptrain import TrainConfig
    from qaccel.perceptrain.callbacks import LoadCheckpoint

load_checkpoint_callback = LoadCheckpoint(on="train_start")

config = TrainConfig(
    max_iter=10000,
    callbacks=[load_checkpoint_callback]
)
record(config)  # test

# ---- 8. LogModelTracker ----

if PERCEPTRAIN:
    from perceptrain import TrainConfig
    from perceptrain.callbacks import LogModelTracker
else:
    from qaccel.perceptrain import TrainConfig
    from qaccel.perceptrain.callbacks import LogModelTracker

log_model_callback = LogModelTracker(on="train_end")

config = TrainConfig(
    max_iter=1000,
    callbacks=[log_model_callback]
)
record(config)  # test

# ---- 9. LRSchedulerStepDecay ----

if PERCEPTRAIN:
    from perceptrain import TrainConfig
    from perceptrain.callbacks import LRSchedulerStepDecay
else:
    from qaccel.perceptrain import TrainConfig
    from qaccel.perceptrain.callbacks import LRSchedulerStepDecay

lr_step_decay = LRSchedulerStepDecay(on="train_epoch_end", called_every=100, gamma=0.5)

config = TrainConfig(
    max_iter=10000,
    callbacks=[lr_step_decay]
)
record(config)  # test

# ---- 10. LRSchedulerCyclic ----

if PERCEPTRAIN:
    from perceptrain import TrainConfig
    from perceptrain.callbacks import LRSchedulerCyclic
else:
    from qaccel.perceptrain import TrainConfig
    from qaccel.perceptrain.callbacks import LRSchedulerCyclic

lr_cyclic = LRSchedulerCyclic(on="train_batch_end", called_every=1, base_lr=0.001, max_lr=0.01, step_size=2000)

config = TrainConfig(
    max_iter=10000,
    callbacks=[lr_cyclic]
)
record(config)  # test

# ---- 11. LRSchedulerCosineAnnealing ----

if PERCEPTRAIN:
    from perceptrain import TrainConfig
    from perceptrain.callbacks import LRSchedulerCosineAnnealing
else:
    from qaccel.perceptrain import TrainConfig
    from qaccel.perceptrain.callbacks import LRSchedulerCosineAnnealing

lr_cosine = LRSchedulerCosineAnnealing(on="train_batch_end", called_every=1, t_max=5000, min_lr=1e-6)

config = TrainConfig(
    max_iter=10000,
    callbacks=[lr_cosine]
)
record(config)  # test

# ---- 11. LRSchedulerReduceOnPlateau ----

if PERCEPTRAIN:
    from perceptrain import TrainConfig
    from perceptrain.callbacks import LRSchedulerReduceOnPlateau
else:
    from qaccel.perceptrain import TrainConfig
    from qaccel.perceptrain.callbacks import LRSchedulerReduceOnPlateau

lr_plateau = LRSchedulerReduceOnPlateau(
    on="train_epoch_end",
    called_every=1,
    monitor="train_loss",
    patience=20,
    mode="min",
    gamma=0.5,
    threshold=1e-4,
    min_lr=1e-5,
)

config = TrainConfig(
    max_iter=10000,
    callbacks=[lr_plateau]
)
record(config)  # test

# ---- 12. EarlyStopping ----

if PERCEPTRAIN:
    from perceptrain import TrainConfig
    from perceptrain.callbacks import EarlyStopping
else:
    from qaccel.perceptrain import TrainConfig
    from qaccel.perceptrain.callbacks import EarlyStopping

early_stopping = EarlyStopping(on="val_epoch_end", called_every=1, monitor="val_loss", patience=5, mode="min")

config = TrainConfig(
    max_iter=10000,
    callbacks=[early_stopping]
)
record(config)  # test

# ---- 13. GradientMonitoring ----

if PERCEPTRAIN:
    from perceptrain import TrainConfig
    from perceptrain.callbacks import GradientMonitoring
else:
    from qaccel.perceptrain import TrainConfig
    from qaccel.perceptrain.callbacks import GradientMonitoring

gradient_monitoring = GradientMonitoring(on="train_batch_end", called_every=10)

config = TrainConfig(
    max_iter=10000,
    callbacks=[gradient_monitoring]
)
record(config)  # test

# ---- 14. R3Sampling ----

import torch

if PERCEPTRAIN:
    from perceptrain import TrainConfig
    from perceptrain.callbacks import R3Sampling
    from perceptrain.data import R3Dataset
else:
    from qaccel.perceptrain import TrainConfig
    from qaccel.perceptrain.callbacks import R3Sampling
    from qaccel.perceptrain.data import R3Dataset
from perceptrain.models import PINN  # perceptrain's model: qaccel has none

m = 1.0
k = 1.0

def uniform_1d(n: int):
    return torch.rand(size=(n, 1))

def harmonic_oscillator(x: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    u = model(x)
    dudt = torch.autograd.grad(
        outputs=u,
        inputs=x,
        grad_outputs=torch.ones_like(u),
        create_graph=True,
        retain_graph=True,
    )[0]
    d2udt2 = torch.autograd.grad(
        outputs=dudt,
        inputs=x,
        grad_outputs=torch.ones_like(dudt),
    )[0]
    return m * d2udt2 - kappa * u

def fitness_function(x: torch.Tensor, model: PINN) -> torch.Tensor:
    return torch.linalg.vector_norm(harmonic_oscillator(x, model.nn), ord=2)

dataset = R3Dataset(
    proba_dist=uniform_1d,
    n_samples=20,
    release_threshold=1.0,
)

callback_r3 = R3Sampling(
    initial_dataset=dataset,
    fitness_function=fitness_function,
    called_every=100,
)

config = TrainConfig(
    max_iter=1000,
    callbacks=[callback_r3]
)
record(config)  # test
