"""Two distribute() calls: the first prints the ranks' torch thread counts; then the caller sets QACCEL_LATE_VAR and
sets OMP_NUM_THREADS to $LATE_THREADS, and the second prints what the ranks see of both. Run by
tests/launch/test_caller_environment.py."""

import os

import torch

from qaccel import Accelerator

if __name__ == "__main__":
    acc = Accelerator(nprocs=2, compute_setup="cpu")
    print(acc.distribute(torch.get_num_threads, all_results=True)(), flush=True)
    os.environ["QACCEL_LATE_VAR"] = "set-after-construction"
    os.environ["OMP_NUM_THREADS"] = os.environ["LATE_THREADS"]
    print(acc.distribute(lambda: (os.environ.get("QACCEL_LATE_VAR"), torch.get_num_threads()), all_results=True)())
