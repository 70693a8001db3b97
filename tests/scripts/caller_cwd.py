"""Two distribute() calls, each after the caller changed directory (to argv[1], then argv[2]): each prints the
ranks' working directories. Run by tests/launch/test_caller_environment.py."""

import os
import sys

from qaccel import Accelerator

if __name__ == "__main__":
    acc = Accelerator(nprocs=2, compute_setup="cpu")
    os.chdir(sys.argv[1])
    print(acc.distribute(os.getcwd, all_results=True)(), flush=True)
    os.chdir(sys.argv[2])
    print(acc.distribute(os.getcwd, all_results=True)(), flush=True)
