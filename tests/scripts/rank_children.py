"""Each rank's DataLoader workers and process pools, forked from it (and a spawned pool, which imports this script as
torchrun's grandchildren do), use a Dataset class and a function defined here. The script prints what they returned,
their parents, the start method, and whether each rank leads its own process group and raises KeyboardInterrupt on
SIGINT. Run by tests/launch/test_worker.py."""

import json
import multiprocessing
import os
import signal

import torch
from torch.utils.data import DataLoader, Dataset

from qaccel import Accelerator


class Squares(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.tensor(i * i), os.getppid()


def cube(n):
    return n**3


def work(acc):
    loader = acc.prepare(DataLoader(Squares(), batch_size=4, num_workers=2))
    seen, parents = [], set()
    for values, ppids in loader:
        seen += values.tolist()
        parents.update(ppids.tolist())
    with multiprocessing.Pool(2) as pool:
        cubes = pool.map(cube, range(4))
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # imports the script, as under torchrun
        cubes += pool.map(cube, [4])
    return {
        "seen": seen,
        "workers_parent_is_rank": parents == {os.getpid()},
        "cubes": cubes,
        "start_method": multiprocessing.get_start_method(),
        "group_leader": os.getpgid(0) == os.getpid() == os.getsid(0),
        "ctrl_c_raises": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    }


if __name__ == "__main__":
    acc = Accelerator(nprocs=2, compute_setup="cpu")
    print("OUT", json.dumps(acc.distribute(work, all_results=True)(acc)), flush=True)
