"""qadence's tutorial page docs/tutorials/qml/ml_tools/callbacks.md ("Callbacks for Trainer"), qadence 1.11.5 at
commit 5b6c7d2, run as a reader pastes its Python blocks, on qadence's callbacks or on qaccel's.

Usage: ``python callbacks.py qadence|qaccel``. Prints one line ``RESULT <json>`` at the end (also after an error,
with what was recorded up to it): each config's callbacks (class, stage, frequency) and the custom callbacks'.

The page trains nothing: its blocks make a TrainConfig with each built-in callback, two custom callbacks and a
Trainer subclass.

Changes from the page:

- imports: ``qadence.ml_tools`` -> ``qaccel``, ``qadence.ml_tools.callbacks`` -> ``qaccel.callbacks``,
  ``qadence.ml_tools.trainer`` -> ``qaccel``, in a second import block next to qadence's;
- lines marked ``# test:`` only record values for the RESULT line.
"""

import atexit
import json
import sys

QADENCE = {"qadence": True, "qaccel": False}[sys.argv[1]]  # test: whose callbacks
RESULT: dict = {"library": sys.argv[1], "configs": []}  # test
atexit.register(lambda: print("RESULT " + json.dumps(RESULT), flush=True))  # test: printed last, even after an error


def described(callback):  # test: what the RESULT line says of a callback
    return [type(callback).__name__, str(getattr(callback.on, "value", callback.on)), callback.called_every]


def record(config):  # test
    RESULT["configs"].append({"max_iter": config.max_iter, "callbacks": [described(c) for c in config.callbacks]})


# ---- 1.1. PrintMetrics ----

if QADENCE:
    from qadence.ml_tools import TrainConfig
    from qadence.ml_tools.callbacks import PrintMetrics
else:
    from qaccel import TrainConfig
    from qaccel.callbacks import PrintMetrics

print_metrics_callback = PrintMetrics(on="val_batch_end", called_every=100)

config = TrainConfig(
    max_iter=10000,
    callbacks=[print_metrics_callback]
)
record(config)  # test

# ---- 1.2. WriteMetrics ----

if QADENCE:
    from qadence.ml_tools import TrainConfig
    from qadence.ml_tools.callbacks import WriteMetrics
else:
    from qaccel import TrainConfig
    from qaccel.callbacks import WriteMetrics

write_metrics_callback = WriteMetrics(on="train_epoch_end", called_every=50)

config = TrainConfig(
    max_iter=5000,
    callbacks=[write_metrics_callback]
)
record(config)  # test

# ---- 1.3. PlotMetrics ----

if QADENCE:
    from qadence.ml_tools import TrainConfig
    from qadence.ml_tools.callbacks import PlotMetrics
else:
    from qaccel import TrainConfig
    from qaccel.callbacks import PlotMetrics

plot_metrics_callback = PlotMetrics(on="train_epoch_end", called_every=100)

config = TrainConfig(
    max_iter=5000,
    callbacks=[plot_metrics_callback]
)
record(config)  # test

# ---- 1.4. LogHyperparameters ----

if QADENCE:
    from qadence.ml_tools import TrainConfig
    from qadence.ml_tools.callbacks import LogHyperparameters
else:
    from qaccel import TrainConfig
    from qaccel.callbacks import LogHyperparameters

log_hyper_callback = LogHyperparameters(on="train_start", called_every=1)

config = TrainConfig(
    max_iter=1000,
    callbacks=[log_hyper_callback]
)
record(config)  # test

# ---- 1.5. SaveCheckpoint ----

if QADENCE:
    from qadence.ml_tools import TrainConfig
    from qadence.ml_tools.callbacks import SaveCheckpoint
else:
    from qaccel import TrainConfig
    from qaccel.callbacks import SaveCheckpoint

save_checkpoint_callback = SaveCheckpoint(on="train_epoch_end", called_every=100)

config = TrainConfig(
    max_iter=10000,
    callbacks=[save_checkpoint_callback]
)
record(config)  # test

# ---- 1.6. SaveBestCheckpoint ----

if QADENCE:
    from qadence.ml_tools import TrainConfig
    from qadence.ml_tools.callbacks import SaveBestCheckpoint
else:
    from qaccel import TrainConfig
    from qaccel.callbacks import SaveBestCheckpoint

save_best_checkpoint_callback = SaveBestCheckpoint(on="val_epoch_end", called_every=10)

config = TrainConfig(
    max_iter=10000,
    callbacks=[save_best_checkpoint_callback]
)
record(config)  # test

# ---- 1.7. LoadCheckpoint ----

if QADENCE:
    from qadence.ml_tools import TrainConfig
    from qadence.ml_tools.callbacks import LoadCheckpoint
else:
    from qaccel import TrainConfig
    from qaccel.callbacks import LoadCheckpoint

load_checkpoint_callback = LoadCheckpoint(on="train_start")

config = TrainConfig(
    max_iter=10000,
    callbacks=[load_checkpoint_callback]
)
record(config)  # test

# ---- 1.8. LogModelTracker ----

if QADENCE:
    from qadence.ml_tools import TrainConfig
    from qadence.ml_tools.callbacks import LogModelTracker
else:
    from qaccel import TrainConfig
    from qaccel.callbacks import LogModelTracker

log_model_callback = LogModelTracker(on="train_end")

config = TrainConfig(
    max_iter=1000,
    callbacks=[log_model_callback]
)
record(config)  # test

# ---- 1.9. LRSchedulerStepDecay ----

if QADENCE:
    from qadence.ml_tools import TrainConfig
    from qadence.ml_tools.callbacks import LRSchedulerStepDecay
else:
    from qaccel import TrainConfig
    from qaccel.callbacks import LRSchedulerStepDecay

lr_step_decay = LRSchedulerStepDecay(on="train_epoch_end", called_every=100, gamma=0.5)

config = TrainConfig(
    max_iter=10000,
    callbacks=[lr_step_decay]
)
record(config)  # test

# ---- 1.10. LRSchedulerCyclic ----

if QADENCE:
    from qadence.ml_tools import TrainConfig
    from qadence.ml_tools.callbacks import LRSchedulerCyclic
else:
    from qaccel import TrainConfig
    from qaccel.callbacks import LRSchedulerCyclic

lr_cyclic = LRSchedulerCyclic(on="train_batch_end", called_every=1, base_lr=0.001, max_lr=0.01, step_size=2000)

config = TrainConfig(
    max_iter=10000,
    callbacks=[lr_cyclic]
)
record(config)  # test

# ---- 1.11. LRSchedulerCosineAnnealing ----

if QADENCE:
    from qadence.ml_tools import TrainConfig
    from qadence.ml_tools.callbacks import LRSchedulerCosineAnnealing
else:
    from qaccel import TrainConfig
    from qaccel.callbacks import LRSchedulerCosineAnnealing

lr_cosine = LRSchedulerCosineAnnealing(on="train_batch_end", called_every=1, t_max=5000, min_lr=1e-6)

config = TrainConfig(
    max_iter=10000,
    callbacks=[lr_cosine]
)
record(config)  # test

# ---- 1.12. EarlyStopping ----

if QADENCE:
    from qadence.ml_tools import TrainConfig
    from qadence.ml_tools.callbacks import EarlyStopping
else:
    from qaccel import TrainConfig
    from qaccel.callbacks import EarlyStopping

early_stopping = EarlyStopping(on="val_epoch_end", called_every=1, monitor="val_loss", patience=5, mode="min")

config = TrainConfig(
    max_iter=10000,
    callbacks=[early_stopping]
)
record(config)  # test

# ---- 1.13. GradientMonitoring ----

if QADENCE:
    from qadence.ml_tools import TrainConfig
    from qadence.ml_tools.callbacks import GradientMonitoring
else:
    from qaccel import TrainConfig
    from qaccel.callbacks import GradientMonitoring

gradient_monitoring = GradientMonitoring(on="train_batch_end", called_every=10)

config = TrainConfig(
    max_iter=10000,
    callbacks=[gradient_monitoring]
)
record(config)  # test

# ---- 2. Custom Callbacks: Example 1, a callback function ----

if QADENCE:
    from qadence.ml_tools.callbacks import Callback
else:
    from qaccel.callbacks import Callback

# Define a custom callback function
def custom_callback_function(trainer, config, writer):
    print("Executing custom callback.")

# Create the callback instance
custom_callback = Callback(
    on="train_end",
    callback=custom_callback_function
)
RESULT["example_1"] = described(custom_callback)  # test

# ---- 2. Custom Callbacks: Example 2, a subclass ----

if QADENCE:
    from qadence.ml_tools.callbacks import Callback
else:
    from qaccel.callbacks import Callback

class CustomCallback(Callback):
    def run_callback(self, trainer, config, writer):
        print("Custom behavior in run_callback method.")

# Create the subclassed callback instance
custom_callback = CustomCallback(on="train_batch_end", called_every=10)
RESULT["example_2"] = described(custom_callback)  # test

# ---- 3. Adding Callbacks to TrainConfig ----

if QADENCE:
    from qadence.ml_tools import TrainConfig
    from qadence.ml_tools.callbacks import SaveCheckpoint, PrintMetrics
else:
    from qaccel import TrainConfig
    from qaccel.callbacks import SaveCheckpoint, PrintMetrics

config = TrainConfig(
    max_iter=10000,
    callbacks=[
        SaveCheckpoint(on="val_epoch_end", called_every=50),
        PrintMetrics(on="train_epoch_end", called_every=100),
    ]
)
record(config)  # test

# ---- 4. Using Callbacks with Trainer: a custom Trainer ----

if QADENCE:
    from qadence.ml_tools.trainer import Trainer
    from qadence.ml_tools.callbacks import PrintMetrics
else:
    from qaccel import Trainer
    from qaccel.callbacks import PrintMetrics

class CustomTrainer(Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.print_metrics_callback = PrintMetrics(on="train_epoch_end", called_every = 10)

    def on_train_epoch_end(self, train_epoch_loss_metrics):
        self.print_metrics_callback.run_callback(self)

RESULT["custom_trainer"] = [c.__name__ for c in CustomTrainer.__mro__[:2]]  # test
