"""perceptrain's tutorial page docs/tutorials/training/gradient.md ("Gradient-Based and Gradient-Free
Optimization"), perceptrain 0.1.0 at commit 2ef328a, run as a reader pastes its Python blocks, on perceptrain's
Trainer or on qaccel.perceptrain's.

Usage: ``python gradient.py perceptrain|qaccel``. Prints one line ``RESULT <json>`` at the end (also after an
error, with what was recorded up to it): after each ``Trainer.set_use_grad(...)``, the ``use_grad`` of a Trainer
made then.

Changes from the page:

- imports: ``perceptrain`` -> ``qaccel.perceptrain``, in a second import block next to perceptrain's;
- left out: the context-manager block (``trainer``, ``optimizer`` and ``ng_optimizer`` undefined there);
- lines marked ``# test:`` only record values for the RESULT line.
"""

import atexit
import json
import sys

PERCEPTRAIN = {"perceptrain": True, "qaccel": False}[sys.argv[1]]  # test: whose Trainer
RESULT: dict = {"library": sys.argv[1], "use_grad": []}  # test
atexit.register(lambda: print("RESULT " + json.dumps(RESULT), flush=True))  # test: printed last, even after an error


def made():  # test: use_grad of a Trainer made now (a model, no optimizer yet, a default config)
    import torch
    if PERCEPTRAIN:
        from perceptrain import TrainConfig
    else:
        from qaccel.perceptrain import TrainConfig
    return Trainer(torch.nn.Linear(1, 1), None, TrainConfig()).use_grad


# ---- Using set_grad for optimization type: gradient-based ----

if PERCEPTRAIN:
    from perceptrain import Trainer
else:
    from qaccel.perceptrain import Trainer

# set_use_grad(True) to enable gradient based training. This is the default behaviour of Trainer.
Trainer.set_use_grad(True)
RESULT["use_grad"].append(made())  # test

# ---- Using set_grad for optimization type: gradient-free ----

if PERCEPTRAIN:
    from perceptrain import Trainer
else:
    from qaccel.perceptrain import Trainer

# set_use_grad(False) to disable gradient based training.
Trainer.set_use_grad(False)
RESULT["use_grad"].append(made())  # test
