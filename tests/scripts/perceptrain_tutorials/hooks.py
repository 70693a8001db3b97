"""perceptrain's tutorial page docs/tutorials/training/hooks.md ("Hooks for Custom Behavior"), perceptrain 0.1.0 at
commit 2ef328a, run as a reader pastes its Python block, on perceptrain's Trainer or on qaccel.perceptrain's.

Usage: ``python hooks.py perceptrain|qaccel``. Prints one line ``RESULT <json>`` at the end (also after an error,
with what was recorded up to it): the custom Trainer's class and base, and which hooks it overrides.

The page trains nothing: it defines a Trainer subclass whose ``on_train_epoch_end`` prints the epoch's results.

Changes from the page:

- imports: ``perceptrain`` -> ``qaccel.perceptrain``, in a second import block next to perceptrain's;
- left out: the hooks' signatures quoted from ``BaseTrainer`` (an indented excerpt of perceptrain's source, not a
  block to run);
- lines marked ``# test:`` only record values for the RESULT line.
"""

import atexit
import json
import sys

PERCEPTRAIN = {"perceptrain": True, "qaccel": False}[sys.argv[1]]  # test: whose Trainer
RESULT: dict = {"library": sys.argv[1]}  # test
atexit.register(lambda: print("RESULT " + json.dumps(RESULT), flush=True))  # test: printed last, even after an error

# ---- Example of using a hook to log a message at the end of each epoch ----

if PERCEPTRAIN:
    from perceptrain import Trainer
else:
    from qaccel.perceptrain import Trainer

class CustomTrainer(Trainer):
    def on_train_epoch_end(self, train_epoch_loss_metrics):
        print(f"End of epoch - Loss and Metrics: {train_epoch_loss_metrics}")

RESULT["custom_trainer"] = [c.__name__ for c in CustomTrainer.__mro__[:2]]  # test
RESULT["hooks"] = sorted(name for name in ("on_train_start", "on_train_end", "on_train_epoch_start",  # test
                                           "on_train_epoch_end", "on_train_batch_start", "on_train_batch_end")  # test
                         if hasattr(Trainer, name))  # test
RESULT["overridden"] = sorted(name for name in vars(CustomTrainer) if name.startswith("on_"))  # test
