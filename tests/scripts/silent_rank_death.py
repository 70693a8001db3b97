"""Rank 1 dies without a word (os._exit(3), as a rank the OOM killer ends) while rank 0 waits in a collective. Run as
srun tasks without a real SLURM by tests/launch/test_slurm_variables.py."""

import os

from qaccel import Accelerator

acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=30)


def work():
    if acc.rank == 1:
        os._exit(3)  # dies without a word, as a rank killed by the OOM killer would
    acc.all_reduce_dict({"x": 1.0})


if __name__ == "__main__":
    acc.distribute(work)()
