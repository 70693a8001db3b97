"""perceptrain's tutorial page docs/tutorials/callbacks/trainer_callbacks.md ("Adding Callbacks to TrainConfig",
"Using Callbacks with Trainer"), perceptrain 0.1.0 at commit 2ef328a, run as a reader pastes its Python blocks, on
perceptrain's callbacks and Trainer or on qaccel.perceptrain's.

Usage: ``python trainer_callbacks.py perceptrain|qaccel``. Prints one line ``RESULT <json>`` at the end (also after
an error, with what was recorded up to it): the config's max_iter and callbacks (class, stage, frequency), and the
custom Trainer's class and base.

The page trains nothing: it makes a config with two callbacks and a Trainer subclass.

Changes from the page:

- imports: ``perceptrain`` -> ``qaccel.perceptrain``, ``perceptrain.callbacks`` -> ``qaccel.perceptrain.callbacks``,
  ``perceptrain.trainer`` -> ``qaccel.perceptrain.trainer``, in a second import block next to perceptrain's;
- lines marked ``# test:`` only record values for the RESULT line.
"""

import atexit
import json
import sys

PERCEPTRAIN = {"perceptrain": True, "qaccel": False}[sys.argv[1]]  # test: whose callbacks and Trainer
RESULT: dict = {"library": sys.argv[1]}  # test
atexit.register(lambda: print("RESULT " + json.dumps(RESULT), flush=True))  # test: printed last, even after an error


def described(callback):  # test: what the RESULT line says of a callback
    return [type(callback).__name__, str(getattr(callback.on, "value", callback.on)), callback.called_every]


# ---- 1. Adding Callbacks to TrainConfig ----

if PERCEPTRAIN:
    from perceptrain import TrainConfig
    from perceptrain.callbacks import SaveCheckpoint, PrintMetrics
else:
    from qaccel.perceptrain import TrainConfig
    from qaccel.perceptrain.callbacks import SaveCheckpoint, PrintMetrics

config = TrainConfig(
    max_iter=10000,
    callbacks=[
        SaveCheckpoint(on="val_epoch_end", called_every=50),
        PrintMetrics(on="train_epoch_end", called_every=100),
    ]
)
RESULT["config"] = {"max_iter": config.max_iter, "callbacks": [described(c) for c in config.callbacks]}  # test

# ---- 2. Using Callbacks with Trainer: Adding a Custom Callback ----

if PERCEPTRAIN:
    from perceptrain.trainer import Trainer
    from perceptrain.callbacks import PrintMetrics
else:
    from qaccel.perceptrain.trainer import Trainer
    from qaccel.perceptrain.callbacks import PrintMetrics

class CustomTrainer(Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.print_metrics_callback = PrintMetrics(on="train_epoch_end", called_every = 10)

    def on_train_epoch_end(self, train_epoch_loss_metrics):
        self.print_metrics_callback.run_callback(self)

RESULT["custom_trainer"] = [c.__name__ for c in CustomTrainer.__mro__[:2]]  # test
RESULT["custom_trainer_module"] = CustomTrainer.__mro__[1].__module__  # test
