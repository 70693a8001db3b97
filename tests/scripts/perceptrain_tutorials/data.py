"""perceptrain's tutorial page docs/tutorials/dataconfig/data.md ("Datasets", "Dataloaders"), perceptrain 0.1.0 at
commit 2ef328a, run as a reader pastes its Python block, on perceptrain's data helpers or on qaccel.perceptrain's.

Usage: ``python data.py perceptrain|qaccel``. Prints one line ``RESULT <json>`` at the end (also after an error,
with what was recorded up to it): the batches the loaders gave.

Changes from the page:

- imports: ``perceptrain`` -> ``qaccel.perceptrain``, in a second import block next to perceptrain's;
- lines marked ``# test:`` only record values for the RESULT line.
"""

import atexit
import json
import sys

PERCEPTRAIN = {"perceptrain": True, "qaccel": False}[sys.argv[1]]  # test: whose helpers
RESULT: dict = {"library": sys.argv[1], "standard": [], "infinite": []}  # test
atexit.register(lambda: print("RESULT " + json.dumps(RESULT), flush=True))  # test: printed last, even after an error

# ---- Dataloaders ----

import torch
from torch.utils.data import DataLoader, TensorDataset
if PERCEPTRAIN:
    from perceptrain import DictDataLoader, to_dataloader
else:
    from qaccel.perceptrain import DictDataLoader, to_dataloader


def dataloader(data_size: int = 25, batch_size: int = 5, infinite: bool = False) -> DataLoader:
    x = torch.linspace(0, 1, data_size).reshape(-1, 1)
    y = torch.sin(x)
    return to_dataloader(x, y, batch_size=batch_size, infinite=infinite)


def dictdataloader(data_size: int = 25, batch_size: int = 5) -> DictDataLoader:
    dls = {}
    for k in ["y1", "y2"]:
        x = torch.rand(data_size, 1)
        y = torch.sin(x)
        dls[k] = to_dataloader(x, y, batch_size=batch_size, infinite=True)
    return DictDataLoader(dls)


# iterate over standard DataLoader
for (x,y) in dataloader(data_size=6, batch_size=2):
    print(f"Standard {x = }")
    RESULT["standard"].append([x.flatten().tolist(), y.flatten().tolist()])  # test

# construct an infinite dataset which will keep sampling indefinitely
n_epochs = 5
dl = iter(dataloader(data_size=6, batch_size=2, infinite=True))
for _ in range(n_epochs):
    (x, y) = next(dl)
    print(f"Infinite {x = }")
    RESULT["infinite"].append([x.flatten().tolist(), y.flatten().tolist()])  # test

# iterate over DictDataLoader
ddl = dictdataloader()
data = next(iter(ddl))
print(f"{data = }")
RESULT["dict"] = {k: [[t.flatten().tolist() for t in batch], list(batch[0].shape)]  # test
                  for k, batch in data.items()}  # test
