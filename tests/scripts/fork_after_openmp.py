"""Forks a child after torch's OpenMP pool ran and prints whether the child's first parallel region, on 4 threads,
finished within HANG_S ("finished") or not ("hung"); run by tests/launch/test_server.py.

    python fork_after_openmp.py as_is    # the pool's threads are still there at the fork: the child hangs
    python fork_after_openmp.py paused   # qaccel stopped the pool first (as before it forks a server)
"""

import os
import signal
import sys
import time

import torch

from qaccel.launch import server

HANG_S = 5  # a 1024 x 1024 product takes milliseconds

(torch.randn(1 << 16, 64) * 2).sum()  # parallel: the pool starts
if sys.argv[1] == "paused":
    assert server.fork_is_safe(), "qaccel stopped the pools and counts one thread"
pid = os.fork()
if pid == 0:
    torch.set_num_threads(4)
    (torch.ones(1024, 1024) * 2).sum()
    os._exit(0)
deadline = time.monotonic() + HANG_S
while (ended := os.waitpid(pid, os.WNOHANG))[0] == 0:
    if time.monotonic() >= deadline:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        print("hung")
        sys.exit(0)
    time.sleep(0.01)
print("finished" if ended[1] == 0 else f"the child failed: wait status {ended[1]}")
