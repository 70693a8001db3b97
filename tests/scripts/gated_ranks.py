"""Two ranks that wait until the file GATE exists, then return MODE, which the script prints. killed: rank 0 first
kills the caller with SIGKILL; quick: the ranks do not wait.

Usage: gated_ranks.py live|killed|quick GATE. Run by tests/launch/test_run_directory.py.
"""

import os
import signal
import sys
import time
from pathlib import Path

from qaccel import Accelerator


def work(mode, caller, gate):
    if mode == "killed" and int(os.environ["RANK"]) == 0:
        os.kill(caller, signal.SIGKILL)  # the caller dies without any chance to clean up
    while mode != "quick" and not Path(gate).exists():
        time.sleep(0.05)
    return mode


if __name__ == "__main__":
    mode, gate = sys.argv[1], sys.argv[2]
    print(Accelerator(nprocs=2, compute_setup="cpu", timeout=60).distribute(work)(mode, os.getpid(), gate), flush=True)
