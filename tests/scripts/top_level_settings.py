"""Settings made at the script's top level: logging (a formatter class defined here, a file handler writing LOG_FILE),
a warnings filter, the default dtype and seeded RNGs. Each rank logs, warns and draws; rank 0 prints one line
``RESULT {json}``.

Usage: top_level_settings.py LOG_FILE. Run with python and under torchrun by tests/launch/test_inherit.py.
"""

import json
import logging
import os
import random
import sys
import warnings

import numpy as np
import torch

from qaccel import Accelerator


class Tagged(logging.Formatter):  # a formatter class defined in the script
    def format(self, record):
        return "TAG " + super().format(record)


logging.basicConfig(level=logging.INFO, format="%(levelname)s|%(name)s|%(message)s")
to_file = logging.FileHandler(sys.argv[1], mode="w")
to_file.setFormatter(Tagged("%(name)s:%(message)s"))
logging.getLogger("app").addHandler(to_file)
logging.getLogger("noisy").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", message="silenced at the top")
torch.set_default_dtype(torch.float64)
torch.manual_seed(0)
np.random.seed(1)
random.seed(2)
acc = Accelerator(nprocs=2, compute_setup="cpu")


def work():
    logging.getLogger("app").info("rank %d says hello", acc.rank)
    logging.getLogger("noisy").warning("rank %d must not be heard", acc.rank)
    logging.debug("below the root level")  # noqa: LOG015 - the root logger's level is what is tested
    warnings.warn("silenced at the top")
    return {
        "dtype": str(torch.get_default_dtype()),
        "torch": torch.rand(2).tolist(),
        "numpy": np.random.rand(),
        "random": random.random(),
        "weight": torch.nn.Linear(2, 1).weight.tolist(),
        "torch_handlers": len(logging.getLogger("torch").handlers),
    }


if __name__ == "__main__":
    out = acc.distribute(work, all_results=True)()
    if acc.is_main_process:
        os.write(
            1,
            (
                "RESULT "
                + json.dumps({"ranks": out, "torch_handlers": len(logging.getLogger("torch").handlers)})
                + "\n"
            ).encode(),
        )
