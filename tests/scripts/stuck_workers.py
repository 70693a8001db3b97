"""Two ranks iterate a DataLoader whose 2 workers are busy (0.2 s an item); each rank and each worker leaves a file
named after its pid in OUT_DIR.

Usage: stuck_workers.py OUT_DIR fail|run. fail: rank 1 raises once all 4 workers are up; run: the ranks run on until
they are stopped. Run by tests/launch/test_worker.py (another rank fails) and tests/launch/test_caller_stops.py (the
caller is stopped).
"""

import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from qaccel import Accelerator

OUT = Path(sys.argv[1])


class Slow(Dataset):
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        (OUT / f"worker-{os.getpid()}").write_text(str(os.getppid()))
        time.sleep(0.2)
        return torch.tensor(i)


def work(acc):
    (OUT / f"rank-{os.getpid()}").write_text(str(acc.rank))
    for i, _ in enumerate(acc.prepare(DataLoader(Slow(), batch_size=2, num_workers=2))):
        if acc.rank == 1 and sys.argv[2] == "fail" and len(list(OUT.glob("worker-*"))) >= 4:
            raise ValueError("rank 1 fails while every rank's workers are busy")


if __name__ == "__main__":
    acc = Accelerator(nprocs=2, compute_setup="cpu")
    acc.distribute(work)(acc)
