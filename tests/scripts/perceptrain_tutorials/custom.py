"""perceptrain's tutorial page docs/tutorials/callbacks/custom.md ("Custom Callbacks"), perceptrain 0.1.0 at commit
2ef328a, run as a reader pastes its Python blocks, on perceptrain's Callback or on qaccel.perceptrain's.

Usage: ``python custom.py perceptrain|qaccel``. Prints one line ``RESULT <json>`` at the end (also after an error,
with what was recorded up to it): each custom callback's class, stage and frequency, and what it prints when run.

The page trains nothing: it makes a callback from a function and one from a subclass.

Changes from the page:

- imports: ``perceptrain.callbacks`` -> ``qaccel.perceptrain.callbacks``, in a second import block next to
  perceptrain's;
- lines marked ``# test:`` only record values for the RESULT line.
"""

import atexit
import contextlib
import io
import json
import sys

PERCEPTRAIN = {"perceptrain": True, "qaccel": False}[sys.argv[1]]  # test: whose Callback
RESULT: dict = {"library": sys.argv[1]}  # test
atexit.register(lambda: print("RESULT " + json.dumps(RESULT), flush=True))  # test: printed last, even after an error


def described(callback):  # test: what the RESULT line says of a callback, and what run_callback prints
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        callback.run_callback(None, None, None)
    return [type(callback).__name__, str(getattr(callback.on, "value", callback.on)), callback.called_every,
            printed.getvalue()]


# ---- Example 1: Providing a Callback Function Directly ----

if PERCEPTRAIN:
    from perceptrain.callbacks import Callback
else:
    from qaccel.perceptrain.callbacks import Callback

# Define a custom callback function
def custom_callback_function(trainer, config, writer):
    print("Executing custom callback.")

# Create the callback instance
custom_callback = Callback(
    on="train_end",
    callback=custom_callback_function
)
RESULT["example_1"] = described(custom_callback)  # test

# ---- Example 2: Subclassing the Callback ----

if PERCEPTRAIN:
    from perceptrain.callbacks import Callback
else:
    from qaccel.perceptrain.callbacks import Callback

class CustomCallback(Callback):
    def run_callback(self, trainer, config, writer):
        print("Custom behavior in run_callback method.")

# Create the subclassed callback instance
custom_callback = CustomCallback(on="train_batch_end", called_every=10)
RESULT["example_2"] = described(custom_callback)  # test
