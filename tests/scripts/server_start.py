"""Reports how the forkserver of a plain launch started, and what its ranks inherited; run by
tests/launch/test_server.py.

    python server_start.py plain        # Accelerator() at the top of a script: the server is forked from it
    python server_start.py openmp       # the caller built its data with multi-threaded torch ops first: its
                                        # OpenMP pool is stopped, and the server forked from it too
    python server_start.py threaded     # a thread runs in the caller: the server is a fresh interpreter
    python server_start.py pthreadpool  # the caller called torch.set_num_threads(2), whose pool nothing stops:
                                        # a fresh interpreter too

Ranks run their parallel ops on RANK_THREADS threads each, more than this machine's cores: a rank forked from a
process whose OpenMP pool ran, and not stopped, would wait for ever in the first of them.
"""

import gc
import json
import multiprocessing.forkserver
import os
import signal
import sys
import threading
import time

import torch

MODE = sys.argv[1]
if MODE == "threaded":
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
if MODE == "openmp":
    data = torch.randn(1 << 16, 64)
    data = (data - data.mean(0)) / data.std(0)  # parallel ops on torch's default threads: the OpenMP pool runs
if MODE == "pthreadpool":
    torch.set_num_threads(2)
    (torch.ones(1 << 20) * 2).sum()
RANK_THREADS = 4
signal.signal(signal.SIGTERM, lambda signum, frame: print("the caller's handler"))
print("written before", end="")  # not flushed yet: stdout is a pipe
THREADS = len(os.listdir("/proc/self/task"))

from qaccel import Accelerator

acc = Accelerator(nprocs=2, compute_setup="cpu")


def facts():
    preloaded = {
        "gc_enabled": gc.isenabled(),
        "frozen": gc.get_freeze_count(),
        "dynamo": "torch._dynamo" in sys.modules,
    }  # before this function imports anything
    torch.set_num_threads(RANK_THREADS)
    product = torch.ones(512, 512) @ torch.ones(512, 512)  # parallel ops in the rank: MKL's, then ATen's
    total = float((torch.ones(1 << 20) * 2).sum())
    return {
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "product": float(product[0, 0]),
        "total": total,
        "threads": torch.get_num_threads(),
        "parent": os.getppid(),
        **preloaded,
    }


if __name__ == "__main__":
    ranks = [acc.distribute(facts, all_results=True)() for _ in range(2)]
    after = float((torch.ones(1 << 20) * 2).sum())  # the caller's own parallel ops, its pool started again
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    with open(f"/proc/{server}/cmdline") as cmdline:
        command = cmdline.read().split("\0")
    print()
    print(
        "FACTS "
        + json.dumps(
            {
                "caller_threads": THREADS,
                "caller_threads_at_launch": len(os.listdir("/proc/self/task")),
                "server": server,
                "command": command,
                "server_threads": len(os.listdir(f"/proc/{server}/task")),
                "ranks": ranks[0] + ranks[1],
                "caller_after": after,
            }
        )
    )
